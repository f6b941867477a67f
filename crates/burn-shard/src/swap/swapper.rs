//! `Swapper`: where each slot's optimizer state is on disk, and the step's read-ahead and
//! write-behind.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use burn::optim::{RecordState, StateSource};
use burn::tensor::{Device, Tensor, TensorData};

use crate::error::ShardError;
use crate::swap::blocks::{BLOCK, reserved};
use crate::swap::config::NvmeOffload;
use crate::swap::file::SwapFile;
use crate::swap::free_space::FreeSpace;
use crate::swap::io_pool::{IoPool, Pending};
use crate::swap::slot_bytes::{self, Field, SlotLayout, StateAndMaster};

/// Where one slot's bytes are in the file.
struct Extent {
    offset: u64,
    /// Bytes reserved (a multiple of [`BLOCK`]); a slot whose state grows past it moves to
    /// free space (or the end of the file) and frees this.
    capacity: u64,
    layout: SlotLayout,
}

/// Bytes read and written by the swap file in the last step (a checkpoint's reads are not
/// counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct IoBytes {
    pub(crate) read: u64,
    pub(crate) written: u64,
}

/// One rank's optimizer state on disk: per slot, its extent in the swap file. Between steps
/// every write has finished; during a step ([`Swapper::begin`] to [`Swapper::finish`]) the
/// slots to be stepped are read ahead in the step's order and each stepped slot is written
/// behind, at most `max_in_flight` reads and `max_in_flight` writes at once.
pub(crate) struct Swapper {
    file: Arc<SwapFile>,
    pool: IoPool,
    extents: Vec<Option<Extent>>,
    /// The bytes of the file no live extent uses.
    space: FreeSpace,
    max_in_flight: usize,
    /// Where states and masters are rebuilt (the optimizer's state device).
    device: Device,
    /// This step's slots not yet read, in the order the step takes them.
    ahead: VecDeque<usize>,
    reads: HashMap<usize, Pending<Vec<u8>>>,
    writes: VecDeque<(usize, Pending<()>)>,
    /// The first error of this step, returned by `finish`.
    error: Option<ShardError>,
    this_step: IoBytes,
    last_step: IoBytes,
    /// The extents a checkpoint still reads ([`Swapper::slot_reader`]).
    pins: Pins,
    /// Extents a step moved away from while pinned: freed once unpinned (`offset`, `capacity`).
    retired: Vec<(u64, u64)>,
}

impl Swapper {
    /// Rank `rank`'s swapper, its file created now in `config.path`; states are rebuilt on
    /// `device`.
    ///
    /// # Errors
    /// As [`NvmeOffload`] says.
    pub(crate) fn new(config: &NvmeOffload, rank: usize, device: Device) -> Result<Self, ShardError> {
        config.check()?;
        let file = Arc::new(SwapFile::create(&config.path, &format!("burn-shard-rank{rank}.swap"))?);
        let pool = IoPool::start(file.clone(), config.io_threads, rank)?;
        Ok(Self {
            file,
            pool,
            extents: Vec::new(),
            // The first block holds the probe `SwapFile::create` wrote.
            space: FreeSpace::new(BLOCK),
            max_in_flight: config.max_in_flight,
            device,
            ahead: VecDeque::new(),
            reads: HashMap::new(),
            writes: VecDeque::new(),
            error: None,
            this_step: IoBytes::default(),
            last_step: IoBytes::default(),
            pins: Pins::default(),
            retired: Vec::new(),
        })
    }

    /// Starts a step that takes `order`'s slots in that order: checks the file is still there,
    /// then starts reading the first `max_in_flight`.
    pub(crate) fn begin(&mut self, order: impl IntoIterator<Item = usize>) {
        // Nothing of an earlier step that did not reach `finish` (a panic) carries over.
        let _ = self.finish();
        self.this_step = IoBytes::default();
        self.reclaim();
        if let Err(e) = self.file.check_present() {
            self.fail(e);
        }
        self.ahead = order.into_iter().filter(|&i| self.extent(i).is_some()).collect();
        self.fill();
    }

    /// Reads ahead while fewer than `max_in_flight` reads are in flight.
    fn fill(&mut self) {
        while self.reads.len() < self.max_in_flight
            && let Some(index) = self.ahead.pop_front()
        {
            let extent = self.extents[index].as_ref().expect("only slots on disk are read ahead");
            let read = self.pool.read(extent.offset, extent.layout.len);
            self.reads.insert(index, read);
        }
    }

    /// Slot `index`'s state and master, read back (`(None, None)` when none was written), the
    /// state rebuilt by `rebuild` (see [`slot_bytes::decode`]).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the read fails or returns other bytes than were written (the
    /// file was truncated or overwritten); also recorded for `finish`.
    pub(crate) fn take<S>(
        &mut self,
        index: usize,
        rebuild: impl FnOnce(&mut StateSource, &Device) -> Option<S>,
    ) -> Result<StateAndMaster<S>, ShardError> {
        let read = match self.reads.remove(&index) {
            Some(read) => Some(read),
            None => {
                self.ahead.retain(|&i| i != index);
                self.extent(index)
                    .map(|extent| self.pool.read(extent.offset, extent.layout.len))
            }
        };
        self.fill();
        let Some(read) = read else {
            return Ok((None, None));
        };
        let result = self.decode(index, read.wait(), rebuild);
        if result.is_ok() {
            self.this_step.read += self.extent(index).map_or(0, |e| e.layout.len as u64);
        }
        result.inspect_err(|e| self.fail(e.clone()))
    }

    fn decode<S>(
        &self,
        index: usize,
        bytes: std::io::Result<Vec<u8>>,
        rebuild: impl FnOnce(&mut StateSource, &Device) -> Option<S>,
    ) -> Result<StateAndMaster<S>, ShardError> {
        let extent = self.extent(index).expect("read slots are on disk");
        let bytes = bytes.map_err(|e| {
            self.file
                .io_error("reading a piece's optimizer state", extent.layout.len, &e)
        })?;
        let corrupt = |reason: &str| corrupt(&self.file, extent.offset, extent.layout.len, reason);
        if !extent.layout.matches(&bytes) {
            return Err(corrupt("are not the ones written (CRC-32 mismatch)"));
        }
        slot_bytes::decode(bytes, &extent.layout, &self.device, rebuild)
            .ok_or_else(|| corrupt("do not rebuild this optimizer's state"))
    }

    /// Writes slot `index`'s `state` and `master` behind the step (waiting for the oldest write
    /// when `max_in_flight` are in flight). An error is recorded for `finish`.
    pub(crate) fn put<S: RecordState>(&mut self, index: usize, state: Option<&S>, master: Option<&Tensor<1>>) {
        if index >= self.extents.len() {
            self.extents.resize_with(index + 1, || None);
        }
        if state.is_none() && master.is_none() {
            if let Some(old) = self.extents[index].take() {
                self.release(old);
            }
            return;
        }
        let (bytes, layout) = slot_bytes::encode(state, master);
        let needed = reserved(layout.len as u64);
        let (offset, capacity) = match self.extents[index].take() {
            Some(extent) if extent.capacity >= needed && !self.pins.is_pinned(extent.offset) => {
                (extent.offset, extent.capacity)
            }
            // New, grown (a state that gained a tensor), or still read by a background save
            // (copy-on-write: the save reads the old bytes, the step writes beside them): in
            // free space; the old extent freed (once unpinned).
            old => {
                if let Some(old) = old {
                    self.release(old);
                }
                (self.space.take(needed), needed)
            }
        };
        while self.writes.len() >= self.max_in_flight {
            self.wait_oldest_write();
        }
        let len = layout.len;
        self.writes.push_back((len, self.pool.write(offset, Arc::new(bytes))));
        self.extents[index] = Some(Extent {
            offset,
            capacity,
            layout,
        });
    }

    fn wait_oldest_write(&mut self) {
        if let Some((len, write)) = self.writes.pop_front() {
            match write.wait() {
                Ok(()) => self.this_step.written += len as u64,
                Err(e) => {
                    let e = self.file.io_error("writing a piece's optimizer state", len, &e);
                    self.fail(e);
                }
            }
        }
    }

    /// Ends the step: waits for every read and write in flight and returns the step's first
    /// error.
    ///
    /// # Errors
    /// [`ShardError::Nvme`], naming the file, the cause and the fix.
    pub(crate) fn finish(&mut self) -> Result<(), ShardError> {
        self.ahead.clear();
        for (_, read) in self.reads.drain() {
            let _ = read.wait();
        }
        while !self.writes.is_empty() {
            self.wait_oldest_write();
        }
        self.last_step = self.this_step;
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A reader of slot `index`'s tensors one at a time, for a checkpoint that writes them
    /// without holding the slot in memory (`None` when it has nothing on disk). The reader
    /// pins the slot's bytes: while it (or a clone) lives, the steps write the slot elsewhere
    /// in the file and leave these bytes as they are, so a background save reads the state
    /// of the step it was staged at, without a copy in memory and without holding up the
    /// steps. The file grows by at most the pinned slots' bytes meanwhile.
    pub(crate) fn slot_reader(&self, index: usize) -> Option<SlotReader> {
        self.extent(index).map(|extent| SlotReader {
            file: self.file.clone(),
            offset: extent.offset,
            layout: extent.layout.clone(),
            _pin: Arc::new(self.pins.pin(extent.offset)),
        })
    }

    /// Frees `old`'s space, or retires it while a reader pins it.
    fn release(&mut self, old: Extent) {
        match self.pins.is_pinned(old.offset) {
            true => self.retired.push((old.offset, old.capacity)),
            false => self.space.give(old.offset, old.capacity),
        }
    }

    /// Frees the retired extents no reader pins any more.
    fn reclaim(&mut self) {
        let (pins, space) = (&self.pins, &mut self.space);
        self.retired.retain(|&(offset, capacity)| {
            let pinned = pins.is_pinned(offset);
            if !pinned {
                space.give(offset, capacity);
            }
            pinned
        });
    }

    /// Starts replacing every slot's state (a checkpoint load): [`Staging::put`] writes where
    /// no live extent is (in the space a previous load or a moved slot freed, then past the
    /// end), so the live state stays as it is until [`Swapper::commit`]; a staging dropped
    /// instead leaves the swapper unchanged and the file its length. The file thus holds about
    /// twice the state at most.
    pub(crate) fn staging(&mut self) -> Staging {
        // Between steps: nothing of an unfinished step is left in flight, and the space of
        // slots no save reads any more is free.
        let _ = self.finish();
        self.reclaim();
        Staging {
            file: self.file.clone(),
            extents: Vec::new(),
            space: self.space.clone(),
            len_before: self.file.len().ok(),
            committed: false,
        }
    }

    /// Makes `staged`'s slots the live ones (those it did not write have none), and the space
    /// of the state they replace free.
    pub(crate) fn commit(&mut self, mut staged: Staging) {
        staged.committed = true;
        let replaced = std::mem::replace(&mut self.extents, std::mem::take(&mut staged.extents));
        self.space = staged.space.clone();
        for old in replaced.into_iter().flatten() {
            self.release(old);
        }
    }

    /// Where slot `index`'s bytes are (`None` when it has none on disk).
    fn extent(&self, index: usize) -> Option<&Extent> {
        self.extents.get(index).and_then(Option::as_ref)
    }

    /// Keeps the first error of the step.
    fn fail(&mut self, e: ShardError) {
        self.error.get_or_insert(e);
    }

    /// Bytes of optimizer state on disk (written, not reserved).
    pub(crate) fn disk_bytes(&self) -> usize {
        self.extents.iter().flatten().map(|e| e.layout.len).sum()
    }

    /// Bytes read and written by the last step.
    pub(crate) fn last_step_io(&self) -> IoBytes {
        self.last_step
    }

    /// The swap file's path.
    pub(crate) fn path(&self) -> &std::path::Path {
        self.file.path()
    }
}

/// A replacement of every slot's state being written (see [`Swapper::staging`]): one slot in
/// memory at a time, written synchronously (a load is not a step).
pub(crate) struct Staging {
    file: Arc<SwapFile>,
    extents: Vec<Option<Extent>>,
    /// The swapper's free space, less what the staged slots took.
    space: FreeSpace,
    /// The file's length before, restored when the staging is dropped uncommitted.
    len_before: Option<u64>,
    committed: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        // A failed load gives back the disk it took (a full disk stays usable for the steps).
        if let (false, Some(len)) = (self.committed, self.len_before)
            && self.file.len().is_ok_and(|now| now > len)
        {
            let _ = self.file.truncate(len);
        }
    }
}

impl Staging {
    /// Writes slot `index`'s `state` and `master` where no live extent is.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the write fails, saying that the optimizer is unchanged.
    pub(crate) fn put<S: RecordState>(
        &mut self,
        index: usize,
        state: Option<&S>,
        master: Option<&Tensor<1>>,
    ) -> Result<(), ShardError> {
        if index >= self.extents.len() {
            self.extents.resize_with(index + 1, || None);
        }
        if state.is_none() && master.is_none() {
            return Ok(());
        }
        let (bytes, layout) = slot_bytes::encode(state, master);
        let capacity = reserved(layout.len as u64);
        let offset = self.space.take(capacity);
        self.file.write_at(&bytes, offset).map_err(|e| {
            // The live state is intact: the fix is to load again, not to resume.
            let then = "load again: the optimizer is unchanged (a load writes the loaded state beside the live \
                        one, so it needs room for the state a second time)";
            self.file
                .io_error_then("writing a loaded piece's optimizer state", bytes.len(), &e, then)
        })?;
        self.extents[index] = Some(Extent {
            offset,
            capacity,
            layout,
        });
        Ok(())
    }
}

/// One slot's tensors on disk, read one at a time (see [`Swapper::slot_reader`]).
#[derive(Clone)]
pub(crate) struct SlotReader {
    file: Arc<SwapFile>,
    offset: u64,
    /// What the slot holds: the fields' names, dtypes, shapes, CRCs and the state's scalars.
    pub(crate) layout: SlotLayout,
    /// Keeps the steps from writing over these bytes while the reader lives.
    _pin: Arc<Pin>,
}

/// The extents that readers pin, with how many pins each: shared by the swapper (which asks)
/// and the pins (dropped on a background writer's thread).
#[derive(Clone, Default)]
struct Pins(Arc<Mutex<HashMap<u64, usize>>>);

impl Pins {
    fn pin(&self, offset: u64) -> Pin {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(offset)
            .or_default() += 1;
        Pin {
            pins: self.clone(),
            offset,
        }
    }

    fn is_pinned(&self, offset: u64) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&offset)
    }
}

/// One pin of an extent, released when dropped.
struct Pin {
    pins: Pins,
    offset: u64,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut pins = self.pins.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = pins.get_mut(&self.offset) {
            *count -= 1;
            if *count == 0 {
                pins.remove(&self.offset);
            }
        }
    }
}

impl SlotReader {
    /// `field`'s bytes (one of [`SlotReader::layout`]'s), read now and checked against its
    /// CRC-32.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the read fails or returns other bytes than were written.
    pub(crate) fn read(&self, field: &Field) -> Result<TensorData, ShardError> {
        let offset = self.offset + field.at as u64;
        let bytes = self
            .file
            .read_at(field.bytes, offset)
            .map_err(|e| self.file.io_error("reading a piece's optimizer state", field.bytes, &e))?;
        if !field.matches(&bytes) {
            return Err(corrupt(
                &self.file,
                offset,
                field.bytes,
                "are not the ones written (CRC-32 mismatch)",
            ));
        }
        Ok(TensorData::from_bytes_vec(bytes, field.shape.clone(), field.dtype))
    }
}

/// The error of a swap file whose `len` bytes at `offset` are not what was written.
fn corrupt(file: &SwapFile, offset: u64, len: usize, reason: &str) -> ShardError {
    ShardError::Nvme {
        path: file.path().to_path_buf(),
        reason: format!("the {len} bytes at offset {offset} {reason}"),
        fix: "another program wrote to the swap file, or the disk corrupted it: the optimizer state on disk is \
              lost; resume from the last checkpoint, and keep other programs out of the NvmeOffload directory"
            .into(),
    }
}
