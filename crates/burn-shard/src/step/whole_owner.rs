//! Stage 3 with an optimizer that reads whole parameters (Muon, LAMB, Adafactor): stage 3 keeps
//! every parameter as `[chunk]` shards, one per rank, so each such parameter gets an owner among
//! the shard group's ranks, which steps it whole. In the step the ranks all-gather the
//! parameter's gradient and values (their `[chunk]` shards), the owner runs the optimizer on
//! the shaped tensor with its own state and `f32` master, and the new values come back by a
//! reduce-scatter to which the owner alone sends non-zeros (a scatter from the owner:
//! `x + 0 = x` exactly), so each rank receives its `[chunk]` in a buffer of its own. The owners
//! are balanced by elements (greedy, largest first, as the whole buckets of stages 1-2:
//! [`balance`]), so the state and the optimizer's work (Newton-Schulz) are divided over the
//! ranks, not repeated on each.
//!
//! Cost: per such parameter of `numel` elements, each rank receives about `3 · numel` elements
//! more per step than stage 3's `3 · numel` of gathers and reduce-scatters (two all-gathers and
//! a reduce-scatter: the collectives have no gather to one rank), and holds the parameter and
//! its gradient whole for the time of its update, one parameter at a time, as a gather does
//! (counted in the step's temporary peak). (Sharding each such parameter whole in forward and
//! backward instead, Megatron's layout, would remove the exchange but breaks the grouped
//! per-unit collectives of `fsdp/`.)

use burn::tensor::{DType, Device, Tensor};
use burn_shard_comm::{Collective, ReduceOp};

use crate::error::ShardError;
use crate::fsdp::collectives::pad_to;
use crate::model::layout::{FlatLayout, balance};
#[cfg(doc)]
use crate::overlap::call_tag::CallTag;

/// The owner of a parameter stepped whole at stage 3, and its full shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WholeOwner {
    /// The rank of the shard group that steps it and keeps its state.
    pub(crate) rank: usize,
    /// The parameter's full shape (the local layout's slot is its `[chunk]`).
    pub(crate) shape: Vec<usize>,
}

impl WholeOwner {
    /// Elements of the whole parameter.
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Per slot of stage 3's local layout: the owner of a parameter an optimizer reads whole,
/// `None` for the others (and at stages 0-2, where the layout gives such parameters whole).
#[derive(Clone, Debug, Default)]
pub(crate) struct WholeOwners {
    owners: Vec<Option<WholeOwner>>,
}

impl WholeOwners {
    /// Owners for the slots of `layout` (stage 3's local one) for which `wants_whole` holds,
    /// over `world_size` ranks. A slot `previous` gave an owner keeps it (a group added after
    /// `init` moves no state); the others go largest first, each to the rank owning fewest new
    /// elements so far, ties to the one owning fewest before, then the lowest rank: at `init`
    /// (no previous owners) the busiest rank owns at most `4/3` of the optimum (Graham's bound
    /// for this greedy rule). `shape_of` gives a slot's full shape. The same on every rank:
    /// slots in layout order, sizes alone.
    pub(crate) fn assign(
        layout: &FlatLayout,
        shape_of: impl Fn(usize) -> Vec<usize>,
        world_size: usize,
        previous: &WholeOwners,
        wants_whole: impl Fn(usize) -> bool,
    ) -> Self {
        let mut owners = vec![None; layout.slots().len()];
        let mut load = vec![0; world_size.max(1)];
        let mut new = Vec::new();
        for (index, slot_owner) in owners.iter_mut().enumerate() {
            if !wants_whole(index) {
                continue;
            }
            match previous.of(index) {
                Some(owner) => {
                    load[owner.rank] += owner.numel();
                    *slot_owner = Some(owner.clone());
                }
                None => new.push((index, shape_of(index))),
            }
        }
        let numels: Vec<usize> = new.iter().map(|(_, shape)| shape.iter().product()).collect();
        let (_, ranks) = balance(&numels, &mut load);
        for ((index, shape), rank) in new.into_iter().zip(ranks) {
            owners[index] = Some(WholeOwner { rank, shape });
        }
        Self { owners }
    }

    /// Whether some slot has an owner (stage 3 with an optimizer that reads whole parameters).
    pub(crate) fn any(&self) -> bool {
        self.owners.iter().any(Option::is_some)
    }

    /// The owner of slot `index`, `None` when the slot is stepped as a flat shard.
    pub(crate) fn of(&self, index: usize) -> Option<&WholeOwner> {
        self.owners.get(index).and_then(Option::as_ref)
    }
}

/// Every rank's `[chunk]` shards of a parameter of `numel` elements, all-gathered: the whole
/// `[numel]` values of each of `chunks` (the parameter and its gradient), padding dropped.
/// `tag` names the calls ([`CallTag::WholeExchange`]).
///
/// # Errors
/// [`ShardError::Comm`] when the all-gather fails.
pub(crate) fn gather_whole(
    comm: &dyn Collective,
    chunks: Vec<Tensor<1>>,
    numel: usize,
    tag: u64,
) -> Result<Vec<Tensor<1>>, ShardError> {
    // One call each: a fused grouped all-gather moves one dtype, and the gradient's may differ.
    chunks
        .into_iter()
        .map(|chunk| Ok(comm.all_gather_tagged(chunk, tag)?.narrow(0, 0, numel)))
        .collect()
}

/// The owner's new `[numel]` values (`updated`, `Some` on the owner alone) -> this rank's
/// `[chunk]` shard of them, zero-padded past `numel` (a stage-3 shard's padding stays zero):
/// a sum-reduce-scatter to which the other ranks send zeros, so the shard is exactly the
/// owner's values (`x + 0 = x`) in a buffer of its own, not a view that would keep the whole
/// parameter alive.
///
/// # Errors
/// [`ShardError::Comm`] when the reduce-scatter fails.
pub(crate) fn scatter_from_owner(
    comm: &dyn Collective,
    updated: Option<Tensor<1>>,
    chunk: usize,
    (device, dtype): (&Device, DType),
    tag: u64,
) -> Result<Tensor<1>, ShardError> {
    let padded = chunk * comm.world_size();
    let sent = match updated {
        Some(values) => pad_to(values, padded),
        None => Tensor::zeros([padded], (device, dtype)),
    };
    Ok(comm.reduce_scatter_tagged(sent, ReduceOp::Sum, tag)?)
}

/// Bytes a rank holds while a parameter is exchanged with its owner: the gathered parameter and
/// gradient and the buffer sent back, each `[chunk · world_size]` (the optimizer's own
/// temporaries on the owner come on top, as at stages 1-2).
pub(crate) fn exchange_bytes(chunk: usize, world_size: usize, [param, grad]: [DType; 2]) -> usize {
    chunk * world_size * (2 * param.size() + grad.size())
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;

    use super::*;
    use crate::model::layout::ParamSlot;

    /// Stage 3's local layout of `shapes` over `world_size` ranks: each slot its `[chunk]`.
    fn local(shapes: &[Vec<usize>], world_size: usize) -> FlatLayout {
        let slots = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let chunk = shape.iter().product::<usize>().div_ceil(world_size);
                ParamSlot {
                    path: format!("p{i}"),
                    id: ParamId::new(),
                    shape: vec![chunk],
                    numel: chunk,
                    dtype: DType::F32,
                    bucket: usize::MAX,
                    offset: usize::MAX,
                }
            })
            .collect();
        FlatLayout::from_slots(slots, 1, 1 << 20).expect("a layout")
    }

    /// The elements each rank owns.
    fn loads(owners: &WholeOwners, slots: usize, world_size: usize) -> Vec<usize> {
        let mut load = vec![0; world_size];
        (0..slots)
            .filter_map(|i| owners.of(i))
            .for_each(|o| load[o.rank] += o.numel());
        load
    }

    #[test]
    fn owners_are_balanced_by_size_and_kept_when_groups_change() {
        // Eight equal matrices and two biases over 4 ranks: 2 matrices per rank, biases flat.
        let mut shapes = vec![vec![16, 16]; 8];
        shapes.extend([vec![16], vec![16]]);
        let layout = local(&shapes, 4);
        let shape_of = |i: usize| shapes[i].clone();
        let matrices = |i: usize| i < 8;
        let owners = WholeOwners::assign(&layout, shape_of, 4, &WholeOwners::default(), matrices);
        assert_eq!(loads(&owners, shapes.len(), 4), [512; 4]);
        assert!(owners.of(8).is_none() && owners.of(9).is_none(), "the biases stay flat");
        assert_eq!(owners.of(0).map(|o| o.shape.clone()), Some(vec![16, 16]), "full shapes");

        // Uneven sizes: the busiest rank within Graham's 4/3 of the optimum (here the mean).
        let uneven: Vec<Vec<usize>> = [7, 5, 4, 4, 3, 3, 3].iter().map(|&n| vec![n, 10]).collect();
        let layout = local(&uneven, 3);
        let owners = WholeOwners::assign(&layout, |i| uneven[i].clone(), 3, &WholeOwners::default(), |_| true);
        let load = loads(&owners, uneven.len(), 3);
        let total: usize = load.iter().sum();
        assert_eq!(total, 290);
        assert!(3 * 3 * load.iter().max().unwrap() <= 4 * total, "{load:?}");

        // A group added later (the biases read whole too): every matrix keeps its owner.
        let layout = local(&shapes, 4);
        let before = WholeOwners::assign(&layout, shape_of, 4, &WholeOwners::default(), matrices);
        let after = WholeOwners::assign(&layout, shape_of, 4, &before, |_| true);
        for i in 0..8 {
            assert_eq!(after.of(i), before.of(i), "matrix {i} moved");
        }
        assert!(after.of(8).is_some() && after.of(9).is_some());
        assert_ne!(
            after.of(8).unwrap().rank,
            after.of(9).unwrap().rank,
            "the new ones spread"
        );
        // One dropped from the group loses its owner.
        let dropped = WholeOwners::assign(&layout, shape_of, 4, &after, |i| i != 3);
        assert!(dropped.of(3).is_none() && dropped.of(2) == after.of(2));
    }
}
