//! Hybrid sharding's mesh ([`ShardConfig::with_replicas`]): the shard and replica groups split
//! from the world.

use std::sync::Arc;

use burn_shard_comm::{Collective, Mesh};

use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::stage::Stage;

/// The mesh of [`ShardConfig::with_replicas`] over `world`, `None` for a flat run.
///
/// # Errors
/// As `with_replicas`.
pub(super) fn mesh(config: &ShardConfig, world: Arc<dyn Collective>) -> Result<Option<Arc<Mesh>>, ShardError> {
    let (replicas, world_size) = (config.mesh.replicas, world.world_size());
    if replicas == 0 || world_size % replicas != 0 {
        return Err(ShardError::InvalidConfig(format!(
            "with_replicas({replicas}) does not divide world_size {world_size}: the ranks form replicas × shard_size = world_size, so pass a divisor of {world_size} (1 for no replication)"
        )));
    }
    if replicas == 1 {
        return Ok(None);
    }
    if config.stage == Stage::Zero {
        return Err(ShardError::InvalidConfig(format!(
            "with_replicas({replicas}) at stage 0: stage 0 (DDP) shards nothing, so every rank already holds a replica; drop with_replicas, or shard within groups at stage 1, 2 or 3"
        )));
    }
    Ok(Some(Arc::new(Mesh::new(world, replicas, config.mesh.layout)?)))
}
