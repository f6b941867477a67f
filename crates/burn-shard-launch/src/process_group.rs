//! Each rank runs in its own process group, so stopping a rank stops what it started too
//! (a shell's children, data-loader workers), and a rank's exit is seen without reaping it, so
//! its process-group id cannot be reused by an unrelated process before the group is signalled.
//!
//! Each rank's main process also dies with the launcher: it is started with the parent-death
//! signal set to SIGKILL, so a launcher killed outright (SIGKILL, the OOM killer), which cannot
//! stop its ranks itself, leaves no orphaned rank behind. Processes a rank started itself are
//! not covered: they are stopped with their rank's process group only while the launcher lives.

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

    /// Starts `command` as the leader of a new process group, with SIGKILL as its parent-death
    /// signal.
    ///
    /// The kernel sends the parent-death signal when the *thread* that forked the child exits,
    /// not only when the whole launcher does. That is fine here: [`launch`](crate::launch)
    /// spawns every rank from its calling thread and blocks in that thread until every rank is
    /// reaped. The signal reaches the rank's main process only (it is not inherited across
    /// fork); what the rank starts itself is stopped through its process group, which needs
    /// a living launcher.
    pub(crate) fn spawn(command: &mut Command) -> io::Result<Child> {
        // Taken before the fork: the child compares it with its parent after arming the signal.
        let launcher = std::process::id() as libc::pid_t;
        let die_with_launcher = move || -> io::Result<()> {
            // SAFETY: runs in the forked child before exec, where only async-signal-safe calls
            // are allowed: prctl, getppid and raise are plain system calls that neither allocate
            // nor take locks, and `io::Error::last_os_error` only reads errno into a value.
            unsafe {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The launcher may have died between the fork and the prctl, when there was no
                // signal to send yet: then this process was already reparented (to init or a
                // subreaper), and ends itself as the signal would have ended it.
                if libc::getppid() != launcher {
                    libc::raise(libc::SIGKILL);
                }
            }
            Ok(())
        };
        // SAFETY: the closure only makes async-signal-safe calls (see above) and touches no
        // state shared with the parent: `launcher` is a copied integer.
        unsafe { command.pre_exec(die_with_launcher) };
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
