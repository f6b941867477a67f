//! Termination signals sent to the launcher (Ctrl-C, `kill`, a closed terminal) are passed on
//! to the ranks: each rank has its own process group, so the terminal's Ctrl-C reaches only the
//! launcher.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use crate::LaunchError;

/// The last termination signal received, 0 for none.
static LAST: AtomicI32 = AtomicI32::new(0);
/// How many termination signals were received (a second one skips the grace period).
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// Makes SIGINT, SIGTERM and SIGHUP stop the ranks of a running [`launch`](crate::launch)
/// (passed on to each rank's process group, then SIGKILL after the grace period, at once on a
/// second signal) instead of ending this process. `burn-shard-run` calls it once at start;
/// without it these signals end the launcher and the ranks keep running.
///
/// # Errors
/// [`LaunchError::Unsupported`] off Linux; [`LaunchError::Config`] if a handler cannot be set.
pub fn forward_termination_signals() -> Result<(), LaunchError> {
    #[cfg(target_os = "linux")]
    {
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // SAFETY: the handler only stores into atomics, which is async-signal-safe.
            if unsafe { libc::signal(signal, handler) } == libc::SIG_ERR {
                return Err(LaunchError::Config(format!(
                    "cannot handle signal {signal}: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    Err(LaunchError::Unsupported)
}

#[cfg(target_os = "linux")]
extern "C" fn on_signal(signal: libc::c_int) {
    LAST.store(signal, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Signals received so far.
pub(crate) fn count() -> usize {
    COUNT.load(Ordering::SeqCst)
}

/// The last signal, if any arrived after `count()` returned `since`.
pub(crate) fn received_since(since: usize) -> Option<i32> {
    (count() > since).then(|| LAST.load(Ordering::SeqCst))
}
