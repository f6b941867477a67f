//! Running a collective ([`NcclComm::run_group`], [`NcclComm::run`] for one tensor): check and
//! allocate every buffer, pin them, wait for CubeCL's queued work, issue under the lock, wait for
//! the stream; on any error abort the communicator and let the buffers go only once the stream
//! is seen drained.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use cudarc::driver::CudaStream;
use cudarc::nccl::result::{NcclError, NcclStatus};
use cudarc::nccl::sys as ncclsys;

use super::buffers::{Buffer, Item, Launch, cube, device_ptr, nccl_dtype};
use super::comm::NcclComm;
use crate::CommError;
use crate::stats::CollectiveKind;

/// After an abort, how long a failed collective waits for its stream to drain before it leaks
/// its buffers rather than hand memory NCCL may still touch back to CubeCL.
const ABORT_DRAIN_GRACE: Duration = Duration::from_secs(10);

impl NcclComm {
    /// Runs one NCCL call on `input` (read) into a fresh output of `out_len` elements.
    pub(super) fn run(
        &self,
        kind: CollectiveKind,
        input: Tensor<1>,
        out_len: usize,
        sent_elems: usize,
        call: impl FnMut(&Launch) -> Result<NcclStatus, NcclError>,
    ) -> Result<Tensor<1>, CommError> {
        let item = Item {
            input,
            out_len,
            sent_elems,
        };
        let mut outputs = self.run_group(kind, vec![item], call)?;
        outputs
            .pop()
            .ok_or_else(|| CommError::Backend("internal error: a single collective returned no output".into()))
    }

    /// Runs `call` for every item, each into a fresh output of its `out_len` elements. More than
    /// one item run as one NCCL group (`ncclGroupStart`/`ncclGroupEnd`): one launch, one wait
    /// with the timeout. Any error once NCCL was called aborts the communicator.
    ///
    /// `call` gets a [`Launch`] whose invariants (documented there) it may rely on: the buffers
    /// hold at least the item's input length (`src`) and `out_len` (`dst`) elements of the dtype.
    pub(super) fn run_group(
        &self,
        kind: CollectiveKind,
        items: Vec<Item>,
        mut call: impl FnMut(&Launch) -> Result<NcclStatus, NcclError>,
    ) -> Result<Vec<Tensor<1>>, CommError> {
        let op = kind.name();
        self.check()?;
        // Check and allocate every buffer before issuing anything, so a bad dtype or device fails
        // the whole call with nothing sent.
        let mut buffers = Vec::with_capacity(items.len());
        for item in items {
            let dtype = item.input.dtype();
            let nccl_dtype = nccl_dtype(dtype)?;
            let in_len = item.input.dims()[0];
            let output = Tensor::<1>::empty([item.out_len], (&self.device, dtype));
            // NCCL reads `count` consecutive elements: a strided or broadcast view (a stepped
            // slice, `expand`) is copied into a dense buffer first (a no-op when already dense).
            let src = burn_cubecl::kernel::into_contiguous(cube(item.input)?);
            let dst = cube(output)?;
            if src.device != dst.device {
                return Err(CommError::Backend(format!(
                    "rank {}: {op} got a tensor on another device; this communicator's GPU is CUDA device {} \
                     (NcclComm::device)",
                    self.rank, self.device_index
                )));
            }
            buffers.push(Buffer {
                src,
                dst,
                dtype: nccl_dtype,
                elem_bytes: dtype.size(),
                in_len,
                out_len: item.out_len,
                sent_bytes: (item.sent_elems * dtype.size()) as u64,
            });
        }
        // Pin every buffer (its allocation is neither freed, reused nor moved while the guard
        // lives) and take its address. An empty tensor moves nothing; lengths are equal on every
        // rank, so every rank skips the same calls.
        let mut pinned = Vec::with_capacity(buffers.len());
        let mut guards = Vec::with_capacity(2 * buffers.len());
        for (index, buffer) in buffers.iter().enumerate() {
            if buffer.in_len == 0 || buffer.out_len == 0 {
                continue;
            }
            let (src, src_guard) = device_ptr(&buffer.src, buffer.in_len * buffer.elem_bytes)?;
            let (dst, dst_guard) = device_ptr(&buffer.dst, buffer.out_len * buffer.elem_bytes)?;
            guards.push(src_guard);
            guards.push(dst_guard);
            pinned.push((index, src, dst));
        }
        if pinned.is_empty() {
            return Ok(self.outputs(kind, buffers));
        }
        // Wait for the work queued on this thread's CubeCL stream, after `get_resource`: that
        // made this stream wait for the stream that wrote each buffer, so the host wait covers
        // writes from other threads' streams too. One wait covers every buffer (same device).
        cubecl::future::block_on(buffers[0].src.client.sync()).map_err(|e| CommError::Backend(format!("{e:?}")))?;

        let raw = self.acquire()?;
        let start = Instant::now();
        let stream = raw.stream.cu_stream() as ncclsys::cudaStream_t;
        let launches: Vec<Launch> = pinned
            .iter()
            .map(|&(index, src, dst)| Launch {
                index,
                src: src as *const c_void,
                dst: dst as *mut c_void,
                dtype: buffers[index].dtype,
                comm: raw.comm,
                stream,
            })
            .collect();
        let result = self
            .issue(op, &launches, &mut call)
            .and_then(|()| self.wait_ready(&raw, op, start))
            .and_then(|()| self.wait_stream(&raw, op, start));
        if let Err(e) = result {
            let mut raw = raw;
            self.abort_locked(&mut raw, &e.to_string());
            let stream = Arc::clone(&raw.stream);
            drop(raw);
            // The aborted communicator stops its kernels; only once the stream is seen drained
            // may CubeCL reuse the buffers. Otherwise keep them pinned forever (a leak, on a path
            // where the job has to restart anyway) rather than let NCCL touch reused memory.
            if !drained(&stream) {
                tracing::error!(
                    rank = self.rank,
                    "the NCCL stream did not drain within {ABORT_DRAIN_GRACE:?} of the abort: leaking the buffers of {op}"
                );
                std::mem::forget(guards);
                std::mem::forget(buffers);
            }
            return Err(e);
        }
        drop(raw);
        // The stream is drained: NCCL is done with every buffer.
        drop(guards);
        Ok(self.outputs(kind, buffers))
    }

    /// The outputs of a completed call, with its traffic recorded.
    fn outputs(&self, kind: CollectiveKind, buffers: Vec<Buffer>) -> Vec<Tensor<1>> {
        buffers
            .into_iter()
            .map(|buffer| {
                self.stats.record(kind, buffer.sent_bytes);
                burn_shard_cube::from_cube::<1>(buffer.dst)
            })
            .collect()
    }
}

/// Whether `stream` finished its work within [`ABORT_DRAIN_GRACE`] (false on any CUDA error).
fn drained(stream: &CudaStream) -> bool {
    let Ok(event) = stream.record_event(None) else {
        return false;
    };
    let start = Instant::now();
    while start.elapsed() < ABORT_DRAIN_GRACE {
        match event.try_is_complete() {
            Ok(true) => return true,
            Ok(false) => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => return false,
        }
    }
    false
}
