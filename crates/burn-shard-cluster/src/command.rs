//! Running `ip` and `tc`, optionally inside a namespace (`ip netns exec`), with their errors.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Mutex;

use crate::error::ClusterError;

/// Runs `program args..` and returns its standard output. It runs in a process group of its
/// own, so a Ctrl-C at the terminal reaches the caller alone, which then removes the cluster
/// (an `ip netns add` killed halfway would leave a namespace nobody recorded).
///
/// # Errors
/// [`ClusterError::Command`] with the command line and its standard error when it exits
/// non-zero, or when it cannot start (naming iproute2, which ships `ip` and `tc`).
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String, ClusterError> {
    let command = || format!("{program} {}", args.join(" "));
    let output = Command::new(program)
        .args(args)
        .process_group(0)
        .output()
        .map_err(|e| ClusterError::Command {
            command: command(),
            status: "not started".into(),
            stderr: format!("{e}: install iproute2 (it ships `ip` and `tc`)"),
        })?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    Err(ClusterError::Command {
        command: command(),
        status: output.status.to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
    })
}

/// Runs `program args..` inside network namespace `netns`.
///
/// # Errors
/// As [`run`].
pub(crate) fn run_in(netns: &str, program: &str, args: &[&str]) -> Result<String, ClusterError> {
    let mut all = vec!["netns", "exec", netns, program];
    all.extend_from_slice(args);
    run("ip", &all)
}

/// Serialises `ip netns add`: iproute2 before 5.5 could stack `/run/netns` mounts when several
/// ran at once (tests make clusters concurrently).
static ADDING: Mutex<()> = Mutex::new(());

/// Makes network namespace `netns`.
pub(crate) fn add_netns(netns: &str) -> Result<(), ClusterError> {
    let _one_at_a_time = ADDING.lock().unwrap_or_else(|p| p.into_inner());
    run("ip", &["netns", "add", netns]).map(drop)
}
