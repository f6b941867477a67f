//! The rendezvous store: ranks as threads over real TCP setting, getting, adding and meeting
//! at barriers, and every failure (a closed port, a late or vanished store, another program on
//! the port, a missed barrier, oversized keys) an error within a bounded time, never a hang.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use burn_shard_comm::{StoreClient, StoreServer};

use crate::job_fixtures::{SECOND, free_port, local_server, rendezvous_msg, token};

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
