//! [`ClusterError`].

/// Why a cluster could not be made or used; each message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// This host cannot make the cluster (not root, no `ip`, no network namespaces).
    #[error("this host cannot make a cluster of network namespaces: {0}")]
    Unsupported(String),
    /// A shaping the kernel lacks: delay, jitter or loss without the `netem` qdisc, or a rate
    /// without `tbf`.
    #[error("{what} needs the `{qdisc}` qdisc, which `tc` could not add on this kernel: {fix}")]
    NoQdisc {
        what: String,
        qdisc: &'static str,
        fix: String,
    },
    /// An `ip` or `tc` command failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    /// A bad [`ClusterSpec`](crate::ClusterSpec).
    #[error("invalid cluster: {0}")]
    Invalid(String),
    /// Starting or waiting for a process failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
