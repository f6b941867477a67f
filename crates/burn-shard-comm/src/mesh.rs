//! [`Mesh`]: a world of ranks seen as `replicas` groups of `shard_size` ranks, for hybrid
//! sharding (PyTorch FSDP2's HSDP over a 2-D `DeviceMesh`, DeepSpeed's MiCS): sharded within a
//! shard group, replicated across the groups. The two sub-groups come from the backend's own
//! [`Collective::split`], made once; the mesh ties the aborts of a rank's three groups together.

use std::sync::Arc;

use burn::tensor::{Device, Tensor};

use crate::{Collective, CommError, CommStats, ReduceOp, Work};

/// Which ranks form a shard group.
///
/// Saved (in burn-shard's `ShardConfig`) as `"consecutive"` or `"interleaved"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MeshLayout {
    /// Shard group `g` is ranks `g·S .. (g+1)·S` (`S = shard_size`): the ranks of one node when
    /// the launcher places `S` consecutive ranks per node (`--nproc-per-node S`, `LOCAL_RANK`),
    /// so the shard group's all-gathers and reduce-scatters stay inside the node and only the
    /// replicas' all-reduce crosses nodes. The default, as FSDP2's `(replicate, shard)` mesh.
    #[default]
    Consecutive,
    /// Shard group `g` is ranks `g, g + R, g + 2R, ..` (`R = replicas`): the replicas are the
    /// consecutive ranks (a node holds one shard of each of `R` replicas).
    Interleaved,
}

impl MeshLayout {
    /// `(shard color, shard key, replica color, replica key)` of `rank` in a mesh of `replicas`
    /// groups of `shard_size` ranks.
    fn colors(self, rank: usize, replicas: usize, shard_size: usize) -> (usize, usize, usize, usize) {
        match self {
            MeshLayout::Consecutive => (
                rank / shard_size,
                rank % shard_size,
                rank % shard_size,
                rank / shard_size,
            ),
            MeshLayout::Interleaved => (rank % replicas, rank / replicas, rank / replicas, rank % replicas),
        }
    }

    fn code(self) -> f32 {
        match self {
            MeshLayout::Consecutive => 0.0,
            MeshLayout::Interleaved => 1.0,
        }
    }
}

/// One rank's view of a `replicas × shard_size` mesh over a world group: its shard group (the
/// ranks its state is sharded over), its replica group (the ranks that hold the same shard in
/// the other shard groups) and the world.
///
/// Errors stay job-wide: a failure or abort in any of the rank's three groups aborts the other
/// two, so a rank blocked in a group the failed rank is not part of fails too (its group-mates
/// abort their other groups in turn), within the backend's abort latency, instead of waiting for
/// the timeout.
pub struct Mesh {
    world: Arc<dyn Collective>,
    shard: Arc<dyn Collective>,
    replicate: Arc<dyn Collective>,
    replicas: usize,
    layout: MeshLayout,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.world.rank())
            .field("replicas", &self.replicas)
            .field("shard_size", &self.shard.world_size())
            .field("layout", &self.layout)
            .finish()
    }
}

impl Mesh {
    /// Splits `world` into `replicas` shard groups of `world_size / replicas` ranks laid out by
    /// `layout`, and the matching replica groups. A collective over `world`: every rank calls it
    /// with the same `replicas` and `layout` (checked by one all-gather of two numbers), then
    /// `world.split` twice.
    ///
    /// # Errors
    /// [`CommError::InvalidMesh`] on every rank when `replicas` is 0 or does not divide the world
    /// size (the world is aborted, so a rank that disagrees fails too), or when the ranks passed
    /// different meshes (naming the first rank that differs from rank 0);
    /// [`CommError::Unsupported`] where the backend cannot split; the collectives' errors.
    pub fn new(world: Arc<dyn Collective>, replicas: usize, layout: MeshLayout) -> Result<Self, CommError> {
        let (rank, n) = (world.rank(), world.world_size());
        if replicas == 0 || n % replicas != 0 {
            let err = CommError::InvalidMesh(format!(
                "{replicas} replicas do not divide world_size {n}: pass a number of replica groups that divides the \
                 world size (replicas × shard_size = world_size; with 8 ranks: 1, 2, 4 or 8)"
            ));
            world.abort(&format!("rank {rank}: {err}"));
            return Err(err);
        }
        agree_on_mesh(world.as_ref(), replicas, layout)?;
        let shard_size = n / replicas;
        let (shard_color, shard_key, replica_color, replica_key) = layout.colors(rank, replicas, shard_size);
        let shard: Arc<dyn Collective> = Arc::from(world.split(shard_color, shard_key)?);
        let replicate: Arc<dyn Collective> = Arc::from(world.split(replica_color, replica_key)?);
        debug_assert_eq!((shard.world_size(), replicate.world_size()), (shard_size, replicas));
        let family = Arc::new(Family {
            world_rank: rank,
            groups: [world, shard, replicate],
        });
        let linked = |index| -> Arc<dyn Collective> {
            Arc::new(Linked {
                index,
                family: family.clone(),
            })
        };
        Ok(Self {
            world: linked(0),
            shard: linked(1),
            replicate: linked(2),
            replicas,
            layout,
        })
    }

    /// The whole job (`world_size` ranks), e.g. to average a loss or agree on a decision.
    pub fn world(&self) -> &Arc<dyn Collective> {
        &self.world
    }

    /// This rank's shard group: `shard_size` ranks that together hold one copy of the sharded
    /// state.
    pub fn shard(&self) -> &Arc<dyn Collective> {
        &self.shard
    }

    /// This rank's replica group: `replicas` ranks, one per shard group, holding the same shard.
    pub fn replicate(&self) -> &Arc<dyn Collective> {
        &self.replicate
    }

    /// Number of shard groups (replicas of the sharded state).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Ranks per shard group.
    pub fn shard_size(&self) -> usize {
        self.shard.world_size()
    }

    /// Which replica this rank's shard group is (`0..replicas`): its rank in the replica group.
    pub fn replica_index(&self) -> usize {
        self.replicate.rank()
    }

    /// How shard groups are laid out over the world's ranks.
    pub fn layout(&self) -> MeshLayout {
        self.layout
    }
}

/// Every rank's `(replicas, layout)` equals rank 0's, or every rank fails naming the first that
/// differs.
fn agree_on_mesh(world: &dyn Collective, replicas: usize, layout: MeshLayout) -> Result<(), CommError> {
    let all = crate::split::all_gather_values(world, vec![replicas as f32, layout.code()], "the ranks' meshes")?;
    let pairs: Vec<&[f32]> = all.chunks(2).collect();
    match pairs.iter().position(|p| *p != pairs[0]) {
        None => Ok(()),
        Some(other) => Err(CommError::InvalidMesh(format!(
            "ranks build different meshes: rank 0 has {} replicas ({}), rank {other} has {} ({}); give every rank \
             the same ShardConfig::with_replicas and layout",
            pairs[0][0],
            layout_name(pairs[0][1]),
            pairs[other][0],
            layout_name(pairs[other][1]),
        ))),
    }
}

fn layout_name(code: f32) -> &'static str {
    if code == MeshLayout::Interleaved.code() {
        "interleaved"
    } else {
        "consecutive"
    }
}

/// A rank's three groups (world, shard, replicate): an error or abort in one aborts all.
struct Family {
    world_rank: usize,
    groups: [Arc<dyn Collective>; 3],
}

impl Family {
    const NAMES: [&'static str; 3] = ["world", "shard", "replica"];

    fn abort_all(&self, reason: &str) {
        self.groups.iter().for_each(|g| g.abort(reason));
    }

    /// Aborts every group after `index`'s call failed with `err` (an abort keeps its reason).
    fn failed(&self, index: usize, err: &CommError) {
        let reason = match err {
            CommError::Aborted(reason) => reason.clone(),
            other => format!("rank {} in its {} group: {other}", self.world_rank, Self::NAMES[index]),
        };
        self.abort_all(&reason);
    }
}

/// One of a rank's mesh groups, whose failures abort the rank's other groups.
struct Linked {
    index: usize,
    family: Arc<Family>,
}

impl Linked {
    fn inner(&self) -> &dyn Collective {
        self.family.groups[self.index].as_ref()
    }

    fn check<T>(&self, out: Result<T, CommError>) -> Result<T, CommError> {
        if let Err(e) = &out {
            self.family.failed(self.index, e);
        }
        out
    }

    fn linked<T>(&self, work: Work<T>) -> Work<T> {
        let (family, index) = (self.family.clone(), self.index);
        work.on_error(move |e| family.failed(index, e))
    }
}

impl Collective for Linked {
    fn rank(&self) -> usize {
        self.inner().rank()
    }

    fn world_size(&self) -> usize {
        self.inner().world_size()
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        self.check(self.inner().all_reduce(tensor, op))
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        self.check(self.inner().reduce_scatter(tensor, op))
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        self.check(self.inner().all_gather(tensor))
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        self.check(self.inner().broadcast(tensor, root))
    }

    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        self.check(self.inner().reduce_scatter_tagged(tensor, op, tag))
    }

    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        self.check(self.inner().all_gather_tagged(tensor, tag))
    }

    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        self.check(self.inner().all_gather_many(tensors))
    }

    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        self.check(self.inner().reduce_scatter_many(tensors, op))
    }

    fn all_gather_async(&self, tensor: Tensor<1>, tag: u64) -> Work<Tensor<1>> {
        self.linked(self.inner().all_gather_async(tensor, tag))
    }

    fn reduce_scatter_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        self.linked(self.inner().reduce_scatter_async(tensor, op, tag))
    }

    fn all_reduce_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        self.linked(self.inner().all_reduce_async(tensor, op, tag))
    }

    fn overlaps_compute(&self) -> bool {
        self.inner().overlaps_compute()
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.check(self.inner().barrier())
    }

    fn stats(&self) -> CommStats {
        self.inner().stats()
    }

    fn abort(&self, reason: &str) {
        self.family.abort_all(reason);
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>, CommError> {
        self.check(self.inner().split(color, key))
    }

    fn required_device(&self) -> Option<Device> {
        self.inner().required_device()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// For every mesh of up to 12 ranks and both layouts: each shard group has `shard_size`
    /// ranks keyed `0..shard_size`, each replica group `replicas` ranks keyed `0..replicas`, a
    /// shard group and a replica group meet in exactly one rank, and `Consecutive` shard groups
    /// are runs of consecutive ranks (one node's under `--nproc-per-node`).
    #[test]
    fn every_rank_is_in_one_shard_group_and_one_replica_group() {
        for world in 1..=12 {
            for replicas in (1..=world).filter(|r| world % r == 0) {
                let shard_size = world / replicas;
                for layout in [MeshLayout::Consecutive, MeshLayout::Interleaved] {
                    let what = format!("{layout:?} mesh of {replicas} × {shard_size}");
                    let mut shards: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
                    let mut replica_groups: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
                    let mut meets = BTreeMap::new();
                    for rank in 0..world {
                        let (shard, shard_key, replica, replica_key) = layout.colors(rank, replicas, shard_size);
                        shards.entry(shard).or_default().push((shard_key, rank));
                        replica_groups.entry(replica).or_default().push((replica_key, rank));
                        assert!(
                            meets.insert((shard, replica), rank).is_none(),
                            "{what}: two ranks in one pair"
                        );
                    }
                    assert_eq!(shards.len(), replicas, "{what}: shard groups");
                    assert_eq!(replica_groups.len(), shard_size, "{what}: replica groups");
                    for members in shards.values_mut() {
                        members.sort();
                        let keys: Vec<usize> = members.iter().map(|m| m.0).collect();
                        assert_eq!(keys, (0..shard_size).collect::<Vec<_>>(), "{what}: shard keys");
                        if layout == MeshLayout::Consecutive {
                            let first = members[0].1;
                            assert!(
                                members.iter().enumerate().all(|(i, m)| m.1 == first + i),
                                "{what}: {members:?}"
                            );
                        }
                    }
                    for members in replica_groups.values() {
                        let mut keys: Vec<usize> = members.iter().map(|m| m.0).collect();
                        keys.sort();
                        assert_eq!(keys, (0..replicas).collect::<Vec<_>>(), "{what}: replica keys");
                    }
                }
            }
        }
    }
}
