//! Where a stage-3 rank's parameter shards live and how they move: [`Shard`](shard::Shard),
//! what a sharded parameter holds (in memory or in the shard file); `ShardHome`, the device,
//! host memory or disk its shards live on and the copies between there and the compute device;
//! `ReadAhead`, shard reads started before their use. Above `swap/` (the disk), below
//! `overlap/` (the collectives that gather and reduce the shards).

pub(crate) mod home;
pub(crate) mod read_ahead;
pub(crate) mod shard;
