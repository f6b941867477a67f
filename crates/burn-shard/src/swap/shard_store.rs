//! Stage-3 parameter shards on disk (ZeRO-Infinity's parameter offload to NVMe, Rajbhandari et
//! al., SC21, §5.1; DeepSpeed's `offload_param: {device: nvme}`): [`Shard`] is what a sharded
//! parameter holds, its values in memory or in the rank's shard file, and [`ShardStore`] is
//! that file.
//!
//! A stored shard is written once and never overwritten: the optimizer writes each updated
//! shard to free space and the old one's space is freed when the last clone of its handle is
//! dropped (a forward's autodiff graph keeps the handle it gathered from, so a re-gather in
//! backward reads the values of the forward, as with shards in memory). The file therefore
//! holds up to two copies of the shards during a step, one between steps.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::error::ShardError;
use crate::swap::file::SwapFile;
use crate::swap::free_space::FreeSpace;

/// Shards are placed at multiples of this many bytes (4 KiB, a page and the common block size).
const BLOCK: u64 = 4096;

/// One rank's file of parameter shards, created as `burn-shard-rank{rank}-params.swap.{pid}.{n}`
/// and unlinked at once (see [`SwapFile::create_unlinked`]: the shards are reachable from
/// Burn's autodiff graph, which may keep a forward that never ran backward until the process
/// exits, so only the process's end can be relied on to free the file), with its free space.
/// Shards are read and written on the thread that needs them (the gather or the step).
pub(crate) struct ShardStore {
    file: SwapFile,
    space: Mutex<FreeSpace>,
    /// Where a read shard is built (Burn's `Flex` CPU device).
    host: Device,
    /// Bytes read and written since the last [`ShardStore::take_io`].
    read: AtomicU64,
    written: AtomicU64,
}

impl fmt::Debug for ShardStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardStore").field("path", &self.file.path()).finish()
    }
}

impl ShardStore {
    /// Rank `rank`'s store, its file created now in `dir` (see [`SwapFile::create_unlinked`]);
    /// read shards are built on `host`.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] as [`SwapFile::create`] says.
    pub(crate) fn create(dir: &Path, rank: usize, host: Device) -> Result<Arc<Self>, ShardError> {
        let file = SwapFile::create_unlinked(dir, &format!("burn-shard-rank{rank}-params.swap"))?;
        Ok(Arc::new(Self {
            file,
            // The first block holds the probe `SwapFile::create` wrote.
            space: Mutex::new(FreeSpace::new(BLOCK)),
            host,
            read: AtomicU64::new(0),
            written: AtomicU64::new(0),
        }))
    }

    /// Writes `shard` (`[chunk]`, any float dtype; `what` it holds, "parameter" or "gradient",
    /// for the errors) to free space.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the write failed (a full disk): the shard is then still the
    /// caller's.
    pub(crate) fn put(self: &Arc<Self>, shard: &Tensor<1>, what: &'static str) -> Result<StoredShard, ShardError> {
        self.file.check_present()?;
        let data = shard.clone().into_data();
        let bytes = data.as_bytes();
        let len = (bytes.len() as u64).div_ceil(BLOCK) * BLOCK;
        let at = self.space().take(len);
        if let Err(e) = self.file.write_at(bytes, at) {
            self.space().give(at, len);
            return Err(self.file.io_error(&format!("writing a {what} shard"), bytes.len(), &e));
        }
        self.written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(StoredShard {
            store: self.clone(),
            at,
            len,
            bytes: bytes.len(),
            numel: shard.dims()[0],
            dtype: data.dtype(),
            crc: crc32fast::hash(bytes),
            what,
        })
    }

    /// Bytes (read, written) since the last call.
    pub(crate) fn take_io(&self) -> (u64, u64) {
        (
            self.read.swap(0, Ordering::Relaxed),
            self.written.swap(0, Ordering::Relaxed),
        )
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        self.file.path()
    }

    fn space(&self) -> std::sync::MutexGuard<'_, FreeSpace> {
        self.space.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One shard in a [`ShardStore`]: where its bytes are, what they hold, and their CRC-32; its
/// space is freed when it is dropped.
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
}

impl StoredShard {
    /// The shard's values, read and checked, in host memory.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the file when it was deleted, truncated or overwritten.
    pub(crate) fn read(&self) -> Result<Tensor<1>, ShardError> {
        let file = &self.store.file;
        file.check_present()?;
        let bytes = file
            .read_at(self.bytes, self.at)
            .map_err(|e| file.io_error(&format!("reading a {} shard", self.what), self.bytes, &e))?;
        if crc32fast::hash(&bytes) != self.crc {
            return Err(ShardError::Nvme {
                path: file.path().to_path_buf(),
                reason: format!(
                    "a {} shard of {} bytes at offset {} reads back different bytes (CRC-32 mismatch; the file \
                     has no name, so no other program wrote it: the disk or the filesystem returned other bytes)",
                    self.what, self.bytes, self.at
                ),
                fix: "check the disk (dmesg); the parameters on disk are lost: resume from the last checkpoint".into(),
            });
        }
        self.store.read.fetch_add(self.bytes as u64, Ordering::Relaxed);
        let data = TensorData::from_bytes_vec(bytes, [self.numel], self.dtype);
        Ok(Tensor::from_data(data, (&self.store.host, self.dtype)))
    }
}

impl Drop for StoredShard {
    fn drop(&mut self) {
        self.store.space().give(self.at, self.len);
    }
}

impl fmt::Debug for StoredShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoredShard {{ {} x {:?} at {} }}", self.numel, self.dtype, self.at)
    }
}

/// What a stage-3 parameter holds of its values: this rank's `[chunk]` shard, in memory (on the
/// compute device, or in host memory with parameter offload) or in the rank's [`ShardStore`].
/// Clones are cheap (a tensor handle or an `Arc`).
// `Held` (a tensor handle, the common case) is the large variant: boxing it would allocate
// each time a shard is replaced, for 64 bytes saved per parameter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum Shard {
    /// In memory, plain (not tracked by autodiff).
    Held(Tensor<1>),
    /// On disk, read on each use.
    Stored(Arc<StoredShard>),
}

impl Shard {
    /// The values, `[chunk]`, read from disk when stored.
    ///
    /// # Errors
    /// As [`StoredShard::read`].
    pub(crate) fn read(&self) -> Result<Tensor<1>, ShardError> {
        match self {
            Shard::Held(shard) => Ok(shard.clone()),
            Shard::Stored(stored) => stored.read(),
        }
    }

    /// Elements (`chunk`).
    pub(crate) fn numel(&self) -> usize {
        match self {
            Shard::Held(shard) => shard.dims()[0],
            Shard::Stored(stored) => stored.numel,
        }
    }

    /// The values' dtype.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Shard::Held(shard) => shard.dtype(),
            Shard::Stored(stored) => stored.dtype,
        }
    }

    /// Where a read shard is: its device in memory, the host when stored.
    pub(crate) fn device(&self) -> Device {
        match self {
            Shard::Held(shard) => shard.device(),
            Shard::Stored(stored) => stored.store.host.clone(),
        }
    }

    /// The tensor, when the shard is in memory.
    pub(crate) fn held(&self) -> Option<&Tensor<1>> {
        match self {
            Shard::Held(shard) => Some(shard),
            Shard::Stored(_) => None,
        }
    }
}
