//! The NCCL backend (feature `cuda`): one rank per GPU, one process (or thread) per rank, any
//! number of nodes. Collectives run on Burn's CUDA tensors through cudarc's NCCL bindings, which
//! load `libnccl` and `libcuda` at run time (nothing is needed to build).
//!
//! Ordering: CubeCL does not expose its CUDA stream, so each collective first pins its buffers
//! and waits for the device's queued work (`client.sync()`), then runs NCCL on this
//! communicator's own stream in the same primary context and waits for it, with a timeout: a
//! peer that never joins makes the call abort the communicator (`ncclCommAbort`) and return
//! [`CommError::NcclTimeout`].
//!
//! Thread safety: NCCL forbids issuing operations on one communicator from several threads at
//! once, and a group (`ncclGroupStart`/`ncclGroupEnd`) must be issued by one thread ("Thread
//! Safety" in NCCL's user guide). [`NcclComm`] keeps the raw communicator and its stream behind
//! one `Mutex`, held for a whole collective (enqueue, group, wait), for `ncclCommAbort` and for
//! `ncclCommDestroy`, so the sharding core may share it (`Arc<dyn Collective>`) and call it from
//! any thread; calls from several threads run one after the other, in lock order, which must
//! still be the same order on every rank.
//!
//! Initialisation: with NCCL ≥ 2.14 the communicator is created non-blocking
//! (`ncclCommInitRankConfig` with `blocking = 0`), so joining it is bounded by a timeout and
//! `ncclCommAbort` can stop it at any point (NCCL's user guide, "Fault Tolerance"). Every later
//! NCCL call may then return `ncclInProgress`; each collective polls `ncclCommGetAsyncError`
//! until NCCL has issued its kernels, before touching the stream, and keeps polling it while
//! waiting for the stream (network errors surface there only). Older NCCL falls back to the
//! blocking `ncclCommInitRank`, which has no timeout.

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::result::{NcclError, NcclStatus};
use cudarc::nccl::sys::ncclResult_t;
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

/// How often a collective polls its stream and `ncclCommGetAsyncError` while it waits.
const POLL: Duration = Duration::from_micros(50);
/// How often the initialisation polls `ncclCommGetAsyncError`.
const INIT_POLL: Duration = Duration::from_millis(1);
/// After an abort, how long a failed collective waits for its stream to drain before it leaks
/// its buffers rather than hand memory NCCL may still touch back to CubeCL.
const ABORT_DRAIN_GRACE: Duration = Duration::from_secs(10);

/// `NCCL_VERSION(X,Y,Z)` of nccl.h: the encoding of `ncclGetVersion` and of `ncclConfig_t::version`.
const fn nccl_version(major: c_uint, minor: c_uint, patch: c_uint) -> c_uint {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

/// The first NCCL with `ncclConfig_t`, `ncclCommInitRankConfig` and non-blocking communicators.
const NCCL_2_14: c_uint = nccl_version(2, 14, 0);
/// `NCCL_API_MAGIC` of nccl.h: the `magic` NCCL_CONFIG_INITIALIZER writes and NCCL checks.
const NCCL_CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT` of nccl.h (`INT_MIN`): "let NCCL choose".
const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `ncclConfig_t` as NCCL 2.14's nccl.h declares it (`struct ncclConfig_v21400 { size_t size;
/// unsigned int magic; unsigned int version; int blocking; }`), filled like its
/// `NCCL_CONFIG_INITIALIZER` (`sizeof`, `0xcafebeef`, the header's version, `NCCL_CONFIG_UNDEF_INT`
/// for every attribute) except `blocking = 0`.
///
/// Built by hand rather than from cudarc's `ncclConfig_t`, whose layout follows whichever
/// `nccl-0xxxx` feature is on. NCCL accepts any older layout: `ncclCommInitRankConfig` copies
/// `min(config.size, sizeof(its ncclConfig_t))` bytes and resets every attribute newer than
/// `config.version` to its default (`parseCommConfig` in NCCL's src/init.cc), which is how a
/// program built against 2.14's header runs on a newer libnccl.
#[repr(C)]
struct NcclConfigV21400 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    /// The C struct's 4 bytes of tail padding, written so that NCCL copies no uninitialised
    /// byte. NCCL ≥ 2.17 reads them as `cgaClusterSize`, then resets that to its default since
    /// `version` < 2.17; `NCCL_CONFIG_UNDEF_INT` is that field's initializer value anyway.
    padding: c_int,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(
    size_of::<NcclConfigV21400>() == 24,
    "sizeof(struct ncclConfig_v21400) on LP64"
);

impl NcclConfigV21400 {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.14 with `blocking = 0`.
    fn non_blocking() -> Self {
        Self {
            size: size_of::<Self>(),
            magic: NCCL_CONFIG_MAGIC,
            version: NCCL_2_14,
            blocking: 0,
            padding: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

/// Whether `libcuda` and `libnccl` can be loaded on this machine (never panics).
pub fn nccl_available() -> bool {
    // SAFETY: both only try to dlopen the library (running its initialisers, as cudarc's own
    // first use does) and close it again; no symbol is called.
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

/// Whether the loaded libnccl exports `name`. cudarc resolves a symbol on its first call and
/// panics ("Missing symbol") when it is absent; this asks first. Call only once
/// [`nccl_available`] is true (cudarc's loader panics without a libnccl).
fn nccl_has_symbol(name: &CStr) -> bool {
    // SAFETY: `culib` returns the libnccl cudarc loads for every NCCL call (present: the callers
    // checked `nccl_available`). `get` only looks the name up (dlsym); the symbol is never
    // called or read, so the pointer type it is given does not matter.
    unsafe { ncclsys::culib().get::<*const c_void>(name).is_ok() }
}

/// `ncclGetVersion`'s code as `major.minor.patch`.
fn version_string(code: c_uint) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
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
        let id = nccl::get_uniqueid().map_err(|e| CommError::Backend(format!("ncclGetUniqueId: {:?}", e.0)))?;
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

/// The raw NCCL communicator and the stream its collectives run on. Only reachable through
/// the lock `NcclComm::raw` (or `&mut NcclComm` in `Drop`), so one thread at a time uses it.
struct Raw {
    /// A communicator created by `ncclCommInitRank(Config)`; null once aborted or destroyed, so a
    /// freed handle is never passed to NCCL again.
    comm: ncclsys::ncclComm_t,
    stream: Arc<CudaStream>,
}

// SAFETY: `ncclComm_t` is a plain pointer that NCCL lets any thread use, provided "only one
// thread operates the communicator at a time" and one thread issues all the operations of a
// group (NCCL user guide, "Thread Safety"). A `Raw` is only reached through `NcclComm::raw`, a
// `Mutex` held for every NCCL call on it, from the group's start to its end (and for the wait
// that follows), or through `&mut NcclComm` in `Drop`: moving it to another thread never lets
// two threads call NCCL on it at once. `Arc<CudaStream>` is already `Send + Sync` (cudarc binds
// the stream's context to the calling thread itself). `Raw` is not `Sync`: sharing goes through
// the `Mutex`, which makes `NcclComm` `Send + Sync` with no further `unsafe impl`.
unsafe impl Send for Raw {}

/// One rank of an NCCL communicator, bound to one CUDA device.
///
/// `Send + Sync`: share it between threads (`Arc<dyn Collective>`); every call locks the
/// communicator for its whole duration (enqueue and wait), so concurrent calls are serialised,
/// as NCCL requires. [`Collective::abort`] from another thread stops a collective in progress
/// within a poll interval (non-blocking communicators, NCCL ≥ 2.14). Two `NcclComm`s on the same
/// GPU must not run collectives concurrently from different threads (NCCL's thread-safety rules
/// cover communicators of one device too): share one handle instead.
pub struct NcclComm {
    /// The communicator and its stream: every NCCL call and every use of the stream holds it.
    raw: Mutex<Raw>,
    /// Set (before the lock is taken) by [`Collective::abort`] and by every internal abort; the
    /// thread holding `raw` checks it between polls and aborts the communicator itself.
    abort_requested: AtomicBool,
    /// Why the communicator was aborted (the first reason given).
    abort_reason: OnceLock<String>,
    /// Created with `blocking = 0` (NCCL ≥ 2.14); informational (NCCL_COMM_BLOCKING=1 in the
    /// environment makes NCCL create it blocking anyway, which the code handles the same way).
    nonblocking: bool,
    rank: usize,
    world_size: usize,
    device_index: usize,
    device: Device,
    timeout: Duration,
    stats: StatsCounter,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<NcclComm>();
};

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device_index", &self.device_index)
            .field("nonblocking", &self.nonblocking)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl NcclComm {
    /// Joins the communicator `id` as `rank` of `world_size`, on CUDA device `device_index`.
    /// Waits until every rank has joined, at most [`RENDEZVOUS_DEFAULT_TIMEOUT`] (60 s; as
    /// [`NcclComm::new_with_init_timeout`]). Collectives then time out after
    /// [`NCCL_DEFAULT_TIMEOUT`] (see [`NcclComm::with_timeout`]).
    ///
    /// # Errors
    /// As [`NcclComm::new_with_init_timeout`].
    pub fn new(device_index: usize, rank: usize, world_size: usize, id: &NcclId) -> Result<Self, CommError> {
        Self::new_with_init_timeout(device_index, rank, world_size, id, RENDEZVOUS_DEFAULT_TIMEOUT)
    }

    /// [`NcclComm::new`], waiting at most `init_timeout` for every rank to join.
    ///
    /// With NCCL ≥ 2.14 the communicator is created non-blocking (`ncclCommInitRankConfig`,
    /// `blocking = 0`) and its state polled; when `init_timeout` passes first, it is aborted
    /// (`ncclCommAbort`) and the call fails. With older NCCL, `ncclCommInitRank` blocks until all
    /// ranks have joined, without a timeout (a warning is logged); so does the initialisation when
    /// `NCCL_COMM_BLOCKING=1` is set, which overrides `blocking = 0`.
    ///
    /// # Errors
    /// - [`CommError::InvalidWorldSize`] when `world_size` is 0, `rank >= world_size`, or
    ///   `world_size` does not fit NCCL's `int`.
    /// - [`CommError::Unavailable`] without libcuda/libnccl, when `device_index` is not a GPU of
    ///   this machine (fewer GPUs than ranks per node), or with an NCCL older than 2.4.
    /// - [`CommError::NcclTimeout`] when not every rank joined within `init_timeout` (a rank did
    ///   not start, used another id, or cannot reach the others over the network); the partly
    ///   built communicator was aborted.
    /// - [`CommError::Backend`] for other CUDA and NCCL failures.
    pub fn new_with_init_timeout(
        device_index: usize,
        rank: usize,
        world_size: usize,
        id: &NcclId,
        init_timeout: Duration,
    ) -> Result<Self, CommError> {
        if world_size == 0 || rank >= world_size || c_int::try_from(world_size).is_err() {
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
        // NCCL creates the communicator on the calling thread's current device (`cudaGetDevice`).
        ctx.bind_to_thread()
            .map_err(|e| CommError::Backend(format!("CUDA context: {e:?}")))?;
        let (comm, nonblocking) = init_comm(id, rank, world_size, device_index, init_timeout)?;
        Ok(Self {
            raw: Mutex::new(Raw { comm, stream }),
            abort_requested: AtomicBool::new(false),
            abort_reason: OnceLock::new(),
            nonblocking,
            rank,
            world_size,
            device_index,
            device: Device::cuda(device_index),
            timeout: NCCL_DEFAULT_TIMEOUT,
            stats: StatsCounter::default(),
        })
    }

    /// Joins the job this process was started in by `burn-shard-run` (or `torchrun`): reads
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`,
    /// exchanges the NCCL id through the [`Rendezvous`] (rank 0 creates it) and builds the
    /// communicator on CUDA device `LOCAL_RANK`. Every process of the job must call it once.
    /// Waits up to [`RENDEZVOUS_DEFAULT_TIMEOUT`] (60 s) for the other ranks, in the rendezvous
    /// and again in NCCL's initialisation.
    ///
    /// # Errors
    /// [`CommError::Env`] for missing or malformed variables; otherwise as
    /// [`NcclComm::from_rendezvous_env`].
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_rendezvous_env(&RendezvousEnv::from_env()?, RENDEZVOUS_DEFAULT_TIMEOUT)
    }

    /// [`NcclComm::from_env`] with the job's place given by `env` and every wait (connecting,
    /// the NCCL id, all ranks present, NCCL's own initialisation) bounded by `timeout`.
    ///
    /// All ranks meet in a barrier before joining the communicator, so a rank that never started
    /// is reported within `timeout` by every other rank. A rank that passes the barrier and then
    /// fails (e.g. its GPU is missing) makes the others fail with [`CommError::NcclTimeout`]
    /// within `timeout` too (NCCL ≥ 2.14; older NCCL waits until the launcher stops them, which
    /// `burn-shard-run` does at once on its node).
    ///
    /// # Errors
    /// [`CommError::Rendezvous`] when the store cannot be hosted or reached, the id does not
    /// arrive, or not every rank arrives within `timeout`; on ranks other than 0, also when rank 0
    /// could not create the id (carrying its reason); else as
    /// [`NcclComm::new_with_init_timeout`].
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
        Self::new_with_init_timeout(env.local_rank, env.rank, env.world_size, &id, timeout)
    }

    /// Sets how long one collective may take before the communicator is aborted (default
    /// [`NCCL_DEFAULT_TIMEOUT`], 5 minutes). It counts from the moment the call holds the
    /// communicator (not while it waits for another thread's call) to the end of its GPU work.
    /// The initialisation timeout is set at construction
    /// ([`NcclComm::new_with_init_timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The Burn device of this rank.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn abort_reason(&self) -> &str {
        self.abort_reason.get().map_or("no reason given", String::as_str)
    }

    fn aborted_error(&self) -> CommError {
        CommError::Aborted(format!(
            "rank {}: the NCCL communicator was aborted: {}",
            self.rank,
            self.abort_reason()
        ))
    }

    /// Fails fast, without the lock, once an abort was requested or done.
    fn check(&self) -> Result<(), CommError> {
        if self.abort_requested.load(Ordering::SeqCst) {
            return Err(self.aborted_error());
        }
        Ok(())
    }

    /// Locks the communicator for one collective. A lock poisoned by a thread that panicked in
    /// the middle of a collective (leaving it half issued) aborts the communicator, as does a
    /// pending abort request; both then return [`CommError::Aborted`].
    fn acquire(&self) -> Result<MutexGuard<'_, Raw>, CommError> {
        let mut raw = match self.raw.lock() {
            Ok(raw) => raw,
            Err(poisoned) => {
                let mut raw = poisoned.into_inner();
                self.abort_locked(&mut raw, "a thread panicked while it was using this NCCL communicator");
                raw
            }
        };
        if !raw.comm.is_null() && self.abort_requested.load(Ordering::SeqCst) {
            self.abort_locked(&mut raw, "abort requested");
        }
        if raw.comm.is_null() {
            return Err(self.aborted_error());
        }
        Ok(raw)
    }

    /// Aborts the communicator unless it already is, and records `reason` if it is the first
    /// one. The caller holds the lock: `raw` is its guard's content.
    fn abort_locked(&self, raw: &mut Raw, reason: &str) {
        let _ = self.abort_reason.set(reason.to_string());
        self.abort_requested.store(true, Ordering::SeqCst);
        if raw.comm.is_null() {
            return;
        }
        tracing::error!(
            rank = self.rank,
            "aborting the NCCL communicator: {}",
            self.abort_reason()
        );
        // SAFETY: `raw.comm` is non-null, so it is the communicator `ncclCommInitRank(Config)`
        // returned and neither `ncclCommAbort` nor `ncclCommDestroy` has run on it (both null
        // it). The caller holds the lock, so no other thread is inside an NCCL call on this
        // communicator, which `ncclCommAbort` requires ("Fault Tolerance"); this thread is not
        // inside one either (collectives call this only after their NCCL calls returned).
        // `ncclCommAbort` may run during initialisation, communication or with work in flight:
        // it stops that work and frees the communicator.
        if let Err(e) = unsafe { nccl::comm_abort(raw.comm) } {
            tracing::warn!(rank = self.rank, "ncclCommAbort returned {:?}", e.0);
        }
        raw.comm = ptr::null_mut();
    }

    /// `ncclCommGetAsyncError`: `Ok(true)` while NCCL is still issuing (non-blocking
    /// communicators), `Ok(false)` when all is issued and no error happened; an error for an
    /// asynchronous NCCL error or a pending abort request (the caller then aborts).
    fn in_progress(&self, raw: &Raw, op: &str) -> Result<bool, CommError> {
        if self.abort_requested.load(Ordering::SeqCst) {
            return Err(self.aborted_error());
        }
        match async_state(raw.comm) {
            CommState::Ready => Ok(false),
            CommState::InProgress => Ok(true),
            CommState::Failed(what) => Err(CommError::Backend(format!(
                "rank {}: NCCL reported {what} during {op}, so the communicator was aborted; a peer may have died \
                 or the network failed (set NCCL_DEBUG=WARN for NCCL's reason)",
                self.rank
            ))),
        }
    }

    fn check_deadline(&self, op: &str, start: Instant) -> Result<(), CommError> {
        let waited = start.elapsed();
        if waited > self.timeout {
            return Err(CommError::NcclTimeout {
                rank: self.rank,
                op: op.to_string(),
                waited,
            });
        }
        Ok(())
    }

    /// Issues one NCCL call per launch, as one group when there are several. Every error is
    /// returned (the caller aborts the communicator: a group's dynamic errors concern all its
    /// operations, and the peers may already wait for the part that was issued).
    fn issue(
        &self,
        op: &str,
        launches: &[Launch],
        call: &mut impl FnMut(&Launch) -> Result<NcclStatus, NcclError>,
    ) -> Result<(), CommError> {
        let failed = |what: &str, e: NcclError| {
            CommError::Backend(format!(
                "rank {}: {what} for {op} returned {:?} (set NCCL_DEBUG=WARN for NCCL's reason)",
                self.rank, e.0
            ))
        };
        let grouped = launches.len() > 1;
        if grouped {
            nccl::group_start().map_err(|e| failed("ncclGroupStart", e))?;
        }
        let mut failure = None;
        for launch in launches {
            // `Ok(InProgress)` (non-blocking communicators) is settled by `wait_ready`; inside a
            // group NCCL reports through ncclGroupEnd.
            if let Err(e) = call(launch) {
                failure = Some(failed("the NCCL call", e));
                break;
            }
        }
        if grouped {
            // Always close the group: group state is per thread, and an open group would swallow
            // this thread's next NCCL calls.
            let end = nccl::group_end();
            if let (None, Err(e)) = (&failure, end) {
                failure = Some(failed("ncclGroupEnd", e));
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Waits until NCCL has issued everything to the stream: a non-blocking communicator may
    /// return `ncclInProgress` from any call and then "users must query the communicator state
    /// until it becomes ncclSuccess before calling another NCCL function", and before CUDA calls
    /// on the stream (NCCL user guide, "Nonblocking Group Operation"). Blocking communicators
    /// return at once.
    fn wait_ready(&self, raw: &Raw, op: &str, start: Instant) -> Result<(), CommError> {
        while self.in_progress(raw, op)? {
            self.check_deadline(op, start)?;
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// Waits for the stream, polling `ncclCommGetAsyncError` too: an operation hit by a network
    /// error never completes and reports only there (NCCL user guide, "Asynchronous errors").
    fn wait_stream(&self, raw: &Raw, op: &str, start: Instant) -> Result<(), CommError> {
        let event = raw
            .stream
            .record_event(None)
            .map_err(|e| CommError::Backend(format!("rank {}: {op}: cannot record a CUDA event: {e:?}", self.rank)))?;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(CommError::Backend(format!(
                        "rank {}: {op} failed on the GPU: {e:?}",
                        self.rank
                    )));
                }
            }
            self.in_progress(raw, op)?;
            self.check_deadline(op, start)?;
            std::thread::sleep(POLL);
        }
    }

    /// Runs one NCCL call on `input` (read) into a fresh output of `out_len` elements.
    fn run(
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
    fn run_group(
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
                Tensor::from_primitive::<CubeBackend>(buffer.dst)
            })
            .collect()
    }
}

/// Creates the communicator: non-blocking with a timeout when the NCCL loaded supports it,
/// blocking otherwise. Returns it and whether it was created non-blocking.
fn init_comm(
    id: &NcclId,
    rank: usize,
    world_size: usize,
    device_index: usize,
    timeout: Duration,
) -> Result<(ncclsys::ncclComm_t, bool), CommError> {
    let (nranks, my_rank) = match (c_int::try_from(world_size), c_int::try_from(rank)) {
        (Ok(nranks), Ok(my_rank)) => (nranks, my_rank),
        _ => return Err(CommError::InvalidWorldSize(world_size)),
    };
    let who = format!("rank {rank} of {world_size} on CUDA device {device_index}");
    // ncclCommAbort and ncclCommGetAsyncError (every collective uses them) exist since NCCL 2.4,
    // ncclGetVersion since 2.3: probe before calling, cudarc's loader panics on a missing symbol.
    if !nccl_has_symbol(c"ncclCommAbort") || !nccl_has_symbol(c"ncclCommGetAsyncError") {
        return Err(CommError::Unavailable(
            "the loaded libnccl lacks ncclCommAbort/ncclCommGetAsyncError (NCCL < 2.4): install NCCL 2.14 or newer"
                .into(),
        ));
    }
    let version =
        nccl::get_nccl_version().map_err(|e| CommError::Backend(format!("ncclGetVersion returned {:?}", e.0)))?;
    let version = c_uint::try_from(version).unwrap_or(0);
    let mut comm: ncclsys::ncclComm_t = ptr::null_mut();
    if version < NCCL_2_14 || !nccl_has_symbol(c"ncclCommInitRankConfig") {
        tracing::warn!(
            "NCCL {} predates non-blocking communicators (2.14): joining the communicator as {who} blocks \
             until every rank has joined, without a timeout",
            version_string(version)
        );
        // SAFETY: `comm` is a valid out-pointer for the call; the id is passed by value; the
        // caller made device `device_index`'s primary context current, the device NCCL takes.
        let result = unsafe { ncclsys::ncclCommInitRank(&mut comm, nranks, id.raw(), my_rank) };
        if result != ncclResult_t::ncclSuccess || comm.is_null() {
            return Err(CommError::Backend(format!(
                "ncclCommInitRank ({who}) returned {result:?} (set NCCL_DEBUG=WARN for NCCL's reason)"
            )));
        }
        return Ok((comm, false));
    }
    // NCCL copies the config during the call (`parseCommConfig`, before the initialisation
    // continues in the background); it lives until this function returns in any case.
    let mut config = NcclConfigV21400::non_blocking();
    // SAFETY: `comm` is a valid out-pointer; `config` is a live, fully initialised
    // `ncclConfig_v21400` (see `NcclConfigV21400`), passed as the `ncclConfig_t*` NCCL ≥ 2.14
    // accepts for it (the version check above; the symbol exists, so cudarc's loader does not
    // panic); the caller made the device current.
    let result = unsafe {
        ncclsys::ncclCommInitRankConfig(
            &mut comm,
            nranks,
            id.raw(),
            my_rank,
            (&raw mut config).cast::<ncclsys::ncclConfig_t>(),
        )
    };
    let abort = |comm: ncclsys::ncclComm_t| {
        if !comm.is_null() {
            // SAFETY: a non-null `comm` is the communicator this call created (NCCL nulls it
            // when creation fails outright), not yet aborted or destroyed, and used by this
            // thread only: no `NcclComm` holds it yet.
            let _ = unsafe { nccl::comm_abort(comm) };
        }
    };
    if !matches!(result, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) || comm.is_null() {
        abort(comm);
        return Err(CommError::Backend(format!(
            "ncclCommInitRankConfig ({who}) returned {result:?} (set NCCL_DEBUG=WARN for NCCL's reason)"
        )));
    }
    // Non-blocking: the communicator is ready when its state leaves ncclInProgress (NCCL user
    // guide, "Creating a communication with options" and "Fault Tolerance").
    let start = Instant::now();
    loop {
        match async_state(comm) {
            CommState::Ready => break,
            CommState::InProgress => {}
            CommState::Failed(what) => {
                abort(comm);
                return Err(CommError::Backend(format!(
                    "joining the NCCL communicator as {who} failed with {what}: check that every rank uses the same \
                     NCCL id and reaches the others over the network (set NCCL_DEBUG=WARN for NCCL's reason)"
                )));
            }
        }
        let waited = start.elapsed();
        if waited > timeout {
            abort(comm);
            return Err(CommError::NcclTimeout {
                rank,
                op: format!(
                    "initialisation (joining the communicator as {who}: check that all {world_size} ranks started \
                     and joined with the same NCCL id, and that every node reaches the others over the network, \
                     e.g. NCCL_SOCKET_IFNAME; the init timeout is the one given to NcclComm::new_with_init_timeout \
                     or NcclComm::from_rendezvous_env)"
                ),
                waited,
            });
        }
        std::thread::sleep(INIT_POLL);
    }
    Ok((comm, true))
}

/// What `ncclCommGetAsyncError` reports.
enum CommState {
    /// `ncclSuccess`: everything issued so far is on the stream, no error.
    Ready,
    /// `ncclInProgress`: a non-blocking communicator is still initialising or issuing.
    InProgress,
    /// An asynchronous error, or the query's own error, named.
    Failed(String),
}

/// The communicator's state, from `ncclCommGetAsyncError`.
fn async_state(comm: ncclsys::ncclComm_t) -> CommState {
    debug_assert!(!comm.is_null(), "ncclCommGetAsyncError on an aborted communicator");
    // NCCL writes a C `ncclResult_t` (an `int`). It is read as an integer, not as cudarc's
    // `#[repr(u32)]` enum, for which a code that binding does not list would be an invalid value.
    let mut state: u32 = ncclResult_t::ncclSuccess as u32;
    // SAFETY: every caller passes a live communicator (non-null: neither aborted nor destroyed)
    // that only it uses now (it holds the lock, or no `NcclComm` owns the communicator yet);
    // `state` is a valid, aligned out-pointer of the enum's size (4 bytes). NCCL allows this call
    // during initialisation and with work in flight: it is how both are polled.
    let result = unsafe { ncclsys::ncclCommGetAsyncError(comm, (&raw mut state).cast::<ncclResult_t>()) };
    if result != ncclResult_t::ncclSuccess {
        return CommState::Failed(format!("{result:?} from ncclCommGetAsyncError"));
    }
    match state {
        s if s == ncclResult_t::ncclSuccess as u32 => CommState::Ready,
        s if s == ncclResult_t::ncclInProgress as u32 => CommState::InProgress,
        code => CommState::Failed(nccl_code_name(code)),
    }
}

/// The name nccl.h gives an `ncclResult_t` code (stable across NCCL 2.x).
fn nccl_code_name(code: u32) -> String {
    const NAMES: [&str; 9] = [
        "ncclSuccess",
        "ncclUnhandledCudaError",
        "ncclSystemError",
        "ncclInternalError",
        "ncclInvalidArgument",
        "ncclInvalidUsage",
        "ncclRemoteError",
        "ncclInProgress",
        "ncclTimeout",
    ];
    match NAMES.get(code as usize) {
        Some(name) => (*name).to_string(),
        None => format!("NCCL error code {code}"),
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

/// One tensor of a collective: its input, its output length and the elements this rank sends.
struct Item {
    input: Tensor<1>,
    out_len: usize,
    sent_elems: usize,
}

/// An item once checked: dense input on this GPU, fresh output.
struct Buffer {
    src: CubeTensor,
    dst: CubeTensor,
    dtype: ncclsys::ncclDataType_t,
    /// Bytes per element of `dtype` (`DType::size`, which equals the NCCL type's size).
    elem_bytes: usize,
    /// Elements of `src`.
    in_len: usize,
    /// Elements of `dst`.
    out_len: usize,
    sent_bytes: u64,
}

/// What one NCCL call of a collective gets. [`NcclComm::run_group`] guarantees, for as long as
/// the call and the GPU work it enqueues run:
/// - `src` is the device address of a dense buffer of at least the item's input length
///   (`tensor.dims()[0]`) elements of `dtype`, and `dst` of at least its `out_len` elements; both
///   on this communicator's GPU, in the primary context NCCL uses; distinct (`dst` is a fresh
///   allocation); checked against the allocation's size;
/// - both allocations are pinned (CubeCL neither frees, reuses nor moves them) until the stream
///   is seen drained, or forever when it is not; CubeCL's queued writes to `src` are complete
///   and nothing else writes to either while NCCL runs (this call holds the tensors);
/// - `comm` is live (not aborted or destroyed) and the calling thread holds its lock, from the
///   group's start to its end;
/// - `stream` is this communicator's stream, alive while the lock is held.
///
/// Counts given to NCCL are in elements of `dtype`, not bytes.
struct Launch {
    /// The item's index in the call's list.
    index: usize,
    src: *const c_void,
    dst: *mut c_void,
    dtype: ncclsys::ncclDataType_t,
    comm: ncclsys::ncclComm_t,
    stream: ncclsys::cudaStream_t,
}

/// The NCCL type of a float dtype: same element size and encoding (IEEE binary32, binary16,
/// bfloat16).
fn nccl_dtype(dtype: DType) -> Result<ncclsys::ncclDataType_t, CommError> {
    match dtype {
        DType::F32 => Ok(ncclsys::ncclDataType_t::ncclFloat32),
        DType::F16 => Ok(ncclsys::ncclDataType_t::ncclFloat16),
        DType::BF16 => Ok(ncclsys::ncclDataType_t::ncclBfloat16),
        other => Err(CommError::UnsupportedDtype(format!("{other:?}"))),
    }
}

fn cube(t: Tensor<1>) -> Result<CubeTensor, CommError> {
    t.inner()
        .try_into_primitive::<CubeBackend>()
        .map_err(|_| CommError::Backend("NCCL collectives take tensors on a CUDA device (Device::cuda(i))".to_string()))
}

/// Raw device address (offset included) and the guard that pins the allocation, checked to span
/// at least `bytes` bytes.
fn device_ptr(t: &CubeTensor, bytes: usize) -> Result<(u64, impl Sized + use<>), CommError> {
    let res = t
        .client
        .get_resource::<CudaServer>(t.handle.clone())
        .map_err(|e| CommError::Backend(format!("tensor is not a CUDA buffer: {e:?}")))?;
    let size = res.resource().size;
    if size < bytes as u64 {
        return Err(CommError::Backend(format!(
            "internal error: a collective needs {bytes} bytes but the tensor's buffer has {size}"
        )));
    }
    Ok((res.resource().ptr, res))
}

fn nccl_op(op: ReduceOp) -> ncclsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclsys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclsys::ncclRedOp_t::ncclAvg,
    }
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
        self.run(CollectiveKind::AllReduce, tensor, n, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length = out_len = `n`: ncclAllReduce
            // reads `n` elements of `l.dtype` from `l.src` and writes `n` to `l.dst`.
            unsafe { nccl::all_reduce(l.src, l.dst, n, l.dtype, nccl_op(op), l.comm, l.stream) }
        })
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
        self.run(CollectiveKind::ReduceScatter, tensor, chunk, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length `n` = `chunk · world_size` and
            // out_len `chunk`: ncclReduceScatter reads `recvcount · nranks` = `n` elements from
            // `l.src` and writes `recvcount` = `chunk` to `l.dst`.
            unsafe { nccl::reduce_scatter(l.src, l.dst, chunk, l.dtype, nccl_op(op), l.comm, l.stream) }
        })
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        let chunk = tensor.dims()[0];
        let sent = (self.world_size - 1) * chunk;
        self.run(CollectiveKind::AllGather, tensor, chunk * self.world_size, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length `chunk` and out_len
            // `chunk · world_size`: ncclAllGather reads `sendcount` = `chunk` elements from
            // `l.src` and writes `sendcount · nranks` to `l.dst`.
            unsafe { nccl::all_gather(l.src, l.dst, chunk, l.dtype, l.comm, l.stream) }
        })
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        if root >= self.world_size {
            return Err(CommError::InvalidRoot {
                root,
                world_size: self.world_size,
            });
        }
        // Fits: root < world_size, which `new_with_init_timeout` checked against `c_int`.
        let root_rank = root as c_int;
        let n = tensor.dims()[0];
        let sent = if self.rank == root { n } else { 0 };
        self.run(CollectiveKind::Broadcast, tensor, n, sent, |l| {
            // SAFETY: `Launch`'s invariants, with input length = out_len = `n`: ncclBroadcast
            // reads `n` elements from `l.src` (on the root) and writes `n` to `l.dst`; `root_rank`
            // is a rank of the communicator.
            unsafe { nccl::broadcast(l.src, l.dst, n, l.dtype, root_rank, l.comm, l.stream) }
        })
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
        self.run_group(CollectiveKind::AllGather, items, |l| {
            // SAFETY: as in `all_gather`, for item `l.index`: input length `chunks[l.index]`,
            // out_len `chunks[l.index] · world_size`.
            unsafe { nccl::all_gather(l.src, l.dst, chunks[l.index], l.dtype, l.comm, l.stream) }
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
        self.run_group(CollectiveKind::ReduceScatter, items, |l| {
            // SAFETY: as in `reduce_scatter`, for item `l.index`: input length
            // `chunks[l.index] · world_size`, out_len `chunks[l.index]`.
            unsafe { nccl::reduce_scatter(l.src, l.dst, chunks[l.index], l.dtype, nccl_op(op), l.comm, l.stream) }
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        let one = Tensor::<1>::zeros([1], &self.device);
        self.all_reduce(one, ReduceOp::Sum).map(drop)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// Aborts the communicator (`ncclCommAbort`) and returns once it is aborted. A collective in
    /// progress on another thread notices within a poll interval, aborts it itself and returns
    /// [`CommError::Aborted`]; with a blocking communicator (NCCL < 2.14) a call stuck inside NCCL
    /// is not interrupted, and this waits for it. Every later call returns
    /// [`CommError::Aborted`] carrying the first reason given.
    fn abort(&self, reason: &str) {
        let _ = self.abort_reason.set(reason.to_string());
        self.abort_requested.store(true, Ordering::SeqCst);
        let mut raw = self.raw.lock().unwrap_or_else(PoisonError::into_inner);
        self.abort_locked(&mut raw, reason);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let poisoned = self.raw.is_poisoned();
        let raw = self.raw.get_mut().unwrap_or_else(PoisonError::into_inner);
        if raw.comm.is_null() {
            return;
        }
        // Every collective returned after its GPU work completed or after aborting, so nothing
        // is in flight. A healthy communicator is destroyed; one with an asynchronous error, or
        // left by a panicking thread, is aborted (NCCL user guide, "Error handling").
        let healthy = !poisoned && matches!(async_state(raw.comm), CommState::Ready);
        if healthy {
            // SAFETY: `raw.comm` is live (non-null) and `&mut self` excludes every other user;
            // it is nulled right after, so it is never used again.
            if let Err(e) = unsafe { nccl::comm_destroy(raw.comm) } {
                tracing::warn!(rank = self.rank, "ncclCommDestroy returned {:?}", e.0);
            }
        } else {
            // SAFETY: as for `comm_destroy` above.
            let _ = unsafe { nccl::comm_abort(raw.comm) };
        }
        raw.comm = ptr::null_mut();
    }
}
