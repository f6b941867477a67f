//! A rank's environment as the launcher sets it and `RendezvousEnv` reads it: each problem
//! names its variable, and ranks meet through the rendezvous built from it.

use burn_shard_comm::{CommError, Rendezvous, RendezvousEnv};

use crate::job_fixtures::{SECOND, free_port, job_vars, token};

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
