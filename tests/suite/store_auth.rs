//! Who may join the job: the rendezvous store against strangers on loopback. Only a process
//! that proves the job token is served; a wrong token, none, garbage, silence, a flood of
//! connections and keys or values past the limits are each refused within seconds, while a
//! legitimate job on the same store still finishes; the bytes the store holds stay bounded.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use burn_shard_comm::{CommError, JobToken, Rendezvous, RendezvousEnv, StoreClient, StoreLimits, StoreServer};
use burn_shard_launch::{LaunchConfig, LaunchError, OutputMode, launch};

use crate::job_fixtures::{free_port, job_vars, local_server, rendezvous_msg, token};

const SECOND: Duration = Duration::from_secs(1);
/// The first bytes of the store's protocol, both ways.
const HELLO: &[u8; 8] = b"BSRDV002";

fn other_token() -> JobToken {
    JobToken::new("another-job-another-job-another-job-0000").unwrap()
}

fn server_with(limits: StoreLimits) -> (StoreServer, String) {
    let server = StoreServer::bind_with_limits("127.0.0.1:0", token(), limits).expect("bind a local store");
    let addr = server.local_addr().to_string();
    (server, addr)
}

/// Waits until the store closes `stream` (end of stream or reset, after reading whatever it
/// sent first); returns how long that took from `since`. Panics if it stays open for `limit`.
fn closed_by_store(stream: &mut TcpStream, since: Instant, limit: Duration) -> Duration {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return since.elapsed(),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                return since.elapsed();
            }
            Err(e) => panic!("the store kept the connection open for {limit:?} ({e})"),
        }
    }
}

/// Polls `condition` every 10 ms for up to `limit`.
fn eventually(limit: Duration, condition: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    condition()
}

/// What a set/get/add refused by the store says, as `burn_shard_comm` reports it.
fn refused(result: Result<impl std::fmt::Debug, impl Into<CommError>>) -> String {
    rendezvous_msg(result)
}

// ---------------------------------------------------------------- the token

#[test]
fn a_client_with_another_token_is_refused_at_once_naming_the_variable() {
    let (server, addr) = local_server();
    let start = Instant::now();
    let msg = rendezvous_msg(StoreClient::connect(&addr, &other_token(), 10 * SECOND));
    let took = start.elapsed();
    assert!(took < 2 * SECOND, "refused after {took:?}, not at once");
    assert!(
        msg.contains("another job token") && msg.contains("BURN_SHARD_JOB_TOKEN"),
        "{msg}"
    );
    assert!(
        eventually(SECOND, || server.open_connections() == 0),
        "the refused connection was closed"
    );
    assert_eq!(server.clients(), 0);
    // The store still serves its own job.
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k", SECOND).unwrap(), b"v");
    assert_eq!(server.clients(), 1);
}

#[test]
fn a_process_without_a_token_cannot_join_and_is_told_which_variable_to_set() {
    let vars: Vec<_> = job_vars(1, 2, free_port())
        .into_iter()
        .filter(|(k, _)| *k != "BURN_SHARD_JOB_TOKEN")
        .collect();
    match RendezvousEnv::from_vars(vars).map_err(CommError::from) {
        Err(e @ CommError::Env { var, .. }) => {
            let msg = e.to_string();
            assert_eq!(var, "BURN_SHARD_JOB_TOKEN", "{msg}");
            assert!(
                msg.contains("BURN_SHARD_JOB_TOKEN_FILE") && msg.contains("chmod 600"),
                "{msg}"
            );
        }
        other => panic!("expected an environment error, got {other:?}"),
    }
}

#[test]
fn a_stranger_that_guesses_the_proof_is_refused_and_disconnected() {
    let (server, addr) = local_server();
    let mut stream = TcpStream::connect(&addr).unwrap();
    let start = Instant::now();
    stream.write_all(&[&HELLO[..], &[7u8; 32]].concat()).unwrap();
    stream.set_read_timeout(Some(2 * SECOND)).unwrap();
    let mut answer = [0u8; 8 + 1 + 32 + 32];
    stream.read_exact(&mut answer).unwrap();
    assert_eq!((&answer[..8], answer[8]), (&HELLO[..], 0), "the store's challenge");
    stream.write_all(&[0u8; 32]).unwrap(); // a proof made without the token
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).unwrap();
    assert_eq!(status[0], 6, "BAD_TOKEN");
    let took = closed_by_store(&mut stream, start, 2 * SECOND);
    assert!(took < SECOND, "closed after {took:?}");
    assert_eq!(server.clients(), 0);
}

#[test]
fn a_client_checks_the_store_too_and_tells_an_impostor_nothing() {
    // Something on MASTER_PORT that speaks the protocol but does not hold the token.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let impostor = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut hello = [0u8; 40];
        stream.read_exact(&mut hello).unwrap();
        stream.write_all(&[&HELLO[..], &[0u8], &[42u8; 64]].concat()).unwrap();
        // The client must hang up without sending its proof.
        stream.set_read_timeout(Some(5 * SECOND)).unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        rest
    });
    let start = Instant::now();
    let msg = rendezvous_msg(StoreClient::connect(&addr, &token(), 10 * SECOND));
    assert!(start.elapsed() < 2 * SECOND, "took {:?}", start.elapsed());
    assert!(
        msg.contains("another job token") && msg.contains("MASTER_PORT"),
        "{msg}"
    );
    assert!(
        impostor.join().unwrap().is_empty(),
        "the client sent its proof to an impostor"
    );
}

#[test]
fn a_rank_with_another_token_fails_at_once_and_the_others_name_it_missing() {
    let port = free_port();
    let timeout = SECOND;
    let results: Vec<(Result<(), String>, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                s.spawn(move || {
                    let mut env = RendezvousEnv::from_vars(job_vars(rank, 3, port)).unwrap();
                    if rank == 2 {
                        std::thread::sleep(Duration::from_millis(100)); // rank 0 is listening
                        env.token = other_token();
                    }
                    let start = Instant::now();
                    let result = Rendezvous::new(env, timeout)
                        .map(drop)
                        .map_err(|e| rendezvous_msg(Err::<(), _>(e)));
                    (result, start.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (intruder, took) = &results[2];
    let msg = intruder.clone().expect_err("rank 2 has another token");
    assert!(msg.contains("BURN_SHARD_JOB_TOKEN"), "{msg}");
    assert!(*took < timeout / 2, "rank 2 took {took:?}");
    for (rank, (result, took)) in results[..2].iter().enumerate() {
        let msg = result.clone().expect_err("rank 2 never joined");
        assert!(msg.contains("rank 2 is missing"), "rank {rank}: {msg}");
        assert!(*took < timeout + 3 * SECOND, "rank {rank} took {took:?}");
    }
}

#[test]
fn token_files_must_be_owner_only_and_tokens_long_enough() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("burn-shard-store-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("job.token");
    std::fs::write(&file, format!("  {}\n", crate::job_fixtures::TEST_TOKEN)).unwrap();
    let with_file = |vars: Vec<(&'static str, String)>| {
        let mut vars: Vec<_> = vars.into_iter().filter(|(k, _)| *k != "BURN_SHARD_JOB_TOKEN").collect();
        vars.push(("BURN_SHARD_JOB_TOKEN_FILE", file.display().to_string()));
        vars
    };
    let env_error = |vars: Vec<(&'static str, String)>| match RendezvousEnv::from_vars(vars).map_err(CommError::from) {
        Err(e @ CommError::Env { var, .. }) => (var, e.to_string()),
        other => panic!("expected an environment error, got {other:?}"),
    };

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (var, msg) = env_error(with_file(job_vars(0, 1, 29500)));
    assert_eq!(var, "BURN_SHARD_JOB_TOKEN_FILE", "{msg}");
    assert!(
        msg.contains(&format!("chmod 600 {}", file.display())) && msg.contains("644"),
        "{msg}"
    );

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let env = RendezvousEnv::from_vars(with_file(job_vars(0, 1, 29500))).unwrap();
    assert_eq!(env.token, token(), "read from the file, whitespace trimmed");
    let shown = format!("{env:?}");
    assert!(
        !shown.contains(crate::job_fixtures::TEST_TOKEN),
        "Debug shows the token: {shown}"
    );

    // Both variables: which one was meant?
    let mut both = with_file(job_vars(0, 1, 29500));
    both.push(("BURN_SHARD_JOB_TOKEN", crate::job_fixtures::TEST_TOKEN.into()));
    let (var, msg) = env_error(both);
    assert!(var == "BURN_SHARD_JOB_TOKEN" && msg.contains("only one"), "{msg}");

    let mut short = job_vars(0, 1, 29500);
    short.retain(|(k, _)| *k != "BURN_SHARD_JOB_TOKEN");
    short.push(("BURN_SHARD_JOB_TOKEN", "secret".into()));
    let (_, msg) = env_error(short);
    assert!(
        msg.contains("6 characters") && msg.contains("openssl rand -hex 32"),
        "{msg}"
    );

    let generated = JobToken::generate().unwrap();
    assert_eq!(generated.reveal().len(), 64);
    assert!(generated.reveal().chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(generated, JobToken::generate().unwrap(), "a fresh token each time");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------- strangers and silence

#[test]
fn garbage_is_disconnected_at_once() {
    let (server, addr) = local_server();
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &b"BSRDV001 an old client"[..],
        &[0xffu8; 4096][..],
    ] {
        let mut stream = TcpStream::connect(&addr).unwrap();
        let start = Instant::now();
        let _ = stream.write_all(garbage);
        let took = closed_by_store(&mut stream, start, 3 * SECOND);
        assert!(took < SECOND, "{:?}...: closed after {took:?}", &garbage[..8]);
    }
    assert!(eventually(SECOND, || server.open_connections() == 0));
}

#[test]
fn a_connection_that_sends_nothing_or_trickles_is_closed_after_the_handshake_timeout() {
    let handshake = Duration::from_millis(500);
    let (server, addr) = server_with(StoreLimits::default().with_handshake_timeout(handshake));
    let mut silent = TcpStream::connect(&addr).unwrap();
    let start = Instant::now();
    let took = closed_by_store(&mut silent, start, 5 * SECOND);
    assert!(
        took >= handshake / 2 && took < handshake + 2 * SECOND,
        "silent: closed after {took:?}"
    );

    // One byte of the hello every 100 ms, until the store closes: each arrives within any
    // per-read timeout, but the handshake as a whole is bounded by the handshake timeout.
    let mut trickle = TcpStream::connect(&addr).unwrap();
    let start = Instant::now();
    let bytes = HELLO.iter().chain([0u8; 32].iter());
    for byte in bytes {
        if trickle.write_all(&[*byte]).is_err() || start.elapsed() > 5 * SECOND {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = closed_by_store(&mut trickle, start, 5 * SECOND);
    assert!(
        took < handshake + Duration::from_millis(400),
        "trickle: closed after {took:?}, the handshake timeout is {handshake:?}"
    );
    assert!(eventually(SECOND, || server.open_connections() == 0));
}

/// One address that opens connections and proves nothing holds at most
/// `max_handshakes_per_peer` of them: the next one from it is refused at once while the others
/// are still open, and the store has room left for the ranks of other hosts.
#[test]
fn one_address_holds_at_most_its_share_of_connections_still_proving_the_token() {
    let per_peer = 8;
    let limits = StoreLimits::default()
        .with_max_handshakes_per_peer(per_peer)
        .with_handshake_timeout(3 * SECOND);
    let (server, addr) = server_with(limits.clone());
    let silent: Vec<TcpStream> = (0..per_peer).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    assert!(eventually(SECOND, || server.open_connections() == per_peer));
    let mut extra = TcpStream::connect(&addr).unwrap();
    let start = Instant::now();
    let took = closed_by_store(&mut extra, start, 2 * SECOND);
    assert!(
        took < SECOND,
        "the connection past the address's share closed after {took:?}"
    );
    assert_eq!(server.open_connections(), per_peer, "the silent ones are still open");
    assert!(
        per_peer < limits.max_connections,
        "connections left for other addresses: {}",
        limits.max_connections - per_peer
    );
    drop(silent);
    assert!(eventually(SECOND, || server.open_connections() == 0));
    // Then a holder of the token gets in.
    StoreClient::connect(&addr, &token(), 5 * SECOND).expect("a rank joins afterwards");
}

#[test]
fn a_thousand_connections_at_once_are_bounded_and_the_job_still_finishes() {
    let max_connections = 64;
    let limits = StoreLimits::default()
        .with_max_connections(max_connections)
        .with_handshake_timeout(SECOND);
    let (server, addr) = server_with(limits);
    let start = Instant::now();
    let world_size = 4;
    let sampling = std::sync::atomic::AtomicBool::new(true);
    let (flood, job, peak) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(server.open_connections());
                std::thread::sleep(Duration::from_millis(1));
            }
            peak
        });
        // 1,000 connections that never speak, from 8 threads at once.
        let flooders: Vec<_> = (0..8)
            .map(|_| {
                let addr = addr.clone();
                s.spawn(move || {
                    // Past the listen backlog the kernel retries a connect's SYN after a second or
                    // more, so the closes are timed from this thread's last connect.
                    let streams: Vec<TcpStream> = (0..125)
                        .filter_map(|_| TcpStream::connect_timeout(&addr.parse().unwrap(), 5 * SECOND).ok())
                        .collect();
                    let last_connect = Instant::now();
                    let opened = streams.len();
                    let closed: Vec<Duration> = streams
                        .into_iter()
                        .map(|mut stream| closed_by_store(&mut stream, last_connect, 10 * SECOND))
                        .collect();
                    (opened, closed)
                })
            })
            .collect();
        // Meanwhile, a job of 4 ranks uses the store (retrying while it is full).
        let ranks: Vec<_> = (0..world_size)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(20));
                    crate::job_fixtures::store_job(&addr, &token(), rank, world_size, 20 * SECOND)
                })
            })
            .collect();
        let flood: Vec<(usize, Vec<Duration>)> = flooders.into_iter().map(|h| h.join().unwrap()).collect();
        let job: Vec<(usize, i64)> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        sampling.store(false, std::sync::atomic::Ordering::Relaxed);
        (flood, job, sampler.join().unwrap())
    });
    let opened: usize = flood.iter().map(|(n, _)| n).sum();
    let slowest = flood.iter().flat_map(|(_, c)| c).max().copied().unwrap_or_default();
    eprintln!(
        "{opened} silent connections: all closed by the store within {slowest:?} of the last connect; at most {peak} \
         open at once; the job finished after {:?}",
        start.elapsed()
    );
    assert!(opened >= 900, "only {opened} of 1000 connections opened");
    assert!(
        peak <= max_connections,
        "{peak} connections open at once, over the limit of {max_connections}"
    );
    assert!(slowest < 3 * SECOND, "a silent connection stayed open for {slowest:?}");
    // Every rank read every part (0+1+2+3, three bytes each) and the counter.
    for (rank, result) in job.iter().enumerate() {
        assert_eq!(*result, (3 * 6, 6), "rank {rank}");
    }
    assert!(start.elapsed() < 15 * SECOND, "took {:?}", start.elapsed());
}

// ---------------------------------------------------------------- sizes and bytes held

#[test]
fn keys_and_values_at_their_limits_pass_and_over_them_are_refused_keeping_the_connection() {
    let (server, addr) = server_with(
        StoreLimits::default()
            .with_max_key_bytes(100)
            .with_max_value_bytes(1000),
    );
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    let key = |n: usize| "k".repeat(n);
    let start = Instant::now();
    store.set(&key(100), &[1u8; 1000]).unwrap();
    assert_eq!(store.get(&key(100), SECOND).unwrap(), vec![1u8; 1000]);
    let msg = refused(store.set(&key(101), b"v"));
    assert!(
        msg.contains("limit of 100 bytes") && msg.contains("max_key_bytes"),
        "{msg}"
    );
    let msg = refused(store.set("v", &[0u8; 1001]));
    assert!(
        msg.contains("limit of 1000 bytes") && msg.contains("max_value_bytes"),
        "{msg}"
    );
    assert!(refused(store.get(&key(101), SECOND)).contains("limit of 100 bytes"));
    assert!(refused(store.add(&key(101), 1)).contains("limit of 100 bytes"));
    assert!(start.elapsed() < 2 * SECOND, "refusals took {:?}", start.elapsed());
    // The connection stayed in step: nothing refused was stored.
    assert_eq!(store.add("counter", 2).unwrap(), 2);
    assert_eq!(server.stored_bytes(), 100 + 1000 + "counter".len() + 8);

    // The wire format's own limits, on a store with the defaults: checked by the client.
    let (_default, addr) = local_server();
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    let largest = vec![7u8; burn_shard_comm::MAX_VALUE_BYTES];
    store.set("largest", &largest).unwrap();
    assert_eq!(store.get("largest", 5 * SECOND).unwrap().len(), largest.len());
    let over = vec![7u8; burn_shard_comm::MAX_VALUE_BYTES + 1];
    assert!(refused(store.set("over", &over)).contains("limit"));
    let long_key = "k".repeat(burn_shard_comm::MAX_KEY_BYTES);
    store.set(&long_key, b"v").unwrap();
}

#[test]
fn the_bytes_the_store_holds_are_bounded_and_replacing_a_value_still_fits() {
    let limit = 10_000;
    let (server, addr) = server_with(StoreLimits::default().with_max_stored_bytes(limit));
    let store = StoreClient::connect(&addr, &token(), 5 * SECOND).unwrap();
    let mut kept = 0;
    let msg = loop {
        match store.set(&format!("value/{kept}"), &[1u8; 1000]) {
            Ok(()) => kept += 1,
            Err(e) => break refused(Err::<(), _>(e)),
        }
        assert!(
            kept < 20,
            "the store took {kept} values of 1000 bytes under a limit of {limit}"
        );
    };
    assert_eq!(kept, 9, "entries of 1007 bytes under 10,000");
    assert!(
        msg.contains("limit of 10000 bytes") && msg.contains("max_stored_bytes"),
        "{msg}"
    );
    assert!(server.stored_bytes() <= limit, "{} bytes held", server.stored_bytes());
    // A full store still takes a value that replaces one of the same size, and reads.
    store.set("value/0", &[2u8; 1000]).unwrap();
    assert_eq!(store.get("value/0", SECOND).unwrap(), vec![2u8; 1000]);
    let msg = refused(store.add(&"c".repeat(1000), 1));
    assert!(msg.contains("max_stored_bytes"), "{msg}");

    // Many clients at once, each sending a value that alone fits: the room is reserved as
    // the values arrive, so the store never holds (or buffers) more than its limit.
    let limit = 8 << 20;
    let (server, addr) = server_with(StoreLimits::default().with_max_stored_bytes(limit));
    let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let addr = addr.clone();
                s.spawn(move || {
                    let store = StoreClient::connect(&addr, &token(), 10 * SECOND).unwrap();
                    store
                        .set(&format!("big/{i}"), &vec![i as u8; 3 << 20])
                        .map_err(|e| refused(Err::<(), _>(e)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let stored = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(stored, 2, "two values of 3 MiB fit under 8 MiB: {outcomes:?}");
    assert!(
        outcomes
            .iter()
            .filter_map(|o| o.as_ref().err())
            .all(|m| m.contains("max_stored_bytes"))
    );
    assert!(server.stored_bytes() <= limit, "{} bytes held", server.stored_bytes());
}

// ---------------------------------------------------------------- the launcher's token

#[test]
fn the_launcher_gives_every_rank_one_fresh_token_per_job_and_several_nodes_need_one() {
    let run = || {
        let config = LaunchConfig::new("sh", 2)
            .with_args([
                "-c",
                "echo \"token=$BURN_SHARD_JOB_TOKEN file=${BURN_SHARD_JOB_TOKEN_FILE-unset}\"",
                "sh",
            ])
            .with_output(OutputMode::Capture);
        let outcome = launch(&config).unwrap();
        let lines: Vec<String> = outcome.output.iter().map(|l| l.text.clone()).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0], lines[1], "both ranks get the same token");
        lines[0].clone()
    };
    let first = run();
    let token = first
        .strip_prefix("token=")
        .unwrap()
        .strip_suffix(" file=unset")
        .unwrap();
    assert_eq!(token.len(), 64, "{first}");
    assert_ne!(first, run(), "a fresh token per job");

    let config = LaunchConfig::new("true", 2).with_nodes(2, 0);
    match launch(&config) {
        Err(e @ LaunchError::Config(_)) => {
            let msg = e.to_string();
            assert!(
                msg.contains("BURN_SHARD_JOB_TOKEN_FILE") && msg.contains("chmod 600") && msg.contains("every node"),
                "{msg}"
            );
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}
