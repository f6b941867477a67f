//! A cluster of "nodes" on one Linux host, for multi-node tests whose traffic crosses a real
//! link: each node is a network namespace with one interface (`eth0`, an address in
//! `10.77.0.0/24`), joined to the others by a bridge that lives in a namespace of its own, so
//! nothing is added to the host's own network. Each node's link can be shaped with `tc`: a rate
//! limit (the `tbf` qdisc, both directions), and delay, jitter and loss where the kernel has
//! `netem` ([`Capabilities`] says what it has). Links can be cut and restored to inject faults.
//!
//! Needs root and the `ip` and `tc` programs (iproute2). Everything a [`Cluster`] made (its
//! namespaces, the links in them, the processes started in them) is removed when it is dropped,
//! also when the code using it panics; what a run killed, aborted or exited before the drop
//! left is removed by [`remove_leftovers`], which every [`Cluster::create`] calls first.
//!
//! - `capabilities.rs`: what this host can do, probed once ([`Capabilities::probe`]);
//! - `spec.rs`: [`ClusterSpec`], the nodes and their link;
//! - `cluster.rs`: [`Cluster`], creation, commands in a node, link faults, removal;
//! - `mpirun.rs`: OpenMPI's `mpirun` across the nodes ([`Cluster::mpirun`]), and the bytes each
//!   node's link carried ([`Cluster::link_bytes`]);
//! - `latency.rs`: the round trip between two nodes as built ([`Cluster::round_trip`]);
//! - `command.rs`: running `ip` and `tc` with their errors.

mod capabilities;
mod cluster;
mod command;
mod error;
mod latency;
mod mpirun;
mod spec;

pub use capabilities::Capabilities;
pub use cluster::{Cluster, remove_leftovers};
pub use error::ClusterError;
pub use mpirun::{LinkBytes, mpirun_on_this_host};
pub use spec::{ClusterSpec, LinkShape};
