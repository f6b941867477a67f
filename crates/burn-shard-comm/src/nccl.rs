//! The NCCL backend (feature `cuda`): one rank per GPU, one process (or thread) per rank, any
//! number of nodes. Collectives run in place on Burn's CUDA tensors through cudarc's NCCL
//! bindings, which load `libnccl` and `libcuda` at run time (nothing is needed to build).
//!
//! Ordering: CubeCL does not expose its CUDA stream, so each collective first waits for the
//! device's queued work (`client.sync()`), then runs NCCL on this communicator's own stream in
//! the same primary context and waits for it, with a timeout: a peer that never joins makes
//! the call abort the communicator (`ncclCommAbort`) and return [`CommError::NcclTimeout`].

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
use crate::{Collective, CommError, CommStats, RENDEZVOUS_DEFAULT_TIMEOUT, ReduceOp, Rendezvous, RendezvousEnv};

/// The CUDA server type of CubeCL (not nameable otherwise).
type CudaServer = <CudaRuntime as Runtime>::Server;

/// The rendezvous key under which rank 0 publishes the NCCL id (256 hex digits).
const NCCL_ID_KEY: &str = "burn-shard/nccl-id";
/// Prefix of the value rank 0 publishes instead when it cannot create the id.
const NCCL_ID_FAILED: &str = "error: ";

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

    /// Joins the job this process was started in by `burn-shard-run` (or `torchrun`): reads
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`,
    /// exchanges the NCCL id through the [`Rendezvous`] (rank 0 creates it) and builds the
    /// communicator on CUDA device `LOCAL_RANK`. Every process of the job must call it once.
    /// Waits up to [`RENDEZVOUS_DEFAULT_TIMEOUT`] (60 s) for the other ranks.
    ///
    /// # Errors
    /// [`CommError::Env`] for missing or malformed variables; otherwise as
    /// [`NcclComm::from_rendezvous_env`].
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_rendezvous_env(&RendezvousEnv::from_env()?, RENDEZVOUS_DEFAULT_TIMEOUT)
    }

    /// [`NcclComm::from_env`] with the job's place given by `env` and every rendezvous wait
    /// (connecting, the NCCL id, all ranks present) bounded by `timeout`.
    ///
    /// All ranks meet in a barrier before joining the communicator, so a rank that never started
    /// is reported within `timeout` by every other rank. `ncclCommInitRank` itself has no
    /// timeout: a rank that passes the barrier and then fails (e.g. its GPU is missing) leaves the
    /// others waiting there until the launcher stops them (`burn-shard-run` does, at once).
    ///
    /// # Errors
    /// [`CommError::Rendezvous`] when the store cannot be hosted or reached, the id does not
    /// arrive, or not every rank arrives within `timeout`; on ranks other than 0, also when rank 0
    /// could not create the id (carrying its reason); else as [`NcclComm::new`].
    pub fn from_rendezvous_env(env: &RendezvousEnv, timeout: Duration) -> Result<Self, CommError> {
        let rendezvous = Rendezvous::new(env.clone(), timeout)?;
        let store = rendezvous.store();
        let id = if env.rank == 0 {
            match NcclId::new() {
                Ok(id) => {
                    store.set(NCCL_ID_KEY, id.to_hex().as_bytes())?;
                    id
                }
                Err(e) => {
                    // Tell the other ranks why, instead of letting them time out.
                    let _ = store.set(NCCL_ID_KEY, format!("{NCCL_ID_FAILED}{e}").as_bytes());
                    return Err(e);
                }
            }
        } else {
            let value = store.get(NCCL_ID_KEY, timeout)?;
            let text = String::from_utf8_lossy(&value);
            if let Some(reason) = text.strip_prefix(NCCL_ID_FAILED) {
                return Err(CommError::Rendezvous(format!(
                    "rank 0 could not create the NCCL id: {reason}"
                )));
            }
            NcclId::from_hex(&text)?
        };
        rendezvous.barrier(timeout)?;
        // Past the barrier every rank has the id: leave the store (rank 0 closes it once the
        // others have left) before the communicator, which may live for the whole job, exists.
        drop(rendezvous);
        Self::new(env.local_rank, env.rank, env.world_size, &id)
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
                return Err(CommError::NcclTimeout {
                    rank: self.rank,
                    op: op.to_string(),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Runs one NCCL call on `input` (read) into a fresh output of `out_len` elements.
    fn run(
        &self,
        kind: CollectiveKind,
        input: Tensor<1>,
        out_len: usize,
        sent_elems: usize,
        call: impl FnOnce(*const c_void, *mut c_void, ncclsys::ncclDataType_t, ncclsys::cudaStream_t) -> Result<(), String>,
    ) -> Result<Tensor<1>, CommError> {
        let item = Item {
            input,
            out_len,
            sent_elems,
        };
        let mut call = Some(call);
        let mut outputs = self.run_group(kind, vec![item], |_, src, dst, dt, stream| match call.take() {
            Some(call) => call(src, dst, dt, stream),
            None => Err("internal error: a single collective was issued twice".into()),
        })?;
        outputs
            .pop()
            .ok_or_else(|| CommError::Backend("internal error: a single collective returned no output".into()))
    }

    /// Runs `call(i, ..)` for every item, each into a fresh output of its `out_len` elements.
    /// More than one item run as one NCCL group (`ncclGroupStart`/`ncclGroupEnd`): one launch,
    /// one wait with the timeout, and on error inside the group the communicator is aborted (the
    /// peers may already be waiting for the part that was issued).
    fn run_group(
        &self,
        kind: CollectiveKind,
        items: Vec<Item>,
        mut call: impl FnMut(
            usize,
            *const c_void,
            *mut c_void,
            ncclsys::ncclDataType_t,
            ncclsys::cudaStream_t,
        ) -> Result<(), String>,
    ) -> Result<Vec<Tensor<1>>, CommError> {
        self.check()?;
        // Check and allocate every buffer before issuing anything, so a bad dtype or device fails
        // the whole call with nothing sent.
        let mut buffers = Vec::with_capacity(items.len());
        for item in items {
            let dtype = item.input.dtype();
            let nccl_dtype = match dtype {
                DType::F32 => ncclsys::ncclDataType_t::ncclFloat32,
                DType::F16 => ncclsys::ncclDataType_t::ncclFloat16,
                DType::BF16 => ncclsys::ncclDataType_t::ncclBfloat16,
                other => return Err(CommError::UnsupportedDtype(format!("{other:?}"))),
            };
            let output = Tensor::<1>::empty([item.out_len], (&self.device, dtype));
            let src = cube(item.input)?;
            let dst = cube(output)?;
            buffers.push((src, dst, nccl_dtype, (item.sent_elems * dtype.size()) as u64));
        }
        let mut pointers = Vec::with_capacity(buffers.len());
        let mut guards = Vec::with_capacity(2 * buffers.len());
        // One wait for the device's queued work covers every buffer (one device, one client).
        if let Some((src, _, _, _)) = buffers.first() {
            cubecl::future::block_on(src.client.sync()).map_err(|e| CommError::Backend(format!("{e:?}")))?;
        }
        for (src, dst, _, _) in &buffers {
            let (src_ptr, src_guard) = device_ptr(src)?;
            let (dst_ptr, dst_guard) = device_ptr(dst)?;
            pointers.push((src_ptr, dst_ptr));
            guards.push(src_guard);
            guards.push(dst_guard);
        }
        let stream = self.stream.cu_stream() as ncclsys::cudaStream_t;
        let grouped = buffers.len() > 1;
        let mut failure = None;
        if grouped {
            nccl::group_start().map_err(|e| CommError::Backend(format!("ncclGroupStart failed: {e:?}")))?;
        }
        for (i, ((src_ptr, dst_ptr), (_, _, nccl_dtype, _))) in pointers.iter().zip(&buffers).enumerate() {
            if let Err(e) = call(
                i,
                *src_ptr as *const c_void,
                *dst_ptr as *mut c_void,
                *nccl_dtype,
                stream,
            ) {
                failure = Some(e);
                break;
            }
        }
        if grouped {
            // Always close the group: an open group would swallow this thread's next NCCL calls.
            let end = nccl::group_end().map_err(|e| format!("ncclGroupEnd failed: {e:?}"));
            if let (None, Err(e)) = (&failure, end) {
                failure = Some(e);
            }
        }
        if let Some(e) = failure {
            if grouped {
                self.abort(&e);
            }
            return Err(CommError::Backend(e));
        }
        self.wait(kind.name())?;
        drop(guards);
        Ok(buffers
            .into_iter()
            .map(|(_, dst, _, sent_bytes)| {
                self.stats.record(kind, sent_bytes);
                Tensor::from_primitive::<CubeBackend>(dst)
            })
            .collect())
    }
}

/// One tensor of a collective: its input, its output length and the elements this rank sends.
struct Item {
    input: Tensor<1>,
    out_len: usize,
    sent_elems: usize,
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
        if !n.is_multiple_of(self.world_size) {
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

    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        let chunks: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
        let items = tensors
            .into_iter()
            .zip(&chunks)
            .map(|(input, &chunk)| Item {
                input,
                out_len: chunk * self.world_size,
                sent_elems: (self.world_size - 1) * chunk,
            })
            .collect();
        self.run_group(CollectiveKind::AllGather, items, |i, src, dst, dt, stream| unsafe {
            nccl::all_gather(src, dst, chunks[i], dt, self.comm, stream)
                .map(drop)
                .map_err(nccl_err("ncclAllGather"))
        })
    }

    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        if tensors.is_empty() {
            return Ok(Vec::new());
        }
        let mut chunks = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let n = t.dims()[0];
            if !n.is_multiple_of(self.world_size) {
                return Err(CommError::NotDivisible {
                    op: "reduce_scatter",
                    len: n,
                    world_size: self.world_size,
                });
            }
            chunks.push(n / self.world_size);
        }
        let items = tensors
            .into_iter()
            .zip(&chunks)
            .map(|(input, &chunk)| Item {
                input,
                out_len: chunk,
                sent_elems: (self.world_size - 1) * chunk,
            })
            .collect();
        self.run_group(CollectiveKind::ReduceScatter, items, |i, src, dst, dt, stream| unsafe {
            nccl::reduce_scatter(src, dst, chunks[i], dt, nccl_op(op), self.comm, stream)
                .map(drop)
                .map_err(nccl_err("ncclReduceScatter"))
        })
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
