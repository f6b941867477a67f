//! Each rank's share of a data loader: equal shares for training, every item once for validation.

use std::sync::Arc;

use burn::data::dataloader::DataLoader;
use burn::tensor::Device;

/// Share `rank` of `loader` split into `world_size` shares of equal length, on `device`.
///
/// Every rank must run the same number of batches: each step is a collective, so a rank with
/// one batch more would wait for the others forever. Burn's `split_dataloader` gives the
/// remainder of `num_items / world_size` to the last device; here the last
/// `num_items % world_size` items are dropped instead (at most `world_size - 1` items per epoch,
/// as PyTorch's `DistributedSampler(drop_last=True)`), and a warning names them. Rank `r` reads
/// items `[r·n, (r+1)·n)` with `n = num_items / world_size`, so with batch size `b` per rank,
/// step `k` trains on the union of the ranks' `k`-th batches.
pub(crate) fn equal_share<O: 'static>(
    loader: &Arc<dyn DataLoader<O>>,
    rank: usize,
    world_size: usize,
    device: &Device,
    split: &str,
) -> Arc<dyn DataLoader<O>> {
    let total = loader.num_items();
    let per_rank = total / world_size;
    let dropped = total - per_rank * world_size;
    if dropped > 0 && rank == 0 {
        tracing::warn!(
            split,
            total,
            world_size,
            dropped,
            "the {split} data does not divide by the world size: its last {dropped} items are left out so that every \
             rank runs the same number of batches"
        );
    }
    loader.slice(rank * per_rank, (rank + 1) * per_rank).to_device(device)
}

/// Share `rank` of `loader` for validation, on `device`: every item in exactly one share, the
/// shares contiguous and as equal as they come (rank `r` reads items
/// `[⌊r·N/W⌋, ⌊(r+1)·N/W⌋)` of `N` items on `W` ranks, so their lengths differ by at most one),
/// so that metrics over the ranks' shares are the metrics over the whole set, at every world
/// size. Ranks may then run different numbers of batches; the rank's loop keeps them in step
/// (see `RankJob::valid_epoch`).
pub(crate) fn whole_share<O: 'static>(
    loader: &Arc<dyn DataLoader<O>>,
    rank: usize,
    world_size: usize,
    device: &Device,
) -> Arc<dyn DataLoader<O>> {
    let total = loader.num_items();
    let bound = |r: usize| r * total / world_size;
    loader.slice(bound(rank), bound(rank + 1)).to_device(device)
}
