//! Per-rank state shared by every stage-3 op of one model: the rank's [`CommContext`] (a leaf),
//! the [`ShardHome`] that places its shards, and the gather schedule and unit reducer that use
//! both.

use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::NodeId;
use burn::module::ParamId;
use burn::tensor::Tensor;
use burn_shard_comm::Collective;

use crate::error::ShardError;
use crate::fsdp::collectives::all_gather_full;
use crate::fsdp::comm_context::CommContext;
use crate::fsdp::gather_schedule::Schedule;
use crate::fsdp::home::{ParamHome, ShardHome};
use crate::fsdp::shard::Shard;
use crate::fsdp::spec::{POLICY_SCOPE, ParamSpec};
use crate::fsdp::unit_reducer::{Reduced, Reducer};

/// Shared by the sharded parameters of one model on one rank. Cheap to clone. Dereferences to
/// its [`CommContext`] (the collective, the first error, transient memory), which the schedule
/// and the reducer are handed instead of this owner, with the [`ShardHome`] (`home()`) where
/// the schedule needs to bring a shard to the compute device.
#[derive(Clone)]
pub(crate) struct FsdpContext(Arc<Inner>);

struct Inner {
    comm: CommContext,
    /// Where this rank's shards live (the compute device, host memory or the shard file).
    home: ShardHome,
    reshard_after_forward: bool,
    schedule: Mutex<Schedule>,
    reducer: Mutex<Reducer>,
    /// The policy unit whose forward gathers ran last in this pass (`None` at a pass's start),
    /// and the scopes numbered so far.
    policy_scope: Mutex<(Option<u32>, u64)>,
    /// With NVMe parameter offload: the gradient shards reduced since the last step, in the
    /// rank's shard file.
    stored_grads: Mutex<StoredGrads>,
}

/// Gradient shards on disk, per parameter in the order they were reduced (several with
/// micro-batches or a parameter used by two forwards), each with the backward pass it came
/// from (the step sums those of one pass in the gradient's dtype, as Burn's gradients do, and
/// the passes in `f32`, as `accumulate` does).
#[derive(Default)]
struct StoredGrads {
    pass: u64,
    by_param: HashMap<ParamId, Vec<(u64, Shard)>>,
}

impl Deref for FsdpContext {
    type Target = CommContext;

    fn deref(&self) -> &CommContext {
        &self.0.comm
    }
}

impl fmt::Debug for FsdpContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsdpContext")
            .field("rank", &self.comm().rank())
            .field("world_size", &self.comm().world_size())
            .field("reshard_after_forward", &self.0.reshard_after_forward)
            .finish()
    }
}

impl FsdpContext {
    /// The context of `comm`'s rank; `param_home` with parameter offload (see [`ParamHome`]).
    pub(crate) fn new(comm: Arc<dyn Collective>, reshard_after_forward: bool, param_home: Option<ParamHome>) -> Self {
        Self(Arc::new(Inner {
            comm: CommContext::new(comm),
            home: ShardHome::new(param_home),
            reshard_after_forward,
            schedule: Mutex::new(Schedule::default()),
            reducer: Mutex::new(Reducer::default()),
            policy_scope: Mutex::new((None, 0)),
            stored_grads: Mutex::new(StoredGrads::default()),
        }))
    }

    /// The full `[numel]` parameter of `spec`: taken from its unit's grouped all-gather when the
    /// schedule fetched it, else all-gathered alone (see [`crate::fsdp::gather_schedule`]).
    pub(crate) fn gather(&self, spec: &ParamSpec) -> Tensor<1> {
        let mut schedule = self.0.schedule.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(full) = schedule.take(&self.0.comm, &self.0.home, spec) {
            return full;
        }
        drop(schedule);
        let full = self.gather_alone(&spec.shard, spec.numel, spec.tag);
        self.watch_tensor(&full, spec.numel * full.dtype().size());
        full
    }

    /// The full `[numel]` parameter of `shard` (`[chunk]`), all-gathered alone under `tag`, on
    /// the compute device; zeros after a failed read or collective (the error recorded).
    pub(crate) fn gather_alone(&self, shard: &Shard, numel: usize, tag: u64) -> Tensor<1> {
        let shard = self.0.home.to_compute(self.read(shard));
        all_gather_full(self, shard, numel, tag)
    }

    /// The values of `shard` (read from disk when stored); a failed read is recorded (the step
    /// returns it) and gives zeros, as a failed collective does.
    pub(crate) fn read(&self, shard: &Shard) -> Tensor<1> {
        self.0
            .home
            .wait_read(shard.start_read(), shard, |e: ShardError| self.record_error(e))
    }

    /// Where this rank's shards live, and how they move to the compute device and back.
    pub(crate) fn home(&self) -> &ShardHome {
        &self.0.home
    }

    /// Takes the complete full gradient (`[numel]`) of `spec`'s parameter, whose autodiff leaf
    /// is `node`, for its unit's grouped reduce-scatter; returns the shards ready to register
    /// now (see [`crate::fsdp::unit_reducer`]).
    pub(crate) fn reduce(&self, spec: &ParamSpec, node: NodeId, grad: Tensor<1>) -> Vec<Reduced> {
        let mut reducer = self.0.reducer.lock().unwrap_or_else(|p| p.into_inner());
        reducer.add(&self.0.comm, spec, node, grad)
    }

    /// The shards of the last backward still in flight or pending, waited for: the optimizer
    /// adds them to the gradients it was given.
    pub(crate) fn finish_reduce(&self) -> Vec<Reduced> {
        // Each backward (one per micro-batch under accumulation: `step` and `accumulate` both
        // call this) ends a pass of the policy units: the next forward enters its first unit
        // afresh, even when it is the unit that ran last.
        self.0.policy_scope.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
        self.0
            .reducer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .finish(&self.0.comm)
    }

    /// With NVMe parameter offload, queues the write of the reduced gradient shard `reduced`
    /// to the shard file (behind backward, see [`ShardStore::put`](crate::swap::shard_store::ShardStore::put);
    /// a failed write is returned by the step) and keeps it for the step (`None`: nothing for
    /// Burn's gradients to hold, so they never hold the gradients of the whole model); without
    /// it, gives it back.
    pub(crate) fn keep_reduced(&self, reduced: Reduced) -> Option<Reduced> {
        let Some(store) = self.0.home.store() else {
            return Some(reduced);
        };
        let shard = Shard::Stored(Arc::new(store.put(&reduced.shard, "gradient")));
        let mut kept = self.0.stored_grads.lock().unwrap_or_else(|p| p.into_inner());
        let pass = kept.pass;
        kept.by_param.entry(reduced.id).or_default().push((pass, shard));
        None
    }

    /// Parameters with gradient shards on disk, kept for the next step (a checkpoint cannot
    /// hold them).
    pub(crate) fn stored_grad_count(&self) -> usize {
        self.0
            .stored_grads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_param
            .len()
    }

    /// Ends a backward pass for [`FsdpContext::keep_reduced`] (after its last shards are kept).
    pub(crate) fn end_grad_pass(&self) {
        self.0.stored_grads.lock().unwrap_or_else(|p| p.into_inner()).pass += 1;
    }

    /// The gradient shards [`FsdpContext::keep_reduced`] kept since the last call, taken, each
    /// with its backward pass.
    pub(crate) fn take_stored_grads(&self) -> HashMap<ParamId, Vec<(u64, Shard)>> {
        let mut kept = self.0.stored_grads.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut kept.by_param)
    }

    /// Records that `spec`'s shard is the parameter's current one (at sharding, and each time
    /// the optimizer or a checkpoint load replaces it), for the grouped gathers.
    pub(crate) fn register(&self, spec: &ParamSpec) {
        self.0.schedule.lock().unwrap_or_else(|p| p.into_inner()).register(spec);
    }

    /// Called before the optimizer replaces the shards: nothing gathered so far is used again.
    pub(crate) fn end_pass(&self) {
        self.0.schedule.lock().unwrap_or_else(|p| p.into_inner()).end_pass();
    }

    /// The unit scope of a forward gather of a parameter of policy unit `unit` (see
    /// [`crate::Stage3Config::units`]): the scope of the unit running, or a new one when the
    /// gathers move to another unit. That is what an `fsdp::unit` call around the unit's
    /// forward would give, read from the order of the gathers instead of from the model code.
    pub(crate) fn policy_scope(&self, unit: u32) -> u64 {
        let mut state = self.0.policy_scope.lock().unwrap_or_else(|p| p.into_inner());
        let (running, count) = &mut *state;
        if *running != Some(unit) {
            *running = Some(unit);
            *count += 1;
        }
        *count | POLICY_SCOPE
    }

    /// Whether gathered parameters are freed after forward and re-gathered in backward
    /// (FSDP's `reshard_after_forward=True`, the default) or kept until backward.
    pub(crate) fn reshard_after_forward(&self) -> bool {
        self.0.reshard_after_forward
    }
}
