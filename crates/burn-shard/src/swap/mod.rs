//! ZeRO-Infinity's NVMe offload of the optimizer state (Rajbhandari et al., SC21, "ZeRO-Infinity:
//! Breaking the GPU Memory Wall for Extreme Scale Deep Learning", §5.1 and §6.3): between
//! steps, each rank's optimizer state and `f32` masters live in one swap file per rank on a
//! local disk instead of in memory, and the step brings them in one parameter piece at a time,
//! read ahead of the piece being stepped and written behind it by a small pool of I/O threads.
//!
//! - `config.rs`: [`NvmeOffload`], what the user configures (`ShardConfig::with_optimizer_state_on(Home::Disk(..))`).
//! - `file.rs`: `SwapFile`, one rank's file: created in the named directory, locked against a
//!   second job, positional reads and writes, checked against deletion, removed at the end.
//! - `io_pool.rs`: `IoPool`, the threads that read and write off the compute thread.
//! - `slot_bytes.rs`: one slot's optimizer state and master as bytes, and back (through Burn's
//!   `RecordState`, so any Burn optimizer's state swaps).
//! - `blocks.rs`: what both files share: space in whole 4 KiB blocks, a CRC-32 per piece.
//! - `shard_store.rs`: `ShardStore`, one rank's file of stage-3 parameter and gradient shards
//!   (`ShardConfig::with_params_on(Home::Disk(..))`), and `StoredShard`, one shard in it.
//! - `swapper.rs`: `Swapper`, where each slot's bytes are on disk and the step's read-ahead and
//!   write-behind, bounded by `max_in_flight`.

pub(crate) mod blocks;
pub(crate) mod config;
pub(crate) mod file;
pub(crate) mod free_space;
pub(crate) mod io_pool;
pub(crate) mod shard_store;
pub(crate) mod slot_bytes;
pub(crate) mod swapper;
