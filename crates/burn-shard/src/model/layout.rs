//! Where every trainable parameter lives in the flat, bucketed, padded buffers.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_shard_comm::Collective;

use crate::error::ShardError;
use crate::model::lazy::entry_meta;

/// One trainable parameter's place in the flat buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    /// Module path, e.g. `blocks.0.attn.query.weight`.
    pub path: String,
    /// The parameter's id (identical on every rank when the model was cloned and forked).
    pub id: ParamId,
    /// Full shape of the parameter.
    pub shape: Vec<usize>,
    /// Number of elements (product of `shape`; 0 for an empty parameter, 1 for a scalar).
    pub numel: usize,
    /// Element type (`F32`, `BF16`, `F16`, ...).
    pub dtype: DType,
    /// Index of the bucket that holds it.
    pub bucket: usize,
    /// Offset of its first element inside that bucket (elements).
    pub offset: usize,
}

impl ParamSlot {
    /// The elements of this parameter that lie in `range` of its bucket, as a range of the
    /// flattened parameter (`0..numel` when `range` holds it all); `None` when none do.
    pub fn within(&self, range: &Range<usize>) -> Option<Range<usize>> {
        let lo = range.start.max(self.offset);
        let hi = range.end.min(self.offset + self.numel);
        (lo < hi).then(|| lo - self.offset..hi - self.offset)
    }
}

/// A contiguous run of parameters that is reduced and updated as one flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Indices into [`FlatLayout::slots`].
    pub slots: Range<usize>,
    /// Elements of real data.
    pub numel: usize,
    /// `numel` rounded up to a multiple of `world_size`, the tail zero padding; in a bucket of
    /// whole-owned parameters ([`FlatLayout::from_module_owning`]) `world_size` segments of
    /// `shard_numel`, each padded at its end.
    pub padded_numel: usize,
    /// `padded_numel / world_size`: the elements each rank owns.
    pub shard_numel: usize,
    /// Element type of every parameter in the bucket (a bucket never mixes dtypes). Buckets of
    /// `bf16`/`f16` parameters get an `f32` master copy in the optimizer.
    pub dtype: DType,
}

impl Bucket {
    /// Element range of the bucket owned by `rank`: `[rank·L/N, (rank+1)·L/N)`.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_numel..(rank + 1) * self.shard_numel
    }

    /// Elements of real data (padding excluded) in `rank`'s range, given the layout's slots:
    /// equal to within one element over the ranks for a flat bucket; for a bucket of
    /// whole-owned parameters, what the balance gave each rank.
    pub fn owned_numel(&self, slots: &[ParamSlot], rank: usize) -> usize {
        let range = self.shard_range(rank);
        slots[self.slots.clone()]
            .iter()
            .filter_map(|slot| slot.within(&range))
            .map(|part| part.len())
            .sum()
    }
}

/// Greedy LPT over one bucket: each slot (largest first, ties in order) to the rank with the
/// fewest elements in this bucket so far, ties to the rank with the fewest in the earlier
/// buckets (`owned_so_far`, updated), then the lowest; returns the largest rank's elements
/// (the segment length, at least 1) and each slot's rank. The tie-break spreads buckets that
/// hold fewer parameters than ranks (one large matrix) over the ranks instead of rank 0.
pub(crate) fn balance(numels: &[usize], owned_so_far: &mut [usize]) -> (usize, Vec<usize>) {
    let mut by_size: Vec<usize> = (0..numels.len()).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(numels[i]), i));
    let mut load = vec![0usize; owned_so_far.len()];
    let mut ranks = vec![0; numels.len()];
    for i in by_size {
        let rank = (0..load.len())
            .min_by_key(|&r| (load[r], owned_so_far[r], r))
            .expect("world_size >= 1");
        ranks[i] = rank;
        load[rank] += numels[i];
    }
    for (total, bucket) in owned_so_far.iter_mut().zip(&load) {
        *total += bucket;
    }
    (load.into_iter().max().unwrap_or(0).max(1), ranks)
}

/// The flat-parameter layout shared by all ranks.
///
/// Parameters that require grad are taken in module traversal order (field declaration order,
/// `Vec` index order), grouped by dtype (in order of first appearance), which is the same on
/// every rank for the same model type, and never depends on `ParamId` values or hashing.
/// Frozen parameters, running-state buffers and empty parameters are left out: they get no
/// gradient and no optimizer state. A parameter never straddles two buckets; a bucket closes when the
/// next parameter would push it over `bucket_numel` elements or has another dtype.
#[derive(Clone, Debug)]
pub struct FlatLayout {
    slots: Vec<ParamSlot>,
    buckets: Vec<Bucket>,
    world_size: usize,
    index: HashMap<ParamId, usize>,
}

impl FlatLayout {
    /// Builds the layout of `module`'s trainable parameters (those that require grad and have
    /// at least one element) for `world_size` ranks and buckets of at most `bucket_numel`
    /// elements (a larger parameter gets a bucket of its own). A module with no trainable
    /// parameter (a frozen teacher, an evaluation-only model) gets an empty layout.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] when `world_size` or `bucket_numel` is 0;
    /// [`ShardError::UnsupportedDtype`] for a trainable parameter that is not `f32`, `f64`,
    /// `bf16` or `f16`; [`ShardError::DuplicateParam`] when two fields hold one `ParamId`.
    pub fn from_module<M: Module>(module: &M, world_size: usize, bucket_numel: usize) -> Result<Self, ShardError> {
        let slots = collect(module)
            .into_iter()
            .filter(|s| s.require_grad)
            .map(|s| s.slot)
            .collect();
        Self::from_slots(slots, world_size, bucket_numel)
    }

    /// [`FlatLayout::from_module`], with each parameter for which `whole` is true owned whole
    /// by one rank: the parameters an optimizer steps whole (Muon, LAMB, Adafactor; see
    /// [`AnyOptimizer`](crate::AnyOptimizer)) at stages 1-2.
    ///
    /// They get buckets of their own (by dtype, in traversal order, closed at `bucket_numel`
    /// elements per rank: `world_size · bucket_numel` in all). Inside such a bucket each
    /// parameter goes to the rank with the fewest elements so far, largest first (greedy LPT
    /// scheduling, Graham 1969: the largest rank holds at most 4/3 of the optimum), ties to the
    /// rank that owns the fewest in the earlier buckets; each rank's segment holds its parameters in
    /// traversal order and is padded with zeros to the largest segment, so the reduce-scatter
    /// that gives each rank its segment delivers whole parameters (Megatron-LM's layout for
    /// Muon, NVIDIA/Megatron-LM#4509). A parameter larger than the others' total leaves the other
    /// ranks padding: [`Bucket::owned_numel`] reports each rank's real elements.
    ///
    /// # Errors
    /// As [`FlatLayout::from_module`].
    pub fn from_module_owning<M: Module>(
        module: &M,
        world_size: usize,
        bucket_numel: usize,
        whole: impl Fn(&ParamSlot) -> bool,
    ) -> Result<Self, ShardError> {
        let slots = collect(module).into_iter().filter(|s| s.require_grad).map(|s| s.slot);
        Self::from_slots_owning(slots.collect(), world_size, bucket_numel, whole)
    }

    /// [`FlatLayout::from_slots`] with the slots for which `whole` is true owned whole (see
    /// [`FlatLayout::from_module_owning`]).
    pub(crate) fn from_slots_owning(
        slots: Vec<ParamSlot>,
        world_size: usize,
        bucket_numel: usize,
        whole: impl Fn(&ParamSlot) -> bool,
    ) -> Result<Self, ShardError> {
        let (whole_slots, flat_slots): (Vec<ParamSlot>, Vec<ParamSlot>) = slots.into_iter().partition(|s| whole(s));
        let mut layout = Self::from_slots(flat_slots, world_size, bucket_numel)?;
        // A bucket of whole parameters holds about `bucket_numel` per rank, so that the
        // matrices of one layer share a bucket instead of each padding the others' segments.
        let owned = Self::from_slots(whole_slots, world_size, bucket_numel.saturating_mul(world_size))?;
        // Real elements each rank owns in the buckets so far: ties go to the least loaded.
        let mut owned_so_far = vec![0usize; world_size];
        for bucket in owned.buckets {
            let mut slots: Vec<ParamSlot> = owned.slots[bucket.slots.clone()].to_vec();
            let numels: Vec<usize> = slots.iter().map(|s| s.numel).collect();
            let (segment, ranks) = balance(&numels, &mut owned_so_far);
            // Each rank's parameters in traversal order, ranks in order: slot order is offset
            // order, which `pieces` and `join_range` rely on.
            let mut order: Vec<usize> = (0..slots.len()).collect();
            order.sort_by_key(|&i| (ranks[i], i));
            let mut filled = vec![0; world_size];
            let start = layout.slots.len();
            for i in order {
                let slot = &mut slots[i];
                slot.bucket = layout.buckets.len();
                slot.offset = ranks[i] * segment + filled[ranks[i]];
                filled[ranks[i]] += slot.numel;
                layout.slots.push(slot.clone());
            }
            layout.buckets.push(Bucket {
                slots: start..layout.slots.len(),
                numel: bucket.numel,
                padded_numel: segment * world_size,
                shard_numel: segment,
                dtype: bucket.dtype,
            });
        }
        layout.index.clear();
        for (i, slot) in layout.slots.iter().enumerate() {
            if let Some(first) = layout.index.insert(slot.id, i) {
                return Err(ShardError::DuplicateParam {
                    first: layout.slots[first].path.clone(),
                    second: slot.path.clone(),
                });
            }
        }
        Ok(layout)
    }

    /// Whether slot `index` lies in one rank's range of its bucket (always true of a bucket
    /// built by [`FlatLayout::from_module_owning`] for whole parameters).
    pub fn owned_whole(&self, index: usize) -> bool {
        let slot = &self.slots[index];
        let shard = self.buckets[slot.bucket].shard_numel.max(1);
        slot.offset / shard == (slot.offset + slot.numel - 1) / shard
    }

    /// Every float entry of `module` with at least one element and a float dtype the
    /// collectives move (frozen parameters and running-state buffers included): what
    /// `ShardConfig::init` broadcasts from rank 0. Entries of other dtypes (a quantized frozen
    /// base) are left out: ranks built from one clone already hold them identically.
    pub(crate) fn with_frozen<M: Module>(
        module: &M,
        world_size: usize,
        bucket_numel: usize,
    ) -> Result<Self, ShardError> {
        let slots = collect(module)
            .into_iter()
            .map(|s| s.slot)
            .filter(|s| SUPPORTED.contains(&s.dtype))
            .collect();
        Self::from_slots(slots, world_size, bucket_numel)
    }

    /// The layout of `slots` (in the order given; `bucket` and `offset` are assigned here).
    /// Empty slots (`numel == 0`) are dropped: they have nothing to reduce or update.
    pub(crate) fn from_slots(
        slots: Vec<ParamSlot>,
        world_size: usize,
        bucket_numel: usize,
    ) -> Result<Self, ShardError> {
        if world_size == 0 || bucket_numel == 0 {
            return Err(ShardError::InvalidConfig(format!(
                "world_size ({world_size}) and bucket_numel ({bucket_numel}) must be at least 1"
            )));
        }
        let mut slots: Vec<ParamSlot> = slots.into_iter().filter(|s| s.numel > 0).collect();
        if let Some(slot) = slots.iter().find(|s| !SUPPORTED.contains(&s.dtype)) {
            return Err(ShardError::UnsupportedDtype {
                path: slot.path.clone(),
                dtype: format!("{:?}", slot.dtype),
            });
        }
        // One dtype per bucket, without fragmenting: group the slots by dtype (in order of first
        // appearance; a stable sort keeps traversal order inside each group), so a bf16 model with
        // f32 norms gets full bf16 buckets and full f32 ones, not two buckets per block.
        let mut dtype_order: Vec<DType> = Vec::new();
        for slot in &slots {
            if !dtype_order.contains(&slot.dtype) {
                dtype_order.push(slot.dtype);
            }
        }
        slots.sort_by_key(|slot| dtype_order.iter().position(|d| *d == slot.dtype));
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut start = 0;
        let mut numel = 0;
        for i in 0..slots.len() {
            if i > start && (numel + slots[i].numel > bucket_numel || slots[i].dtype != slots[start].dtype) {
                buckets.push(Bucket::new(start..i, numel, world_size, slots[start].dtype));
                start = i;
                numel = 0;
            }
            slots[i].bucket = buckets.len();
            slots[i].offset = numel;
            numel += slots[i].numel;
        }
        if !slots.is_empty() {
            buckets.push(Bucket::new(start..slots.len(), numel, world_size, slots[start].dtype));
        }
        let mut index = HashMap::with_capacity(slots.len());
        for (i, slot) in slots.iter().enumerate() {
            if let Some(first) = index.insert(slot.id, i) {
                return Err(ShardError::DuplicateParam {
                    first: slots[first].path.clone(),
                    second: slot.path.clone(),
                });
            }
        }
        Ok(Self {
            slots,
            buckets,
            world_size,
            index,
        })
    }

    /// Every trainable parameter, in layout order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The buckets, in layout order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Number of ranks the layout was built for.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// `Ψ`: the number of trainable parameter elements (padding excluded).
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }

    /// Elements of padding added over all buckets (less than `world_size` per flat bucket; the
    /// segments' padding in a bucket of whole-owned parameters).
    pub fn padding(&self) -> usize {
        self.buckets.iter().map(|b| b.padded_numel - b.numel).sum()
    }

    /// Elements one rank owns over all buckets.
    pub fn shard_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.shard_numel).sum()
    }

    /// The slots of `bucket` with elements in `range` (of the bucket's elements), in bucket
    /// order, each with the part of the slot's own elements that lies in `range`: the pieces a
    /// rank owning `range` steps.
    pub(crate) fn pieces<'a>(
        &'a self,
        bucket: &'a Bucket,
        range: &'a Range<usize>,
    ) -> impl Iterator<Item = (usize, Range<usize>)> + 'a {
        bucket
            .slots
            .clone()
            .filter_map(move |index| self.slots[index].within(range).map(|part| (index, part)))
    }

    /// Index of the slot of parameter `id`, if it is trainable.
    pub fn slot_of(&self, id: &ParamId) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// A 64-bit digest of paths, shapes, dtypes, buckets and world size; equal layouts give equal values
    /// on every rank of the same build.
    pub fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.world_size.hash(&mut h);
        for s in &self.slots {
            s.path.hash(&mut h);
            s.shape.hash(&mut h);
            format!("{:?}", s.dtype).hash(&mut h);
            s.bucket.hash(&mut h);
            s.offset.hash(&mut h);
        }
        h.finish()
    }
}

impl Bucket {
    fn new(slots: Range<usize>, numel: usize, world_size: usize, dtype: DType) -> Self {
        let padded_numel = numel.div_ceil(world_size) * world_size;
        Bucket {
            slots,
            numel,
            padded_numel,
            shard_numel: padded_numel / world_size,
            dtype,
        }
    }
}

/// Float dtypes the flat buffers and collectives carry.
pub(crate) const SUPPORTED: [DType; 5] = [DType::F32, DType::F64, DType::Flex32, DType::BF16, DType::F16];

/// A float entry of a module with whether it requires grad.
struct Collected {
    slot: ParamSlot,
    require_grad: bool,
}

/// Every float entry of `module`, in traversal order, with its module path.
fn collect<M: Module>(module: &M) -> Vec<Collected> {
    let mut collector = SlotCollector::default();
    module.visit(&mut collector);
    collector.slots
}

#[derive(Default)]
struct SlotCollector {
    path: Vec<String>,
    slots: Vec<Collected>,
}

impl ModuleVisitor for SlotCollector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        // Read without initialising (see `lazy.rs`).
        let meta = entry_meta(param);
        self.slots.push(Collected {
            require_grad: meta.require_grad,
            slot: ParamSlot {
                path: self.path.join("."),
                id: param.id,
                numel: meta.shape.iter().product(),
                dtype: meta.dtype,
                shape: meta.shape,
                bucket: 0,
                offset: 0,
            },
        });
    }
}

/// All-gathers every rank's layout fingerprint and fails on the first rank that differs.
pub(crate) fn check_same_layout(comm: &dyn Collective, ours: u64, device: &Device) -> Result<(), ShardError> {
    let all = all_gather_u64s(comm, &[ours], device)?;
    match all.into_iter().enumerate().find(|(_, theirs)| theirs[0] != ours) {
        Some((peer, theirs)) => Err(ShardError::LayoutMismatch {
            rank: comm.rank(),
            peer,
            ours,
            theirs: theirs[0],
        }),
        None => Ok(()),
    }
}

/// Every rank's `values` (the same number on every rank), in rank order: one all-gather of
/// four exact 16-bit pieces in `f32` per value (`f32` whatever the device's default float
/// dtype: a `bf16` default would round the pieces). A collective.
pub(crate) fn all_gather_u64s(
    comm: &dyn Collective,
    values: &[u64],
    device: &Device,
) -> Result<Vec<Vec<u64>>, ShardError> {
    let pieces: Vec<f32> = values
        .iter()
        .flat_map(|v| (0..4).map(move |i| ((v >> (16 * i)) & 0xffff) as f32))
        .collect();
    let len = pieces.len();
    let all = comm.all_gather(Tensor::<1>::from_data(
        TensorData::new(pieces, [len]),
        (device, DType::F32),
    ))?;
    let all: Vec<f32> = all.into_data().convert::<f32>().iter::<f32>().collect();
    Ok(all
        .chunks(len.max(1))
        .map(|rank| {
            rank.chunks(4)
                .map(|p| {
                    p.iter()
                        .enumerate()
                        .fold(0u64, |acc, (i, v)| acc | ((*v as u64) << (16 * i)))
                })
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(path: &str, numel: usize, dtype: DType) -> ParamSlot {
        ParamSlot {
            path: path.into(),
            id: ParamId::new(),
            shape: vec![numel],
            numel,
            dtype,
            bucket: usize::MAX,
            offset: usize::MAX,
        }
    }

    /// Parameters of mixed sizes and dtypes, an empty one among them, in traversal order.
    fn model_slots() -> Vec<ParamSlot> {
        let sizes = [
            (7, DType::F32),
            (1, DType::BF16),
            (0, DType::F32),
            (12, DType::F32),
            (5, DType::BF16),
        ];
        let more = [(3, DType::F32), (40, DType::F32), (2, DType::BF16), (9, DType::F32)];
        sizes
            .into_iter()
            .chain(more)
            .enumerate()
            .map(|(i, (numel, dtype))| slot(&format!("p{i}"), numel, dtype))
            .collect()
    }

    /// Whole ownership (`from_slots_owning`): every whole parameter lies in one rank's range
    /// (world sizes 1-5, several bucket sizes); each element of each bucket belongs to at most
    /// one parameter and each parameter element to exactly one rank; flat parameters keep
    /// their buckets; and the largest rank of a bucket holds at most total / world size + the
    /// largest parameter (Graham's list-scheduling bound).
    #[test]
    fn whole_parameters_lie_in_one_rank_and_the_ranks_are_balanced() {
        let is_whole = |s: &ParamSlot| s.path != "p3" && s.path != "p6";
        for world_size in 1..=5 {
            for bucket_numel in [1, 13, 20, 1000] {
                let layout = FlatLayout::from_slots_owning(model_slots(), world_size, bucket_numel, is_whole).unwrap();
                let real: usize = model_slots().iter().map(|s| s.numel).sum();
                assert_eq!(layout.numel(), real);
                let mut covered: Vec<Vec<u8>> = layout.buckets().iter().map(|b| vec![0; b.padded_numel]).collect();
                for (index, slot) in layout.slots().iter().enumerate() {
                    let bucket = &layout.buckets()[slot.bucket];
                    assert!(bucket.slots.contains(&index));
                    covered[slot.bucket][slot.offset..slot.offset + slot.numel]
                        .iter_mut()
                        .for_each(|c| *c += 1);
                    if is_whole(slot) {
                        assert!(
                            layout.owned_whole(index),
                            "{} cut at world size {world_size}",
                            slot.path
                        );
                    }
                    let owned: usize = (0..world_size)
                        .filter_map(|rank| slot.within(&bucket.shard_range(rank)))
                        .map(|part| part.len())
                        .sum();
                    assert_eq!(owned, slot.numel, "{}: every element owned by one rank", slot.path);
                }
                for (bucket, covered) in layout.buckets().iter().zip(&covered) {
                    assert!(covered.iter().all(|&c| c <= 1), "parameters overlap in a bucket");
                    assert_eq!(covered.iter().filter(|&&c| c == 1).count(), bucket.numel);
                    assert_eq!(bucket.padded_numel, bucket.shard_numel * world_size);
                    let total: usize = (0..world_size).map(|r| bucket.owned_numel(layout.slots(), r)).sum();
                    assert_eq!(total, bucket.numel);
                    let largest = layout.slots()[bucket.slots.clone()]
                        .iter()
                        .map(|s| s.numel)
                        .max()
                        .unwrap();
                    assert!(bucket.shard_numel <= bucket.numel.div_ceil(world_size) + largest);
                }
            }
        }
        // One parameter larger than the others' total: alone on rank 0, the rest on rank 1.
        let slots = [40, 7, 9, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| slot(&format!("q{i}"), n, DType::F32));
        let layout = FlatLayout::from_slots_owning(slots.collect(), 2, 1000, |_| true).unwrap();
        let bucket = &layout.buckets()[0];
        assert_eq!((bucket.shard_numel, bucket.padded_numel), (40, 80));
        assert_eq!(bucket.owned_numel(layout.slots(), 0), 40);
        assert_eq!(bucket.owned_numel(layout.slots(), 1), 19);
        let offsets: Vec<(String, usize)> = layout.slots().iter().map(|s| (s.path.clone(), s.offset)).collect();
        let want = [("q0", 0), ("q1", 40), ("q2", 47), ("q3", 56)];
        assert_eq!(offsets, want.map(|(p, o)| (p.to_string(), o)));
        // Eight equal matrices over 4 ranks, `bucket_numel` one matrix: buckets of 4 (one per
        // rank, no padding), and each rank owns two, not rank 0 all.
        let slots = (0..8).map(|i| slot(&format!("m{i}"), 64, DType::F32));
        let layout = FlatLayout::from_slots_owning(slots.collect(), 4, 64, |_| true).unwrap();
        assert_eq!(layout.buckets().len(), 2);
        assert_eq!(layout.padding(), 0);
        let mut per_rank = [0; 4];
        for bucket in layout.buckets() {
            for (rank, owned) in per_rank.iter_mut().enumerate() {
                *owned += bucket.owned_numel(layout.slots(), rank);
            }
        }
        assert_eq!(per_rank, [128; 4]);
        // One matrix per bucket: the buckets go to ranks in turn.
        let slots = (0..4).map(|i| slot(&format!("b{i}"), 100, DType::F32));
        let layout = FlatLayout::from_slots_owning(slots.collect(), 2, 50, |_| true).unwrap();
        let owners: Vec<usize> = layout
            .slots()
            .iter()
            .map(|s| s.offset / layout.buckets()[s.bucket].shard_numel)
            .collect();
        assert_eq!(owners, [0, 1, 0, 1]);
    }

    /// The rule every stage's step, checkpoint and reduction rests on, for world sizes 1-5 and
    /// several bucket sizes: the ranks' owned ranges of a bucket are disjoint, in rank order,
    /// and cover its padded length; padding is less than one element per rank; and over all
    /// ranks every element of every parameter is owned exactly once (`ParamSlot::within`).
    #[test]
    fn the_ranks_owned_ranges_partition_every_bucket_and_every_parameter() {
        for world_size in 1..=5 {
            for bucket_numel in [1, 8, 13, 20, 1000] {
                let layout = FlatLayout::from_slots(model_slots(), world_size, bucket_numel).unwrap();
                for bucket in layout.buckets() {
                    assert_eq!(bucket.padded_numel % world_size, 0);
                    assert!(bucket.padded_numel - bucket.numel < world_size);
                    let ranges: Vec<Range<usize>> = (0..world_size).map(|r| bucket.shard_range(r)).collect();
                    assert_eq!(ranges[0].start, 0);
                    assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
                    assert_eq!(ranges[world_size - 1].end, bucket.padded_numel);
                    for slot in &layout.slots()[bucket.slots.clone()] {
                        let owned: usize = ranges.iter().filter_map(|r| slot.within(r)).map(|p| p.len()).sum();
                        assert_eq!(owned, slot.numel, "{} at world size {world_size}", slot.path);
                    }
                }
                let real: usize = layout.slots().iter().map(|s| s.numel).sum();
                assert_eq!(real, layout.numel());
                assert_eq!(layout.numel(), 7 + 1 + 12 + 5 + 3 + 40 + 2 + 9);
            }
        }
    }

    /// How buckets are formed: the slots grouped by dtype in order of first appearance,
    /// traversal order kept inside a group, empty parameters left out; each bucket one dtype,
    /// its slots contiguous from offset 0, closed before the next slot would pass
    /// `bucket_numel` (a larger parameter alone in its bucket).
    #[test]
    fn buckets_group_by_dtype_keep_order_and_close_at_bucket_numel() {
        let layout = FlatLayout::from_slots(model_slots(), 2, 13).unwrap();
        let paths: Vec<&str> = layout.slots().iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["p0", "p3", "p5", "p6", "p8", "p1", "p4", "p7"]);
        let groups: Vec<(Vec<&str>, DType)> = layout
            .buckets()
            .iter()
            .map(|b| {
                (
                    layout.slots()[b.slots.clone()]
                        .iter()
                        .map(|s| s.path.as_str())
                        .collect(),
                    b.dtype,
                )
            })
            .collect();
        let want: Vec<(Vec<&str>, DType)> = vec![
            (vec!["p0"], DType::F32),
            (vec!["p3"], DType::F32),
            (vec!["p5"], DType::F32),
            (vec!["p6"], DType::F32),
            (vec!["p8"], DType::F32),
            (vec!["p1", "p4", "p7"], DType::BF16),
        ];
        assert_eq!(groups, want);
        for (index, bucket) in layout.buckets().iter().enumerate() {
            let mut offset = 0;
            for slot in &layout.slots()[bucket.slots.clone()] {
                assert_eq!((slot.bucket, slot.offset, slot.dtype), (index, offset, bucket.dtype));
                offset += slot.numel;
            }
            assert_eq!(offset, bucket.numel);
            assert!(bucket.numel <= 13 || bucket.slots.len() == 1);
        }
        // 7 + 12 > 13 closes p0's bucket; 3 + 40 > 13 closes p5's; 40 alone; 9 alone after it.
        assert_eq!(layout.buckets()[3].numel, 40);
    }

    /// The layout fingerprint the ranks compare at `init`: equal for the same model built twice
    /// (other `ParamId`s), different when any rank's layout differs in a way that would
    /// misalign the collectives: a path, a shape of the same size, a dtype, the world size, or
    /// where the buckets close.
    #[test]
    fn the_fingerprint_tells_every_layout_difference_and_ignores_ids() {
        let of = |slots: Vec<ParamSlot>, world_size: usize, bucket_numel: usize| {
            FlatLayout::from_slots(slots, world_size, bucket_numel)
                .unwrap()
                .fingerprint()
        };
        let base = of(model_slots(), 2, 13);
        assert_eq!(base, of(model_slots(), 2, 13), "fresh ParamIds");
        let mut renamed = model_slots();
        renamed[3].path = "q3".into();
        let mut reshaped = model_slots();
        reshaped[3].shape = vec![3, 4];
        let mut retyped = model_slots();
        retyped[3].dtype = DType::F64;
        let changed = [
            ("a path", of(renamed, 2, 13)),
            ("a shape of the same size", of(reshaped, 2, 13)),
            ("a dtype", of(retyped, 2, 13)),
            ("the world size", of(model_slots(), 3, 13)),
            ("where buckets close", of(model_slots(), 2, 20)),
        ];
        for (what, fingerprint) in changed {
            assert_ne!(fingerprint, base, "{what} changed but the fingerprint did not");
        }
    }

    /// Zero ranks or a zero bucket size is refused, and so is one `ParamId` in two fields.
    #[test]
    fn a_zero_size_or_a_shared_id_is_refused() {
        assert!(matches!(
            FlatLayout::from_slots(model_slots(), 0, 8),
            Err(ShardError::InvalidConfig(_))
        ));
        assert!(matches!(
            FlatLayout::from_slots(model_slots(), 2, 0),
            Err(ShardError::InvalidConfig(_))
        ));
        let mut twins = model_slots();
        twins[1].id = twins[0].id;
        twins[1].dtype = DType::F32;
        match FlatLayout::from_slots(twins, 2, 8) {
            Err(ShardError::DuplicateParam { first, second }) => {
                assert_eq!((first.as_str(), second.as_str()), ("p0", "p1"))
            }
            other => panic!("expected DuplicateParam, got {other:?}"),
        }
    }
}
