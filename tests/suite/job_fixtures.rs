//! What the multi-process job tests share: the job token, a local store, free ports, a rank's
//! environment as the launcher sets it, scratch directories and the liveness of a pid. Every
//! failure these tests provoke must be an error within a bounded time, never a hang.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use burn_shard_comm::{CommError, JobToken, StoreClient, StoreServer};

/// One second: the unit of these tests' timeouts.
pub(crate) const SECOND: Duration = Duration::from_secs(1);

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

/// A fresh, empty directory for one test's files.
pub(crate) fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-shard-launch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Whether `pid` has ended (gone, or a zombie waiting for a reaper that is not us).
pub(crate) fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name in parentheses: "pid (comm) S ...".
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// What one rank of a small job does with the rendezvous store at `addr`: joins with `token`,
/// sets its part (3 bytes of its rank), reads every rank's part, adds its rank to a counter,
/// waits at a barrier, and returns the sum of the parts it read and the counter's final
/// value (`(3·Σr, Σr)` when every rank did its share). Every wait is bounded by `timeout`.
pub(crate) fn store_job(
    addr: &str,
    token: &JobToken,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> (usize, i64) {
    let store = StoreClient::connect(addr, token, timeout).unwrap();
    store.set(&format!("part/{rank}"), &[rank as u8; 3]).unwrap();
    let total: usize = (0..world_size)
        .map(|r| {
            store
                .get(&format!("part/{r}"), timeout)
                .unwrap()
                .iter()
                .map(|&b| b as usize)
                .sum::<usize>()
        })
        .sum();
    store.add("sum", rank as i64).unwrap();
    store.barrier(world_size, timeout).unwrap();
    (total, store.add("sum", 0).unwrap())
}
