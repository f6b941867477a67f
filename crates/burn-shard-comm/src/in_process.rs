//! The in-process backend: `world_size` ranks as threads of one process, joined in a ring by
//! channels.
//!
//! It is the CPU default and the test bed. Misuse never hangs: every message carries the call's
//! sequence number and signature, so a rank that called something else is reported as a
//! [`CommError::Mismatch`]; a dropped or panicked peer closes its channel
//! ([`CommError::PeerGone`]); silence beyond the timeout is a [`CommError::Timeout`]. The first
//! error aborts the group, and every rank blocked in a collective returns within one poll
//! interval (10 ms).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor};

use crate::call_sig::CallSig;
use crate::host::HostBuffer;
use crate::ring::{self, RingLink};
use crate::stats::{CollectiveKind, StatsCounter};
use crate::work::CommThread;
use crate::{Collective, CommError, CommStats, ReduceOp, Work};

/// How often a blocked rank looks at the group's abort flag.
const POLL: Duration = Duration::from_millis(10);

/// Default time a rank waits for its neighbour before [`CommError::Timeout`] (5 minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Builder of an in-process group of `world_size` ranks.
///
/// ```
/// use burn_shard_comm::{Collective, InProcessGroup};
/// let comms = InProcessGroup::new(2).unwrap().into_comms();
/// assert_eq!(comms[1].rank(), 1);
/// ```
#[derive(Clone, Debug)]
pub struct InProcessGroup {
    world_size: usize,
    timeout: Duration,
}

impl InProcessGroup {
    /// A group of `world_size` ranks with the default 5-minute timeout.
    ///
    /// # Errors
    /// [`CommError::InvalidWorldSize`] when `world_size == 0`.
    pub fn new(world_size: usize) -> Result<Self, CommError> {
        if world_size == 0 {
            return Err(CommError::InvalidWorldSize(world_size));
        }
        Ok(Self {
            world_size,
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// Sets how long a rank waits for its neighbour inside one collective (seconds granularity
    /// is enough; the check runs every 10 ms).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The group size.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// One handle per rank, index = rank. Move each into its rank's thread.
    pub fn into_comms(self) -> Vec<InProcessComm> {
        let n = self.world_size;
        let shared = Arc::new(Shared::default());
        // Channel i carries messages from rank i to rank i+1.
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<Message>()).unzip();
        let mut receivers: Vec<Option<Receiver<Message>>> = receivers.into_iter().map(Some).collect();
        senders
            .into_iter()
            .enumerate()
            .map(|(rank, next)| {
                let prev_rank = (rank + n - 1) % n;
                InProcessComm {
                    end: Arc::new(Endpoint {
                        rank,
                        world_size: n,
                        timeout: self.timeout,
                        next,
                        prev: Mutex::new(receivers[prev_rank].take().expect("each receiver is taken once")),
                        seq: AtomicU64::new(0),
                        shared: shared.clone(),
                        stats: StatsCounter::default(),
                        splits: AtomicU64::new(0),
                    }),
                    thread: CommThread::new(format!("burn-shard-comm-rank-{rank}")),
                }
            })
            .collect()
    }
}

/// The handles of a sub-group its members have not taken yet (index = rank in the sub-group).
type Untaken = Vec<Option<InProcessComm>>;

#[derive(Default, Debug)]
struct Shared {
    aborted: AtomicBool,
    reason: Mutex<Option<String>>,
    /// Sub-groups being handed out by [`Collective::split`], by (split number, color): the
    /// handles not yet taken by their rank. The first member to arrive builds the sub-group.
    splits: Mutex<HashMap<(u64, usize), Untaken>>,
}

impl Shared {
    fn abort(&self, reason: String) {
        let mut slot = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(reason);
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    /// This rank's handle of sub-group `color` of split number `split`: built by the first of
    /// its `size` members to arrive (with `timeout`), taken by each member once.
    fn take_split(&self, split: u64, color: usize, size: usize, rank: usize, timeout: Duration) -> InProcessComm {
        let mut splits = self.splits.lock().unwrap_or_else(|p| p.into_inner());
        let handles = splits.entry((split, color)).or_insert_with(|| {
            let group = InProcessGroup {
                world_size: size,
                timeout,
            };
            group.into_comms().into_iter().map(Some).collect()
        });
        let comm = handles[rank].take().expect("each member takes its handle once");
        if handles.iter().all(Option::is_none) {
            splits.remove(&(split, color));
        }
        comm
    }

    fn check(&self) -> Result<(), CommError> {
        if self.aborted.load(Ordering::SeqCst) {
            let reason = self.reason.lock().unwrap_or_else(|p| p.into_inner()).clone();
            return Err(CommError::Aborted(reason.unwrap_or_default()));
        }
        Ok(())
    }
}

struct Message {
    seq: u64,
    sig: CallSig,
    payload: Vec<f32>,
}

/// One rank's handle of an [`InProcessGroup`]. Dropping it (or panicking while holding it)
/// tells the other ranks that this rank is gone.
///
/// Collectives run on the calling thread until the first asynchronous call
/// ([`Collective::all_gather_async`], [`Collective::reduce_scatter_async`]) starts this rank's communication thread; from then on
/// every call of the rank runs there, in the order the calls were made, so an asynchronous
/// gather overlaps the caller's compute while the ranks' sequences stay aligned.
pub struct InProcessComm {
    end: Arc<Endpoint>,
    thread: CommThread,
}

/// This rank's end of the ring: what a call needs, shared with the communication thread.
struct Endpoint {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    next: Sender<Message>,
    prev: Mutex<Receiver<Message>>,
    seq: AtomicU64,
    shared: Arc<Shared>,
    stats: StatsCounter,
    /// Splits made so far (the same on every rank: `split` is a collective).
    splits: AtomicU64,
}

impl fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessComm")
            .field("rank", &self.end.rank)
            .field("world_size", &self.end.world_size)
            .finish()
    }
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.end.shared.abort(format!("rank {} panicked", self.end.rank));
        }
    }
}

/// One collective call in flight: the ring link of this rank, checked and counted.
struct Call<'a> {
    comm: &'a Endpoint,
    prev: &'a Receiver<Message>,
    seq: u64,
    sig: CallSig,
    elem_bytes: u64,
    bytes_sent: u64,
}

impl RingLink for Call<'_> {
    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world_size(&self) -> usize {
        self.comm.world_size
    }

    fn send(&mut self, payload: Vec<f32>) -> Result<(), CommError> {
        self.bytes_sent += payload.len() as u64 * self.elem_bytes;
        let msg = Message {
            seq: self.seq,
            sig: self.sig.clone(),
            payload,
        };
        // A peer that left after aborting the group left its reason: report that.
        self.comm.next.send(msg).map_err(|_| match self.comm.shared.check() {
            Err(aborted) => aborted,
            Ok(()) => CommError::PeerGone {
                peer: (self.comm.rank + 1) % self.comm.world_size,
                op: self.sig.to_string(),
            },
        })
    }

    fn recv(&mut self) -> Result<Vec<f32>, CommError> {
        let peer = (self.comm.rank + self.comm.world_size - 1) % self.comm.world_size;
        let start = Instant::now();
        loop {
            match self.prev.recv_timeout(POLL) {
                Ok(msg) => {
                    if msg.seq != self.seq || msg.sig != self.sig {
                        return Err(CommError::Mismatch {
                            seq: self.seq,
                            rank: self.comm.rank,
                            ours: format!("call #{} {}", self.seq, self.sig),
                            peer,
                            theirs: format!("call #{} {}", msg.seq, msg.sig),
                        });
                    }
                    return Ok(msg.payload);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.comm.shared.check()?;
                    return Err(CommError::PeerGone {
                        peer,
                        op: self.sig.to_string(),
                    });
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.comm.shared.check()?;
                    let waited = start.elapsed();
                    if waited >= self.comm.timeout {
                        return Err(CommError::Timeout {
                            rank: self.comm.rank,
                            peer,
                            op: self.sig.to_string(),
                            waited,
                        });
                    }
                }
            }
        }
    }
}

impl Endpoint {
    /// Runs `body` as collective call number `seq`, with abort bookkeeping and traffic counting.
    fn call<T>(
        &self,
        kind: CollectiveKind,
        len: usize,
        dtype: DType,
        root: usize,
        tag: u64,
        body: impl FnOnce(&mut Call<'_>) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.shared.check()?;
        let prev = self.prev.lock().unwrap_or_else(|p| p.into_inner());
        let sig = CallSig {
            kind,
            len,
            dtype,
            root,
            tag,
        };
        let mut call = Call {
            comm: self,
            prev: &prev,
            seq: self.seq.fetch_add(1, Ordering::SeqCst),
            sig,
            elem_bytes: dtype.size() as u64,
            bytes_sent: 0,
        };
        match body(&mut call) {
            Ok(out) => {
                self.stats.record(kind, call.bytes_sent);
                Ok(out)
            }
            Err(err) => {
                if !matches!(err, CommError::Aborted(_)) {
                    self.shared.abort(format!("rank {}: {err}", self.rank));
                }
                Err(err)
            }
        }
    }

    /// Fails (and aborts the group, so the peers fail too) on a precondition every rank checks.
    fn reject(&self, err: CommError) -> CommError {
        self.shared.abort(format!("rank {}: {err}", self.rank));
        err
    }
}

/// The collectives themselves, run by [`InProcessComm`] on the caller's or the communication
/// thread.
impl Endpoint {
    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer {
            mut values,
            dtype,
            device,
        } = HostBuffer::read(tensor)?;
        let n = self.world_size;
        self.call(CollectiveKind::AllReduce, values.len(), dtype, 0, tag, |link| {
            let own = ring::reduce_scatter(link, &mut values)?;
            if op == ReduceOp::Avg {
                values[own].iter_mut().for_each(|v| *v /= n as f32);
            }
            ring::all_gather(link, &mut values)
        })?;
        Ok(HostBuffer::into_tensor(values, dtype, &device))
    }

    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer {
            mut values,
            dtype,
            device,
        } = HostBuffer::read(tensor)?;
        let n = self.world_size;
        if values.len() % n != 0 {
            return Err(self.reject(CommError::NotDivisible {
                op: "reduce_scatter",
                len: values.len(),
                world_size: n,
            }));
        }
        let own = self.call(CollectiveKind::ReduceScatter, values.len(), dtype, 0, tag, |link| {
            ring::reduce_scatter(link, &mut values)
        })?;
        let mut out = values[own].to_vec();
        if op == ReduceOp::Avg {
            out.iter_mut().for_each(|v| *v /= n as f32);
        }
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        let HostBuffer { values, dtype, device } = HostBuffer::read(tensor)?;
        let (n, c) = (self.world_size, values.len());
        let mut full = vec![0.0f32; n * c];
        full[self.rank * c..(self.rank + 1) * c].copy_from_slice(&values);
        self.call(CollectiveKind::AllGather, c, dtype, 0, tag, |link| {
            ring::all_gather(link, &mut full)
        })?;
        Ok(HostBuffer::into_tensor(full, dtype, &device))
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        if root >= self.world_size {
            return Err(self.reject(CommError::InvalidRoot {
                root,
                world_size: self.world_size,
            }));
        }
        let HostBuffer { values, dtype, device } = HostBuffer::read(tensor)?;
        let out = self.call(CollectiveKind::Broadcast, values.len(), dtype, root, 0, |link| {
            ring::broadcast(link, values, root)
        })?;
        Ok(HostBuffer::into_tensor(out, dtype, &device))
    }

    fn barrier(&self) -> Result<(), CommError> {
        // An all-gather of empty chunks: after N-1 ring steps every rank has heard, through its
        // neighbour, from every other rank, so all have entered.
        self.call(CollectiveKind::Barrier, 0, DType::F32, 0, 0, |link| {
            let mut empty: Vec<f32> = Vec::new();
            ring::all_gather(link, &mut empty)
        })
    }
}

impl Collective for InProcessComm {
    fn rank(&self) -> usize {
        self.end.rank
    }

    fn world_size(&self) -> usize {
        self.end.world_size
    }

    fn all_reduce(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        let end = self.end.clone();
        self.thread.run(move || end.all_reduce(tensor, op, 0))
    }

    fn all_reduce_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        let end = self.end.clone();
        self.thread.start(move || end.all_reduce(tensor, op, tag))
    }

    fn overlaps_compute(&self) -> bool {
        true
    }

    fn reduce_scatter(&self, tensor: Tensor<1>, op: ReduceOp) -> Result<Tensor<1>, CommError> {
        self.reduce_scatter_tagged(tensor, op, 0)
    }

    fn reduce_scatter_tagged(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Result<Tensor<1>, CommError> {
        let end = self.end.clone();
        self.thread.run(move || end.reduce_scatter_tagged(tensor, op, tag))
    }

    fn all_gather(&self, tensor: Tensor<1>) -> Result<Tensor<1>, CommError> {
        self.all_gather_tagged(tensor, 0)
    }

    fn all_gather_tagged(&self, tensor: Tensor<1>, tag: u64) -> Result<Tensor<1>, CommError> {
        let end = self.end.clone();
        self.thread.run(move || end.all_gather_tagged(tensor, tag))
    }

    fn all_gather_async(&self, tensor: Tensor<1>, tag: u64) -> Work<Tensor<1>> {
        let end = self.end.clone();
        self.thread.start(move || end.all_gather_tagged(tensor, tag))
    }

    fn reduce_scatter_async(&self, tensor: Tensor<1>, op: ReduceOp, tag: u64) -> Work<Tensor<1>> {
        let end = self.end.clone();
        self.thread.start(move || end.reduce_scatter_tagged(tensor, op, tag))
    }

    fn broadcast(&self, tensor: Tensor<1>, root: usize) -> Result<Tensor<1>, CommError> {
        let end = self.end.clone();
        self.thread.run(move || end.broadcast(tensor, root))
    }

    fn barrier(&self) -> Result<(), CommError> {
        let end = self.end.clone();
        self.thread.run(move || end.barrier())
    }

    fn stats(&self) -> CommStats {
        self.end.stats.snapshot().with_time(self.thread.timing().snapshot())
    }

    fn abort(&self, reason: &str) {
        self.end.shared.abort(reason.to_string());
    }

    /// A new in-process group per color, built by the first of its members to get here; the
    /// members learn each other through one all-gather of this group.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>, CommError> {
        let plan = crate::split::plan(self, color, key)?;
        let split = self.end.splits.fetch_add(1, Ordering::SeqCst);
        let comm = self
            .end
            .shared
            .take_split(split, color, plan.members.len(), plan.rank, self.end.timeout);
        Ok(Box::new(comm))
    }
}
