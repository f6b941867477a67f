//! [`Cluster`]: the namespaces, the bridge and the shaped links, and their removal.
//!
//! Layout, for a cluster named `bsc<pid>-<n>`: namespace `bsc<pid>-<n>-sw` holds the bridge
//! `br0` and one port `p<i>` per node; namespace `bsc<pid>-<n>-n<i>` is node `i`, with `lo` and
//! `eth0` (`10.77.0.(i+1)/24`), the other end of `p<i>`. The host's own namespace gets nothing:
//! every link is made directly inside the namespaces (`ip -n`), so traffic between nodes never
//! leaves them. The rate limit sits on both ends of a node's link (`eth0` limits what the node
//! sends, `p<i>` what it receives); delay, jitter and loss on `eth0` alone, so a packet meets
//! them once on its way from one node to another.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::capabilities::Capabilities;
use crate::command::{add_netns, run};
use crate::error::ClusterError;
use crate::spec::{ClusterSpec, LinkShape};

/// Prefix of every namespace a cluster makes; [`remove_leftovers`] looks for it.
const PREFIX: &str = "bsc";

/// The nodes' subnet: node `i` is `10.77.0.(i+1)`, and nothing else is in it.
pub(crate) const SUBNET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 77, 0, 0), 24);

/// Clusters made by this process so far, for unique names.
static MADE: AtomicUsize = AtomicUsize::new(0);

/// A running cluster (see the [module docs](self)). Dropping it kills every process still
/// running in its namespaces and removes the namespaces with their links.
#[derive(Debug)]
pub struct Cluster {
    name: String,
    nodes: usize,
    /// Namespaces made so far (the switch first), removed on drop in reverse order.
    made: Vec<String>,
    /// The cluster's folder, once made (see [`Cluster::folder`]).
    folder: Mutex<Option<PathBuf>>,
}

impl Cluster {
    /// Makes the cluster `spec` describes.
    ///
    /// # Errors
    /// [`ClusterError::Unsupported`] when this host cannot (not root, no `ip`);
    /// [`ClusterError::NoQdisc`] for delay, jitter or loss without `netem`, or a rate without `tbf`;
    /// [`ClusterError::Invalid`] for 0 or more than 200 nodes or a rate that is not positive;
    /// [`ClusterError::Command`] when a step fails (what was made is removed).
    pub fn create(spec: &ClusterSpec) -> Result<Self, ClusterError> {
        if !(1..=200).contains(&spec.nodes) {
            return Err(ClusterError::Invalid(format!("{} nodes: give 1 to 200", spec.nodes)));
        }
        if spec.link.rate_mbit.is_some_and(|rate| rate.is_nan() || rate <= 0.0) {
            return Err(ClusterError::Invalid(format!(
                "rate {:?} Mbit/s: give a positive rate",
                spec.link.rate_mbit
            )));
        }
        let LinkShape {
            delay_ms,
            jitter_ms,
            loss_percent,
            ..
        } = spec.link;
        if !(delay_ms >= 0.0 && jitter_ms >= 0.0 && (0.0..=100.0).contains(&loss_percent)) {
            return Err(ClusterError::Invalid(format!(
                "delay {delay_ms} ms, jitter {jitter_ms} ms, loss {loss_percent} %: give delays of 0 or more and \
                 a loss from 0 to 100"
            )));
        }
        let caps = Capabilities::probe();
        if let Some(why) = caps.unsupported {
            return Err(ClusterError::Unsupported(why));
        }
        if spec.link.needs_netem() && !caps.netem {
            return Err(ClusterError::NoQdisc {
                what: format!("delay {delay_ms} ms, jitter {jitter_ms} ms, loss {loss_percent} %"),
                qdisc: "netem",
                fix: "drop the delay, jitter and loss, or run on a kernel with sch_netem".into(),
            });
        }
        if spec.link.rate_mbit.is_some() && !caps.tbf {
            return Err(ClusterError::NoQdisc {
                what: format!("a rate of {:?} Mbit/s", spec.link.rate_mbit),
                qdisc: "tbf",
                fix: "drop the rate, or run on a kernel with sch_tbf".into(),
            });
        }
        // What a killed run left (its process gone): best effort, it must not stop this one.
        if let Err(e) = remove_leftovers() {
            eprintln!("burn-shard-cluster: could not look for a killed run's namespaces: {e}");
        }
        let name = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        );
        let mut cluster = Cluster {
            name,
            nodes: spec.nodes,
            made: Vec::new(),
            folder: Mutex::new(None),
        };
        // Built step by step into `cluster`: a failure drops it, which removes what was made.
        let switch = cluster.add_netns("sw")?;
        ip(&["-n", &switch, "link", "set", "lo", "up"])?;
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for node in 0..spec.nodes {
            let netns = cluster.add_netns(&format!("n{node}"))?;
            let port = format!("p{node}");
            ip(&[
                "-n", &switch, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &netns,
            ])?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
            let address = format!("{}/{}", cluster.address(node), SUBNET.1);
            ip(&["-n", &netns, "addr", "add", &address, "dev", "eth0"])?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            shape(&netns, "eth0", &spec.link, true)?;
            shape(&switch, &port, &spec.link, false)?;
        }
        Ok(cluster)
    }

    /// Makes namespace `<name>-<suffix>` and records it for removal.
    fn add_netns(&mut self, suffix: &str) -> Result<String, ClusterError> {
        let netns = format!("{}-{suffix}", self.name);
        add_netns(&netns)?;
        self.made.push(netns.clone());
        Ok(netns)
    }

    /// The cluster's name, `bsc<pid>-<n>`: every namespace it made is named `<name>-...`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Node `node`'s address, `10.77.0.(node+1)`.
    ///
    /// # Panics
    /// When `node` is not a node of this cluster.
    pub fn address(&self, node: usize) -> Ipv4Addr {
        assert!(node < self.nodes, "node {node} of a {}-node cluster", self.nodes);
        let [a, b, c, _] = SUBNET.0.octets();
        Ipv4Addr::new(a, b, c, node as u8 + 1)
    }

    /// This cluster's folder for the files it writes (`mpirun`'s rsh agent, which runs as
    /// root), under the system's temporary folder and named as the cluster; made on first use
    /// for this process's user alone (mode 0700), removed with the cluster.
    ///
    /// # Errors
    /// [`ClusterError::Io`] when it cannot be made, also when a folder of that name exists
    /// already: it is not this cluster's, so nothing in it is trusted.
    pub(crate) fn folder(&self) -> Result<PathBuf, ClusterError> {
        use std::os::unix::fs::DirBuilderExt;
        let mut made = self.folder.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(folder) = made.as_ref() {
            return Ok(folder.clone());
        }
        let folder = folder_of(&self.name);
        std::fs::DirBuilder::new().mode(0o700).create(&folder)?;
        *made = Some(folder.clone());
        Ok(folder)
    }

    /// Node `node`'s network namespace (a name for `ip netns exec`).
    pub fn netns(&self, node: usize) -> String {
        assert!(node < self.nodes, "node {node} of a {}-node cluster", self.nodes);
        format!("{}-n{node}", self.name)
    }

    /// A command that runs `program` inside node `node` (`ip netns exec NETNS program`); add
    /// arguments and environment, then spawn it. Processes still running in the node when the
    /// cluster is dropped are killed.
    pub fn command(&self, node: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec"]).arg(self.netns(node)).arg(program);
        command
    }

    /// Cuts (`up` false) or restores node `node`'s link at the bridge: its port goes down, so
    /// what the node sends is dropped and nothing reaches it until the port is up again (a
    /// partition of one node; the node keeps its address and route, so its connections time
    /// out rather than fail at once, as across a broken cable).
    ///
    /// # Errors
    /// [`ClusterError::Command`].
    ///
    /// # Panics
    /// When `node` is not a node of this cluster.
    pub fn set_link(&self, node: usize, up: bool) -> Result<(), ClusterError> {
        assert!(node < self.nodes, "node {node} of a {}-node cluster", self.nodes);
        let state = if up { "up" } else { "down" };
        let switch = format!("{}-sw", self.name);
        ip(&["-n", &switch, "link", "set", &format!("p{node}"), state])
    }

    /// Moves the calling thread into node `node`'s network namespace: sockets it opens from
    /// then on are the node's (other threads are unaffected). For in-process tests; a thread
    /// that entered a node should end with the test.
    ///
    /// # Errors
    /// [`ClusterError::Io`] when the namespace cannot be opened or entered.
    #[cfg(target_os = "linux")]
    pub fn enter(&self, node: usize) -> Result<(), ClusterError> {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::open(format!("/run/netns/{}", self.netns(node)))?;
        // SAFETY: `file` is an open namespace file for the whole call; setns(2) with
        // CLONE_NEWNET changes only the calling thread's network namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // What was recorded, and whatever else carries this cluster's name (a namespace made
        // by a command interrupted before its name was recorded).
        let prefix = format!("{}-", self.name);
        let mut names: Vec<String> = self.made.drain(..).rev().collect();
        let listed = run("ip", &["netns", "list"]).unwrap_or_default();
        for netns in listed.lines().filter_map(|line| line.split_whitespace().next()) {
            if netns.starts_with(&prefix) && !names.iter().any(|n| n == netns) {
                names.push(netns.to_string());
            }
        }
        for netns in names {
            if let Err(e) = remove_netns(&netns) {
                eprintln!("burn-shard-cluster: could not remove namespace {netns}: {e}");
            }
        }
        if let Some(folder) = self.folder.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            remove_folder(&folder);
        }
    }
}

/// The folder of the cluster named `name` (see [`Cluster::folder`]).
fn folder_of(name: &str) -> PathBuf {
    std::env::temp_dir().join(name)
}

/// Removes a cluster's folder; one never made is not an error.
fn remove_folder(folder: &std::path::Path) {
    match std::fs::remove_dir_all(folder) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => eprintln!("burn-shard-cluster: could not remove {}: {e}", folder.display()),
    }
}

/// Kills the processes in `netns`, again until none is left (a process may fork while the
/// others are killed), then removes it (its links go with it). This process is never killed,
/// even when one of its threads entered the namespace.
fn remove_netns(netns: &str) -> Result<(), ClusterError> {
    let own = std::process::id() as libc::pid_t;
    for _ in 0..50 {
        let pids = run("ip", &["netns", "pids", netns]).unwrap_or_default();
        let others: Vec<libc::pid_t> = pids
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|pid| *pid != own)
            .collect();
        if others.is_empty() {
            return ip(&["netns", "del", netns]);
        }
        for pid in others {
            // SAFETY: kill(2) has no memory preconditions; a pid gone since is ESRCH, ignored.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(ClusterError::Invalid(format!(
        "processes in namespace {netns} survived 50 rounds of SIGKILL; kill them (`ip netns pids {netns}`), \
         then run `cargo xtask cluster -- clean`"
    )))
}

/// Removes the namespaces of clusters whose process is gone (a run killed, aborted or exited
/// before its drop), with their processes, and their folders; returns the namespaces' names.
/// Also what OpenMPI left of their jobs: the session folders `<temp>/ompi.<node>.*` and the
/// shared-memory segments `/dev/shm/vader_segment.<node>.*` of their nodes (each node's
/// hostname is its namespace's name), which a job killed with SIGKILL does not remove.
/// Only names this crate gives (`bsc<pid>-<n>-sw`, `bsc<pid>-<n>-n<i>`, `bsc<pid>-probe<n>`,
/// folders `bsc<pid>-<n>`) are considered; one that cannot be removed is reported on stderr and
/// the others are still removed.
///
/// # Errors
/// [`ClusterError::Command`] when `ip netns list` fails.
pub fn remove_leftovers() -> Result<Vec<String>, ClusterError> {
    let list = run("ip", &["netns", "list"])?;
    let mut removed = Vec::new();
    for netns in list.lines().filter_map(|line| line.split_whitespace().next()) {
        let Some(pid) = owner(netns) else { continue };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        match remove_netns(netns) {
            Ok(()) => removed.push(netns.to_string()),
            Err(e) => eprintln!("burn-shard-cluster: could not remove namespace {netns}: {e}"),
        }
    }
    for entry in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // A folder is named as its cluster; its switch's namespace name has the same owner.
        if let Some(pid) = owner(&format!("{name}-sw"))
            && entry.file_type().is_ok_and(|t| t.is_dir())
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            remove_folder(&entry.path());
        }
    }
    remove_mpi_leftovers(&std::env::temp_dir(), "ompi.");
    remove_mpi_leftovers(std::path::Path::new("/dev/shm"), "vader_segment.");
    Ok(removed)
}

/// Removes the entries of `folder` named `<prefix><node>.<rest>` whose `<node>` is a node of a
/// cluster whose process is gone.
fn remove_mpi_leftovers(folder: &std::path::Path, prefix: &str) {
    for entry in std::fs::read_dir(folder).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(node) = name.strip_prefix(prefix).and_then(|rest| rest.split('.').next()) else {
            continue;
        };
        let Some(pid) = owner(node) else { continue };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let path = entry.path();
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        if let Err(e) = removed
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("burn-shard-cluster: could not remove {}: {e}", path.display());
        }
    }
}

/// The pid in a name this crate gives; `None` for any other name.
fn owner(netns: &str) -> Option<u32> {
    let (pid, rest) = netns.strip_prefix(PREFIX)?.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let ours = match rest.split_once('-') {
        Some((n, part)) => digits(n) && (part == "sw" || part.strip_prefix('n').is_some_and(digits)),
        None => rest.strip_prefix("probe").is_some_and(digits),
    };
    if digits(pid) && ours { pid.parse().ok() } else { None }
}

fn ip(args: &[&str]) -> Result<(), ClusterError> {
    run("ip", args).map(drop)
}

/// Shapes what `dev` in `netns` sends: with `netem` set, the link's delay, jitter and loss at
/// the root with the rate (`tbf`) below it; the rate alone otherwise.
fn shape(netns: &str, dev: &str, link: &LinkShape, netem: bool) -> Result<(), ClusterError> {
    let tc = |args: &[&str]| {
        let mut all = vec!["-n", netns, "qdisc", "add", "dev", dev];
        all.extend_from_slice(args);
        run("tc", &all).map(drop)
    };
    let mut parent = vec!["root"];
    if netem && link.needs_netem() {
        let (delay, jitter, loss) = (
            format!("{}ms", link.delay_ms),
            format!("{}ms", link.jitter_ms),
            format!("{}%", link.loss_percent),
        );
        // A queue of 10 000 packets: netem's default 1 000 drops at high rates with delay.
        let args = [
            "root", "handle", "1:", "netem", "limit", "10000", "delay", &delay, &jitter, "loss", &loss,
        ];
        tc(&args)?;
        parent = vec!["parent", "1:"];
    }
    if let Some(rate) = link.rate_mbit {
        // A bucket of 10 ms at the rate, at least 16 KB (more than a 9000-byte jumbo frame): a
        // smaller one caps the rate below the one asked when the qdisc is served late.
        let burst = ((rate * 1e6 / 8.0 * 0.010) as u64).max(16_000).to_string();
        let rate = format!("{}bit", (rate * 1e6).round() as u64);
        let mut args = parent.clone();
        args.extend_from_slice(&["tbf", "rate", &rate, "burst", &burst, "latency", "100ms"]);
        tc(&args)?;
    }
    Ok(())
}
