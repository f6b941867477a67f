//! Multi-process jobs without a GPU: the rendezvous store (ranks as threads over real TCP), the
//! launcher's environment as `RendezvousEnv` reads it, the grouped collectives against their
//! single-tensor loops, and `burn-shard-run`'s core (`launch`) on `sh` children, fail-fast
//! included. Every failure must be an error within a bounded time, never a hang.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn::tensor::DType;
use burn_shard_comm::{
    Collective, CollectiveKind, CommError, InProcessGroup, JobToken, ReduceOp, Rendezvous, RendezvousEnv, StoreClient,
    StoreServer, run_ranks,
};
use burn_shard_launch::{LaunchConfig, LaunchError, OutputLine, OutputMode, OutputStream, launch, parse_args};

use crate::common::Rng;

const SECOND: Duration = Duration::from_secs(1);

/// The job token of these tests' stores and ranks.
pub(crate) const TEST_TOKEN: &str = "0123456789abcdef0123456789abcdef-launch-tests";

pub(crate) fn token() -> JobToken {
    JobToken::new(TEST_TOKEN).unwrap()
}

pub(crate) fn local_server() -> (StoreServer, String) {
    let server = StoreServer::bind("127.0.0.1:0", token()).expect("bind a local store");
    let addr = server.local_addr().to_string();
    (server, addr)
}

/// A port that was free a moment ago (the OS does not hand it out again right away).
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The message of a rendezvous error, as `burn_shard_comm` reports it (the rendezvous crate's
/// own errors convert into `CommError` with the same message).
pub(crate) fn rendezvous_msg(result: Result<impl std::fmt::Debug, impl Into<CommError>>) -> String {
    match result.map_err(Into::into) {
        Err(CommError::Rendezvous(msg)) => msg,
        other => panic!("expected a rendezvous error, got {other:?}"),
    }
}

// ---------------------------------------------------------------- the store

#[test]
fn store_set_get_add_and_barrier_across_ranks() {
    let (server, addr) = local_server();
    let world_size = 4;
    let out: Vec<(Vec<Vec<u8>>, i64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
                    // Ranks publish at different times: `get` must wait for late keys.
                    std::thread::sleep(Duration::from_millis(40 * (world_size - rank) as u64));
                    store.set(&format!("key/{rank}"), &vec![rank as u8; rank + 1]).unwrap();
                    let seen = (0..world_size)
                        .map(|r| store.get(&format!("key/{r}"), 5 * SECOND).unwrap())
                        .collect();
                    let ticket = store.add("counter", 10).unwrap();
                    store.barrier(world_size, 5 * SECOND).unwrap();
                    store.barrier(world_size, 5 * SECOND).unwrap(); // a second, distinct barrier
                    // Everyone has added before anyone leaves the barrier.
                    assert_eq!(store.add("counter", 0).unwrap(), 10 * world_size as i64);
                    (seen, ticket)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (seen, _) in &out {
        for (r, value) in seen.iter().enumerate() {
            assert_eq!(value, &vec![r as u8; r + 1]);
        }
    }
    let mut tickets: Vec<i64> = out.iter().map(|(_, t)| *t).collect();
    tickets.sort();
    assert_eq!(tickets, vec![10, 20, 30, 40], "add is atomic");
    drop(server);
}

#[test]
fn get_of_a_key_never_set_is_an_error_after_its_timeout() {
    let (_server, addr) = local_server();
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    let start = Instant::now();
    let msg = rendezvous_msg(store.get("nccl-id", Duration::from_millis(300)));
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(300) && took < 5 * SECOND, "took {took:?}");
    assert!(
        msg.contains("'nccl-id'") && msg.contains("0.3 s") && msg.contains("rank 0"),
        "{msg}"
    );
    // A timed-out get is an answer, not a broken connection.
    store.set("nccl-id", b"x").unwrap();
    assert_eq!(store.get("nccl-id", SECOND).unwrap(), b"x");
}

#[test]
fn connecting_to_a_closed_port_is_an_error_in_bounded_time() {
    let addr = format!("127.0.0.1:{}", free_port());
    let start = Instant::now();
    let msg = rendezvous_msg(StoreClient::connect(&addr, &token(), Duration::from_millis(500)));
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(500) && took < 5 * SECOND, "took {took:?}");
    assert!(msg.contains(&addr) && msg.contains("0.5 s"), "{msg}");
    assert!(msg.contains("MASTER_ADDR") && msg.contains("MASTER_PORT"), "{msg}");
}

#[test]
fn connecting_waits_for_a_store_that_starts_late() {
    let port = free_port();
    let (done, wait_done) = std::sync::mpsc::channel::<()>();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let server = StoreServer::bind(("127.0.0.1", port), token()).unwrap();
        let _ = wait_done.recv_timeout(10 * SECOND);
        drop(server);
    });
    let start = Instant::now();
    let store = StoreClient::connect(&format!("127.0.0.1:{port}"), &token(), 10 * SECOND).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(250),
        "connected before the store existed"
    );
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k", SECOND).unwrap(), b"v");
    done.send(()).unwrap();
    late.join().unwrap();
}

#[test]
fn another_program_on_the_port_is_named_not_misread() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stranger = std::thread::spawn(move || {
        use std::io::Write;
        let (mut stream, _) = listener.accept().unwrap();
        let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    let start = Instant::now();
    let msg = rendezvous_msg(StoreClient::connect(&addr, &token(), 10 * SECOND));
    assert!(start.elapsed() < 5 * SECOND);
    assert!(
        msg.contains("not as a burn-shard rendezvous") && msg.contains("MASTER_PORT"),
        "{msg}"
    );
    stranger.join().unwrap();
}

#[test]
fn a_barrier_that_a_rank_misses_says_how_many_arrived() {
    let (_server, addr) = local_server();
    let start = Instant::now();
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let addr = addr.clone();
                s.spawn(move || {
                    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
                    rendezvous_msg(store.barrier(3, Duration::from_millis(300)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(start.elapsed() < 5 * SECOND);
    for msg in errors {
        assert!(msg.contains("only 2 of 3 ranks"), "{msg}");
    }
}

#[test]
fn a_store_that_goes_away_fails_waiting_ranks_at_once() {
    let (server, addr) = local_server();
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        let result = store.get("never", 30 * SECOND);
        (rendezvous_msg(result), start.elapsed(), store)
    });
    std::thread::sleep(Duration::from_millis(200));
    drop(server);
    let (msg, took, store) = waiter.join().unwrap();
    assert!(took < 5 * SECOND, "took {took:?}");
    assert!(msg.contains("lost the connection") && msg.contains("rank 0"), "{msg}");
    // Later calls report the same cause instead of reading a stale reply.
    assert!(rendezvous_msg(store.set("k", b"v")).contains("lost the connection"));
}

#[test]
fn oversized_keys_and_non_counters_are_errors_that_keep_the_connection() {
    let (_server, addr) = local_server();
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    let long_key = "k".repeat(burn_shard_comm::MAX_KEY_BYTES + 1);
    assert!(rendezvous_msg(store.set(&long_key, b"v")).contains("limit"));
    store.set("bytes", b"abc").unwrap();
    assert!(rendezvous_msg(store.add("bytes", 1)).contains("not a counter"));
    assert_eq!(store.add("fresh", 5).unwrap(), 5);
    assert_eq!(store.get("bytes", SECOND).unwrap(), b"abc");
}

#[test]
fn a_port_in_use_is_an_error_naming_master_port() {
    let (_server, addr) = local_server();
    let msg = rendezvous_msg(StoreServer::bind(addr.as_str(), token()));
    assert!(msg.contains("MASTER_PORT"), "{msg}");
}

// ---------------------------------------------------------------- the environment

pub(crate) fn job_vars(rank: usize, world_size: usize, port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world_size.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world_size.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("BURN_SHARD_JOB_TOKEN", TEST_TOKEN.into()),
    ]
}

fn env_error(vars: &[(&'static str, String)]) -> (&'static str, String) {
    match RendezvousEnv::from_vars(vars.iter().cloned()).map_err(CommError::from) {
        Err(e @ CommError::Env { var, .. }) => (var, e.to_string()),
        other => panic!("expected an environment error for {vars:?}, got {other:?}"),
    }
}

fn with(mut vars: Vec<(&'static str, String)>, name: &str, value: &str) -> Vec<(&'static str, String)> {
    vars.iter_mut().find(|(k, _)| *k == name).unwrap().1 = value.to_string();
    vars
}

#[test]
fn environment_is_parsed_and_each_problem_names_its_variable() {
    let good = job_vars(2, 4, 29500);
    let env = RendezvousEnv::from_vars(good.iter().cloned()).unwrap();
    assert_eq!(
        env,
        RendezvousEnv {
            rank: 2,
            world_size: 4,
            local_rank: 2,
            local_world_size: 4,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            token: token(),
        }
    );
    assert_eq!(env.master(), "127.0.0.1:29500");
    let v6 = RendezvousEnv::from_vars(with(good.clone(), "MASTER_ADDR", "[::1]")).unwrap();
    assert_eq!((v6.master_addr.as_str(), v6.master().as_str()), ("::1", "[::1]:29500"));

    for (name, _) in &good {
        let missing: Vec<_> = good.iter().filter(|(k, _)| k != name).cloned().collect();
        let (var, msg) = env_error(&missing);
        assert_eq!(var, *name);
        assert!(msg.contains("is not set") && msg.contains("burn-shard-run"), "{msg}");
    }
    let cases = [
        ("RANK", "two", "RANK", "\"two\""),
        ("RANK", "4", "RANK", "WORLD_SIZE is 4"),
        ("WORLD_SIZE", "0", "WORLD_SIZE", "at least 1"),
        ("WORLD_SIZE", "-1", "WORLD_SIZE", "non-negative integer"),
        ("LOCAL_WORLD_SIZE", "8", "LOCAL_WORLD_SIZE", "WORLD_SIZE is 4"),
        ("LOCAL_RANK", "4", "LOCAL_RANK", "LOCAL_WORLD_SIZE is 4"),
        ("MASTER_PORT", "70000", "MASTER_PORT", "1..=65535"),
        ("MASTER_PORT", "0", "MASTER_PORT", "1..=65535"),
        ("MASTER_ADDR", " ", "MASTER_ADDR", "is empty"),
    ];
    for (name, value, want_var, want_text) in cases {
        let (var, msg) = env_error(&with(good.clone(), name, value));
        assert_eq!(var, want_var, "{name}={value}: {msg}");
        assert!(msg.contains(want_text), "{name}={value}: {msg}");
    }
}

#[test]
fn ranks_meet_through_the_rendezvous_built_from_their_environment() {
    let port = free_port();
    let world_size = 3;
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                s.spawn(move || {
                    let env = RendezvousEnv::from_vars(job_vars(rank, world_size, port)).unwrap();
                    let rendezvous = Rendezvous::new(env, 10 * SECOND).unwrap();
                    assert_eq!(rendezvous.server_addr().is_some(), rank == 0, "only rank 0 hosts");
                    if rank == 0 {
                        rendezvous.store().set("id", b"from rank 0").unwrap();
                    }
                    let id = rendezvous.store().get("id", 10 * SECOND).unwrap();
                    rendezvous.barrier(10 * SECOND).unwrap();
                    // Dropped at once on every rank: rank 0's drop must wait for the others
                    // to leave, or a rank still reading the barrier's release loses the store.
                    drop(rendezvous);
                    id
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(got.iter().all(|id| id == b"from rank 0"), "{got:?}");
}

/// One rank to start as a thread: its `RANK`, its `WORLD_SIZE`, and how long it starts late.
#[derive(Clone, Copy)]
struct Member {
    rank: usize,
    world_size: usize,
    late: Duration,
}

/// Ranks `(RANK, WORLD_SIZE)` that all start at once.
fn at_once(members: &[Claim]) -> Vec<Member> {
    members
        .iter()
        .map(|&(rank, world_size)| Member {
            rank,
            world_size,
            late: Duration::ZERO,
        })
        .collect()
}

/// Joins `members` as threads through one rendezvous; returns, per member, the error message
/// (`None` once joined) and how long `Rendezvous::new` took. Joined ranks exchange a key and
/// pass a barrier, and every rendezvous is kept until all members have returned (so a late
/// member still finds the store).
fn join_as_threads(members: &[Member], timeout: Duration) -> Vec<(Option<String>, Duration)> {
    let port = free_port();
    let all_returned = std::sync::Barrier::new(members.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .map(|&m| {
                let all_returned = &all_returned;
                s.spawn(move || {
                    std::thread::sleep(m.late);
                    let env = RendezvousEnv::from_vars(job_vars(m.rank, m.world_size, port)).unwrap();
                    let start = Instant::now();
                    let result = Rendezvous::new(env, timeout);
                    let took = start.elapsed();
                    let outcome = match &result {
                        Ok(rendezvous) => {
                            let store = rendezvous.store();
                            store.set(&format!("hello/{}", m.rank), b"hi").unwrap();
                            let peer = (m.rank + 1) % m.world_size;
                            assert_eq!(store.get(&format!("hello/{peer}"), 10 * SECOND).unwrap(), b"hi");
                            rendezvous.barrier(10 * SECOND).unwrap();
                            None
                        }
                        Err(e) => Some(rendezvous_msg(Err::<(), _>(e.clone()))),
                    };
                    all_returned.wait();
                    drop(result);
                    (outcome, took)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// What a rank claims: `(RANK, WORLD_SIZE)`.
type Claim = (usize, usize);

/// The longest time a member of [`join_as_threads`] took.
fn slowest(results: &[(Option<String>, Duration)]) -> Duration {
    results.iter().map(|(_, took)| *took).max().unwrap_or_default()
}

#[test]
fn ranks_of_every_world_size_join_and_late_ranks_are_waited_for() {
    for world_size in 1..=4 {
        // Highest rank first: the others arrive while it waits, rank 0 (the host) last.
        let members: Vec<Member> = (0..world_size)
            .map(|rank| Member {
                rank,
                world_size,
                late: Duration::from_millis(60 * (world_size - 1 - rank) as u64),
            })
            .collect();
        for (rank, (error, took)) in join_as_threads(&members, 10 * SECOND).into_iter().enumerate() {
            assert_eq!(error, None, "world_size {world_size} rank {rank}");
            assert!(took < 5 * SECOND, "world_size {world_size} rank {rank} took {took:?}");
        }
    }
}

#[test]
fn duplicate_ranks_fail_every_rank_at_once_naming_the_rank() {
    let timeout = 3 * SECOND;
    // The reported case, and duplicates that also leave a rank missing.
    let cases: [(&[(usize, usize)], usize); 3] = [
        (&[(0, 3), (1, 3), (1, 3)], 1),
        (&[(0, 3), (2, 3), (2, 3)], 2),
        (&[(0, 4), (3, 4), (1, 4), (3, 4)], 3),
    ];
    for (members, duplicate) in cases {
        let results = join_as_threads(&at_once(members), timeout);
        eprintln!("{members:?}: every rank failed within {:?}", slowest(&results));
        for ((rank, _), (error, took)) in members.iter().zip(results) {
            let ctx = format!("{members:?}, rank {rank}");
            let msg = error.unwrap_or_else(|| panic!("{ctx}: joined despite a duplicate RANK"));
            assert!(
                msg.contains(&format!("rank {duplicate} is duplicated")) && msg.contains(&format!("RANK={duplicate}")),
                "{ctx}: {msg}"
            );
            assert!(msg.contains("--node-rank"), "{ctx}: the fix is named: {msg}");
            // Found as the duplicate registers, not at the timeout.
            assert!(took < timeout / 2, "{ctx}: took {took:?}");
        }
    }
}

#[test]
fn disagreeing_world_sizes_fail_every_rank_naming_both_sizes() {
    let timeout = 3 * SECOND;
    // (members, rank 0's size, the other size, more to find); in none of them can the ranks
    // that agree with rank 0 complete a job on their own.
    let cases: [(&[Claim], usize, usize, &str); 4] = [
        (&[(0, 2), (1, 3), (2, 3)], 2, 3, ""),
        (&[(0, 2), (2, 3)], 2, 3, "RANK 2 is out of rank 0's range 0..2"),
        (&[(0, 3), (1, 2)], 3, 2, ""),
        (&[(0, 4), (1, 2), (2, 4), (3, 4)], 4, 2, ""),
    ];
    for (members, rank0_size, other_size, more) in cases {
        let results = join_as_threads(&at_once(members), timeout);
        eprintln!("{members:?}: every rank failed within {:?}", slowest(&results));
        for ((rank, _), (error, took)) in members.iter().zip(results) {
            let ctx = format!("{members:?}, rank {rank}");
            let msg = error.unwrap_or_else(|| panic!("{ctx}: joined despite disagreeing WORLD_SIZEs"));
            assert!(
                msg.contains(&format!("rank 0 has WORLD_SIZE {rank0_size}"))
                    && msg.contains(&format!("has WORLD_SIZE {other_size} but")),
                "{ctx}: {msg}"
            );
            assert!(msg.contains(more) && msg.contains("same WORLD_SIZE"), "{ctx}: {msg}");
            assert!(took < timeout / 2, "{ctx}: took {took:?}");
        }
    }

    // A disagreeing rank that arrives once the others have all joined cannot stop them any
    // more: it fails alone, and says so.
    let mut members = at_once(&[(0, 2), (1, 2), (2, 3)]);
    members[2].late = Duration::from_millis(500);
    let results = join_as_threads(&members, timeout);
    assert_eq!((&results[0].0, &results[1].0), (&None, &None));
    let msg = results[2].0.clone().expect("the late rank 2 of 3 fails");
    assert!(
        msg.contains("rank 2 has WORLD_SIZE 3 but rank 0 has WORLD_SIZE 2")
            && msg.contains("joined before this process"),
        "{msg}"
    );
}

#[test]
fn missing_ranks_fail_every_rank_after_the_timeout_naming_them() {
    let timeout = SECOND;
    let cases: [(&[(usize, usize)], &str); 3] = [
        (
            &[(0, 3), (2, 3)],
            "only 2 of 3 ranks joined within 1 s: rank 1 is missing",
        ),
        (
            &[(0, 4)],
            "only 1 of 4 ranks joined within 1 s: ranks 1, 2, 3 are missing",
        ),
        // Nobody hosts the store: each rank gives up connecting.
        (&[(1, 3), (2, 3)], "is rank 0 running"),
    ];
    for (members, want) in cases {
        let results = join_as_threads(&at_once(members), timeout);
        eprintln!("{members:?}: every rank failed within {:?}", slowest(&results));
        for ((rank, _), (error, took)) in members.iter().zip(results) {
            let ctx = format!("{members:?}, rank {rank}");
            let msg = error.unwrap_or_else(|| panic!("{ctx}: joined with ranks missing"));
            assert!(msg.contains(want), "{ctx}: {msg}");
            // The first rank to give up fails the others at once: nobody waits much longer.
            assert!(
                took >= timeout / 2 && took < timeout + 2 * SECOND,
                "{ctx}: took {took:?}"
            );
        }
    }
}

// ---------------------------------------------------------------- grouped collectives

fn tensor(values: Vec<f32>) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), &Device::flex())
}

fn host(t: Tensor<1>) -> Vec<u32> {
    t.into_data().convert::<f32>().iter::<f32>().map(f32::to_bits).collect()
}

/// A bucket of tensors of this rank: lengths divisible by `world_size`, one of them bf16.
fn bucket(rank: usize, world_size: usize, seed: u64) -> Vec<Tensor<1>> {
    [3, 1, 7, 2]
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let t = tensor(Rng::new(seed + 10 * rank as u64 + i as u64).vec(k * world_size));
            if i == 2 { t.cast(DType::BF16) } else { t }
        })
        .collect()
}

#[test]
fn grouped_collectives_equal_their_single_tensor_loops() {
    for world_size in 1..=4 {
        let out = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            let r = comm.rank();
            let dtypes: Vec<DType> = bucket(r, world_size, 1).iter().map(|t| t.dtype()).collect();
            let before = comm.stats();
            let gathered = comm.all_gather_many(bucket(r, world_size, 1)).unwrap();
            let grouped_stats = comm.stats().since(&before);
            let before = comm.stats();
            let looped: Vec<_> = bucket(r, world_size, 1)
                .into_iter()
                .map(|t| comm.all_gather(t).unwrap())
                .collect();
            let loop_stats = comm.stats().since(&before);
            // Traffic only: the time counters differ from run to run.
            let traffic = |s: &burn_shard_comm::CommStats| {
                [
                    CollectiveKind::AllReduce,
                    CollectiveKind::ReduceScatter,
                    CollectiveKind::AllGather,
                    CollectiveKind::Broadcast,
                    CollectiveKind::Barrier,
                ]
                .map(|k| s.get(k))
            };
            assert_eq!(
                traffic(&grouped_stats),
                traffic(&loop_stats),
                "all_gather_many counts one call per tensor"
            );
            assert_eq!(grouped_stats.get(CollectiveKind::AllGather).calls, 4);
            let out_dtypes: Vec<DType> = gathered.iter().map(|t| t.dtype()).collect();
            assert_eq!(out_dtypes, dtypes, "dtypes are kept");

            let mut reduced = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let many = comm.reduce_scatter_many(bucket(r, world_size, 2), op).unwrap();
                let single: Vec<_> = bucket(r, world_size, 2)
                    .into_iter()
                    .map(|t| comm.reduce_scatter(t, op).unwrap())
                    .collect();
                reduced.push((
                    many.into_iter().map(host).collect::<Vec<_>>(),
                    single.into_iter().map(host).collect::<Vec<_>>(),
                ));
            }
            assert!(comm.all_gather_many(Vec::new()).unwrap().is_empty());
            assert!(comm.reduce_scatter_many(Vec::new(), ReduceOp::Sum).unwrap().is_empty());
            let gathered: Vec<_> = gathered.into_iter().map(host).collect();
            let looped: Vec<_> = looped.into_iter().map(host).collect();
            (gathered, looped, reduced)
        })
        .unwrap();
        for (rank, (gathered, looped, reduced)) in out.into_iter().enumerate() {
            let ctx = format!("world_size {world_size} rank {rank}");
            assert_eq!(gathered, looped, "{ctx}: all_gather_many");
            let lens: Vec<usize> = gathered.iter().map(Vec::len).collect();
            assert_eq!(
                lens,
                vec![
                    3 * world_size * world_size,
                    world_size * world_size,
                    7 * world_size * world_size,
                    2 * world_size * world_size
                ],
                "{ctx}"
            );
            for (many, single) in reduced {
                assert_eq!(many, single, "{ctx}: reduce_scatter_many");
                let lens: Vec<usize> = many.iter().map(Vec::len).collect();
                assert_eq!(lens, vec![3, 1, 7, 2], "{ctx}");
            }
        }
    }
}

#[test]
fn grouped_reduce_scatter_of_an_indivisible_tensor_is_an_error() {
    let out = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        comm.reduce_scatter_many(vec![tensor(vec![1.0; 4]), tensor(vec![1.0; 3])], ReduceOp::Sum)
            .err()
    })
    .unwrap();
    for err in out {
        assert!(
            matches!(
                err,
                Some(CommError::NotDivisible {
                    len: 3,
                    world_size: 2,
                    ..
                })
            ),
            "{err:?}"
        );
    }
}

// ---------------------------------------------------------------- the launcher

/// A fresh, empty directory for one test's files.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-shard-launch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn sh(script: &str, nproc: usize) -> LaunchConfig {
    LaunchConfig::new("sh", nproc)
        .with_args(["-c", script, "sh"])
        .with_output(OutputMode::Capture)
}

/// Whether `pid` has ended (gone, or a zombie waiting for a reaper that is not us).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name in parentheses: "pid (comm) S ...".
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

fn pids_in(dir: &Path, prefix: &str) -> Vec<u32> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            name.starts_with(prefix)
                .then(|| std::fs::read_to_string(e.path()).unwrap().trim().parse().unwrap())
        })
        .collect()
}

#[test]
fn every_rank_runs_with_its_rank_environment() {
    // Node 1 of 2, three ranks per node: global ranks 3, 4, 5 of 6.
    let config = sh(
        "env; echo \"CVD=${CUDA_VISIBLE_DEVICES-unset}\"; echo to-stderr >&2; printf 'no newline\\r\\nlast'",
        3,
    )
    .with_nodes(2, 1)
    .with_master("10.1.2.3", 29511)
    .with_token(token());
    let outcome = launch(&config).unwrap();
    let ranks: Vec<(usize, usize, Option<i32>)> = outcome
        .ranks
        .iter()
        .map(|r| (r.rank, r.local_rank, r.status.code()))
        .collect();
    assert_eq!(ranks, vec![(3, 0, Some(0)), (4, 1, Some(0)), (5, 2, Some(0))]);
    let cvd = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
    for local_rank in 0..3 {
        let rank = 3 + local_rank;
        let stdout: Vec<&OutputLine> = outcome
            .output
            .iter()
            .filter(|l| l.rank == rank && l.stream == OutputStream::Stdout)
            .collect();
        let vars = stdout.iter().filter_map(|l| l.text.split_once('='));
        let env = RendezvousEnv::from_vars(vars).unwrap();
        assert_eq!(
            env,
            RendezvousEnv {
                rank,
                world_size: 6,
                local_rank,
                local_world_size: 3,
                master_addr: "10.1.2.3".into(),
                master_port: 29511,
                token: token(),
            }
        );
        assert!(
            stdout.iter().any(|l| l.text == format!("CVD={cvd}")),
            "CUDA_VISIBLE_DEVICES is passed unchanged"
        );
        let tail: Vec<&str> = stdout.iter().rev().take(2).rev().map(|l| l.text.as_str()).collect();
        assert_eq!(tail, ["no newline", "last"], "CRLF and an unterminated last line");
        let stderr: Vec<String> = outcome
            .output
            .iter()
            .filter(|l| l.rank == rank && l.stream == OutputStream::Stderr)
            .map(ToString::to_string)
            .collect();
        assert_eq!(stderr, [format!("[rank {rank}] to-stderr")]);
    }
}

/// One rank of [`processes_meet_through_the_launcher`]: this test binary, started by `launch`.
#[test]
#[ignore = "a rank process of launch::processes_meet_through_the_launcher, which starts it"]
fn rank_process() {
    let Ok(env) = RendezvousEnv::from_env() else {
        return; // started by hand, not by the launcher: there is no job to join
    };
    let rendezvous = Rendezvous::new(env.clone(), 30 * SECOND).unwrap();
    if env.rank == 0 {
        rendezvous.store().set("greeting", b"hello from rank 0").unwrap();
    }
    let got = rendezvous.store().get("greeting", 30 * SECOND).unwrap();
    rendezvous.barrier(30 * SECOND).unwrap();
    println!(
        "rank {} of {} (local {}) got {:?}",
        env.rank,
        env.world_size,
        env.local_rank,
        String::from_utf8_lossy(&got)
    );
}

#[test]
fn processes_meet_through_the_launcher() {
    // Three processes of this test binary, each running only `rank_process`, exchange a key
    // through the store that rank 0 hosts at the address the launcher gave them all.
    let config = LaunchConfig::new(std::env::current_exe().unwrap(), 3)
        .with_args([
            "launch::rank_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .with_master("127.0.0.1", free_port())
        .with_output(OutputMode::Capture);
    let outcome = launch(&config).unwrap();
    assert_eq!(outcome.ranks.len(), 3);
    for rank in 0..3 {
        // The test harness prints the test name first on the same line.
        let want = format!("rank {rank} of 3 (local {rank}) got \"hello from rank 0\"");
        assert!(
            outcome.output.iter().any(|l| l.rank == rank && l.text.ends_with(&want)),
            "rank {rank} did not report {want:?}: {:#?}",
            outcome.output
        );
    }
}

#[test]
fn a_failing_rank_stops_every_other_rank_within_seconds() {
    let dir = scratch_dir("fail-fast");
    // Every rank records its shell and a child it started, then rank 1 fails once all four
    // ranks are up (so the others are surely running when it does).
    let script = r#"
        sleep 30 & echo $! > "$1/.c$RANK" && mv "$1/.c$RANK" "$1/child.$RANK"
        echo $$ > "$1/.s$RANK" && mv "$1/.s$RANK" "$1/shell.$RANK"
        if [ "$RANK" = 1 ]; then
            while [ "$(ls "$1" | wc -l)" -lt 8 ]; do sleep 0.02; done
            echo "rank 1 gives up" >&2
            exit 3
        fi
        wait
    "#;
    let config = LaunchConfig::new("sh", 4)
        .with_args(["-c", script, "sh", dir.to_str().unwrap()])
        .with_output(OutputMode::Capture);
    let start = Instant::now();
    let err = launch(&config).unwrap_err();
    let took = start.elapsed();
    assert!(took < 10 * SECOND, "took {took:?}: the sleeping ranks were not stopped");
    match &err {
        LaunchError::RankFailed {
            rank: 1,
            local_rank: 1,
            status,
            stopped: 3,
        } => assert_eq!(status.code(), Some(3)),
        other => panic!("expected rank 1 to fail, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("rank 1") && msg.contains("exit status: 3"), "{msg}");
    assert_eq!(err.exit_code(), 3);
    assert!(!ended(std::process::id()), "the liveness check sees a live process");
    let pids = [pids_in(&dir, "shell."), pids_in(&dir, "child.")].concat();
    assert_eq!(pids.len(), 8, "every rank started");
    // The children are killed with their rank's process group; give init a moment to reap them.
    let deadline = Instant::now() + 5 * SECOND;
    while !pids.iter().all(|&p| ended(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive: Vec<_> = pids.iter().filter(|&&p| !ended(p)).collect();
    assert!(alive.is_empty(), "still running after launch returned: {alive:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let dir = scratch_dir("grace");
    let script = r#"
        if [ "$RANK" = 0 ]; then
            while [ ! -e "$1/ready" ]; do sleep 0.02; done
            exit 1
        fi
        trap '' TERM
        touch "$1/ready"
        sleep 30
    "#;
    let grace = Duration::from_millis(400);
    let config = LaunchConfig::new("sh", 2)
        .with_args(["-c", script, "sh", dir.to_str().unwrap()])
        .with_output(OutputMode::Capture)
        .with_stop_grace(grace);
    let start = Instant::now();
    let err = launch(&config).unwrap_err();
    let took = start.elapsed();
    assert!(took >= grace && took < 10 * SECOND, "took {took:?}");
    assert!(
        matches!(
            err,
            LaunchError::RankFailed {
                rank: 0,
                stopped: 1,
                ..
            }
        ),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_killed_by_a_signal_is_a_failure() {
    let err = launch(&sh("if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30", 2)).unwrap_err();
    match &err {
        LaunchError::RankFailed { rank: 0, status, .. } => {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(9));
        }
        other => panic!("expected rank 0 killed, got {other:?}"),
    }
    assert_eq!(err.exit_code(), 128 + 9);
    assert!(err.to_string().contains("SIGKILL"), "{err}");
}

#[test]
fn a_program_that_cannot_start_is_an_error_naming_it() {
    let config = LaunchConfig::new("/nonexistent/burn-shard-program", 3);
    let err = launch(&config).unwrap_err();
    assert!(matches!(err, LaunchError::Spawn { rank: 0, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("/nonexistent/burn-shard-program") && msg.contains("PATH"),
        "{msg}"
    );
    assert_eq!(err.exit_code(), 127);
}

#[test]
fn invalid_configurations_are_errors_before_anything_starts() {
    let base = || LaunchConfig::new("true", 2);
    let cases = [
        (LaunchConfig::new("true", 0), "nproc_per_node"),
        (base().with_nodes(2, 2), "node_rank 2"),
        (base().with_nodes(0, 0), "nnodes"),
        (base().with_master("10.0.0.1", 0), "master_port"),
        (base().with_master("", 29500), "master_addr"),
        (LaunchConfig::new("", 1), "no program"),
    ];
    for (config, want) in cases {
        match launch(&config) {
            Err(e @ LaunchError::Config(_)) => {
                assert!(e.to_string().contains(want), "{e}");
                assert_eq!(e.exit_code(), 2);
            }
            other => panic!("{want}: expected a configuration error, got {other:?}"),
        }
    }
}

#[test]
fn the_command_line_reads_like_torchrun() {
    let dir = scratch_dir("cli-token");
    let token_file = dir.join("job.token");
    std::fs::write(&token_file, format!("{TEST_TOKEN}\n")).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let config = parse_args([
        "burn-shard-run",
        "--nproc-per-node",
        "8",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29600",
        "--job-token-file",
        token_file.to_str().unwrap(),
        "--",
        "python",
        "train.py",
        "--lr",
        "3e-4",
    ])
    .unwrap();
    assert_eq!(config.program, "python");
    assert_eq!(config.args, ["train.py", "--lr", "3e-4"]);
    assert_eq!((config.nproc_per_node, config.nnodes, config.node_rank), (8, 2, 1));
    assert_eq!((config.master_addr.as_str(), config.master_port), ("10.0.0.1", 29600));
    assert_eq!((config.world_size(), config.rank(3)), (16, 11));
    assert_eq!(config.token, Some(token()), "the token is read from --job-token-file");

    // torchrun's underscores, and no `--` before the program.
    let config = parse_args(["burn-shard-run", "--nproc_per_node=2", "./train", "-v"]).unwrap();
    assert_eq!((config.program.to_str(), config.args.len()), (Some("./train"), 1));
    assert_eq!((config.master_addr.as_str(), config.master_port), ("127.0.0.1", 29500));

    let err = |args: &[&str]| parse_args(args.iter().copied()).unwrap_err().to_string();
    assert!(err(&["burn-shard-run", "--nproc-per-node", "2", "--nnodes", "2", "x"]).contains("--master-addr"));
    assert!(err(&["burn-shard-run", "--nproc-per-node", "2"]).contains("PROGRAM"));
    assert!(err(&["burn-shard-run", "x"]).contains("--nproc-per-node"));
    assert!(err(&["burn-shard-run", "--nproc-per-node", "1", "--stop-grace=-1", "x"]).contains("--stop-grace"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where [`launcher_process`] has its ranks record their pids, and how many it starts.
const LAUNCHER_DIR_VAR: &str = "BURN_SHARD_TEST_LAUNCHER_DIR";
const LAUNCHER_NPROC_VAR: &str = "BURN_SHARD_TEST_LAUNCHER_NPROC";
/// The line [`launcher_process`] prints right before it starts its ranks.
const LAUNCHING: &str = "launcher: starting the ranks";

/// A launcher to kill: this test binary, started by [`start_launcher`], does what
/// `burn-shard-run` does (termination signals forwarded, then `launch`) with ranks that record
/// their pid first thing (`pid.<RANK>` in the given directory), then sleep.
#[test]
#[ignore = "the launcher process of the launch::ranks_die_with_a_launcher_killed_* tests, which start it"]
fn launcher_process() {
    use std::io::Write;
    let (Ok(dir), Ok(nproc)) = (std::env::var(LAUNCHER_DIR_VAR), std::env::var(LAUNCHER_NPROC_VAR)) else {
        return; // started by hand, not by a test: nothing to launch
    };
    let script = r#"echo $$ > "$1/pid.$RANK"; exec sleep 1000"#;
    let config = LaunchConfig::new("sh", nproc.parse().unwrap())
        .with_args(["-c", script, "sh", &dir])
        .with_output(OutputMode::Capture);
    burn_shard_launch::forward_termination_signals().unwrap();
    println!("{LAUNCHING}");
    std::io::stdout().flush().unwrap();
    let _ = launch(&config);
}

/// A [`launcher_process`] and the ranks it started: dropping it (a failed assertion included)
/// kills the launcher and every rank still running, so no test leaves processes behind.
struct KilledLauncher {
    launcher: std::process::Child,
    dir: PathBuf,
}

impl KilledLauncher {
    /// Starts the launcher with `nproc` ranks, and returns once it is about to start them.
    fn start(dir: &Path, nproc: usize) -> Self {
        use std::io::BufRead;
        let mut launcher = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "launch::launcher_process",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(LAUNCHER_DIR_VAR, dir)
            .env(LAUNCHER_NPROC_VAR, nproc.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = launcher.stdout.take().unwrap();
        let this = Self {
            launcher,
            dir: dir.to_path_buf(),
        };
        // The harness prints the test's name first, on the same line.
        let launching = std::io::BufReader::new(stdout)
            .lines()
            .any(|line| line.is_ok_and(|l| l.ends_with(LAUNCHING)));
        assert!(launching, "the launcher process ended before starting its ranks");
        this
    }

    /// The pids the ranks have recorded so far (a file still being written is skipped).
    fn rank_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = std::fs::read_dir(&self.dir)
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok()?.trim().parse().ok())
            .collect();
        pids.sort();
        pids
    }

    /// Kills the launcher with SIGKILL, so that it cannot stop its ranks itself, and reaps it.
    fn kill(&mut self) {
        self.launcher.kill().unwrap();
        self.launcher.wait().unwrap();
    }

    /// Waits up to `limit` for every recorded rank to end; returns how long that took, or the
    /// pids still running.
    fn ranks_ended_within(&self, limit: Duration) -> Result<Duration, Vec<u32>> {
        let start = Instant::now();
        loop {
            let alive: Vec<u32> = self.rank_pids().into_iter().filter(|&p| !ended(p)).collect();
            if alive.is_empty() {
                return Ok(start.elapsed());
            }
            if start.elapsed() >= limit {
                return Err(alive);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for KilledLauncher {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        for pid in self.rank_pids().into_iter().filter(|&p| !ended(p)) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn ranks_die_with_a_launcher_killed_by_sigkill() {
    let mut launcher = KilledLauncher::start(&scratch_dir("killed-launcher"), 2);
    let deadline = Instant::now() + 10 * SECOND;
    while launcher.rank_pids().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the ranks did not start: {:?}",
            launcher.rank_pids()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids = launcher.rank_pids();
    assert!(
        pids.iter().all(|&p| !ended(p)),
        "the ranks run before the launcher is killed"
    );
    launcher.kill();
    match launcher.ranks_ended_within(5 * SECOND) {
        Ok(took) => eprintln!("ranks {pids:?} ended {took:?} after their launcher was reaped"),
        Err(alive) => panic!("ranks {alive:?} outlived their launcher (killed by SIGKILL) by 5 s"),
    }
}

#[test]
fn ranks_die_with_a_launcher_killed_while_it_starts_them() {
    // Killed at once, or during the forks (between a rank's fork and its prctl, the rank must
    // notice it was orphaned already), or just after: no rank that got to record its pid
    // survives.
    let trials = 20;
    let mut started = Vec::new();
    for trial in 0..trials {
        let mut launcher = KilledLauncher::start(&scratch_dir(&format!("launcher-race-{trial}")), 4);
        std::thread::sleep(Duration::from_micros(1500 * trial));
        launcher.kill();
        if let Err(alive) = launcher.ranks_ended_within(5 * SECOND) {
            panic!("trial {trial}: ranks {alive:?} outlived their launcher by 5 s");
        }
        // A rank that survived without having recorded its pid yet would record it now.
        std::thread::sleep(Duration::from_millis(50));
        let alive: Vec<u32> = launcher.rank_pids().into_iter().filter(|&p| !ended(p)).collect();
        assert!(
            alive.is_empty(),
            "trial {trial}: ranks {alive:?} outlived their launcher"
        );
        started.push(launcher.rank_pids().len());
    }
    eprintln!("ranks that recorded their pid before the launcher was killed, per trial: {started:?}");
}

/// The NCCL side (feature `cuda`), run on every GPU by `cargo xtask multi-gpu-test` (its
/// `gpu::` filter selects this module): ranks as threads join one communicator through
/// `NcclComm::from_rendezvous_env`, as processes started by `burn-shard-run` do, and the
/// grouped collectives (one NCCL group) match the single calls.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use burn_shard_comm::NcclComm;

    use crate::gpu::{gpus, host as values};

    #[test]
    fn gpu_ranks_join_from_their_environment_and_grouped_calls_match_single_ones() {
        let n = gpus();
        if n == 0 {
            return;
        }
        let port = free_port();
        let out = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    s.spawn(move || {
                        let env = RendezvousEnv::from_vars(job_vars(rank, n, port)).unwrap();
                        let comm = NcclComm::from_rendezvous_env(&env, 60 * SECOND).expect("NCCL from the environment");
                        assert_eq!((comm.rank(), comm.world_size()), (rank, n));
                        let device = comm.device().clone();
                        let bucket = |seed: u64| -> Vec<Tensor<1>> {
                            [3usize, 1, 7]
                                .iter()
                                .enumerate()
                                .map(|(i, &k)| {
                                    let v = Rng::new(seed + 10 * rank as u64 + i as u64).vec(k * n);
                                    Tensor::from_data(TensorData::new(v, [k * n]), &device)
                                })
                                .collect()
                        };
                        let many: Vec<_> = comm
                            .all_gather_many(bucket(1))
                            .unwrap()
                            .into_iter()
                            .map(values)
                            .collect();
                        let single: Vec<_> = bucket(1)
                            .into_iter()
                            .map(|t| values(comm.all_gather(t).unwrap()))
                            .collect();
                        let rs_many: Vec<_> = comm
                            .reduce_scatter_many(bucket(2), ReduceOp::Avg)
                            .unwrap()
                            .into_iter()
                            .map(values)
                            .collect();
                        let rs_single: Vec<_> = bucket(2)
                            .into_iter()
                            .map(|t| values(comm.reduce_scatter(t, ReduceOp::Avg).unwrap()))
                            .collect();
                        assert_eq!(comm.stats().get(CollectiveKind::AllGather).calls, 6);
                        (many, single, rs_many, rs_single)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        for (rank, (many, single, rs_many, rs_single)) in out.into_iter().enumerate() {
            assert_eq!(many, single, "all_gather_many rank {rank}");
            for (a, b) in rs_many.iter().flatten().zip(rs_single.iter().flatten()) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "reduce_scatter_many rank {rank}: {a} vs {b}"
                );
            }
            let lens: Vec<usize> = rs_many.iter().map(Vec::len).collect();
            assert_eq!(lens, vec![3, 1, 7], "rank {rank}");
        }
    }
}
