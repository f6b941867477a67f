//! The per-rank state of stages 0-2's reduction inside backward: which gradients each bucket
//! still waits for, which buckets are in flight, and what was learned about the backward.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_shard_comm::{Collective, CommError, ReduceOp, Work};

use crate::error::ShardError;
use crate::model::flat::{self, SlotValues};
use crate::model::layout::{Bucket, FlatLayout};
use crate::overlap::backward_log::BackwardLog;
use crate::overlap::call_tag::CallTag;

/// How stages 0-2 reduce a bucket: the one thing the reducer needs to know of the stage
/// (`StagePlan::bucket_reduction` decides it; stage 3 has none, it reduces per unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BucketReduction {
    /// Stages 0-1: every rank keeps the whole averaged bucket (`[padded_numel]`).
    AllReduce,
    /// Stage 2: each rank keeps its shard of the averaged bucket (`[shard_numel]`).
    ReduceScatter,
}

impl BucketReduction {
    /// The `[padded_numel]` gradient of a bucket averaged over ranks, as far as this rank keeps
    /// it.
    pub(crate) fn reduce(self, comm: &dyn Collective, flat: Tensor<1>) -> Result<Tensor<1>, CommError> {
        match self {
            BucketReduction::AllReduce => comm.all_reduce(flat, ReduceOp::Avg),
            BucketReduction::ReduceScatter => comm.reduce_scatter(flat, ReduceOp::Avg),
        }
    }

    /// [`BucketReduction::reduce`] started asynchronously (inside backward); `tag` names the
    /// bucket in the collective.
    pub(crate) fn reduce_async(self, comm: &dyn Collective, flat: Tensor<1>, tag: u64) -> Work<Tensor<1>> {
        match self {
            BucketReduction::AllReduce => comm.all_reduce_async(flat, ReduceOp::Avg, tag),
            BucketReduction::ReduceScatter => comm.reduce_scatter_async(flat, ReduceOp::Avg, tag),
        }
    }

    /// Elements of what [`BucketReduction::reduce`] returns for `bucket`.
    pub(crate) fn reduced_numel(self, bucket: &Bucket) -> usize {
        match self {
            BucketReduction::AllReduce => bucket.padded_numel,
            BucketReduction::ReduceScatter => bucket.shard_numel,
        }
    }
}

/// What one optimizer call takes from the reducer: the buckets reduced during the backwards
/// since the previous call, and which slots contributed to them.
pub(crate) struct Early {
    /// Per bucket: its reduced gradient as [`BucketReduction::reduce`] returns it, or `None` when the
    /// bucket was not reduced early.
    pub(crate) reduced: Vec<Option<Tensor<1>>>,
    /// Per layout slot: whether a gradient of it went into an early reduction on this rank.
    pub(crate) present: Vec<bool>,
    /// Buckets started inside backward (the rest were started by `finish`).
    pub(crate) started_in_backward: usize,
    /// Whether this rank's backwards since the last step differed from the learned ones (another
    /// number of `accumulate` calls, or other gradient counts per parameter: a changed number
    /// of micro-batches, a layer trained only now). The step agrees on it with the other ranks
    /// and then calls [`BucketReducer::forget`], so the next step learns again.
    pub(crate) differs: bool,
}

/// What the first step learned about the backward (see [`super`]).
#[derive(Debug)]
struct Learned {
    /// Per slot: how many gradients one backward hands over (a parameter used twice, two).
    counts: Vec<usize>,
    /// The buckets reduced inside backward, in the order they are started: the order in which
    /// the learning backward completed them (rank 0's, so every rank starts the same calls in
    /// the same order). A bucket with a slot that received no gradient through its hook (a
    /// parameter with a reparameterization of its own, one frozen or unused while learning) is
    /// left out: its gradients pass through to the step.
    order: Vec<usize>,
    /// Per bucket: whether it is in `order`.
    early: Vec<bool>,
    /// `accumulate` calls that preceded the learning step: a backward is reduced inside only
    /// when as many have been made since the last step, so micro-batches send nothing.
    accumulates: usize,
}

#[derive(Default)]
struct State {
    learned: Option<Learned>,
    /// Whether gradients arriving now go into buckets (the next optimizer call is expected to
    /// be a step); when not, they pass through to `GradientsParams` untouched.
    armed: bool,
    /// `accumulate` calls since the last step.
    accumulates: usize,
    /// The gradients since the last optimizer call, by slot: how many each slot got, and when
    /// each bucket's last one arrived.
    log: BackwardLog,
    /// Per slot: the sum of this backward's gradients waiting for their bucket (`[numel]`, in
    /// the gradient's dtype, added as Burn adds the parts of a parameter read twice).
    pending: SlotValues,
    /// Per slot: the micro-batch sum `accumulate` handed over ([`BucketReducer::seed`]), kept
    /// apart from `pending` and added to it once, when the bucket starts, as the step adds it
    /// to the gradient: the result does not depend on the order the parts arrive in.
    seeded: SlotValues,
    /// Per bucket: its reduction in flight.
    started: Vec<Option<Work<Tensor<1>>>>,
    /// Position in `learned.order` of the next bucket to start.
    next: usize,
    /// Per slot: whether a gradient went into a bucket since the last optimizer call.
    present: Vec<bool>,
}

/// Shared by the [`BucketHook`](crate::bucket::hook::BucketHook)s of one model on one rank and its
/// optimizer. Cheap to clone.
#[derive(Clone)]
pub(crate) struct BucketReducer(Arc<Inner>);

struct Inner {
    comm: Arc<dyn Collective>,
    layout: Arc<FlatLayout>,
    reduction: BucketReduction,
    /// The parameters' plain device, where absent gradients are zeros.
    device: Device,
    state: Mutex<State>,
}

impl fmt::Debug for BucketReducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BucketReducer")
            .field("rank", &self.0.comm.rank())
            .field("buckets", &self.0.layout.buckets().len())
            .finish()
    }
}

impl BucketReducer {
    pub(crate) fn new(
        comm: Arc<dyn Collective>,
        layout: Arc<FlatLayout>,
        reduction: BucketReduction,
        device: Device,
    ) -> Self {
        let (slots, buckets) = (layout.slots().len(), layout.buckets().len());
        let state = State {
            pending: vec![None; slots],
            seeded: vec![None; slots],
            started: (0..buckets).map(|_| None).collect(),
            present: vec![false; slots],
            ..State::default()
        };
        Self(Arc::new(Inner {
            comm,
            layout,
            reduction,
            device,
            state: Mutex::new(state),
        }))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one gradient of layout slot `slot` (`[numel]`): into its bucket, starting every
    /// bucket that is now complete in the learned order, or back to the caller (`Some`) to be
    /// registered on the parameter as usual, when nothing is reduced inside this backward or
    /// its bucket has already been started.
    pub(crate) fn hand(&self, slot: usize, grad: Tensor<1>) -> Option<Tensor<1>> {
        let layout = &self.0.layout;
        let bucket = layout.slots()[slot].bucket;
        let mut state = self.state();
        let state = &mut *state;
        state.log.record(slot as u64);
        let Some(learned) = state.learned.as_ref().filter(|_| state.armed) else {
            return Some(grad);
        };
        if !learned.early[bucket] || state.started[bucket].is_some() {
            return Some(grad);
        }
        state.pending[slot] = Some(match state.pending[slot].take() {
            Some(sum) => sum + grad,
            None => grad,
        });
        state.present[slot] = true;
        while let Some(&next) = learned.order.get(state.next) {
            let complete = layout.buckets()[next]
                .slots
                .clone()
                .all(|s| state.log.count(s as u64) >= learned.counts[s]);
            if !complete {
                break;
            }
            state.started[next] = Some(self.start(next, &mut state.pending, &mut state.seeded));
            state.next += 1;
        }
        None
    }

    /// Whether the gradients of the next backward go into buckets.
    pub(crate) fn armed(&self) -> bool {
        self.state().armed
    }

    /// Takes `sums` (per slot, `[numel]`: the micro-batch sums `accumulate` kept unreduced) into
    /// the buckets, so the backward expected to end in a step reduces them with its own
    /// gradients, added once when each bucket starts, in one collective per bucket (DDP reduces
    /// what `no_sync` backwards accumulated in `.grad` the same way). Call it only when [`BucketReducer::armed`].
    /// Sums of slots whose bucket stays with the step are left in `sums`.
    pub(crate) fn seed(&self, sums: &mut SlotValues) {
        let mut guard = self.state();
        let state = &mut *guard;
        let Some(learned) = &state.learned else {
            return;
        };
        for (slot, sum) in sums.iter_mut().enumerate() {
            if !learned.early[self.0.layout.slots()[slot].bucket] {
                continue;
            }
            if let Some(sum) = sum.take() {
                state.present[slot] = true;
                state.seeded[slot] = Some(sum);
            }
        }
    }

    /// Slots holding gradients that wait for their bucket (seeded micro-batch sums, or a
    /// backward's gradients before the optimizer call).
    pub(crate) fn pending_slots(&self) -> usize {
        let state = self.state();
        (0..state.pending.len())
            .filter(|&slot| state.pending[slot].is_some() || state.seeded[slot].is_some())
            .count()
    }

    /// Drops every gradient handed over since the last optimizer call: what is pending, and
    /// the reductions started (which are first started everywhere and waited for, as
    /// [`BucketReducer::finish`] does, so the ranks' calls stay aligned). What was learned is
    /// kept; the next backward is reduced inside when a step is expected after no `accumulate`.
    /// Every rank calls this at the same point.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a reduction failed.
    pub(crate) fn discard(&self) -> Result<(), ShardError> {
        let result = self.finish(false).map(drop);
        let mut state = self.state();
        state.accumulates = 0;
        state.armed = state.learned.as_ref().is_some_and(|l| l.accumulates == 0);
        result
    }

    /// Starts bucket `index`'s reduction from its slots' seeded and pending sums (absent ones
    /// are zeros), which it takes.
    fn start(&self, index: usize, pending: &mut SlotValues, seeded: &mut SlotValues) -> Work<Tensor<1>> {
        let (layout, bucket) = (&self.0.layout, &self.0.layout.buckets()[index]);
        for slot in bucket.slots.clone() {
            let total = match (seeded[slot].take(), pending[slot].take()) {
                // The seeded sum may be wider (`f32` for `bf16`/`f16`): add in its dtype.
                (Some(sum), Some(grad)) => {
                    let dtype = sum.dtype();
                    Some(sum + grad.cast(dtype))
                }
                (sum, grad) => sum.or(grad),
            };
            pending[slot] = total.map(|t| {
                if t.dtype() == bucket.dtype {
                    t
                } else {
                    t.cast(bucket.dtype)
                }
            });
        }
        let flat = flat::assemble(layout, bucket, pending, 0..bucket.padded_numel, &self.0.device);
        pending[bucket.slots.clone()].iter_mut().for_each(|p| *p = None);
        self.0
            .reduction
            .reduce_async(self.0.comm.as_ref(), flat, CallTag::BucketReduction(index).value())
    }

    /// Ends the backwards since the last optimizer call, at the start of `step` (`is_step`) or
    /// `accumulate`, on every rank at the same point: starts the buckets not yet started (in
    /// the learned order, absent gradients as zeros), waits for all of them, and returns them.
    /// The first step also learns (one broadcast of rank 0's bucket order). Then decides
    /// whether the next backward reduces inside.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a reduction failed.
    pub(crate) fn finish(&self, is_step: bool) -> Result<Early, ShardError> {
        let layout = &self.0.layout;
        let mut guard = self.state();
        let state = &mut *guard;
        let buckets = layout.buckets().len();
        let started_in_backward = state.next;
        if let Some(learned) = state.learned.as_ref().filter(|_| state.armed) {
            while let Some(&next) = learned.order.get(state.next) {
                state.started[next] = Some(self.start(next, &mut state.pending, &mut state.seeded));
                state.next += 1;
            }
        }
        let differs = is_step
            && state.learned.as_ref().is_some_and(|l| {
                l.accumulates != state.accumulates || l.counts != state.log.counts(layout.slots().len())
            });
        let reduced = Work::wait_all(state.started.iter_mut().map(Option::take));
        let present = std::mem::replace(&mut state.present, vec![false; layout.slots().len()]);
        state.next = 0;
        if is_step && state.learned.is_none() {
            let order = self.agree_order(&state.log)?;
            let mut early = vec![false; buckets];
            order.iter().for_each(|&b| early[b] = true);
            state.learned = Some(Learned {
                counts: state.log.counts(layout.slots().len()),
                order,
                early,
                accumulates: state.accumulates,
            });
        }
        state.accumulates = if is_step { 0 } else { state.accumulates + 1 };
        state.armed = state
            .learned
            .as_ref()
            .is_some_and(|l| l.accumulates == state.accumulates);
        state.log.clear();
        Ok(Early {
            reduced: reduced?,
            present,
            started_in_backward,
            differs,
        })
    }

    /// Drops what was learned, so the backwards up to the next step pass through to it and that
    /// step learns again (as the first one did). Every rank calls it at the same step: the step
    /// decides from [`Early::differs`] agreed over the ranks.
    pub(crate) fn forget(&self) {
        let mut state = self.state();
        state.learned = None;
        state.armed = false;
    }

    /// The buckets whose every slot received a gradient through its hook (in `log`), ordered
    /// by when their last gradient arrived, as rank 0 saw them: one broadcast of `buckets`
    /// values (the order, then -1 for each bucket left out; exact in `f32` below 2^24).
    fn agree_order(&self, log: &BackwardLog) -> Result<Vec<usize>, ShardError> {
        let layout = &self.0.layout;
        let buckets = layout.buckets();
        let slots = |b: usize| buckets[b].slots.clone().map(|s| s as u64);
        let mut order: Vec<usize> = (0..buckets.len())
            .filter(|&b| slots(b).all(|s| log.count(s) > 0))
            .collect();
        order.sort_by_key(|&b| (log.last_arrival(slots(b)), b));
        let mut ours: Vec<f32> = order.iter().map(|&b| b as f32).collect();
        ours.resize(buckets.len(), -1.0);
        // `f32` whatever the device's default float dtype: `bf16` holds integers exactly only to 256.
        let ours = Tensor::<1>::from_data(TensorData::new(ours, [buckets.len()]), (&self.0.device, DType::F32));
        let agreed = self.0.comm.broadcast(ours, 0)?;
        Ok(agreed
            .into_data()
            .convert::<f32>()
            .iter::<f32>()
            .take_while(|&b| b >= 0.0)
            .map(|b| b as usize)
            .collect())
    }
}

/// Whether stages 0-2 reduce inside backward for this collective and device (see the
/// [`bucket`](crate::bucket) docs).
pub(crate) fn reduces_in_backward(comm: &dyn Collective, device: &Device) -> bool {
    comm.world_size() > 1 && comm.overlaps_compute() && crate::backend::has_ops(device)
}
