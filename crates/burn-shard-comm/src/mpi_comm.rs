//! The MPI backend (feature `mpi`): one rank per process, started by `mpirun`, over the
//! system's MPI library (OpenMPI or MPICH) through rsmpi. For CPU machines and clusters.
//!
//! Collectives map to MPI's own: reduce-scatter to `MPI_Ireduce_scatter_block`, all-gather to
//! `MPI_Iallgather`, broadcast to `MPI_Ibcast`, barrier to `MPI_Ibarrier`. All-reduce is a
//! reduce-scatter followed by an all-gather of the (padded) buffer, so that, as the trait
//! promises, every rank gets bitwise-identical values (each element is reduced once, by its
//! owner; `MPI_Allreduce` does not promise that for every algorithm). Grouped calls
//! (`*_many`) move the whole bucket in one MPI call.
//!
//! Misuse is an error, as on the in-process backend:
//! - before each collective, the ranks all-gather its signature (call number, kind, length,
//!   dtype, root, tag: 48 bytes), so ranks that call different things get
//!   [`CommError::Mismatch`], all of them, instead of MPI's undefined behaviour;
//! - every call is non-blocking and polled: a rank that fails alone calls
//!   [`Collective::abort`], which sends its reason to every other rank on a second communicator,
//!   and the others return [`CommError::Aborted`] within a poll; silence longer than the timeout
//!   is [`CommError::MpiTimeout`];
//! - a rank that dies is `mpirun`'s business: it ends the whole job and names the rank.
//!
//! MPI is finalised when the process exits (an `atexit` handler, as mpi4py does), not when the
//! communicator drops: at stage 3, Burn's autodiff graph releases the last handle only at its
//! next clean-up, which may never come. MPI cannot cancel a collective: after a timeout or an
//! abort notice the pending call's buffers are left to MPI (leaked) and the exit handler skips
//! `MPI_Finalize` (it would wait for that call); `mpirun` then ends the job.

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use ::mpi::collective::SystemOperation;
use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use burn::tensor::{DType, Tensor};

use crate::call_sig::{CallSig, SIG_WORDS};
use crate::host::HostBuffer;
use crate::stats::{CollectiveKind, StatsCounter};
use crate::{Collective, CommError, CommStats, ReduceOp};

/// Default time a collective may wait for the other ranks before [`CommError::MpiTimeout`]
/// (5 minutes, as the other backends).
pub const MPI_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Tag of the abort notices on the control communicator.
const ABORT_TAG: i32 = 1;
/// Polls of a pending call before the poll loop starts sleeping between tests (MPI progresses
/// a non-blocking collective only inside MPI calls, so the first polls spin).
const SPIN_POLLS: u32 = 1000;
/// Pause between polls after [`SPIN_POLLS`]: bounds the added latency of a slow collective.
const POLL_PAUSE: Duration = Duration::from_micros(100);

/// Set once a call was abandoned in flight, or a thread panicked: `MPI_Finalize` would wait
/// for a call (or for ranks) that will never come, so the exit skips it and `mpirun` ends the
/// job within seconds.
static ABANDONED: AtomicBool = AtomicBool::new(false);

/// Held by every MPI call of this process (one `MpiComm` per process), by `Drop` and by the
/// exit handler, so `MPI_Finalize` never runs alongside another thread's call.
static MPI_CALLS: Mutex<()> = Mutex::new(());

fn mpi_calls() -> MutexGuard<'static, ()> {
    MPI_CALLS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Finalises MPI at process exit (`exit`, or a return from `main`), unless a call was abandoned,
/// a thread panicked, or another thread is inside an MPI call right now.
extern "C" fn finalize_at_exit() {
    let Ok(_calls) = MPI_CALLS.try_lock() else {
        return; // a thread is inside MPI: finalising now would break MPI_THREAD_SERIALIZED
    };
    if !ABANDONED.load(Ordering::SeqCst) && !::mpi::environment::is_finalized() {
        // SAFETY: MPI was initialised (this handler is registered by `MpiComm::init` after
        // that) and not finalised; holding `MPI_CALLS` means no other thread is in an MPI call,
        // and none can start one (each checks `is_finalized` under the same lock).
        unsafe {
            ::mpi::ffi::MPI_Finalize();
        }
    }
}

/// Whether this process was started by an MPI launcher (`mpirun`/`mpiexec` of OpenMPI, MPICH
/// or any PMIx launcher), judged from the variables they set (`OMPI_COMM_WORLD_SIZE`,
/// `PMI_SIZE`, `PMIX_RANK`). Never initialises MPI.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|var| std::env::var_os(var).is_some())
}

/// One rank of the job's MPI world: a [`Collective`] for CPU processes started by `mpirun`.
///
/// ```no_run
/// use burn_shard_comm::{Collective, MpiComm};
/// let comm = MpiComm::init().unwrap(); // once per process
/// println!("rank {} of {}", comm.rank(), comm.world_size());
/// ```
///
/// Create one per process, preferably on the main thread. MPI is finalised when the process
/// exits normally (from `main` or `std::process::exit`), whatever still holds a handle. It may
/// be used from any thread: calls are serialised by a mutex, as `MPI_THREAD_SERIALIZED`
/// requires.
/// Tensors are copied to host `f32` and back, so any Burn device works (the CPU is the point).
pub struct MpiComm {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Every MPI call happens with this lock held. Dropped by hand: the handles are freed only
    /// while MPI is still initialised and no call was abandoned (see `Drop`).
    state: Mutex<ManuallyDrop<State>>,
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    stats: StatsCounter,
}

/// The MPI handles, used only with [`MpiComm::state`] locked.
struct State {
    /// Collectives and their signatures.
    data: SimpleCommunicator,
    /// Abort notices, so they never match a collective's messages.
    control: SimpleCommunicator,
    /// Calls made so far (the signature's call number).
    seq: u64,
    /// A call was abandoned in flight: MPI may still use leaked buffers.
    abandoned: bool,
}

// SAFETY: the MPI handles in `State` are only used with the `state` mutex held, so no two
// threads call MPI at the same time, which is what MPI_THREAD_SERIALIZED (checked in `init`)
// allows from any thread. The remaining fields are atomics, mutexes and plain values.
unsafe impl Send for MpiComm {}
// SAFETY: as for `Send`: every `&self` method that reaches MPI takes the `state` mutex first.
unsafe impl Sync for MpiComm {}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

impl MpiComm {
    /// Initialises MPI (`MPI_Init_thread` with `MPI_THREAD_SERIALIZED`), registers its
    /// finalisation at process exit, and joins its world: the rank and world size are
    /// `mpirun`'s. Without `mpirun` it is a world of one process.
    ///
    /// # Errors
    /// [`CommError::Unavailable`] when MPI was already initialised in this process (one
    /// `MpiComm` per process), or when the MPI library cannot serve calls from several threads
    /// one at a time (it provides less than `MPI_THREAD_SERIALIZED`).
    pub fn init() -> Result<Self, CommError> {
        let (universe, threading) =
            ::mpi::initialize_with_threading(::mpi::Threading::Serialized).ok_or_else(|| {
                CommError::Unavailable(
                    "MPI is already initialised in this process: create one MpiComm per process and share it (Arc)"
                        .into(),
                )
            })?;
        if !launched_by_mpirun() && std::env::var_os("WORLD_SIZE").is_some_and(|w| w != "1") {
            return Err(CommError::Unavailable(
                "WORLD_SIZE is set but this process was not started by mpirun: a launcher such as burn-shard-run \
                 or torchrun starts processes that MPI cannot join (each would train alone); start them with \
                 `mpirun -np N`, or use NcclComm::from_env under burn-shard-run"
                    .into(),
            ));
        }
        if matches!(threading, ::mpi::Threading::Single | ::mpi::Threading::Funneled) {
            return Err(CommError::Unavailable(format!(
                "the MPI library provides only {threading:?} threading, burn-shard needs Serialized: \
                 use an MPI built with thread support (Debian's OpenMPI has it)"
            )));
        }
        let world = universe.world();
        let (rank, world_size) = (world.rank() as usize, world.size() as usize);
        // Finalised by `finalize_at_exit`, not by rsmpi's `Universe` drop (see the module doc).
        std::mem::forget(universe);
        // SAFETY: registers a plain `extern "C" fn` without arguments, as `atexit` requires.
        if unsafe { libc::atexit(finalize_at_exit) } != 0 {
            tracing::warn!("cannot register MPI_Finalize at exit: mpirun may report an abnormal exit");
        }
        // A panic anywhere means this rank will not reach its next collective: skip the
        // finalisation (which would wait for the others until their timeout) so that mpirun
        // ends the job as soon as this process exits.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            ABANDONED.store(true, Ordering::SeqCst);
            previous(info);
        }));
        Ok(Self {
            rank,
            world_size,
            timeout: MPI_DEFAULT_TIMEOUT,
            state: Mutex::new(ManuallyDrop::new(State {
                data: world.duplicate(),
                control: world.duplicate(),
                seq: 0,
                abandoned: false,
            })),
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            stats: StatsCounter::default(),
        })
    }

    /// Sets how long one collective may wait for the other ranks (default 5 minutes).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn state(&self) -> MutexGuard<'_, ManuallyDrop<State>> {
        // A panic while the lock was held cannot leave a call in flight (rsmpi aborts the
        // process when a pending request unwinds), so the handles stay usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The reason of an abort of this rank, or of one another rank told this one about.
    fn check(&self) -> Result<(), CommError> {
        if self.aborted.load(Ordering::SeqCst) {
            let reason = self.reason.lock().unwrap_or_else(PoisonError::into_inner).clone();
            return Err(CommError::Aborted(reason.unwrap_or_default()));
        }
        Ok(())
    }

    /// Marks the group aborted with `reason` (the first reason wins); whether this call did it.
    fn mark_aborted(&self, reason: String) -> bool {
        let mut slot = self.reason.lock().unwrap_or_else(PoisonError::into_inner);
        let first = slot.is_none();
        if first {
            *slot = Some(reason);
        }
        self.aborted.store(true, Ordering::SeqCst);
        first
    }

    /// Reads one pending abort notice from another rank, if any, and aborts this rank with it.
    fn receive_notice(&self, state: &State) {
        if let Some(probed) = state.control.any_process().immediate_matched_probe_with_tag(ABORT_TAG) {
            let (bytes, status) = probed.matched_receive_vec::<u8>();
            let reason = String::from_utf8_lossy(&bytes).into_owned();
            self.mark_aborted(format!("rank {} aborted: {reason}", status.source_rank()));
        }
    }

    /// Waits for `request`, polling for abort notices, this rank's own abort and the timeout.
    /// On an error the request is abandoned: the caller must leave its buffers to MPI
    /// ([`Pinned`] without `into_vec`).
    fn wait<D: ?Sized>(
        &self,
        state: &mut State,
        mut request: Request<'static, D, StaticScope>,
        sig: &CallSig,
    ) -> Result<(), CommError> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match request.test() {
                Ok(_) => return Ok(()),
                Err(pending) => request = pending,
            }
            self.receive_notice(state);
            let failure = match self.check() {
                Err(aborted) => Some(aborted),
                Ok(()) if start.elapsed() >= self.timeout => Some(CommError::MpiTimeout {
                    rank: self.rank,
                    op: sig.to_string(),
                    waited: start.elapsed(),
                }),
                Ok(()) => None,
            };
            if let Some(err) = failure {
                // MPI cannot cancel a collective: forget the request (its Drop would panic) and
                // leave MPI the buffers; the group is dead, so this happens at most once.
                std::mem::forget(request);
                state.abandoned = true;
                ABANDONED.store(true, Ordering::SeqCst);
                if !matches!(err, CommError::Aborted(_)) && self.mark_aborted(format!("rank {}: {err}", self.rank)) {
                    self.send_notices(state, &err.to_string());
                }
                return Err(err);
            }
            polls = polls.saturating_add(1);
            if polls < SPIN_POLLS {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(POLL_PAUSE);
            }
        }
    }

    /// Runs one collective: checks the group, takes the lock, compares signatures with every
    /// rank, then runs `body` and counts one call of `bytes_sent` (`None`: the caller counts).
    fn call<T>(
        &self,
        sig: CallSig,
        bytes_sent: Option<u64>,
        body: impl FnOnce(&Self, &mut State) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.check()?;
        let _calls = mpi_calls();
        if ::mpi::environment::is_finalized() {
            return Err(CommError::Unavailable(
                "MPI was finalised: the process is exiting".into(),
            ));
        }
        let mut guard = self.state();
        let state: &mut State = &mut guard;
        self.receive_notice(state);
        self.check()?;
        let seq = state.seq;
        state.seq += 1;
        self.compare_signatures(state, seq, &sig)?;
        let out = body(self, state)?;
        if let Some(bytes) = bytes_sent {
            self.stats.record(sig.kind, bytes);
        }
        Ok(out)
    }

    /// Sends `reason` to every other rank's control communicator. Never blocks: the sends are
    /// not waited for (a peer may have failed too), and their buffers are never freed.
    fn send_notices(&self, state: &State, reason: &str) {
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            let notice = Pinned::new(reason.as_bytes().to_vec());
            // SAFETY: the notice is never taken back, so it stays allocated for as long as
            // MPI may send it; the forgotten request only leaks MPI's bookkeeping of it.
            let request = unsafe {
                state.control.process_at_rank(peer as i32).immediate_send_with_tag(
                    StaticScope,
                    notice.as_static(),
                    ABORT_TAG,
                )
            };
            std::mem::forget(request);
        }
    }

    /// Copies every tensor of a bucket to the host, as [`MpiComm::read`].
    fn read_bucket(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<HostBuffer>, CommError> {
        tensors.into_iter().map(|t| self.read(t)).collect()
    }

    /// Copies `tensor` to the host; a dtype the backend cannot move fails the whole group.
    fn read(&self, tensor: Tensor<1>) -> Result<HostBuffer, CommError> {
        HostBuffer::read(tensor).map_err(|e| self.reject(e))
    }

    /// All-gathers every rank's signature of call `seq`; the first rank whose signature differs
    /// from this rank's is a [`CommError::Mismatch`], found by every rank from the same data.
    fn compare_signatures(&self, state: &mut State, seq: u64, sig: &CallSig) -> Result<(), CommError> {
        let ours = sig.to_words(seq);
        let send = Pinned::new(ours.to_vec());
        let mut recv = Pinned::new(vec![0u64; SIG_WORDS * self.world_size]);
        // SAFETY: `send` and `recv` stay allocated until `wait` returns Ok (then they are taken
        // back below) or forever (an abandoned call leaks them); nothing else touches them.
        let request = unsafe {
            state
                .data
                .immediate_all_gather_into(StaticScope, send.as_static(), recv.as_static_mut())
        };
        self.wait(state, request, sig)?;
        // SAFETY: the all-gather completed, so MPI no longer uses either buffer.
        let (_, all) = unsafe { (send.into_vec(), recv.into_vec()) };
        let Some((peer, theirs)) = all
            .chunks(SIG_WORDS)
            .enumerate()
            .find(|(_, words)| *words != ours.as_slice())
        else {
            return Ok(());
        };
        let theirs = match CallSig::from_words(theirs) {
            Some((their_seq, their_sig)) => format!("call #{their_seq} {their_sig}"),
            None => format!("an unknown call {theirs:?} (another burn-shard version?)"),
        };
        let err = CommError::Mismatch {
            seq,
            rank: self.rank,
            ours: format!("call #{seq} {sig}"),
            peer,
            theirs,
        };
        // Every rank sees the same table and fails here: no notice is needed.
        self.mark_aborted(format!("rank {}: {err}", self.rank));
        Err(err)
    }

    /// Fails (and aborts the group, so the peers fail too) on a precondition every rank checks.
    fn reject(&self, err: CommError) -> CommError {
        self.abort(&format!("rank {}: {err}", self.rank));
        err
    }

    /// This rank's reduced chunk of `values` (length divisible by `world_size`), summed.
    fn reduce_scatter_sum(&self, state: &mut State, values: Vec<f32>, sig: &CallSig) -> Result<Vec<f32>, CommError> {
        let chunk = values.len() / self.world_size;
        let send = Pinned::new(values);
        let mut recv = Pinned::new(vec![0f32; chunk]);
        // SAFETY: as in `compare_signatures`: the buffers outlive the request or are leaked.
        let request = unsafe {
            state.data.immediate_reduce_scatter_block_into(
                StaticScope,
                send.as_static(),
                recv.as_static_mut(),
                SystemOperation::sum(),
            )
        };
        self.wait(state, request, sig)?;
        // SAFETY: the reduce-scatter completed.
        Ok(unsafe { (send.into_vec(), recv.into_vec()) }.1)
    }

    /// Every rank's `chunk`, concatenated in rank order.
    fn all_gather_f32(&self, state: &mut State, chunk: Vec<f32>, sig: &CallSig) -> Result<Vec<f32>, CommError> {
        let len = chunk.len() * self.world_size;
        let send = Pinned::new(chunk);
        let mut recv = Pinned::new(vec![0f32; len]);
        // SAFETY: as in `compare_signatures`: the buffers outlive the request or are leaked.
        let request = unsafe {
            state
                .data
                .immediate_all_gather_into(StaticScope, send.as_static(), recv.as_static_mut())
        };
        self.wait(state, request, sig)?;
        // SAFETY: the all-gather completed.
        Ok(unsafe { (send.into_vec(), recv.into_vec()) }.1)
    }

    /// Bytes this rank sends in a ring reduce-scatter or all-gather of `chunk` elements per
    /// rank: the volume [`CommStats`] counts on every backend (MPI picks its own algorithm).
    fn ring_bytes(&self, chunk: usize, dtype: DType) -> u64 {
        ((self.world_size - 1) * chunk * dtype.size()) as u64
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let _calls = mpi_calls();
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if state.abandoned || ::mpi::environment::is_finalized() {
            // Freeing a communicator with a call in flight, or after MPI_Finalize, is an MPI
            // error: leave the handles to the process's end.
            return;
        }
        // SAFETY: `state` is not used again (this is drop); it frees the two communicators.
        unsafe { ManuallyDrop::drop(state) };
    }
}

impl Collective for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let HostBuffer {
            mut values,
            dtype,
            device,
        } = self.read(tensor)?;
        let (n, len) = (self.world_size, values.len());
        let chunk = len.div_ceil(n);
        values.resize(chunk * n, 0.0);
        let sig = CallSig {
            kind: CollectiveKind::AllReduce,
            len,
            dtype,
            root: 0,
            tag: 0,
        };
        let mut out = self.call(sig.clone(), Some(2 * self.ring_bytes(chunk, dtype)), |comm, state| {
            let mut own = comm.reduce_scatter_sum(state, values, &sig)?;
            if op == ReduceOp::Avg {
                own.iter_mut().for_each(|v| *v /= n as f32);
            }
            comm.all_gather_f32(state, own, &sig)
        })?;
        out.truncate(len);
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        self.reduce_scatter_tagged(tensor, op, 0)
    }

    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer { values, dtype, device } = self.read(tensor)?;
        let n = self.world_size;
        if values.len() % n != 0 {
            return Err(self.reject(CommError::NotDivisible {
                op: "reduce_scatter",
                len: values.len(),
                world_size: n,
            }));
        }
        let sig = CallSig {
            kind: CollectiveKind::ReduceScatter,
            len: values.len(),
            dtype,
            root: 0,
            tag,
        };
        let bytes = self.ring_bytes(values.len() / n, dtype);
        let mut out = self.call(sig.clone(), Some(bytes), |comm, state| {
            comm.reduce_scatter_sum(state, values, &sig)
        })?;
        if op == ReduceOp::Avg {
            out.iter_mut().for_each(|v| *v /= n as f32);
        }
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        self.all_gather_tagged(tensor, 0)
    }

    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer { values, dtype, device } = self.read(tensor)?;
        let sig = CallSig {
            kind: CollectiveKind::AllGather,
            len: values.len(),
            dtype,
            root: 0,
            tag,
        };
        let bytes = self.ring_bytes(values.len(), dtype);
        let out = self.call(sig.clone(), Some(bytes), |comm, state| {
            comm.all_gather_f32(state, values, &sig)
        })?;
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        if root >= self.world_size {
            return Err(self.reject(CommError::InvalidRoot {
                root,
                world_size: self.world_size,
            }));
        }
        let HostBuffer { values, dtype, device } = self.read(tensor)?;
        let sig = CallSig {
            kind: CollectiveKind::Broadcast,
            len: values.len(),
            dtype,
            root,
            tag: 0,
        };
        // Counted as the ring broadcast of the in-process backend: every rank but the one
        // before the root forwards the buffer.
        let forwards = (self.rank + 1) % self.world_size != root;
        let bytes = if forwards {
            (values.len() * dtype.size()) as u64
        } else {
            0
        };
        let out = self.call(sig.clone(), Some(bytes), |comm, state| {
            let mut buf = Pinned::new(values);
            // SAFETY: as in `compare_signatures`: the buffer outlives the request or is leaked.
            let request = unsafe {
                state
                    .data
                    .process_at_rank(root as i32)
                    .immediate_broadcast_into(StaticScope, buf.as_static_mut())
            };
            comm.wait(state, request, &sig)?;
            // SAFETY: the broadcast completed.
            Ok(unsafe { buf.into_vec() })
        })?;
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn all_gather_many(&self, tensors: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, CommError> {
        let buffers = self.read_bucket(tensors)?;
        if buffers.is_empty() {
            return Ok(Vec::new());
        }
        let n = self.world_size;
        let sig = bucket_sig(CollectiveKind::AllGather, &buffers);
        // One all-gather of the concatenated chunks: rank r's block holds its chunk of every
        // tensor, in order.
        let send: Vec<f32> = buffers.iter().flat_map(|b| b.values.iter().copied()).collect();
        let block = send.len();
        let gathered = self.call(sig.clone(), None, |comm, state| comm.all_gather_f32(state, send, &sig))?;
        let mut offset = 0;
        let out = buffers
            .iter()
            .map(|b| {
                let c = b.values.len();
                let mut full = Vec::with_capacity(n * c);
                for r in 0..n {
                    full.extend_from_slice(&gathered[r * block + offset..r * block + offset + c]);
                }
                offset += c;
                self.stats
                    .record(CollectiveKind::AllGather, self.ring_bytes(c, b.dtype));
                HostBuffer::into_tensor(full, b.dtype, &b.device)
            })
            .collect();
        Ok(out)
    }

    fn reduce_scatter_many(&self, tensors: Vec<Tensor<1>>, op: ReduceOp) -> Result<Vec<Tensor<1>>, CommError> {
        let buffers = self.read_bucket(tensors)?;
        if buffers.is_empty() {
            return Ok(Vec::new());
        }
        let n = self.world_size;
        if let Some(b) = buffers.iter().find(|b| b.values.len() % n != 0) {
            return Err(self.reject(CommError::NotDivisible {
                op: "reduce_scatter",
                len: b.values.len(),
                world_size: n,
            }));
        }
        let sig = bucket_sig(CollectiveKind::ReduceScatter, &buffers);
        // One reduce-scatter of a rank-major buffer: block r holds chunk r of every tensor, so
        // rank r receives its chunk of each, in order.
        let mut send = Vec::with_capacity(buffers.iter().map(|b| b.values.len()).sum());
        for r in 0..n {
            for b in &buffers {
                let c = b.values.len() / n;
                send.extend_from_slice(&b.values[r * c..(r + 1) * c]);
            }
        }
        let own = self.call(sig.clone(), None, |comm, state| {
            comm.reduce_scatter_sum(state, send, &sig)
        })?;
        let mut offset = 0;
        let out = buffers
            .iter()
            .map(|b| {
                let c = b.values.len() / n;
                let mut chunk = own[offset..offset + c].to_vec();
                offset += c;
                if op == ReduceOp::Avg {
                    chunk.iter_mut().for_each(|v| *v /= n as f32);
                }
                self.stats
                    .record(CollectiveKind::ReduceScatter, self.ring_bytes(c, b.dtype));
                HostBuffer::into_tensor(chunk, b.dtype, &b.device)
            })
            .collect();
        Ok(out)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let sig = CallSig {
            kind: CollectiveKind::Barrier,
            len: 0,
            dtype: DType::F32,
            root: 0,
            tag: 0,
        };
        self.call(sig.clone(), Some(0), |comm, state| {
            let request = state.data.immediate_barrier();
            comm.wait(state, request, &sig)
        })
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// Marks this rank aborted and sends `reason` to every other rank, whose pending and later
    /// calls then return [`CommError::Aborted`] (within one poll of a pending call).
    fn abort(&self, reason: &str) {
        if !self.mark_aborted(reason.to_string()) {
            return; // already aborted: the notices went out then, or the peers know
        }
        // A call of another thread polling with the lock held sees the flag and returns.
        let _calls = mpi_calls();
        if ::mpi::environment::is_finalized() {
            return;
        }
        let state = self.state();
        self.send_notices(&state, reason);
    }
}

/// The signature of a grouped call: its total length, and a tag that hashes every tensor's
/// length and dtype, so ranks with different buckets of equal total length mismatch too.
fn bucket_sig(kind: CollectiveKind, buffers: &[HostBuffer]) -> CallSig {
    // FNV-1a (Fowler, Noll, Vo), 64-bit.
    let mut tag: u64 = 0xcbf2_9ce4_8422_2325;
    for b in buffers {
        let (len, dtype) = (b.values.len() as u64, format!("{:?}", b.dtype));
        for byte in len.to_le_bytes().iter().chain(dtype.as_bytes()) {
            tag = (tag ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    CallSig {
        kind,
        len: buffers.iter().map(|b| b.values.len()).sum(),
        dtype: DType::F32,
        root: 0,
        tag: tag.max(1),
    }
}

/// A buffer handed to MPI for a non-blocking call, which needs it to outlive the request: the
/// memory is owned through a raw pointer and freed only by [`Pinned::into_vec`], once the call
/// completed. A `Pinned` dropped without `into_vec` leaks, which is what an abandoned call
/// needs (MPI may still write into it).
struct Pinned<T: 'static> {
    ptr: *mut [T],
}

impl<T: 'static> Pinned<T> {
    fn new(values: Vec<T>) -> Self {
        Self {
            ptr: Box::into_raw(values.into_boxed_slice()),
        }
    }

    /// # Safety
    /// The reference must not be used after [`Pinned::into_vec`], nor alongside a mutable one.
    unsafe fn as_static(&self) -> &'static [T] {
        // SAFETY: `ptr` came from `Box::into_raw` and is freed only by `into_vec`.
        unsafe { &*self.ptr }
    }

    /// # Safety
    /// As [`Pinned::as_static`]; only one such reference may exist.
    unsafe fn as_static_mut(&mut self) -> &'static mut [T] {
        // SAFETY: as in `as_static`.
        unsafe { &mut *self.ptr }
    }

    /// # Safety
    /// Only once no MPI request uses the buffer any more.
    unsafe fn into_vec(self) -> Vec<T> {
        // SAFETY: `ptr` came from `Box::into_raw` and is taken back once (this consumes self).
        unsafe { Box::from_raw(self.ptr) }.into_vec()
    }
}
