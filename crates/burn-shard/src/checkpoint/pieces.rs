//! Which elements of each entry a rank holds at a given stage and world size: the one rule the
//! writer and the reader share.

use std::ops::Range;

use super::meta::Piece;
use crate::model::layout::FlatLayout;
use crate::stage::Stage;

/// Where an entry's elements live in a run.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Holding<'a> {
    /// A trainable parameter of a stage 0-2 run: its slot in the (global) flat layout.
    Slot(&'a FlatLayout, usize),
    /// A parameter sharded by stage 3 (trainable or frozen): chunks of `ceil(numel / N)`.
    Chunks,
    /// A stage-3 parameter that an optimizer reads whole, stepped by its owner, this rank of
    /// the shard group ([`crate::step::whole_owner`]): held as `Chunks`, saved whole by the
    /// owner with its state and master (the owner gathers it to save it).
    Owned(usize),
    /// Kept whole on every rank (buffers, frozen parameters at stages 0-2, reparameterized
    /// parameters): rank 0 saves it.
    Whole,
}

impl Holding<'_> {
    /// Whether the rank holds the entry as a stage-3 shard (`Chunks`, `Owned`).
    pub(crate) fn is_sharded(&self) -> bool {
        matches!(self, Holding::Chunks | Holding::Owned(_))
    }
}

/// The element range of an entry of `numel` elements that `rank` of `world_size` holds (and
/// saves, and steps when trainable); `None` when it holds none of it.
pub(crate) fn piece(
    stage: Stage,
    holding: Holding,
    numel: usize,
    rank: usize,
    world_size: usize,
) -> Option<Range<usize>> {
    let range = match holding {
        // Stages 0-2 (stage 3 shards every parameter: `Chunks`).
        Holding::Slot(layout, index) => {
            debug_assert!(!stage.shards_parameters(), "stage 3 holds parameters as chunks");
            let slot = &layout.slots()[index];
            match stage.shards_optimizer_state() {
                true => slot
                    .within(&layout.buckets()[slot.bucket].shard_range(rank))
                    .unwrap_or(0..0),
                false => whole_on_rank_0(numel, rank),
            }
        }
        Holding::Chunks => {
            let chunk = numel.div_ceil(world_size);
            (rank * chunk).min(numel)..((rank + 1) * chunk).min(numel)
        }
        Holding::Owned(owner) => match rank == owner {
            true => 0..numel,
            false => 0..0,
        },
        Holding::Whole => whole_on_rank_0(numel, rank),
    };
    (!range.is_empty()).then_some(range)
}

fn whole_on_rank_0(numel: usize, rank: usize) -> Range<usize> {
    if rank == 0 { 0..numel } else { 0..0 }
}

/// The element range of a trainable entry whose optimizer state `rank` needs to step it: what it
/// holds, except at stage 0, where every rank steps the whole (replicated) parameter.
pub(crate) fn stepped(
    stage: Stage,
    holding: Holding,
    numel: usize,
    rank: usize,
    world_size: usize,
) -> Option<Range<usize>> {
    match holding {
        Holding::Slot(..) if !stage.shards_optimizer_state() => (numel > 0).then_some(0..numel),
        _ => piece(stage, holding, numel, rank, world_size),
    }
}

/// Every rank's piece of an entry, in rank order: what `meta.json` lists.
pub(crate) fn pieces(stage: Stage, holding: Holding, numel: usize, world_size: usize) -> Vec<Piece> {
    (0..world_size)
        .filter_map(|rank| {
            piece(stage, holding, numel, rank, world_size).map(|r| Piece {
                rank,
                start: r.start,
                end: r.end,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;
    use burn::tensor::DType;

    use super::*;
    use crate::model::layout::ParamSlot;

    /// A layout of `f32` parameters of `numels` elements over `world_size` ranks.
    fn layout(numels: &[usize], world_size: usize, bucket_numel: usize) -> FlatLayout {
        let slots = numels
            .iter()
            .enumerate()
            .map(|(i, &numel)| ParamSlot {
                path: format!("p{i}"),
                id: ParamId::new(),
                shape: vec![numel],
                numel,
                dtype: DType::F32,
                bucket: 0,
                offset: 0,
            })
            .collect();
        FlatLayout::from_slots(slots, world_size, bucket_numel).unwrap()
    }

    /// Asserts that `pieces` cover `0..numel` once, in rank order, without gaps.
    fn assert_partition(pieces: &[Piece], numel: usize, what: &str) {
        let mut next = 0;
        for (i, p) in pieces.iter().enumerate() {
            assert!(
                i == 0 || p.rank > pieces[i - 1].rank,
                "{what}: ranks out of order: {pieces:?}"
            );
            assert_eq!(
                p.start, next,
                "{what}: a gap or an overlap before rank {}: {pieces:?}",
                p.rank
            );
            assert!(p.end > p.start, "{what}: an empty piece listed: {pieces:?}");
            next = p.end;
        }
        assert_eq!(
            next, numel,
            "{what}: the pieces end at {next}, not at {numel}: {pieces:?}"
        );
    }

    /// Whatever the stage, world size and bucket size, an entry's pieces cover its elements
    /// exactly once (what lets a reader of any other world size find every element); whole
    /// holdings and stage 0 are rank 0's alone.
    #[test]
    fn pieces_partition_every_entry_at_every_stage_and_world_size() {
        for world_size in 1..=4 {
            for numels in [[7, 1, 12, 5], [3, 3, 3, 3], [1, 1, 1, 30]] {
                for bucket_numel in [4, 10, 1000] {
                    let layout = layout(&numels, world_size, bucket_numel);
                    for stage in [Stage::Zero, Stage::One, Stage::Two] {
                        for (index, &numel) in numels.iter().enumerate() {
                            let what = format!(
                                "slot {index} of {numels:?}, stage {stage}, world size {world_size}, buckets of {bucket_numel}"
                            );
                            let ps = pieces(stage, Holding::Slot(&layout, index), numel, world_size);
                            assert_partition(&ps, numel, &what);
                            if stage == Stage::Zero {
                                assert_eq!(ps.len(), 1, "{what}: stage 0 saves on rank 0 alone");
                            }
                            for rank in 0..world_size {
                                let stepped = stepped(stage, Holding::Slot(&layout, index), numel, rank, world_size);
                                match stage {
                                    Stage::Zero => {
                                        assert_eq!(stepped, Some(0..numel), "{what}: stage 0 steps it whole")
                                    }
                                    _ => assert_eq!(
                                        stepped,
                                        piece(stage, Holding::Slot(&layout, index), numel, rank, world_size),
                                        "{what}: rank {rank} steps what it holds"
                                    ),
                                }
                            }
                        }
                    }
                }
            }
            for numel in 0..=13 {
                let what = format!("{numel} elements as stage-3 chunks of world size {world_size}");
                assert_partition(&pieces(Stage::Three, Holding::Chunks, numel, world_size), numel, &what);
                for stage in [Stage::Zero, Stage::Three] {
                    let whole = pieces(stage, Holding::Whole, numel, world_size);
                    assert_partition(&whole, numel, &format!("{numel} elements held whole"));
                    assert!(
                        whole.iter().all(|p| p.rank == 0),
                        "a whole entry is rank 0's: {whole:?}"
                    );
                }
            }
        }
    }
}
