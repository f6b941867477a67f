//! Each rank runs in its own process group, so stopping a rank stops what it started too
//! (a shell's children, data-loader workers), and a rank's exit is seen without reaping it, so
//! its process-group id cannot be reused by an unrelated process before the group is signalled.

use std::io;
use std::process::{Child, Command};

/// How a rank's main process stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    Running,
    Succeeded,
    Failed,
}

#[cfg(target_os = "linux")]
mod imp {
    use super::*;
    use std::os::unix::process::CommandExt;

    pub(crate) fn spawn(command: &mut Command) -> io::Result<Child> {
        command.process_group(0).spawn()
    }

    /// Whether the process has exited, leaving it a zombie (`WNOWAIT`): it is reaped only by
    /// [`Child::wait`] once its group has been signalled.
    pub(crate) fn peek_exit(child: &Child) -> io::Result<Exit> {
        // SAFETY: waitid writes a siginfo_t into `info`, which is zero-initialised (valid for it).
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let options = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        let rc = unsafe { libc::waitid(libc::P_PID, child.id() as libc::id_t, &mut info, options) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(Exit::Running), // asked again at the next poll
                _ => Err(e),
            };
        }
        // SAFETY: the fields of a siginfo_t filled by waitid for a child.
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        Ok(if pid == 0 {
            Exit::Running // WNOHANG and no state change
        } else if info.si_code == libc::CLD_EXITED && status == 0 {
            Exit::Succeeded
        } else {
            Exit::Failed
        })
    }

    /// Sends `signal` to every process of the child's group; a group that is already empty is
    /// not an error.
    pub(crate) fn signal_group(child: &Child, signal: i32) {
        // SAFETY: plain system call. The group id is the child's pid, which stays reserved while
        // the child is unreaped (running or a zombie), so this cannot reach an unrelated group.
        unsafe {
            libc::killpg(child.id() as libc::pid_t, signal);
        }
    }

    pub(crate) const SIGTERM: i32 = libc::SIGTERM;
    pub(crate) const SIGKILL: i32 = libc::SIGKILL;
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::*;
    use crate::LaunchError;

    pub(crate) fn spawn(_: &mut Command) -> io::Result<Child> {
        Err(io::Error::other(LaunchError::Unsupported.to_string()))
    }

    pub(crate) fn peek_exit(_: &Child) -> io::Result<Exit> {
        Err(io::Error::other(LaunchError::Unsupported.to_string()))
    }

    pub(crate) fn signal_group(_: &Child, _: i32) {}

    pub(crate) const SIGTERM: i32 = 15;
    pub(crate) const SIGKILL: i32 = 9;
}

pub(crate) use imp::{SIGKILL, SIGTERM, peek_exit, signal_group, spawn};
