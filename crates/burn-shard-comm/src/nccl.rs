//! The NCCL backend (feature `cuda`): one rank per GPU, one process (or thread) per rank, any
//! number of nodes. Collectives run in place on Burn's CUDA tensors through cudarc's NCCL
//! bindings, which load `libnccl` and `libcuda` at run time (nothing is needed to build).
//!
//! Ordering: CubeCL does not expose its CUDA stream, so each collective first waits for the
//! device's queued work (`client.sync()`), then runs NCCL on this communicator's own stream in
//! the same primary context and waits for it, with a timeout: a peer that never joins makes
//! the call abort the communicator (`ncclCommAbort`) and return [`CommError::Timeout`].

use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as ncclsys};

use crate::stats::{CollectiveKind, StatsCounter};
use crate::{Collective, CommError, CommStats, ReduceOp};

/// The CUDA server type of CubeCL (not nameable otherwise).
type CudaServer = <CudaRuntime as Runtime>::Server;

/// Default time a collective may take before the communicator is aborted (5 minutes).
pub const NCCL_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Whether `libcuda` and `libnccl` can be loaded on this machine (never panics).
pub fn nccl_available() -> bool {
    // SAFETY: these only try to dlopen the libraries.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

/// Number of CUDA devices, or an error naming what is missing.
pub fn cuda_device_count() -> Result<usize, CommError> {
    if !nccl_available() {
        return Err(CommError::Unavailable(
            "libcuda or libnccl cannot be loaded: install the NVIDIA driver and NCCL (libnccl2), or use InProcessGroup on the CPU".into(),
        ));
    }
    cudarc::driver::result::init().map_err(|e| CommError::Backend(format!("cuInit failed: {e:?}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| CommError::Backend(format!("cannot count CUDA devices: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// The 128-byte NCCL unique id that rank 0 creates and every rank needs: pass it through the
/// launcher's rendezvous, a file ([`NcclId::write_file`]) or an environment variable
/// ([`NcclId::to_hex`]).
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id (call on rank 0 only).
    ///
    /// # Errors
    /// [`CommError::Unavailable`] without libnccl; [`CommError::Backend`] when NCCL fails.
    pub fn new() -> Result<Self, CommError> {
        cuda_device_count()?;
        let id = nccl::get_uniqueid().map_err(|e| CommError::Backend(format!("ncclGetUniqueId: {e:?}")))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    /// Lowercase hex, 256 characters.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`NcclId::to_hex`]'s output.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the problem when the text is not 256 hex digits.
    pub fn from_hex(hex: &str) -> Result<Self, CommError> {
        let hex = hex.trim();
        if hex.len() != 256 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CommError::Backend(format!(
                "an NCCL id is 256 hex digits, got {} characters; pass the id rank 0 wrote",
                hex.len()
            )));
        }
        let mut out = [0u8; 128];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex digits");
        }
        Ok(Self(out))
    }

    /// Writes the id atomically (temporary file + rename) so readers never see half of it.
    pub fn write_file(&self, path: &std::path::Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.to_hex())?;
        std::fs::rename(tmp, path)
    }

    /// Waits up to `timeout` for `path` (written by rank 0) and reads it.
    pub fn read_file(path: &std::path::Path, timeout: Duration) -> Result<Self, CommError> {
        let start = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(path) {
                return Self::from_hex(&text);
            }
            if start.elapsed() > timeout {
                return Err(CommError::Backend(format!(
                    "no NCCL id at {} after {timeout:?}: did rank 0 start and call NcclId::write_file?",
                    path.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn raw(&self) -> ncclsys::ncclUniqueId {
        ncclsys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// One rank of an NCCL communicator, bound to one CUDA device.
pub struct NcclComm {
    comm: ncclsys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    device: Device,
    timeout: Duration,
    aborted: AtomicBool,
    stats: StatsCounter,
}

// SAFETY: the NCCL communicator handle is used from one thread at a time (calls take &self
// but NCCL communicators are thread-safe for enqueueing on one stream per our design, and the
// handle itself is a plain pointer that may move between threads).
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size`, on CUDA device `device_index`.
    /// Blocks until every rank has joined.
    ///
    /// # Errors
    /// [`CommError::Unavailable`] without libcuda/libnccl or when `device_index` is not a GPU of
    /// this machine (fewer GPUs than ranks per node); [`CommError::Backend`] for NCCL failures.
    pub fn new(device_index: usize, rank: usize, world_size: usize, id: &NcclId) -> Result<Self, CommError> {
        if world_size == 0 || rank >= world_size {
            return Err(CommError::InvalidWorldSize(world_size));
        }
        let gpus = cuda_device_count()?;
        if device_index >= gpus {
            return Err(CommError::Unavailable(format!(
                "rank {rank} asked for CUDA device {device_index} but this machine has {gpus} GPU(s): \
                 run at most {gpus} ranks per node (one GPU each)"
            )));
        }
        // The primary context, the one CubeCL retains: device pointers of Burn tensors are valid here.
        let ctx = CudaContext::new(device_index).map_err(|e| CommError::Backend(format!("CUDA context: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CommError::Backend(format!("CUDA stream: {e:?}")))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by ncclCommInitRank before it is read.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), world_size as i32, id.raw(), rank as i32)
                .map_err(|e| CommError::Backend(format!("ncclCommInitRank (rank {rank} of {world_size}): {e:?}")))?;
            comm.assume_init()
        };
        Ok(Self {
            comm,
            stream,
            rank,
            world_size,
            device: Device::cuda(device_index),
            timeout: NCCL_DEFAULT_TIMEOUT,
            aborted: AtomicBool::new(false),
            stats: StatsCounter::default(),
        })
    }

    /// Sets how long one collective may take before the communicator is aborted.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The Burn device of this rank.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn check(&self) -> Result<(), CommError> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(CommError::Aborted(format!(
                "rank {}: the NCCL communicator was aborted",
                self.rank
            )));
        }
        Ok(())
    }

    /// Waits for this communicator's stream, aborting the communicator after the timeout.
    fn wait(&self, op: &str) -> Result<(), CommError> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| CommError::Backend(format!("{op}: {e:?}")))?;
        let start = Instant::now();
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(CommError::Backend(format!("{op}: {e:?}"))),
            }
            if start.elapsed() > self.timeout {
                self.abort(&format!("{op} timed out"));
                return Err(CommError::Timeout {
                    rank: self.rank,
                    peer: usize::MAX,
                    op: op.to_string(),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Runs one NCCL call on `inputs` (read) into a fresh output of `out_len` elements.
    fn run(
        &self,
        kind: CollectiveKind,
        input: Tensor<1>,
        out_len: usize,
        sent_elems: usize,
        call: impl FnOnce(*const c_void, *mut c_void, ncclsys::ncclDataType_t, ncclsys::cudaStream_t) -> Result<(), String>,
    ) -> Result<Tensor<1>, CommError> {
        self.check()?;
        let dtype = input.dtype();
        let nccl_dtype = match dtype {
            DType::F32 => ncclsys::ncclDataType_t::ncclFloat32,
            DType::F16 => ncclsys::ncclDataType_t::ncclFloat16,
            DType::BF16 => ncclsys::ncclDataType_t::ncclBfloat16,
            other => return Err(CommError::UnsupportedDtype(format!("{other:?}"))),
        };
        let output = Tensor::<1>::empty([out_len], (&self.device, dtype));
        let src = cube(input)?;
        let dst = cube(output)?;
        cubecl::future::block_on(src.client.sync()).map_err(|e| CommError::Backend(format!("{e:?}")))?;
        let (src_ptr, _src_guard) = device_ptr(&src)?;
        let (dst_ptr, _dst_guard) = device_ptr(&dst)?;
        call(
            src_ptr as *const c_void,
            dst_ptr as *mut c_void,
            nccl_dtype,
            self.stream.cu_stream() as _,
        )
        .map_err(CommError::Backend)?;
        self.wait(kind.name())?;
        self.stats.record(kind, (sent_elems * dtype.size()) as u64);
        Ok(Tensor::from_primitive::<CubeBackend>(dst))
    }
}

fn cube(t: Tensor<1>) -> Result<CubeTensor, CommError> {
    t.inner()
        .try_into_primitive::<CubeBackend>()
        .map_err(|_| CommError::Backend("NCCL collectives take tensors on a CUDA device (Device::cuda(i))".to_string()))
}

/// Raw device address (offset included) and the guard that pins the allocation.
fn device_ptr(t: &CubeTensor) -> Result<(u64, impl Sized + use<>), CommError> {
    let res = t
        .client
        .get_resource::<CudaServer>(t.handle.clone())
        .map_err(|e| CommError::Backend(format!("tensor is not a CUDA buffer: {e:?}")))?;
    Ok((res.resource().ptr, res))
}

fn nccl_op(op: ReduceOp) -> ncclsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclsys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclsys::ncclRedOp_t::ncclAvg,
    }
}

fn nccl_err(what: &str) -> impl Fn(nccl::NcclError) -> String + '_ {
    move |e| format!("{what} failed: {e:?}")
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let n = tensor.dims()[0];
        let sent = 2 * (self.world_size - 1) * n / self.world_size;
        self.run(
            CollectiveKind::AllReduce,
            tensor,
            n,
            sent,
            |src, dst, dt, stream| unsafe {
                nccl::all_reduce(src, dst, n, dt, nccl_op(op), self.comm, stream)
                    .map(drop)
                    .map_err(nccl_err("ncclAllReduce"))
            },
        )
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let n = tensor.dims()[0];
        if n % self.world_size != 0 {
            return Err(CommError::NotDivisible {
                op: "reduce_scatter",
                len: n,
                world_size: self.world_size,
            });
        }
        let chunk = n / self.world_size;
        let sent = (self.world_size - 1) * chunk;
        self.run(
            CollectiveKind::ReduceScatter,
            tensor,
            chunk,
            sent,
            |src, dst, dt, stream| unsafe {
                nccl::reduce_scatter(src, dst, chunk, dt, nccl_op(op), self.comm, stream)
                    .map(drop)
                    .map_err(nccl_err("ncclReduceScatter"))
            },
        )
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        let chunk = tensor.dims()[0];
        let sent = (self.world_size - 1) * chunk;
        self.run(
            CollectiveKind::AllGather,
            tensor,
            chunk * self.world_size,
            sent,
            |src, dst, dt, stream| unsafe {
                nccl::all_gather(src, dst, chunk, dt, self.comm, stream)
                    .map(drop)
                    .map_err(nccl_err("ncclAllGather"))
            },
        )
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        if root >= self.world_size {
            return Err(CommError::InvalidRoot {
                root,
                world_size: self.world_size,
            });
        }
        let n = tensor.dims()[0];
        let sent = if self.rank == root { n } else { 0 };
        self.run(
            CollectiveKind::Broadcast,
            tensor,
            n,
            sent,
            |src, dst, dt, stream| unsafe {
                nccl::broadcast(src, dst, n, dt, root as i32, self.comm, stream)
                    .map(drop)
                    .map_err(nccl_err("ncclBroadcast"))
            },
        )
    }

    fn barrier(&self) -> Result<(), CommError> {
        let one = Tensor::<1>::zeros([1], &self.device);
        self.all_reduce(one, ReduceOp::Sum).map(drop)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn abort(&self, reason: &str) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            tracing::error!(rank = self.rank, "aborting the NCCL communicator: {reason}");
            // SAFETY: the communicator is valid until Drop; abort makes pending calls return.
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::SeqCst) {
            // SAFETY: the communicator was created by ncclCommInitRank and not aborted.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}
