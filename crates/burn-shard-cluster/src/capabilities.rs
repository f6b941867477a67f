//! [`Capabilities`]: what this host can do for a cluster, probed in a namespace of its own.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::command::{add_netns, run, run_in};

/// What this host offers a cluster. Probed, not assumed: kernels differ in the qdiscs they
/// were built with (`netem` is often missing, `tbf` rarely).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Why no cluster can be made here (not root, no `ip`, namespaces refused); `None` when
    /// one can.
    pub unsupported: Option<String>,
    /// Rate limits (`tbf`).
    pub tbf: bool,
    /// Delay, jitter and loss (`netem`).
    pub netem: bool,
}

impl Capabilities {
    /// Probes this host: root, `ip` and `tc`, a network namespace made and removed, and which
    /// qdiscs `tc` can add to its loopback. Starts a few `ip`/`tc` processes (tens of
    /// milliseconds); leaves nothing behind.
    pub fn probe() -> Self {
        let none = |why: String| Self {
            unsupported: Some(why),
            tbf: false,
            netem: false,
        };
        if !cfg!(target_os = "linux") {
            return none("network namespaces are Linux's".into());
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return none("it takes root (network namespaces and tc); run as root".into());
        }
        for program in ["ip", "tc"] {
            if let Err(e) = run(program, &["-V"]) {
                return none(format!("`{program}` is not usable: {e}"));
            }
        }
        // Unique per probe (tests probe concurrently), and named like a cluster's namespaces so
        // that `remove_leftovers` removes one a killed probe left.
        static PROBES: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "bsc{}-probe{}",
            std::process::id(),
            PROBES.fetch_add(1, Ordering::Relaxed)
        );
        if let Err(e) = add_netns(&name) {
            return none(format!("a network namespace could not be made: {e}"));
        }
        let qdisc = |kind: &[&str]| {
            let mut args = vec!["qdisc", "replace", "dev", "lo", "root"];
            args.extend_from_slice(kind);
            run_in(&name, "tc", &args).is_ok()
        };
        let tbf = qdisc(&["tbf", "rate", "1gbit", "burst", "32kb", "latency", "50ms"]);
        let netem = qdisc(&["netem", "delay", "1ms"]);
        if let Err(e) = run("ip", &["netns", "del", &name]) {
            eprintln!("burn-shard-cluster: could not remove the probe's namespace {name}: {e}");
        }
        Self {
            unsupported: None,
            tbf,
            netem,
        }
    }
}
