//! The cluster of network namespaces that multi-node tests run on (`burn-shard-cluster`, and
//! `cargo xtask cluster`): nodes reach each other only across their links, at the rate the
//! links are shaped to, a cut link stops traffic until it is restored, and nothing the cluster
//! made is left once it is dropped; the job's rendezvous store refuses a node without the job
//! token across the links, and a node killed and started again rejoins its elastic job. Needs root and iproute2: elsewhere each test says why it skips.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use burn_shard_cluster::{Capabilities, Cluster, ClusterError, ClusterSpec};

/// The namespaces of the cluster named `cluster` that exist now.
fn namespaces_of(cluster: &str) -> Vec<String> {
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let prefix = format!("{cluster}-");
    String::from_utf8_lossy(&list.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

/// This host's capabilities, or `None` (with the reason printed) when it cannot make a cluster.
pub(crate) fn capabilities_or_skip(test: &str) -> Option<Capabilities> {
    let caps = Capabilities::probe();
    match &caps.unsupported {
        Some(why) => {
            println!("{test}: skipped: {why}");
            None
        }
        None => Some(caps),
    }
}

/// Sends `bytes` from node 1 to node 0 and returns the rate in Mbit/s (the time from the first
/// byte sent to node 0's acknowledgement of the last). Every wait is bounded (a stalled link
/// fails the test within seconds).
fn transfer_mbit(cluster: &Cluster, port: u16, bytes: usize) -> f64 {
    let server: SocketAddr = (cluster.address(0), port).into();
    let limit = Duration::from_secs(30);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        let receiver = scope.spawn(move || {
            cluster.enter(0).unwrap();
            let listener = TcpListener::bind(server).unwrap();
            listener.set_nonblocking(true).unwrap();
            ready_tx.send(()).unwrap();
            let started = Instant::now();
            let mut conn = loop {
                match listener.accept() {
                    Ok((conn, _)) => break conn,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        assert!(started.elapsed() < limit, "no sender connected within {limit:?}");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => panic!("accept: {e}"),
                }
            };
            conn.set_nonblocking(false).unwrap();
            conn.set_read_timeout(Some(limit)).unwrap();
            let mut buf = vec![0u8; 1 << 16];
            let mut received = 0;
            while received < bytes {
                let n = conn.read(&mut buf).unwrap();
                assert!(n > 0, "the sender closed after {received} of {bytes} bytes");
                received += n;
            }
            conn.write_all(&[1]).unwrap();
        });
        ready_rx.recv().unwrap();
        let sender = scope.spawn(move || {
            cluster.enter(1).unwrap();
            let mut conn = TcpStream::connect_timeout(&server, Duration::from_secs(5)).unwrap();
            conn.set_write_timeout(Some(limit)).unwrap();
            conn.set_read_timeout(Some(limit)).unwrap();
            let started = Instant::now();
            let chunk = vec![7u8; 1 << 16];
            let mut sent = 0;
            while sent < bytes {
                let n = chunk.len().min(bytes - sent);
                conn.write_all(&chunk[..n]).unwrap();
                sent += n;
            }
            let mut ack = [0u8];
            conn.read_exact(&mut ack).unwrap();
            started.elapsed()
        });
        let elapsed = sender.join().unwrap();
        receiver.join().unwrap();
        bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e6
    })
}

/// How a connection from a thread in node `from` to `to` ends within `timeout`: `Ok` when it
/// opened or was refused (no listener: the node answered), the error kind otherwise
/// (`TimedOut` when nothing answered). Only from inside a node: the host's own namespace might
/// route `10.77.0.0/24` off the host.
fn connect(cluster: &Cluster, from: usize, to: SocketAddr, timeout: Duration) -> Result<(), std::io::ErrorKind> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                cluster.enter(from).unwrap();
                match TcpStream::connect_timeout(&to, timeout) {
                    Ok(_) => Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
                    Err(e) => Err(e.kind()),
                }
            })
            .join()
            .unwrap()
    })
}

/// Two nodes on links limited to 100 Mbit/s: 8 MB crosses at that rate (an unshaped pair of
/// namespaces moves gigabits, so the upper bound shows the limit; the lower one allows for a
/// loaded host); a 1-byte round trip takes microseconds; node 1's link cut at the bridge makes node 0 silent to it (a connection times
/// out, as across a broken cable), and the restored link answers again; dropping the cluster
/// leaves none of its namespaces.
#[test]
fn two_nodes_talk_across_a_shaped_link_and_nothing_is_left() {
    let test = "two_nodes_talk_across_a_shaped_link_and_nothing_is_left";
    let Some(caps) = capabilities_or_skip(test) else { return };
    if !caps.tbf {
        println!("{test}: skipped: `tc` cannot add the tbf qdisc (rate limits) on this kernel");
        return;
    }
    let name = {
        let cluster = Cluster::create(&ClusterSpec::new(2).with_rate_mbit(100.0)).unwrap();
        let made = namespaces_of(cluster.name());
        assert_eq!(made.len(), 3, "a switch and two nodes: {made:?}");
        let rate = transfer_mbit(&cluster, 5001, 8_000_000);
        println!("{test}: 8 MB at {rate:.1} Mbit/s on a 100 Mbit/s link");
        assert!((10.0..110.0).contains(&rate), "{rate:.1} Mbit/s on a 100 Mbit/s link");

        // Two namespaces on one host: tens of microseconds, never zero, never milliseconds.
        let rtt = cluster.round_trip(1, 0, 50).unwrap();
        println!("{test}: round trip {rtt:?}");
        assert!(
            (Duration::from_micros(1)..Duration::from_millis(20)).contains(&rtt),
            "{rtt:?}"
        );

        let node0: SocketAddr = (cluster.address(0), 5002).into();
        let short = Duration::from_millis(300);
        assert_eq!(connect(&cluster, 1, node0, short), Ok(()), "node 1 reaches node 0");
        cluster.set_link(1, false).unwrap();
        let cut = connect(&cluster, 1, node0, short);
        assert_eq!(
            cut,
            Err(std::io::ErrorKind::TimedOut),
            "node 1 to node 0 with its link cut"
        );
        cluster.set_link(1, true).unwrap();
        // The bridge forwards again within a moment of the port coming back.
        let back = Instant::now();
        while connect(&cluster, 1, node0, short).is_err() {
            assert!(
                back.elapsed() < Duration::from_secs(5),
                "node 1's restored link stays silent"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        cluster.name().to_string()
    };
    assert_eq!(
        namespaces_of(&name),
        Vec::<String>::new(),
        "namespaces left after the drop"
    );
}

/// Delay, jitter and loss need the kernel's `netem`: without it the cluster is refused (before
/// anything is made), naming what is missing and the fix; with it, a 20 ms delay on what each
/// node sends makes a connection (a round trip) take 40 ms or more.
#[test]
fn delay_needs_netem_and_is_refused_without_it() {
    let test = "delay_needs_netem_and_is_refused_without_it";
    let Some(caps) = capabilities_or_skip(test) else { return };
    let spec = ClusterSpec::new(2).with_delay_ms(20.0, 0.0);
    if !caps.netem {
        let err = Cluster::create(&spec).unwrap_err();
        assert!(matches!(err, ClusterError::NoQdisc { qdisc: "netem", .. }), "{err:?}");
        assert!(err.to_string().contains("drop the delay"), "{err}");
        return;
    }
    let cluster = Cluster::create(&spec).unwrap();
    let node0: SocketAddr = (cluster.address(0), 5003).into();
    // The first connection also resolves the neighbour's address (ARP, delayed too).
    assert_eq!(connect(&cluster, 1, node0, Duration::from_secs(2)), Ok(()));
    let started = Instant::now();
    assert_eq!(connect(&cluster, 1, node0, Duration::from_secs(2)), Ok(()));
    let rtt = started.elapsed();
    assert!(
        (Duration::from_millis(40)..Duration::from_millis(400)).contains(&rtt),
        "{rtt:?} for a round trip"
    );
}

/// The job's rendezvous store in node 0 of a 3-node cluster, its 4 ranks in node 1, and a
/// stranger in node 2 without the job token, all across the bridge. The stranger's client is
/// refused within 2 s, naming the token's variable; each of its 200 silent connections (8
/// threads) is closed by the store within 3 s of opening (the handshake timeout is 1 s, the rest
/// is slack for a loaded host); meanwhile the ranks finish their set, get, add and barrier with
/// the right values.
#[test]
fn a_third_node_without_the_job_token_is_refused_and_the_job_finishes() {
    use burn_shard_comm::{JobToken, StoreClient, StoreLimits, StoreServer};

    let test = "a_third_node_without_the_job_token_is_refused_and_the_job_finishes";
    if capabilities_or_skip(test).is_none() {
        return;
    }
    let cluster = Cluster::create(&ClusterSpec::new(3)).unwrap();
    let addr = format!("{}:29517", cluster.address(0));
    let token = crate::job_fixtures::token();
    let stranger = JobToken::new("another-job-another-job-another-job-0000").unwrap();
    let second = Duration::from_secs(1);
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let world_size = 4;
    std::thread::scope(|s| {
        let (node0, store_addr, job_token) = (&cluster, &addr, &token);
        let server = s.spawn(move || {
            let (cluster, addr, token) = (node0, store_addr, job_token);
            cluster.enter(0).unwrap();
            let limits = StoreLimits::default().with_handshake_timeout(second);
            let server = StoreServer::bind_with_limits(addr, token.clone(), limits).unwrap();
            bound_tx.send(()).unwrap();
            done_rx.recv_timeout(Duration::from_secs(60)).ok();
            drop(server);
        });
        bound_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let refused = s.spawn(|| {
            cluster.enter(2).unwrap();
            let start = Instant::now();
            let err = StoreClient::connect(&addr, &stranger, 10 * second).unwrap_err();
            (err.to_string(), start.elapsed())
        });
        let flooders: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    cluster.enter(2).unwrap();
                    let target: SocketAddr = addr.parse().unwrap();
                    // Each connection with when it opened: how long the store kept it is timed
                    // from there (they close in the order they opened, and are read in it).
                    let mut streams: Vec<(TcpStream, Instant)> = (0..25)
                        .filter_map(|_| TcpStream::connect_timeout(&target, 5 * second).ok())
                        .map(|stream| (stream, Instant::now()))
                        .collect();
                    let opened = streams.len();
                    let slowest = streams
                        .iter_mut()
                        .map(|(stream, at)| {
                            stream.set_read_timeout(Some(10 * second)).unwrap();
                            let mut buf = [0u8; 256];
                            loop {
                                match stream.read(&mut buf) {
                                    Ok(0) => break at.elapsed(),
                                    Ok(_) => {}
                                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break at.elapsed(),
                                    Err(e) => panic!("a silent connection stayed open: {e}"),
                                }
                            }
                        })
                        .max()
                        .unwrap_or_default();
                    (opened, slowest)
                })
            })
            .collect();
        let ranks: Vec<_> = (0..world_size)
            .map(|rank| {
                let (addr, token, cluster) = (&addr, &token, &cluster);
                s.spawn(move || {
                    cluster.enter(1).unwrap();
                    crate::job_fixtures::store_job(addr, token, rank, world_size, 20 * second)
                })
            })
            .collect();
        let (message, took) = refused.join().unwrap();
        println!("{test}: the stranger was refused after {took:?}: {message}");
        assert!(took < 2 * second, "refused after {took:?}");
        assert!(
            message.contains("another job token") && message.contains("BURN_SHARD_JOB_TOKEN"),
            "{message}"
        );
        for flooder in flooders {
            let (opened, slowest) = flooder.join().unwrap();
            assert!(opened >= 20, "only {opened} of 25 connections opened");
            assert!(slowest < 3 * second, "a silent connection stayed open {slowest:?}");
        }
        for (rank, job) in ranks.into_iter().enumerate() {
            assert_eq!(job.join().unwrap(), (3 * 6, 6), "rank {rank}");
        }
        done_tx.send(()).unwrap();
        server.join().unwrap();
    });
    assert!(
        cluster.link_bytes(2).unwrap().sent > 0,
        "node 2's traffic crossed its link"
    );
}

/// A node's processes killed mid-run and the node started again, across the links: one
/// launcher per node (`--nnodes 1:2`, job token on, the ranks' store in node 0), the stand-in
/// training program of the elastic tests. Node 1's launcher is killed with SIGKILL (its ranks
/// with it); node 0's launcher finds it lost and restarts at world size 2; node 1's launcher,
/// started again, is taken in at the next start; the job ends at world size 4, bit for bit the
/// uninterrupted run (see [`crate::elastic::a_lost_node_comes_back`]).
#[test]
fn a_node_killed_and_started_again_across_the_links_rejoins_and_the_job_ends_as_if_uninterrupted() {
    let test = "a_node_killed_and_started_again_across_the_links_rejoins_and_the_job_ends_as_if_uninterrupted";
    if capabilities_or_skip(test).is_none() {
        return;
    }
    let cluster = Cluster::create(&ClusterSpec::new(2).with_rate_mbit(1000.0)).unwrap();
    let dir = crate::job_fixtures::scratch_dir("cluster-node-back");
    let master = cluster.address(0).to_string();
    let exe = std::env::current_exe().unwrap();
    crate::elastic::a_lost_node_comes_back(test, &dir, &master, |node| cluster.command(node, &exe));
}

/// What OpenMPI leaves of a cluster job killed with SIGKILL (its session folder in the temp
/// folder, its shared-memory segments in `/dev/shm`, both named after the node's hostname, its
/// namespace's name) is removed by `remove_leftovers` when the cluster's process is gone, and
/// kept while it runs.
#[test]
fn openmpi_leftovers_of_a_dead_cluster_are_removed_and_a_live_ones_kept() {
    let test = "openmpi_leftovers_of_a_dead_cluster_are_removed_and_a_live_ones_kept";
    if capabilities_or_skip(test).is_none() {
        return;
    }
    // A pid that is gone: a child that has exited and been reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let (dead, alive) = (child.id(), std::process::id());
    let shm = std::path::Path::new("/dev/shm");
    let paths = |pid: u32| {
        let node = format!("bsc{pid}-9-n1");
        [
            std::env::temp_dir().join(format!("ompi.{node}.0")),
            shm.join(format!("vader_segment.{node}.5c3a0001.0")),
        ]
    };
    // Not this crate's names, or not a node's: kept whatever their pid.
    let strangers = [
        std::env::temp_dir().join("ompi.otherhost.0"),
        shm.join(format!("vader_segment.bsc{dead}-x-n1.0")),
        shm.join(format!("vader_segment.bsc{dead}-9.0")),
    ];
    for path in &strangers {
        std::fs::write(path, "x").unwrap();
    }
    for pid in [dead, alive] {
        let [session, segment] = paths(pid);
        std::fs::create_dir_all(session.join("jf.0")).unwrap();
        std::fs::write(session.join("jf.0/contact.txt"), "x").unwrap();
        std::fs::write(&segment, "x").unwrap();
    }
    burn_shard_cluster::remove_leftovers().unwrap();
    for path in paths(dead) {
        assert!(!path.exists(), "{} is left", path.display());
    }
    for path in &strangers {
        assert!(
            path.exists(),
            "{} is not a dead cluster's node's, yet was removed",
            path.display()
        );
        std::fs::remove_file(path).unwrap();
    }
    for path in paths(alive) {
        assert!(path.exists(), "{} of a live cluster was removed", path.display());
        let _ = std::fs::remove_dir_all(&path);
        let _ = std::fs::remove_file(&path);
    }
}
