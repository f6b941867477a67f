//! Per-rank traffic and timing counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The five collectives, used to index [`CommStats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// [`crate::Collective::all_reduce`].
    AllReduce,
    /// [`crate::Collective::reduce_scatter`].
    ReduceScatter,
    /// [`crate::Collective::all_gather`].
    AllGather,
    /// [`crate::Collective::broadcast`].
    Broadcast,
    /// [`crate::Collective::barrier`].
    Barrier,
}

impl CollectiveKind {
    pub(crate) const ALL: [CollectiveKind; 5] = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
    ];

    /// The collective's name in the field's usual spelling (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Calls and bytes sent by one rank for one collective.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Number of completed calls.
    pub calls: u64,
    /// Bytes this rank put on the wire (payload only, in the caller's dtype).
    pub bytes_sent: u64,
}

/// A snapshot of one rank's traffic, per collective, and of its time in collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    ops: [OpStats; 5],
    busy: Duration,
    exposed: Duration,
}

impl CommStats {
    /// Counters of one collective.
    pub fn get(&self, kind: CollectiveKind) -> OpStats {
        self.ops[kind.index()]
    }

    /// Calls this rank completed over all collectives.
    pub fn total_calls(&self) -> u64 {
        self.ops.iter().map(|o| o.calls).sum()
    }

    /// Bytes sent by this rank over all collectives.
    pub fn total_bytes_sent(&self) -> u64 {
        self.ops.iter().map(|o| o.bytes_sent).sum()
    }

    /// Wall time this rank's collectives ran (seconds), synchronous and asynchronous calls
    /// alike. Measured by the in-process backend; backends that do not measure it report zero.
    pub fn busy(&self) -> Duration {
        self.busy
    }

    /// Wall time callers were blocked on this rank's collectives: the whole of every
    /// synchronous call, and the part of an asynchronous call's run that had not finished when
    /// its [`Work::wait`](crate::Work::wait) began. At most [`CommStats::busy`], up to
    /// clock granularity.
    pub fn exposed(&self) -> Duration {
        self.exposed
    }

    /// Share of [`CommStats::busy`] hidden behind the caller's own work,
    /// `1 - exposed / busy` in `[0, 1]`; `None` when no time was measured.
    pub fn hidden_share(&self) -> Option<f64> {
        let busy = self.busy.as_secs_f64();
        (busy > 0.0).then(|| (1.0 - self.exposed.as_secs_f64() / busy).clamp(0.0, 1.0))
    }

    /// The traffic and time between an earlier snapshot and this one.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = *self;
        for (o, e) in out.ops.iter_mut().zip(earlier.ops.iter()) {
            o.calls -= e.calls;
            o.bytes_sent -= e.bytes_sent;
        }
        out.busy = self.busy.saturating_sub(earlier.busy);
        out.exposed = self.exposed.saturating_sub(earlier.exposed);
        out
    }

    /// This snapshot with the time counters `(busy, exposed)` set.
    pub(crate) fn with_time(mut self, (busy, exposed): (Duration, Duration)) -> CommStats {
        self.busy = busy;
        self.exposed = exposed;
        self
    }
}

/// Lock-free counters a backend updates while it runs.
#[derive(Debug, Default)]
pub(crate) struct StatsCounter {
    calls: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
}

impl StatsCounter {
    pub(crate) fn record(&self, kind: CollectiveKind, bytes_sent: u64) {
        self.calls[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.bytes[kind.index()].fetch_add(bytes_sent, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> CommStats {
        let mut s = CommStats::default();
        for kind in CollectiveKind::ALL {
            s.ops[kind.index()] = OpStats {
                calls: self.calls[kind.index()].load(Ordering::Relaxed),
                bytes_sent: self.bytes[kind.index()].load(Ordering::Relaxed),
            };
        }
        s
    }
}
