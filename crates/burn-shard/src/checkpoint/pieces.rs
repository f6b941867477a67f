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
    /// Kept whole on every rank (buffers, frozen parameters at stages 0-2, reparameterized
    /// parameters): rank 0 saves it.
    Whole,
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
