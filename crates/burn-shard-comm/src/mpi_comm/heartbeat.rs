//! Heartbeats during a long wait ([`Heartbeats`]), so that a timeout names who is missing. MPI
//! says nothing about which peer holds a collective up; a rank that waits longer than a beat
//! period tells the other members of the waiting group, once per period, that it is alive and
//! waiting (an empty message on the job's control communicator), and counts whom it hears from.
//! When its wait times out, the members it has not heard from for [`SILENT_AFTER`] periods are
//! the suspects: dead, stuck before the call, or cut off (a link down). Ranks in the same call
//! hear each other; across a cut link nobody does, so each side names the other.
//!
//! A short wait (under one period, every wait of a healthy job) does nothing but read the
//! clock. A beat travels on the same connection as the collectives' data, so on a slow link
//! busy with a large collective a live peer's beat can come late: the names are suspects, not
//! proof.

use std::time::{Duration, Instant};

use ::mpi::request::{Request, StaticScope};
use ::mpi::topology::Rank;
use ::mpi::traits::*;

use super::comm::State;

/// Tag of the heartbeats on the control communicator.
const HEARTBEAT_TAG: i32 = 2;
/// The longest beat period; shorter for short timeouts (a quarter of the timeout), so that a
/// timeout always spans several beats.
const MAX_PERIOD: Duration = Duration::from_secs(1);
/// A member unheard for this many periods is silent. Beats are read from the first period on,
/// so a stale beat (sent during an earlier wait) counts as heard at one period at the latest
/// and has aged out by the timeout, four periods in.
const SILENT_AFTER: u32 = 2;
/// What a beat carries: nothing but its tag and source. Static, so a beat to a peer that never
/// reads it holds no buffer of ours.
static BEAT: [u8; 0] = [];

/// The heartbeats of one wait (see the module docs). Dropped with the MPI lock held, as it is
/// used: in [`MpiComm::wait`](super::comm::MpiComm), whose caller holds it.
pub(super) struct Heartbeats {
    period: Duration,
    /// When the first beat is due.
    next: Instant,
    /// Set at the first beat: who takes part, and what was heard.
    started: Option<Started>,
}

/// What a long wait keeps: the other members of the group (ranks of the job's world, the
/// control communicator's), when each was last heard from, and the beats in flight.
struct Started {
    peers: Vec<Rank>,
    heard: Vec<Option<Instant>>,
    in_flight: Vec<Request<'static, [u8], StaticScope>>,
}

impl Heartbeats {
    /// For a wait that starts now, with `timeout`.
    pub(super) fn new(timeout: Duration) -> Self {
        let period = (timeout / 4).min(MAX_PERIOD);
        Self {
            period,
            next: Instant::now() + period,
            started: None,
        }
    }

    /// Once the wait has lasted a period: reads every beat that arrived, and sends one to each
    /// other member of the group each period. Call with the MPI lock held.
    pub(super) fn poll(&mut self, state: &State) {
        let now = Instant::now();
        if self.started.is_none() && now < self.next {
            return;
        }
        let started = self.started.get_or_insert_with(|| Started::new(state));
        let control = &state.control;
        for source in read_beats(state) {
            if let Some(slot) = started.heard.get_mut(source) {
                *slot = Some(Instant::now());
            }
        }
        started.in_flight = std::mem::take(&mut started.in_flight)
            .into_iter()
            .filter_map(|request| request.test().err())
            .collect();
        if now < self.next {
            return;
        }
        self.next = now + self.period;
        for &peer in &started.peers {
            let request = control
                .process_at_rank(peer)
                .immediate_send_with_tag(StaticScope, &BEAT[..], HEARTBEAT_TAG);
            started.in_flight.push(request);
        }
    }

    /// Reads and drops the beats that reached this rank, at the end of a call that completed:
    /// a rank that never waits long (the slowest of a job) would otherwise collect them in
    /// MPI's queue of unexpected messages, which every probe walks. One probe when there are
    /// none. Call with the MPI lock held.
    pub(super) fn discard_pending(&self, state: &State) {
        read_beats(state).for_each(drop);
    }

    /// The other members of the group (ranks of the job's world, `mpirun`'s ranks) not heard
    /// from in the last [`SILENT_AFTER`] periods. Call with the MPI lock held.
    pub(super) fn silent(&mut self, state: &State) -> Vec<usize> {
        let recent = self.period * SILENT_AFTER;
        let started = self.started.get_or_insert_with(|| Started::new(state));
        started
            .peers
            .iter()
            .filter(|&&p| started.heard[p as usize].is_none_or(|at| at.elapsed() > recent))
            .map(|&p| p as usize)
            .collect()
    }
}

/// The sources (ranks of the control communicator) of the beats that arrived, read one by one.
fn read_beats(state: &State) -> impl Iterator<Item = usize> + '_ {
    std::iter::from_fn(|| {
        let probed = state
            .control
            .any_process()
            .immediate_matched_probe_with_tag(HEARTBEAT_TAG)?;
        let (_, status) = probed.matched_receive_vec::<u8>();
        Some(status.source_rank() as usize)
    })
}

impl Started {
    /// The group's other members as ranks of the control communicator (the job's world: a
    /// sub-group's members are a part of it).
    fn new(state: &State) -> Self {
        let (data, control) = (&state.data, &state.control);
        let members: Vec<Rank> = (0..data.size()).collect();
        let me = control.rank();
        let peers = data
            .group()
            .translate_ranks(&members, &control.group())
            .into_iter()
            .flatten()
            .filter(|&p| p != me)
            .collect();
        Self {
            peers,
            heard: vec![None; control.size() as usize],
            in_flight: Vec::new(),
        }
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        let Some(started) = self.started.take() else { return };
        for request in started.in_flight {
            if let Err(pending) = request.test() {
                // A beat to a peer that reads nothing more: MPI frees the request once the send
                // is done (freeing an active send is allowed); the buffer is static.
                // SAFETY: the request is active and ours; its buffer lives forever.
                unsafe {
                    let (mut raw, _, _) = pending.into_raw();
                    ::mpi::ffi::MPI_Request_free(&mut raw);
                }
            }
        }
    }
}
