//! Phase 3 of a step: Burn's optimizer on each parameter's piece of this rank's range, bucket
//! by bucket, then the updated values published (all-gathered at stages 1-2) or, at stage 3,
//! the new shards put where shards live as soon as their bucket is stepped.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ParamId};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor};
use burn_shard_comm::Work;

use crate::error::ShardError;
use crate::fsdp::exchange;
use crate::fsdp::holding::ParamHolding;
use crate::fsdp::read_ahead::ReadAhead;
use crate::fsdp::shard::Shard;
use crate::model::flat::{self, tensor_bytes};
use crate::model::layout::{Bucket, FlatLayout};
use crate::model::memory::PeakTracker;
use crate::optim::groups::Groups;
use crate::optim::master::MasterWeightStep;
use crate::overlap::call_tag::CallTag;
use crate::step::agreement::{agree_on_disk, disk_dir};
use crate::step::bucket_grads::BucketGrads;
use crate::step::context::StepContext;
use crate::step::measure::Clip;
use crate::step::slot_state::SlotStates;
use crate::step::whole_owner::{WholeOwner, WholeOwners, exchange_bytes, gather_whole, scatter_from_owner};

/// The update phase of one step: what it reads (the context, learning rate, clipping, which
/// slots have a gradient, each slot's optimizer) and the per-slot state it changes.
pub(crate) struct Update<'a, O: MasterWeightStep> {
    /// The step's context (layout, plan, collective, device, loss scale).
    pub(crate) cx: &'a StepContext<'a>,
    /// The learning rate (one, or per group from a `ModuleLrScheduler`).
    pub(crate) lr: &'a ModuleLearningRate,
    /// The clipping the measuring phase decided (global-norm factor, per-parameter norms).
    pub(crate) clip: Clip<'a>,
    /// Per layout slot: whether it received a gradient on some rank (see
    /// [`presence`](crate::step::reduce::presence)); slots without one keep value and state.
    pub(crate) has_grad: &'a [bool],
    /// The optimizer (and per-parameter clipping) of each slot.
    pub(crate) groups: &'a Groups<O>,
    /// The optimizer state and `f32` master of each slot's piece.
    pub(crate) slots: &'a mut SlotStates<O>,
    /// Whether each bucket's all-gather starts as soon as the bucket is stepped and runs while
    /// the next one is (where backward reduces buckets, the collectives overlap compute).
    pub(crate) overlap: bool,
    /// Wall time spent in the optimizer's own steps ([`SlotStates::step`]), added to: on a
    /// backend that runs operations as they are called (Burn's CPU `Flex`), their compute.
    pub(crate) optimizer_time: &'a mut std::time::Duration,
    /// Set once the phase starts changing the parameters and the optimizer state: an error
    /// after that leaves some buckets stepped and others not (`ShardedOptimizer`'s
    /// `half_applied`).
    pub(crate) updating: &'a mut bool,
    /// Stage 3: the rank that steps each parameter an optimizer reads whole.
    pub(crate) owners: &'a WholeOwners,
}

impl<O: MasterWeightStep> Update<'_, O> {
    /// Steps every bucket's owned range of `model` with `grads` and publishes it; returns each
    /// bucket's updated values as this stage holds them (see [`Updated`]). All publishing
    /// collectives and disk writes are waited for before returning; with NVMe offload the ranks
    /// agree on whether every rank's reads and writes succeeded. Peak bytes of the step's
    /// temporary tensors on the device count in `temp`.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a collective fails; [`ShardError::Nvme`] when a rank's swap or
    /// shard file could not be read or written; [`ShardError::UnknownParam`] when `model` lacks
    /// a parameter of the layout.
    pub(crate) fn run<M: Module>(
        mut self,
        model: &M,
        mut grads: BucketGrads,
        temp: &mut PeakTracker,
    ) -> Result<Updated, ShardError> {
        let cx = self.cx;
        let (layout, plan, device) = (cx.layout, cx.plan, &cx.device);
        let keep: Vec<bool> = self.has_grad.iter().map(|g| !g).collect();
        let values = read_values(plan.params(), model, layout)?;
        // From here an error leaves some buckets stepped and others not.
        *self.updating = true;
        self.slots.begin_step(self.stepped_slots());
        let mut publishing = Vec::with_capacity(layout.buckets().len());
        let mut shards = HashMap::new();
        let mut failed = None;
        // With NVMe parameter offload: the next bucket's parameter shards are read while this
        // one is stepped (this bucket's first, for the first bucket).
        let mut param_reads = ReadAhead::default();
        // Stage 3: the exchanges with owners of whole parameters begun so far (see `drain`).
        let mut exchanged = 0;
        for (index, bucket) in layout.buckets().iter().enumerate() {
            // Queued in the order they are waited for: this bucket's parameters and gradients,
            // then the next bucket's gradients and parameters.
            param_reads.start(&self.piece_shards(&values, bucket), false);
            let range = cx.owned_range(bucket);
            let grad = grads.take(cx, index);
            if let Some(next) = layout.buckets().get(index + 1) {
                param_reads.start(&self.piece_shards(&values, next), true);
            }
            let stepped = grad.and_then(|grad| {
                let values = (&values[..], &mut param_reads);
                self.range(bucket, range, values, grad, (&mut *temp, &mut exchanged))
            });
            let param = match stepped {
                Ok(param) => param,
                Err(e) => {
                    // The other ranks still exchange whole parameters with their owners.
                    if !matches!(e, ShardError::Comm(_)) {
                        self.drain(exchanged);
                    }
                    failed = Some(e);
                    break;
                }
            };
            let param_bytes = bytes_on(&param, device);
            temp.alloc(param_bytes);
            // Stage 3: the new shards go where shards live now (written behind the step with
            // NVMe parameter offload), so the step holds one bucket of them at a time.
            match plan.params().home_shards(layout, bucket, &param, &keep) {
                Some(homed) => {
                    temp.free(param_bytes);
                    let held = homed.iter().filter_map(|(_, s)| s.held()).map(|t| bytes_on(t, device));
                    temp.alloc(held.sum());
                    shards.extend(homed);
                }
                None => publishing.push((param_bytes, plan.publish(cx.comm, param, index, self.overlap))),
            }
        }
        drop((values, param_reads));
        let (param_bytes, works): (Vec<usize>, Vec<_>) = publishing.into_iter().unzip();
        let waited = Work::wait_all(works.into_iter().map(Some));
        // Ended whatever the collectives did, so that no write of this step is left in flight.
        let swapped = self.slots.end_step();
        let homed = plan.params().flush_home();
        // A failed read or write of the shard file comes first, then the swap file's.
        let own = match failed {
            Some(e) => Err(e),
            None => homed.and(swapped),
        };
        match self.slots.swaps() || plan.params().shard_store().is_some() {
            true => agree_on_disk(cx.comm, own, device, "in this step", disk_dir(self.slots, plan))?,
            false => own?,
        }
        // Stages 1-2: the published buckets replace the updated ranges (none at stage 3).
        let full: Vec<Tensor<1>> = waited?.into_iter().flatten().collect();
        for (param_bytes, updated) in param_bytes.into_iter().zip(&full) {
            temp.free(param_bytes);
            temp.alloc(bytes_on(updated, device));
        }
        Ok(match plan.params().shards_parameters() {
            true => Updated::Shards(shards),
            false => Updated::Buckets(full),
        })
    }

    /// Steps each parameter's piece of `range` of `bucket` with its own optimizer state (so
    /// per-parameter state, such as Adam's step count, follows Burn's per-parameter semantics)
    /// and returns the updated `[range.len()]` range. `grad` covers `range`. Pieces of
    /// parameters without a gradient on any rank are returned as they are, their state and
    /// master untouched; padding stays zero. Each value is taken as its piece is reached (from
    /// the shard file with NVMe parameter offload, its read started in `reads`).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when a shard cannot be read; [`ShardError::Comm`] when an exchange
    /// with an owner fails (stage 3).
    fn range(
        &mut self,
        bucket: &Bucket,
        range: Range<usize>,
        (values, reads): (&[Option<Shard>], &mut ReadAhead),
        grad: Tensor<1>,
        (temp, exchanged): (&mut PeakTracker, &mut usize),
    ) -> Result<Tensor<1>, ShardError> {
        let (layout, device) = (self.cx.layout, &self.cx.device);
        let mut pieces = Vec::new();
        for (index, part) in layout.pieces(bucket, &range) {
            let slot = &layout.slots()[index];
            let len = part.len();
            let value = values[index].as_ref().map(|v| reads.take(v).wait()).transpose()?;
            let param = flat::slot_piece(&value, slot, part.clone(), bucket.dtype, device);
            let at = slot.offset + part.start;
            if !self.has_grad[index] {
                pieces.push((at, param));
                continue;
            }
            let grad = grad.clone().narrow(0, at - range.start, len);
            let grad = self.clip.piece(self.groups, index, grad);
            let lr = self.lr.lr_from_param(slot.id, Some(&slot.path));
            // Stage 3: a parameter read whole is stepped by its owner (every rank takes part).
            if let Some(owner) = self.owners.of(index) {
                *exchanged += 1;
                pieces.push((at, self.step_on_owner(index, owner, lr, [param, grad], temp)?));
                continue;
            }
            let optim = self.groups.optim(index);
            // An optimizer that reads whole parameters is given them whole (the layout puts
            // each of them in one rank's range; `init` checked it).
            let shape = optim.needs_whole_params().then_some(&slot.shape[..]);
            debug_assert!(
                shape.is_none() || len == slot.numel,
                "`{}` is not whole here",
                slot.path
            );
            let started = std::time::Instant::now();
            let param = self.slots.step(index, optim, lr, shape, param, grad);
            *self.optimizer_time += started.elapsed();
            pieces.push((at, param));
        }
        Ok(flat::join_range(pieces, bucket, range, device))
    }

    /// Stage 3: slot `index`'s parameter stepped whole by its `owner`
    /// ([`crate::step::whole_owner`]): `param` and `grad` are this rank's `[chunk]` shards, as
    /// is the result (where `param` was: in host memory with parameter offload). A collective
    /// of the shard group, run on the compute device; the whole tensors count in `temp`.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a collective fails.
    fn step_on_owner(
        &mut self,
        index: usize,
        owner: &WholeOwner,
        lr: burn::optim::LearningRate,
        [param, grad]: [Tensor<1>; 2],
        temp: &mut PeakTracker,
    ) -> Result<Tensor<1>, ShardError> {
        let (comm, device) = (self.cx.comm, &self.cx.device);
        let (chunk, dtype, home) = (param.dims()[0], param.dtype(), param.device());
        let (numel, tag) = (owner.numel(), self.exchange_tag(index));
        let bytes = exchange_bytes(chunk, comm.world_size(), [dtype, grad.dtype()]);
        temp.alloc(bytes);
        let shard = (|| {
            let chunks = vec![param.to_device(device), grad.to_device(device)];
            let mut whole = gather_whole(comm, chunks, numel, tag)?.into_iter();
            let (param, grad) = (whole.next().expect("gathered"), whole.next().expect("gathered"));
            let updated = match comm.rank() == owner.rank {
                true => {
                    let started = std::time::Instant::now();
                    let optim = self.groups.optim(index);
                    let param = self.slots.step(index, optim, lr, Some(&owner.shape), param, grad);
                    *self.optimizer_time += started.elapsed();
                    Some(param.to_device(device))
                }
                false => None,
            };
            scatter_from_owner(comm, updated, chunk, (device, dtype), tag)
        })();
        temp.free(bytes);
        Ok(shard?.to_device(&home))
    }

    /// The tag of slot `index`'s exchange with its owner ([`CallTag::WholeExchange`]).
    fn exchange_tag(&self, index: usize) -> u64 {
        CallTag::WholeExchange(&self.cx.layout.slots()[index].path).value()
    }

    /// After this rank failed (a shard or gradient it could not read), the exchanges with
    /// owners of whole parameters that the other ranks still run this step, from the
    /// `exchanged + 1`-th on, with zeros of the dtypes they send (the gradient's as
    /// [`StepContext::unscaled_dtype`] gives it), until one fails: so that no rank of the shard
    /// group waits for this one. The step then fails on every rank (their disk outcome agreed)
    /// and later steps and saves are refused: a parameter this rank owns got zeros, one it
    /// does not was stepped with zeros for this rank's shard. (With hybrid sharding and the
    /// gradient shards on disk, a replica that waits in a later bucket's all-reduce is not
    /// covered.)
    fn drain(&self, exchanged: usize) {
        let (layout, comm, device) = (self.cx.layout, self.cx.comm, &self.cx.device);
        let mut order = Vec::new();
        for bucket in layout.buckets() {
            let range = self.cx.owned_range(bucket);
            order.extend(layout.pieces(bucket, &range).map(|(index, _)| (index, bucket.dtype)));
        }
        let exchanges = order
            .into_iter()
            .filter(|&(index, _)| self.has_grad[index])
            .filter_map(|(index, dtype)| Some((index, self.owners.of(index)?, dtype)))
            .skip(exchanged);
        for (index, owner, dtype) in exchanges {
            let (chunk, tag) = (layout.slots()[index].numel, self.exchange_tag(index));
            let zeros = |dtype| Tensor::<1>::zeros([chunk], (device, dtype));
            let sent = vec![zeros(dtype), zeros(self.cx.unscaled_dtype(dtype))];
            let exchanged = gather_whole(comm, sent, owner.numel(), tag)
                .and_then(|_| scatter_from_owner(comm, None, chunk, (device, dtype), tag));
            if exchanged.is_err() {
                break; // this rank's calls no longer match the others'
            }
        }
    }

    /// The values of the pieces of `bucket` this rank steps (stage 3: their shards).
    fn piece_shards(&self, values: &[Option<Shard>], bucket: &Bucket) -> Vec<Shard> {
        let range = self.cx.owned_range(bucket);
        let pieces = self.cx.layout.pieces(bucket, &range);
        pieces.filter_map(|(index, _)| values[index].clone()).collect()
    }

    /// The slots this step updates on this rank, in the order `range` takes them: those with a
    /// gradient and a piece in this rank's range, bucket by bucket (at stage 3 not those of
    /// parameters another rank owns whole).
    fn stepped_slots(&self) -> Vec<usize> {
        let layout = self.cx.layout;
        let mut order = Vec::new();
        for bucket in layout.buckets() {
            let range = self.cx.owned_range(bucket);
            order.extend(
                layout
                    .pieces(bucket, &range)
                    .map(|(i, _)| i)
                    .filter(|&i| self.has_grad[i])
                    .filter(|&i| self.owners.of(i).is_none_or(|o| o.rank == self.cx.comm.rank())),
            );
        }
        order
    }
}

/// Bytes of `tensor` when it is on `device`, 0 elsewhere: the step's temporary peak counts the
/// parameters' device, not the host memory that parameter offload updates its shards in.
fn bytes_on(tensor: &Tensor<1>, device: &Device) -> usize {
    match tensor.device() == *device {
        true => tensor_bytes(tensor),
        false => 0,
    }
}

/// What a step updated: each bucket's published values (whole parameters, stages 0-2), or the
/// stepped slots' new shards, already where shards live (stage 3).
pub(crate) enum Updated {
    /// Per bucket, its `[padded_numel]` values as every rank now holds them.
    Buckets(Vec<Tensor<1>>),
    /// Per stepped parameter, this rank's new `[chunk]` shard.
    Shards(HashMap<ParamId, Shard>),
}

impl Updated {
    /// `model` rebuilt from the step's update, slots with `keep` set left as they are.
    pub(crate) fn write_into<M: Module>(self, model: M, layout: &FlatLayout, keep: &[bool]) -> M {
        match self {
            Updated::Shards(shards) => exchange::replace_shards(model, shards),
            Updated::Buckets(buckets) => flat::scatter_into(model, layout, &buckets, keep),
        }
    }
}

/// The current values of the layout's slots: the parameters when `params` holds them whole, or
/// this rank's shards (read one by one as the step reaches them, from disk with NVMe parameter
/// offload).
///
/// # Errors
/// [`ShardError::UnknownParam`] when `model` lacks a parameter of the layout.
fn read_values<M: Module>(
    params: &dyn ParamHolding,
    model: &M,
    layout: &FlatLayout,
) -> Result<Vec<Option<Shard>>, ShardError> {
    if !params.shards_parameters() {
        let values = flat::param_values(model, layout)?.0;
        return Ok(values.into_iter().map(|value| value.map(Shard::Held)).collect());
    }
    let mut shards = exchange::collect_shards(model);
    let mut values = Vec::with_capacity(layout.slots().len());
    for slot in layout.slots() {
        let shard = shards.remove(&slot.id).ok_or_else(|| ShardError::UnknownParam {
            path: slot.path.clone(),
            id: slot.id.to_string(),
        })?;
        values.push(Some(shard));
    }
    Ok(values)
}
