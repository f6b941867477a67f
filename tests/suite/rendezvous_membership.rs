//! Who joins a rendezvous: ranks of every world size join (late ones are waited for), and
//! duplicate ranks, disagreeing world sizes and missing ranks fail every rank, naming the
//! problem, within a bounded time.

use std::time::{Duration, Instant};

use burn_shard_comm::{Rendezvous, RendezvousEnv};

use crate::job_fixtures::{SECOND, free_port, job_vars, rendezvous_msg};

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
