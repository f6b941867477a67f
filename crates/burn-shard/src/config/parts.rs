//! The nested parts of [`ShardConfig`](crate::ShardConfig) besides the placement: stage 3's
//! gathering, the mesh of hybrid sharding, and what checkpoints do.

use burn_shard_comm::MeshLayout;

use crate::run::FrozenEntries;

/// Stage 3's gathering (ignored at stages 0-2).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stage3Config {
    /// Free each gathered parameter after forward and re-gather it in backward (default
    /// `true`, FSDP's `reshard_after_forward`). `false` keeps gathered parameters from forward
    /// to backward: more memory, one all-gather per parameter instead of two.
    #[serde(default = "yes")]
    pub reshard_after_forward: bool,
    /// The units of a model whose `forward` has no [`crate::fsdp::unit`] calls, by module path
    /// (default none): `["layers.*", "head"]` makes each element of the `Vec` field `layers`,
    /// and `head`, one unit (`*` is any one path segment; see
    /// [`ShardConfig::with_units`](crate::ShardConfig::with_units)).
    #[serde(default)]
    pub units: Vec<String>,
}

impl Default for Stage3Config {
    fn default() -> Self {
        Self {
            reshard_after_forward: true,
            units: Vec::new(),
        }
    }
}

/// Hybrid sharding's mesh: how the world's ranks form shard groups (see
/// [`ShardConfig::with_replicas`](crate::ShardConfig::with_replicas)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MeshConfig {
    /// The world's ranks form `replicas` shard groups of `world_size / replicas` ranks; the
    /// state is sharded within a group and replicated across the groups (default 1: one group
    /// of every rank).
    #[serde(default = "one")]
    pub replicas: usize,
    /// With `replicas > 1`: which ranks form a shard group (default
    /// [`MeshLayout::Consecutive`]: consecutive ranks, those of one node).
    #[serde(default)]
    pub layout: MeshLayout,
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            replicas: 1,
            layout: MeshLayout::Consecutive,
        }
    }
}

/// What checkpoints hold and how many are written at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointConfig {
    /// What checkpoints hold of the parameters the optimizer does not train (default
    /// [`FrozenEntries::Saved`]: their values). See
    /// [`ShardConfig::with_frozen_entries`](crate::ShardConfig::with_frozen_entries).
    #[serde(default)]
    pub frozen_entries: FrozenEntries,
    /// How many checkpoints `save_checkpoint` may write in the background at once (default 1:
    /// the next save waits for the previous one). See
    /// [`ShardConfig::with_saves_in_flight`](crate::ShardConfig::with_saves_in_flight).
    #[serde(default = "one")]
    pub saves_in_flight: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            frozen_entries: FrozenEntries::Saved,
            saves_in_flight: 1,
        }
    }
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}
