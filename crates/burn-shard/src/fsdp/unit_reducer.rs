//! Per-unit grouped reduce-scatters of the stage-3 gradients, overlapped with backward
//! (FSDP2's post-backward of an `FSDPParamGroup`: one reduce-scatter of the unit's gradients,
//! on its own stream).
//!
//! Backward completes a unit's full gradients one after the other (each gather op's backward).
//! Reducing each alone costs one synchronisation of the ranks per parameter and nothing
//! overlaps. The reducer instead keeps a unit's full gradients until the unit is complete, then
//! reduce-scatters them with one call per dtype, started asynchronously: it runs on the rank's
//! communication thread while backward computes the unit before. A unit is complete when it has
//! as many gradients as the same unit had in the previous pass, or, for an `fsdp::unit` scope,
//! when a gradient of another such unit arrives (its backward is contiguous). Units are told
//! apart by their scope, not by the order of arrival: the gradients of units named by
//! `Stage3Config::units` all arrive at the end of backward, interleaved in Burn's traversal
//! order, so such a unit starts when its learned count is complete. At most one reduce-scatter
//! is in flight: starting the next one waits for it, and its shards are returned for
//! registration on the parameters' autodiff leaves.
//!
//! Passes. Until the optimizer's first `step` or `accumulate`, the reducer learns: each gradient
//! is reduce-scattered alone, at once, as the op's backward runs, while the reducer counts the
//! unit sizes and records the gradients' order; one backward is the shortest repeating part of
//! that order (several backwards may precede the call). From then on, each backward's last
//! gradient starts what is pending and waits for it inside backward, so the `Gradients` that
//! `backward()` returns hold every shard and nothing of one backward reaches the next. If the
//! gradients between two optimizer calls are not a whole number of learned backwards (the
//! model's backward changed), what is still pending or in flight is left to the optimizer
//! ([`Reducer::finish`], called by `step` and `accumulate`), and the reducer learns again.
//!
//! Memory: one unit's full gradients plus one unit's in flight, as FSDP2, for `fsdp::unit`
//! scopes; units named by `Stage3Config::units` keep every full gradient until the end of
//! backward (Burn runs their gathers' backwards last). The gradient of a parameter gathered
//! outside any unit (a tied head, an embedding) is a group of its own, started as soon as it is
//! complete.
//!
//! Every rank runs the same backward, so every rank starts the same calls in the same order,
//! which the collectives require; what was learned decides when a unit is started and how its
//! gradients are grouped, never which elements are averaged with which: each element is the
//! mean over the same ranks as with one reduce-scatter per parameter (bitwise so on the
//! in-process ring, which sums each chunk in the same rank order however the chunks are
//! grouped).

use std::collections::HashMap;
use std::sync::Arc;

use burn::backend::autodiff::NodeId;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor};
use burn_shard_comm::{ReduceOp, Work};

use crate::fsdp::collectives::{dtype_group, pad_to, reduce_scatter_grad};
use crate::fsdp::comm_context::CommContext;
use crate::fsdp::spec::{POLICY_SCOPE, ParamSpec};
use crate::overlap::backward_log::BackwardLog;
use crate::overlap::call_tag::CallTag;

/// This rank's shard of a parameter's mean gradient, ready to be registered.
pub(crate) struct Reduced {
    /// The parameter's autodiff leaf (its placeholder) in the backward that produced it.
    pub(crate) node: NodeId,
    /// The parameter, for a shard handed to the optimizer after backward.
    pub(crate) id: ParamId,
    /// `[1, .., 1, chunk]`: the rank of the parameter.
    pub(crate) shard_shape: Shape,
    /// `[chunk]`, the gradient's dtype.
    pub(crate) shard: Tensor<1>,
}

/// Where a parameter's shard lies in a grouped reduce-scatter.
struct Member {
    node: NodeId,
    id: ParamId,
    shard_shape: Shape,
    chunk: usize,
    /// Element offset of the parameter's chunk in each rank's block.
    offset: usize,
}

/// A parameter's full gradient waiting for the rest of its unit.
struct FullGrad {
    member: Member,
    tag: u64,
    /// `[numel]`.
    grad: Tensor<1>,
}

/// A unit whose gradients are arriving.
struct Pending {
    scope: u64,
    /// Tag of its first gradient: names the unit across passes.
    first_tag: u64,
    grads: Vec<FullGrad>,
}

/// One unit's reduce-scatters (one per dtype), started and not yet taken apart.
struct InFlight {
    parts: Vec<Part>,
    /// Alive while the buffers are in flight: the transient-memory probe's handle.
    _watch: Option<Arc<()>>,
}

/// One dtype's reduce-scatter of a unit: `[width]` elements per rank.
struct Part {
    members: Vec<Member>,
    width: usize,
    dtype: DType,
    device: Device,
    work: Work<Tensor<1>>,
}

/// The gradients of the unit being completed and of the unit being reduced.
#[derive(Default)]
pub(crate) struct Reducer {
    /// Gradients each unit (by its first tag) had in the previous pass.
    sizes: HashMap<u64, usize>,
    /// Gradients a pass has in all, learned; `None` while learning (see the module docs).
    expected: Option<usize>,
    /// The gradients since the optimizer last ended a pass, by tag: a learning pass's one
    /// backward is its period.
    log: BackwardLog,
    /// While learning: each unit's scope, first tag and gradients so far, in order of arrival.
    counting: Vec<(u64, u64, usize)>,
    /// The units whose gradients are arriving, in order of their first gradient.
    pending: Vec<Pending>,
    in_flight: Option<InFlight>,
}

impl Reducer {
    /// Takes the complete full gradient `grad` (`[numel]`) of `spec`'s parameter, whose autodiff
    /// leaf is `node`, and returns the shards that are ready now (this one's, or earlier ones').
    pub(crate) fn add(&mut self, ctx: &CommContext, spec: &ParamSpec, node: NodeId, grad: Tensor<1>) -> Vec<Reduced> {
        let mut ready = Vec::new();
        let member = Member {
            node,
            id: spec.id,
            shard_shape: spec.shard_shape.clone(),
            chunk: spec.chunk,
            offset: 0,
        };
        self.log.record(spec.tag);
        let Some(expected) = self.expected else {
            // Learning: alone and at once, counting the units.
            debug_assert!(self.pending.is_empty() && self.in_flight.is_none(), "drained by finish");
            self.count(spec);
            let shard = reduce_scatter_grad(ctx, grad, spec.chunk, spec.tag);
            ready.push(Reduced::of(member, shard));
            return ready;
        };
        self.add_grouped(ctx, spec, member, grad, &mut ready);
        if self.log.len().is_multiple_of(expected) {
            // The pass's last gradient (or the last of several backwards before one step):
            // nothing is left for after backward.
            self.start_pending(ctx, &mut ready);
            ready.extend(self.wait(ctx));
        }
        ready
    }

    /// From the second pass on: `grad` joins its unit's pending gradients, or is started alone
    /// outside units; shards that become ready go to `ready`.
    fn add_grouped(
        &mut self,
        ctx: &CommContext,
        spec: &ParamSpec,
        member: Member,
        grad: Tensor<1>,
        ready: &mut Vec<Reduced>,
    ) {
        let full = FullGrad {
            member,
            tag: spec.tag,
            grad,
        };
        let Some(scope) = spec.unit_scope else {
            // Outside units: a group of its own, started at once after everything before it.
            self.start_pending(ctx, ready);
            ready.extend(self.wait(ctx));
            self.in_flight = Some(start(ctx, vec![full]));
            return;
        };
        if scope & POLICY_SCOPE == 0 {
            // An `fsdp::unit` scope: its backward is contiguous, so another unit's gradient means
            // the units before are complete (even when smaller than learned: a parameter left
            // out this time), and they start now rather than at the end of backward.
            let done: Vec<Pending> = self
                .pending
                .extract_if(.., |p| p.scope != scope && p.scope & POLICY_SCOPE == 0)
                .collect();
            for unit in done {
                self.start_unit(ctx, unit, ready);
            }
        }
        let index = match self.pending.iter().position(|p| p.scope == scope) {
            Some(index) => index,
            None => {
                self.pending.push(Pending {
                    scope,
                    first_tag: spec.tag,
                    grads: Vec::new(),
                });
                self.pending.len() - 1
            }
        };
        let pending = &mut self.pending[index];
        pending.grads.push(full);
        if self.sizes.get(&pending.first_tag) == Some(&pending.grads.len()) {
            let complete = self.pending.remove(index);
            self.start_unit(ctx, complete, ready);
        }
    }

    /// While learning: counts `spec`'s gradient in its unit (by scope: see the module docs).
    fn count(&mut self, spec: &ParamSpec) {
        let Some(scope) = spec.unit_scope else { return };
        match self.counting.iter_mut().find(|(counted, _, _)| *counted == scope) {
            Some((_, _, n)) => *n += 1,
            None => self.counting.push((scope, spec.tag, 1)),
        }
    }

    /// Ends the pass (every rank calls it at the same point: the optimizer, after backward):
    /// returns every shard not returned yet, after starting the pending unit and waiting for
    /// all. After a learning pass, one backward's gradient count is learned; after a pass whose
    /// count is not a multiple of it, the next pass learns again.
    pub(crate) fn finish(&mut self, ctx: &CommContext) -> Vec<Reduced> {
        let mut ready = Vec::new();
        self.start_pending(ctx, &mut ready);
        ready.extend(self.wait(ctx));
        for (_, first_tag, n) in self.counting.drain(..) {
            self.sizes.insert(first_tag, n);
        }
        self.expected = match self.expected {
            // Learning ended: one backward's gradients (none: keep learning).
            None => (self.log.len() > 0).then(|| self.log.period()),
            // As many as last time (or a multiple: several backwards before this call).
            Some(expected) if self.log.len().is_multiple_of(expected) => Some(expected),
            // The model's backward changed: learn again.
            Some(_) => None,
        };
        self.log.clear();
        ready
    }

    /// Starts the reduce-scatter of every pending unit, in order.
    fn start_pending(&mut self, ctx: &CommContext, ready: &mut Vec<Reduced>) {
        for pending in std::mem::take(&mut self.pending) {
            self.start_unit(ctx, pending, ready);
        }
    }

    /// Starts the reduce-scatter of `unit`, after taking the one in flight.
    fn start_unit(&mut self, ctx: &CommContext, unit: Pending, ready: &mut Vec<Reduced>) {
        self.sizes.insert(unit.first_tag, unit.grads.len());
        ready.extend(self.wait(ctx));
        self.in_flight = Some(start(ctx, unit.grads));
    }

    /// Waits for the reduce-scatter in flight and takes each parameter's shard out of it.
    fn wait(&mut self, ctx: &CommContext) -> Vec<Reduced> {
        let Some(in_flight) = self.in_flight.take() else {
            return Vec::new();
        };
        let mut ready = Vec::new();
        for part in in_flight.parts {
            let reduced = part.work.wait().unwrap_or_else(|e| {
                // The step reports it; zeros keep backward going meanwhile.
                ctx.record_error(e);
                Tensor::zeros([part.width], (&part.device, part.dtype))
            });
            for m in part.members {
                let shard = reduced.clone().narrow(0, m.offset, m.chunk);
                ready.push(Reduced::of(m, shard));
            }
        }
        ready
    }
}

impl Reduced {
    fn of(member: Member, shard: Tensor<1>) -> Self {
        Self {
            node: member.node,
            id: member.id,
            shard_shape: member.shard_shape,
            shard,
        }
    }
}

/// One dtype's gradients of a unit, being laid out for its reduce-scatter.
struct Group {
    dtype: DType,
    members: Vec<Member>,
    /// Each parameter's padded gradient as `[world_size, chunk]`.
    rows: Vec<Tensor<2>>,
    tags: Vec<u64>,
    /// Elements of each rank's block so far.
    width: usize,
}

/// Starts one reduce-scatter per dtype of `grads`: each rank's block holds, in order, every
/// parameter's chunk for that rank (`[world_size, width]` row-major), so the result is this
/// rank's `[width]` block, split back into the parameters' shards.
fn start(ctx: &CommContext, grads: Vec<FullGrad>) -> InFlight {
    let world_size = ctx.comm().world_size();
    let Some(sample) = grads.first().map(|g| g.grad.clone()) else {
        return InFlight {
            parts: Vec::new(),
            _watch: None,
        };
    };
    let device = sample.device();
    let mut groups: Vec<Group> = Vec::new();
    let mut bytes = 0;
    for g in grads {
        let dtype = g.grad.dtype();
        let group = dtype_group(
            &mut groups,
            dtype,
            |g| g.dtype,
            || Group {
                dtype,
                members: Vec::new(),
                rows: Vec::new(),
                tags: Vec::new(),
                width: 0,
            },
        );
        let padded = world_size * g.member.chunk;
        let grad = pad_to(g.grad, padded);
        bytes += padded * dtype.size();
        group.rows.push(grad.reshape([world_size, g.member.chunk]));
        group.tags.push(g.tag);
        group.width += g.member.chunk;
        group.members.push(Member {
            offset: group.width - g.member.chunk,
            ..g.member
        });
    }
    let parts = groups
        .into_iter()
        .map(|group| {
            let width = group.width;
            let flat = match group.rows.len() {
                1 => group
                    .rows
                    .into_iter()
                    .next()
                    .expect("one row block")
                    .reshape([world_size * width]),
                _ => Tensor::cat(group.rows, 1).reshape([world_size * width]),
            };
            Part {
                work: ctx
                    .comm()
                    .reduce_scatter_async(flat, ReduceOp::Avg, CallTag::Group(&group.tags).value()),
                members: group.members,
                width,
                dtype: group.dtype,
                device: device.clone(),
            }
        })
        .collect();
    InFlight {
        parts,
        _watch: ctx.watch_in_flight(&sample, bytes),
    }
}

/// Adds the shards `reduced` to `grads` under their parameters' ids, reshaped to the shape of
/// their gradients at stage 3 (`[1, .., 1, chunk]`); a parameter of `model` that already has a
/// gradient gets the sum. The optimizer calls this with [`FsdpContext::finish_reduce`](crate::fsdp::context::FsdpContext::finish_reduce) for the
/// shards that backward left in flight.
pub(crate) fn add_to_grads<M: Module>(model: &M, reduced: Vec<Reduced>, grads: &mut GradientsParams) {
    struct Add<'a> {
        reduced: HashMap<ParamId, Vec<Reduced>>,
        grads: &'a mut GradientsParams,
    }
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            for r in self.reduced.remove(&param.id).into_iter().flatten() {
                let shard: Tensor<D> = r.shard.reshape(r.shard_shape);
                let sum = match self.grads.remove::<D>(param.id) {
                    Some(grad) => grad + shard,
                    None => shard,
                };
                self.grads.register(param.id, sum);
            }
        }
    }
    if reduced.is_empty() {
        return;
    }
    let mut by_id: HashMap<ParamId, Vec<Reduced>> = HashMap::new();
    for r in reduced {
        by_id.entry(r.id).or_default().push(r);
    }
    model.visit(&mut Add { reduced: by_id, grads });
}
