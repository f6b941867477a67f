//! Who joined the rendezvous: every rank registers its `RANK` and `WORLD_SIZE` in the store, and
//! the join succeeds once all of rank 0's `WORLD_SIZE` ranks registered, each exactly once and
//! each with rank 0's `WORLD_SIZE`. Counting arrivals alone would let ranks 0, 1, 1 of 3 pass,
//! and the job would hang in its first collective.
//!
//! The outcome is decided once for the whole job, in a verdict key that every rank waits for:
//! the last rank to register validly writes "ok"; a rank that finds a problem (it is a
//! duplicate, or its `WORLD_SIZE` differs from rank 0's) or that waited `timeout` in vain
//! writes the problem, so the other ranks fail with the same message at once rather than at
//! their own timeout. The first rank to claim the verdict writes it; the others read it.
//! After a failure, rank 0 keeps the store up in the background until every process the job is
//! known to have has read the verdict (see [`serve_stragglers`]).
//!
//! Keys (all under `burn-shard/`): `members` counts the processes that registered and
//! `member/<n>` holds the `n`-th one's `"RANK WORLD_SIZE"`; `rank/<r>` counts those with
//! `RANK = r`; `world-size` holds rank 0's `WORLD_SIZE` in decimal; `joined` counts the ranks
//! registered without a problem; `verdict/claim`, `verdict` and `verdict/told` (how many
//! processes read a failure) hold the outcome.

use std::thread;
use std::time::{Duration, Instant};

/// Least wait for a verdict another rank claimed but has not written yet.
const VERDICT_GRACE: Duration = Duration::from_secs(5);

use super::{StoreClient, StoreServer, seconds};
use crate::RendezvousError;

const MEMBERS_KEY: &str = "burn-shard/members";
const MEMBER_PREFIX: &str = "burn-shard/member/";
const WORLD_SIZE_KEY: &str = "burn-shard/world-size";
const JOINED_KEY: &str = "burn-shard/joined";
const VERDICT_CLAIM_KEY: &str = "burn-shard/verdict/claim";
const VERDICT_KEY: &str = "burn-shard/verdict";
const TOLD_KEY: &str = "burn-shard/verdict/told";
/// How often rank 0's store checks whether every process has read a failure.
const LINGER_POLL: Duration = Duration::from_millis(10);
/// Verdict values: success, or this prefix followed by the problem.
const OK: &[u8] = b"ok";
const FAIL: &[u8] = b"fail:";
/// At most this many missing ranks are named in a message.
const MISSING_NAMED: usize = 16;

/// The counter of processes that registered with `RANK = rank`.
fn rank_key(rank: usize) -> String {
    format!("burn-shard/rank/{rank}")
}

/// The job's outcome, as stored in [`VERDICT_KEY`].
enum Verdict {
    Ok,
    Fail(String),
}

impl Verdict {
    fn encode(&self) -> Vec<u8> {
        match self {
            Verdict::Ok => OK.to_vec(),
            Verdict::Fail(problem) => [FAIL, problem.as_bytes()].concat(),
        }
    }

    fn decode(bytes: &[u8]) -> Self {
        match bytes.strip_prefix(FAIL) {
            Some(problem) => Verdict::Fail(String::from_utf8_lossy(problem).into_owned()),
            None if bytes == OK => Verdict::Ok,
            None => Verdict::Fail(format!(
                "the rendezvous holds an unknown verdict {:?}: all ranks must run the same burn-shard version",
                String::from_utf8_lossy(bytes)
            )),
        }
    }
}

/// Registers this process as `rank` of `world_size` and waits until every rank of the job has
/// registered, up to `timeout` after this rank registered.
///
/// # Errors
/// [`RendezvousError::Rendezvous`], on every rank that is still waiting, when a `RANK` registered
/// twice, when a rank's `WORLD_SIZE` differs from rank 0's (a `RANK` out of rank 0's range
/// included), or when not all ranks registered within `timeout` (naming the missing ones); on
/// this rank alone when it is such a duplicate or mismatch and the others had already
/// completed the job without it; or when the store is lost.
pub(super) fn join(
    store: &StoreClient,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<(), RendezvousError> {
    let deadline = Instant::now() + timeout;
    let registration = register(store, rank, world_size, deadline)?;
    let verdict = match &registration.problem {
        Some(problem) => decide(store, Verdict::Fail(problem.clone()), timeout)?,
        None => match store.try_get(VERDICT_KEY, left(deadline))? {
            Some(verdict) => Verdict::decode(&verdict),
            None => {
                let expected = registration.rank0_world_size.unwrap_or(world_size);
                let problem = missing(store, expected, timeout)?;
                decide(store, Verdict::Fail(problem), timeout)?
            }
        },
    };
    match (verdict, registration.problem) {
        (Verdict::Ok, None) => Ok(()),
        (Verdict::Fail(problem), _) => {
            // Lets rank 0's store close once every process has read the failure; if this fails,
            // the store just stays up until its timeout.
            let _ = store.add(TOLD_KEY, 1);
            Err(RendezvousError::Rendezvous(problem))
        }
        (Verdict::Ok, Some(problem)) => Err(RendezvousError::Rendezvous(format!(
            "{problem} (the job's other ranks had all joined before this process, and run without it)"
        ))),
    }
}

/// What this rank's registration found.
struct Registration {
    /// Why this process cannot be part of the job, if it cannot.
    problem: Option<String>,
    /// Rank 0's `WORLD_SIZE`, once known.
    rank0_world_size: Option<usize>,
}

/// Records this rank in the store; the last rank to register validly decides success.
fn register(
    store: &StoreClient,
    rank: usize,
    world_size: usize,
    deadline: Instant,
) -> Result<Registration, RendezvousError> {
    let member = store.add(MEMBERS_KEY, 1)?;
    store.set(
        &format!("{MEMBER_PREFIX}{member}"),
        format!("{rank} {world_size}").as_bytes(),
    )?;
    let copies = store.add(&rank_key(rank), 1)?;
    if copies > 1 {
        return Ok(Registration {
            problem: Some(format!(
                "rank {rank} is duplicated: {copies} processes joined with RANK={rank} (WORLD_SIZE {world_size}); \
                 every process of a job needs its own RANK in 0..WORLD_SIZE: with burn-shard-run give each node \
                 its own --node-rank, and make sure no other job uses the same MASTER_ADDR:MASTER_PORT"
            )),
            rank0_world_size: None,
        });
    }
    let rank0_world_size = if rank == 0 {
        store.set(WORLD_SIZE_KEY, world_size.to_string().as_bytes())?;
        world_size
    } else {
        match store.try_get(WORLD_SIZE_KEY, left(deadline))? {
            Some(bytes) => parse_world_size(&bytes)?,
            // Rank 0 has not registered: the verdict wait that follows times out at once and
            // names it among the missing ranks.
            None => {
                return Ok(Registration {
                    problem: None,
                    rank0_world_size: None,
                });
            }
        }
    };
    if rank0_world_size != world_size {
        let out_of_range = if rank >= rank0_world_size {
            format!(", so RANK {rank} is out of rank 0's range 0..{rank0_world_size}")
        } else {
            String::new()
        };
        return Ok(Registration {
            problem: Some(format!(
                "the ranks disagree on WORLD_SIZE: rank {rank} has WORLD_SIZE {world_size} but rank 0 has \
                 WORLD_SIZE {rank0_world_size}{out_of_range}; give every process the same WORLD_SIZE (with \
                 burn-shard-run: the same --nnodes and --nproc-per-node on every node)"
            )),
            rank0_world_size: Some(rank0_world_size),
        });
    }
    // Only distinct ranks below rank 0's WORLD_SIZE get here, so the count reaches it exactly
    // when every rank has registered.
    let joined = store.add(JOINED_KEY, 1)?;
    if joined == rank0_world_size as i64 {
        // If another rank decided a failure first, the verdict wait that follows reads it.
        // The deadline may be nearly spent (this rank waited for rank 0's WORLD_SIZE): still give
        // a rank that claimed the verdict a moment to write it.
        decide(store, Verdict::Ok, left(deadline).max(VERDICT_GRACE))?;
    }
    Ok(Registration {
        problem: None,
        rank0_world_size: Some(rank0_world_size),
    })
}

/// Writes `proposal` as the job's verdict if no rank has yet, else reads the verdict written.
/// `wait` bounds the wait for a verdict claimed by another rank but not yet written.
fn decide(store: &StoreClient, proposal: Verdict, wait: Duration) -> Result<Verdict, RendezvousError> {
    if store.add(VERDICT_CLAIM_KEY, 1)? == 1 {
        store.set(VERDICT_KEY, &proposal.encode())?;
        return Ok(proposal);
    }
    match store.try_get(VERDICT_KEY, wait)? {
        Some(verdict) => Ok(Verdict::decode(&verdict)),
        None => Err(RendezvousError::Rendezvous(format!(
            "another rank claimed the rendezvous's verdict but did not write it within {}: it failed or was \
             stopped while joining; see its output",
            seconds(wait)
        ))),
    }
}

/// The problem of a job whose ranks did not all register within `timeout`, naming the missing
/// ranks of `0..world_size`.
fn missing(store: &StoreClient, world_size: usize, timeout: Duration) -> Result<String, RendezvousError> {
    let joined = store.add(JOINED_KEY, 0)?;
    let mut absent = Vec::new();
    let mut absent_count = 0usize;
    for rank in 0..world_size {
        if store.add(&rank_key(rank), 0)? == 0 {
            absent_count += 1;
            if absent.len() < MISSING_NAMED {
                absent.push(rank.to_string());
            }
        }
    }
    let more = absent_count - absent.len();
    let named = match (absent_count, more) {
        (0, _) => "none missing, yet the ranks did not all complete the join".to_string(),
        (1, _) => format!("rank {} is missing", absent[0]),
        (_, 0) => format!("ranks {} are missing", absent.join(", ")),
        _ => format!("ranks {} and {more} more are missing", absent.join(", ")),
    };
    Ok(format!(
        "only {joined} of {world_size} ranks joined within {}: {named}; they did not start, failed before \
         joining (see their output), or were given another MASTER_ADDR or MASTER_PORT",
        seconds(timeout)
    ))
}

/// On rank 0, after a failed join: keeps `server` answering in the background, for at most
/// `timeout`, until as many processes as the job is known to have (those registered, or the
/// largest `WORLD_SIZE` any of them claimed, whichever is more) have read the failure and no
/// client is connected; then closes it. So a rank still starting learns the job's problem
/// instead of finding no store, while rank 0 reports the failure at once.
pub(super) fn serve_stragglers(server: StoreServer, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    // If no thread can be started, the store closes at once (ranks still joining report a lost
    // or missing store instead of the problem).
    let _ = thread::Builder::new()
        .name("rendezvous-stragglers".into())
        .spawn(move || {
            while Instant::now() < deadline && !everyone_told(&server) {
                thread::sleep(LINGER_POLL);
            }
            drop(server);
        });
}

/// Whether every process the job is known to have has read the failure and left.
fn everyone_told(server: &StoreServer) -> bool {
    if server.clients() > 0 {
        return false;
    }
    let counter = |value: &[u8]| <[u8; 8]>::try_from(value).map_or(0, i64::from_le_bytes);
    let (mut told, mut members, mut largest_world) = (0, 0, 0);
    for (key, value) in server.values_under("burn-shard/") {
        if key == TOLD_KEY {
            told = counter(&value);
        } else if key == MEMBERS_KEY {
            members = counter(&value);
        } else if key.starts_with(MEMBER_PREFIX) {
            // "RANK WORLD_SIZE": the world this member expects.
            let world = std::str::from_utf8(&value)
                .ok()
                .and_then(|v| v.split_once(' '))
                .and_then(|(_, world)| world.parse::<i64>().ok());
            largest_world = largest_world.max(world.unwrap_or(0));
        }
    }
    told >= members.max(largest_world)
}

fn parse_world_size(bytes: &[u8]) -> Result<usize, RendezvousError> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| {
            RendezvousError::Rendezvous(format!(
                "the rendezvous holds WORLD_SIZE {:?}, not a number: all ranks must run the same burn-shard version",
                String::from_utf8_lossy(bytes)
            ))
        })
}

/// Time left until `deadline` (zero once it has passed).
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}
