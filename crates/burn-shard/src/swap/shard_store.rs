//! Stage-3 parameter shards on disk (ZeRO-Infinity's parameter offload to NVMe, Rajbhandari et
//! al., SC21, §5.1; DeepSpeed's `offload_param: {device: nvme}`): [`ShardStore`] is the rank's
//! file of shards and [`StoredShard`] one shard in it (a parameter's
//! [`Shard`](crate::fsdp::shard::Shard) holds one when its values are on disk).
//!
//! A stored shard is written once and never overwritten: the optimizer writes each updated
//! shard to free space and the old one's space is freed when the last clone of its handle is
//! dropped (a forward's autodiff graph keeps the handle it gathered from, so a re-gather in
//! backward reads the values of the forward, as with shards in memory). The file therefore
//! holds up to two copies of the shards during a step, one between steps.

use std::collections::VecDeque;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::error::ShardError;
use crate::swap::blocks::{BLOCK, checksum, reserved};
use crate::swap::config::NvmeOffload;
use crate::swap::file::SwapFile;
use crate::swap::free_space::FreeSpace;
use crate::swap::io_pool::{IoPool, Pending};

/// One rank's file of parameter shards, created as `burn-shard-rank{rank}-params.swap.{pid}.{n}`
/// and unlinked at once (see [`SwapFile::create_unlinked`]: the shards are reachable from
/// Burn's autodiff graph, which may keep a forward that never ran backward until the process
/// exits, so only the process's end can be relied on to free the file), with its free space.
///
/// Reads and writes run on an [`IoPool`] off the compute thread:
/// - a write is queued behind the caller ([`ShardStore::put`] returns at once), with the
///   shard's values kept in memory until it is done, so that a shard being written reads from
///   memory and a failed write loses nothing; at most `max_in_flight` writes are queued (the
///   oldest is waited for first), and [`ShardStore::flush`] waits for all of them and returns
///   the first failure;
/// - a read can be started ahead of its use ([`StoredShard::start_read`], [`ReadAhead`](crate::fsdp::read_ahead::ReadAhead)): the gather schedule
///   reads the unit after the one being gathered, and the step the bucket after the one being
///   stepped.
pub(crate) struct ShardStore {
    file: Arc<SwapFile>,
    pool: IoPool,
    space: Mutex<FreeSpace>,
    /// Writes queued and not yet waited for, oldest first.
    writes: Mutex<VecDeque<Arc<WriteBehind>>>,
    max_in_flight: usize,
    /// The first write that failed since the last [`ShardStore::flush`].
    failed: Mutex<Option<ShardError>>,
    /// Where a read shard is built (Burn's `Flex` CPU device).
    host: Device,
    /// Bytes read and written (writes counted when done) since the last
    /// [`ShardStore::take_io`], and of the reads those bytes that were not started ahead of
    /// their use.
    read: AtomicU64,
    written: AtomicU64,
    read_on_demand: AtomicU64,
}

/// Bytes of a [`ShardStore`]'s I/O over a span (one step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ShardIo {
    pub(crate) read: u64,
    pub(crate) written: u64,
    /// Of `read`, the bytes whose reads the thread that needed them started itself and waited
    /// for (not read ahead).
    pub(crate) read_on_demand: u64,
}

impl fmt::Debug for ShardStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardStore").field("path", &self.file.path()).finish()
    }
}

impl ShardStore {
    /// Rank `rank`'s store, its file created now in `nvme.path` (see
    /// [`SwapFile::create_unlinked`]) with `nvme.io_threads` I/O threads and at most
    /// `nvme.max_in_flight` writes queued; read shards are built on `host`.
    ///
    /// # Errors
    /// As [`NvmeOffload::check`], [`SwapFile::create`] and [`IoPool::start`] say.
    pub(crate) fn create(nvme: &NvmeOffload, rank: usize, host: Device) -> Result<Arc<Self>, ShardError> {
        nvme.check()?;
        let file = Arc::new(SwapFile::create_unlinked(
            &nvme.path,
            &format!("burn-shard-rank{rank}-params.swap"),
        )?);
        let pool = IoPool::start(file.clone(), nvme.io_threads, rank)?;
        Ok(Arc::new(Self {
            file,
            pool,
            // The first block holds the probe `SwapFile::create` wrote.
            space: Mutex::new(FreeSpace::new(BLOCK)),
            writes: Mutex::new(VecDeque::new()),
            max_in_flight: nvme.max_in_flight,
            failed: Mutex::new(None),
            host,
            read: AtomicU64::new(0),
            written: AtomicU64::new(0),
            read_on_demand: AtomicU64::new(0),
        }))
    }

    /// Queues the write of `shard` (`[chunk]`, any float dtype, in host memory; `what` it
    /// holds, "parameter" or "gradient", for the errors) to free space, behind the caller: the
    /// returned shard reads from memory until the write is done, and from memory for good when
    /// it failed. Waits for the oldest queued write first when `max_in_flight` are queued.
    ///
    /// A failed write is reported by [`ShardStore::flush`] (the step, a load and
    /// `map_params` call it before they agree on their outcome), not here.
    pub(crate) fn put(self: &Arc<Self>, shard: &Tensor<1>, what: &'static str) -> StoredShard {
        let data = shard.clone().into_data();
        let dtype = data.dtype();
        // One copy of the values, shared by the write and the reads while it is queued (the
        // caller's tensor, which may be a view of a larger one, is not kept).
        let values = Arc::new(data.into_bytes().to_vec());
        let bytes = values.len();
        let crc = checksum(&values);
        let len = reserved(bytes as u64);
        let at = self.space().take(len);
        let write = Arc::new(WriteBehind {
            what,
            bytes,
            state: Mutex::new(WriteState::Queued {
                done: self.pool.write(at, values.clone()),
                values,
            }),
        });
        let oldest = {
            let mut writes = self.writes();
            writes.push_back(write.clone());
            match writes.len() > self.max_in_flight {
                true => writes.pop_front(),
                false => None,
            }
        };
        if let Some(oldest) = oldest {
            oldest.settle(self);
        }
        StoredShard {
            store: self.clone(),
            at,
            len,
            bytes,
            numel: shard.dims()[0],
            dtype,
            crc,
            what,
            write,
        }
    }

    /// Waits for every queued write.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the file when a write since the last call failed (a full
    /// disk); the shards it held are still in memory.
    pub(crate) fn flush(&self) -> Result<(), ShardError> {
        let queued: Vec<_> = self.writes().drain(..).collect();
        for write in queued {
            write.settle(self);
        }
        match self.failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Bytes read and written since the last call.
    pub(crate) fn take_io(&self) -> ShardIo {
        ShardIo {
            read: self.read.swap(0, Ordering::Relaxed),
            written: self.written.swap(0, Ordering::Relaxed),
            read_on_demand: self.read_on_demand.swap(0, Ordering::Relaxed),
        }
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }

    fn record_failure(&self, e: ShardError) {
        tracing::error!(path = %self.file.path().display(), "shard write failed: {e}");
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
    }

    fn space(&self) -> MutexGuard<'_, FreeSpace> {
        self.space.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn writes(&self) -> MutexGuard<'_, VecDeque<Arc<WriteBehind>>> {
        self.writes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A shard's write on the store's I/O threads, with its values kept until it is done.
struct WriteBehind {
    /// "parameter" or "gradient", and the bytes written, for the errors.
    what: &'static str,
    bytes: usize,
    state: Mutex<WriteState>,
}

enum WriteState {
    /// Queued or being written: the values' bytes, read from memory meanwhile.
    Queued { done: Pending<()>, values: Arc<Vec<u8>> },
    /// On disk.
    Written,
    /// The write failed (reported once, by the store's next flush): the bytes stay here.
    Failed(Arc<Vec<u8>>),
}

impl WriteBehind {
    /// Waits for the write if it is still queued, recording a failure in `store` (for its
    /// next [`ShardStore::flush`]).
    fn settle(&self, store: &ShardStore) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(*state, WriteState::Queued { .. }) {
            return;
        }
        let WriteState::Queued { done, values } = std::mem::replace(&mut *state, WriteState::Written) else {
            unreachable!("matched above")
        };
        match done.wait() {
            Ok(()) => {
                store.written.fetch_add(self.bytes as u64, Ordering::Relaxed);
            }
            Err(e) => {
                let what = format!("writing a {} shard", self.what);
                store.record_failure(store.file.io_error(&what, self.bytes, &e));
                *state = WriteState::Failed(values);
            }
        }
    }

    /// The values' bytes while they are in memory (queued, or the write failed); `None` once
    /// on disk.
    fn in_memory(&self) -> Option<Arc<Vec<u8>>> {
        match &*self.state.lock().unwrap_or_else(|p| p.into_inner()) {
            WriteState::Queued { values, .. } | WriteState::Failed(values) => Some(values.clone()),
            WriteState::Written => None,
        }
    }
}

/// One shard in a [`ShardStore`]: where its bytes are, what they hold, and their CRC-32; its
/// space is freed when it is dropped (after its write is done).
pub(crate) struct StoredShard {
    store: Arc<ShardStore>,
    at: u64,
    /// Bytes of file it occupies (whole blocks).
    len: u64,
    /// Bytes of its values.
    bytes: usize,
    numel: usize,
    dtype: DType,
    crc: u32,
    /// "parameter" or "gradient", for the errors.
    what: &'static str,
    write: Arc<WriteBehind>,
}

/// A shard's values on their way from disk ([`StoredShard::start_read`]): wait with
/// [`ShardRead::wait`].
// `Ready` (a tensor handle) is the large variant; reads are few at a time.
#[allow(clippy::large_enum_variant)]
pub(crate) enum ShardRead {
    /// In memory already (the shard's write was still queued, or failed).
    Ready(Tensor<1>),
    /// Read on the store's I/O threads; `ahead` when started ahead of its use.
    Reading {
        shard: Arc<StoredShard>,
        pending: Pending<Vec<u8>>,
        ahead: bool,
    },
}

impl ShardRead {
    /// The values, read and checked, in host memory.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the file when it was truncated or a read failed, or the
    /// bytes read back differ from those written (CRC-32).
    pub(crate) fn wait(self) -> Result<Tensor<1>, ShardError> {
        self.finish(true)
    }

    /// [`ShardRead::wait`], counted in the store's I/O bytes or not (a checkpoint's reads are
    /// not the step's).
    fn finish(self, counted: bool) -> Result<Tensor<1>, ShardError> {
        let (shard, pending, ahead) = match self {
            ShardRead::Ready(values) => return Ok(values),
            ShardRead::Reading { shard, pending, ahead } => (shard, pending, ahead),
        };
        let file = &shard.store.file;
        let bytes = pending
            .wait()
            .map_err(|e| file.io_error(&format!("reading a {} shard", shard.what), shard.bytes, &e))?;
        if checksum(&bytes) != shard.crc {
            return Err(ShardError::Nvme {
                path: file.path().to_path_buf(),
                reason: format!(
                    "a {} shard of {} bytes at offset {} reads back different bytes (CRC-32 mismatch; the file \
                     has no name, so no other program wrote it: the disk or the filesystem returned other bytes)",
                    shard.what, shard.bytes, shard.at
                ),
                fix: "check the disk (dmesg); the parameters on disk are lost: resume from the last checkpoint".into(),
            });
        }
        if !counted {
            return Ok(shard.tensor(bytes));
        }
        shard.store.read.fetch_add(shard.bytes as u64, Ordering::Relaxed);
        if !ahead {
            shard
                .store
                .read_on_demand
                .fetch_add(shard.bytes as u64, Ordering::Relaxed);
        }
        Ok(shard.tensor(bytes))
    }
}

impl StoredShard {
    /// Starts reading the shard's values on the store's I/O threads (from memory while its
    /// write is queued); `ahead` when that is ahead of their use (counted in
    /// [`ShardIo::read_on_demand`] otherwise).
    pub(crate) fn start_read(self: &Arc<Self>, ahead: bool) -> ShardRead {
        match self.write.in_memory() {
            Some(bytes) => ShardRead::Ready(self.tensor(bytes.to_vec())),
            None => ShardRead::Reading {
                shard: self.clone(),
                pending: self.store.pool.read(self.at, self.bytes),
                ahead,
            },
        }
    }

    /// The shard's values from their bytes, in host memory.
    fn tensor(&self, bytes: Vec<u8>) -> Tensor<1> {
        let data = TensorData::from_bytes_vec(bytes, [self.numel], self.dtype);
        Tensor::from_data(data, (&self.store.host, self.dtype))
    }

    /// The shard's values, read and checked, in host memory.
    ///
    /// # Errors
    /// As [`ShardRead::wait`].
    pub(crate) fn read(self: &Arc<Self>) -> Result<Tensor<1>, ShardError> {
        self.start_read(false).wait()
    }

    /// [`StoredShard::read`] for a checkpoint (its writer, a fingerprint): not counted in the
    /// store's I/O bytes, which are the steps'.
    ///
    /// # Errors
    /// As [`ShardRead::wait`].
    pub(crate) fn read_for_checkpoint(self: &Arc<Self>) -> Result<Tensor<1>, ShardError> {
        self.start_read(false).finish(false)
    }

    /// Elements of the shard (`chunk`).
    pub(crate) fn numel(&self) -> usize {
        self.numel
    }

    /// The shard's dtype.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where a read of the shard builds its tensor: the store's host device (Burn's `Flex`).
    pub(crate) fn host(&self) -> Device {
        self.store.host.clone()
    }
}

impl Drop for StoredShard {
    /// Frees the shard's space once no write to it is in flight (another shard may take it).
    fn drop(&mut self) {
        self.write.settle(&self.store);
        self.store.space().give(self.at, self.len);
    }
}

impl fmt::Debug for StoredShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoredShard {{ {} x {:?} at {} }}", self.numel, self.dtype, self.at)
    }
}
