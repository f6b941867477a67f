//! OpenMPI's `mpirun` across a cluster's nodes ([`Cluster::mpirun`]), and what crossed a node's
//! link ([`Cluster::link_bytes`]).
//!
//! `mpirun` starts its remote daemons (`orted`) through an "rsh agent", `ssh` by default. Here
//! the agent is a script the cluster writes, which enters the node whose address it is given
//! (`ip netns exec`) instead of logging in: every node then runs its ranks in its own
//! namespace, the ranks of a node talk through shared memory (OpenMPI's `vader`), and those of
//! different nodes through TCP over their shaped links, as on a real cluster.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::Command;

use crate::cluster::{Cluster, SUBNET};
use crate::command::run;
use crate::error::ClusterError;

/// Bytes a node's link carried, counted by the kernel at the node's `eth0` since the cluster
/// was made (Ethernet frames: payload plus TCP, IP and Ethernet headers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkBytes {
    /// Sent by the node.
    pub sent: u64,
    /// Received by the node.
    pub received: u64,
}

/// The options every `mpirun` of this crate takes: root allowed (a cluster needs it), no
/// binding to cores (the ranks of every node share this host's), and OpenMPI's `ob1` with the
/// `self`, `vader` (shared memory) and `tcp` transports (UCX, where OpenMPI has it, would pick
/// its own).
const TRANSPORT: [&str; 9] = [
    "--allow-run-as-root",
    "--bind-to",
    "none",
    "--mca",
    "pml",
    "ob1",
    "--mca",
    "btl",
    "self,vader,tcp",
];

/// The same job as [`Cluster::mpirun`] runs, on this host alone: OpenMPI's `mpirun` with
/// `ranks` ranks on shared memory (more ranks than cores allowed) and the same transports, so
/// that the two pick the same collective algorithms. Append options, the program and its
/// arguments.
pub fn mpirun_on_this_host(ranks: usize) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(TRANSPORT)
        .args(["--oversubscribe", "-np", &ranks.to_string()]);
    command
}

impl Cluster {
    /// A command that runs OpenMPI's `mpirun` in node 0 with `ranks_per_node` ranks on every
    /// node (rank `r` on node `r / ranks_per_node`): append `-x VAR` options, then the program
    /// and its arguments, and spawn it. Options set: `--allow-run-as-root`, no binding to
    /// cores, OpenMPI's `ob1` with the `self`, `vader` and `tcp` transports, `--host` with every
    /// node's address, the cluster's rsh agent (see the [module docs](self)), and TCP and
    /// `mpirun`'s own traffic restricted to the cluster's subnet. `mpirun` and each node's
    /// daemon run in a UTS namespace of their own whose hostname is the node's namespace name:
    /// OpenMPI tells nodes apart by hostname, which one host's namespaces share. Tested with
    /// OpenMPI 4.1; MPICH's `mpiexec` takes other options.
    ///
    /// # Errors
    /// [`ClusterError::Invalid`] for 0 ranks per node; [`ClusterError::Io`] when the agent
    /// script cannot be written.
    pub fn mpirun(&self, ranks_per_node: usize) -> Result<Command, ClusterError> {
        if ranks_per_node == 0 {
            return Err(ClusterError::Invalid("0 ranks per node: give 1 or more".into()));
        }
        let agent = self.rsh_agent()?;
        let hosts: Vec<String> = (0..self.nodes())
            .map(|node| format!("{}:{ranks_per_node}", self.address(node)))
            .collect();
        let subnet = format!("{}/{}", SUBNET.0, SUBNET.1);
        // Node 0's hostname is its namespace's name, as the agent gives every other node its
        // own: with one hostname for all nodes, a rank crashed (SIGSEGV) in the first job tried.
        let mut command = self.command(0, "unshare");
        command
            .args(["--uts", "sh", "-c", "hostname \"$0\" && exec mpirun \"$@\""])
            .arg(self.netns(0))
            .args(TRANSPORT)
            .args(["-np", &(ranks_per_node * self.nodes()).to_string()])
            .args(["--host", &hosts.join(",")])
            .arg("--mca")
            .arg("plm_rsh_agent")
            .arg(&agent)
            .args([
                "--mca",
                "btl_tcp_if_include",
                &subnet,
                "--mca",
                "oob_tcp_if_include",
                &subnet,
            ]);
        Ok(command)
    }

    /// The rsh agent script of this cluster, written on first use into the cluster's own
    /// folder (removed with the cluster): it skips the options `mpirun` gives an `ssh`, maps
    /// the host address to its node's namespace and runs the rest of its arguments there.
    fn rsh_agent(&self) -> Result<PathBuf, ClusterError> {
        let path = self.folder()?.join("rsh-agent");
        if path.is_file() {
            return Ok(path);
        }
        let mut script = format!(
            "#!/bin/sh\n# mpirun's rsh agent for cluster {}: enters the node instead of ssh.\n\
             while [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n\
             host=$1; shift\ncase \"$host\" in\n",
            self.name()
        );
        for node in 0..self.nodes() {
            script.push_str(&format!("  {}) netns={};;\n", self.address(node), self.netns(node)));
        }
        script.push_str(&format!(
            "  *) echo \"rsh agent of cluster {}: $host is not one of its nodes\" >&2; exit 255;;\n\
             esac\nexec ip netns exec \"$netns\" unshare --uts sh -c \"hostname $netns && $*\"\n",
            self.name()
        ));
        // Written beside, then renamed: `mpirun` never sees half a script. The folder is this
        // cluster's own (mode 0700), and the file must be new.
        let partial = path.with_extension("partial");
        let written = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o700)
            .open(&partial)
            .and_then(|mut file| file.write_all(script.as_bytes()))
            .and_then(|()| fs::rename(&partial, &path));
        if let Err(e) = written {
            // Not left behind: the next call writes it anew.
            let _ = fs::remove_file(&partial);
            return Err(e.into());
        }
        Ok(path)
    }

    /// Bytes node `node`'s link carried since the cluster was made: read before and after a
    /// job, the difference is what the job sent across nodes (ranks in a node talk through
    /// shared memory, which no link counts).
    ///
    /// # Errors
    /// [`ClusterError::Command`] when the counters cannot be read.
    ///
    /// # Panics
    /// When `node` is not a node of this cluster.
    pub fn link_bytes(&self, node: usize) -> Result<LinkBytes, ClusterError> {
        let netns = self.netns(node);
        let counter = |name: &str| -> Result<u64, ClusterError> {
            let path = format!("/sys/class/net/eth0/statistics/{name}");
            let text = run("ip", &["netns", "exec", &netns, "cat", &path])?;
            text.trim().parse().map_err(|e| ClusterError::Command {
                command: format!("ip netns exec {netns} cat {path}"),
                status: "exit status: 0".into(),
                stderr: format!("not a byte count: {text:?} ({e})"),
            })
        };
        Ok(LinkBytes {
            sent: counter("tx_bytes")?,
            received: counter("rx_bytes")?,
        })
    }
}
