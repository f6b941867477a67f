//! [`JobToken`]: the secret that a job's processes share, and that the rendezvous store asks
//! every connection to prove it knows (see `auth.rs`) before it reads or writes a key.
//!
//! Where a process finds it, in this order:
//! - [`JOB_TOKEN`] (`BURN_SHARD_JOB_TOKEN`): the token's text. `burn-shard-run` sets it for every
//!   rank it starts: a fresh random one per job on a single node, the one it was given otherwise;
//! - [`JOB_TOKEN_FILE`] (`BURN_SHARD_JOB_TOKEN_FILE`): the path of a file holding it (surrounding
//!   whitespace ignored), which must be readable by its owner only (`chmod 600`).
//!
//! Setting both is an error (which one was meant?). A token is at least [`MIN_JOB_TOKEN_CHARS`]
//! printable ASCII characters without spaces; [`JobToken::generate`] makes 64 hex digits (32
//! random bytes from the operating system), as `openssl rand -hex 32` does.

use std::fmt;
use std::path::Path;

use crate::RendezvousError;

/// `BURN_SHARD_JOB_TOKEN`: the job's token, as text. Takes the place of a file.
pub const JOB_TOKEN: &str = "BURN_SHARD_JOB_TOKEN";
/// `BURN_SHARD_JOB_TOKEN_FILE`: the path of a file (mode `600`) that holds the job's token.
pub const JOB_TOKEN_FILE: &str = "BURN_SHARD_JOB_TOKEN_FILE";
/// Fewest characters a token may have (32: 128 bits as hex digits).
pub const MIN_JOB_TOKEN_CHARS: usize = 32;
/// Random bytes in a token made by [`JobToken::generate`] (written as twice as many hex digits).
pub const GENERATED_JOB_TOKEN_BYTES: usize = 32;

/// How to make a token and hand it to every node, for error messages.
pub(crate) const HOW_TO_SHARE: &str = "make one token per job (`openssl rand -hex 32 > job.token && chmod 600 \
     job.token`), copy it to every node, and set BURN_SHARD_JOB_TOKEN_FILE=job.token (or BURN_SHARD_JOB_TOKEN=<its \
     text>) on each before starting it";

/// The secret of one job: only processes that hold it can use the job's rendezvous store.
///
/// It never crosses the network: the store and its clients prove to each other that they hold
/// it (HMAC-SHA256 of fresh random challenges). Its `Debug` output is redacted, and two tokens
/// compare in constant time.
#[derive(Clone)]
pub struct JobToken {
    text: String,
}

impl JobToken {
    /// A fresh random token: [`GENERATED_JOB_TOKEN_BYTES`] bytes from the operating system's
    /// random source, as hex digits.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when the operating system has no random source to offer.
    pub fn generate() -> Result<Self, RendezvousError> {
        let mut bytes = [0u8; GENERATED_JOB_TOKEN_BYTES];
        getrandom::fill(&mut bytes).map_err(|e| {
            RendezvousError::Rendezvous(format!(
                "cannot make a job token: the system's random source failed: {e}"
            ))
        })?;
        let text = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Self { text })
    }

    /// The token whose text is `text` (surrounding whitespace removed).
    ///
    /// # Errors
    /// [`RendezvousError::Env`] (for [`JOB_TOKEN`]) when the text is shorter than
    /// [`MIN_JOB_TOKEN_CHARS`] or holds anything but printable ASCII without spaces.
    pub fn new(text: &str) -> Result<Self, RendezvousError> {
        Self::parse(text, JOB_TOKEN, "")
    }

    /// Reads the token from the file at `path`, which must be a regular file readable by its
    /// owner only.
    ///
    /// # Errors
    /// [`RendezvousError::Env`] (for [`JOB_TOKEN_FILE`]) when the file cannot be read, is readable
    /// by its group or others (the message says `chmod 600 <path>`), or does not hold a token.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RendezvousError> {
        let path = path.as_ref();
        let problem = |problem: String| RendezvousError::Env {
            var: JOB_TOKEN_FILE,
            problem,
        };
        let metadata = std::fs::metadata(path).map_err(|e| problem(format!("cannot read {}: {e}", path.display())))?;
        if !metadata.is_file() {
            return Err(problem(format!("{} is not a regular file", path.display())));
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(problem(format!(
                    "{} is readable by others than its owner (mode {mode:03o}): a job token must be secret; run \
                     `chmod 600 {}`",
                    path.display(),
                    path.display()
                )));
            }
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| problem(format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text, JOB_TOKEN_FILE, &format!("{} ", path.display()))
    }

    /// The token of this process's environment: [`JOB_TOKEN`], else the file named by
    /// [`JOB_TOKEN_FILE`]; `None` when neither is set.
    ///
    /// # Errors
    /// As [`JobToken::new`] and [`JobToken::from_file`]; [`RendezvousError::Env`] when both
    /// variables are set, or one is not UTF-8.
    pub fn from_env() -> Result<Option<Self>, RendezvousError> {
        Self::from_lookup(crate::process_env::process_var)
    }

    /// [`JobToken::from_env`] with the variables read by `get`.
    pub(crate) fn from_lookup(
        get: impl Fn(&'static str) -> Result<Option<String>, RendezvousError>,
    ) -> Result<Option<Self>, RendezvousError> {
        match (get(JOB_TOKEN)?, get(JOB_TOKEN_FILE)?) {
            (Some(_), Some(_)) => Err(RendezvousError::Env {
                var: JOB_TOKEN,
                problem: format!("is set, and so is {JOB_TOKEN_FILE}: set only one of them"),
            }),
            (Some(text), None) => Self::new(&text).map(Some),
            (None, Some(path)) => Self::from_file(path.trim()).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The token's text, to hand it to a process (`burn-shard-run` sets [`JOB_TOKEN`] to it for
    /// the ranks it starts). Anyone who reads it can join the job: do not log it.
    pub fn reveal(&self) -> &str {
        &self.text
    }

    /// The key of the store's HMACs.
    pub(crate) fn secret(&self) -> &[u8] {
        self.text.as_bytes()
    }

    /// `source`: what held the text, with a trailing space ("" for a variable).
    fn parse(text: &str, var: &'static str, source: &str) -> Result<Self, RendezvousError> {
        let text = text.trim();
        let problem = |what: String| RendezvousError::Env {
            var,
            problem: format!("{what}; {HOW_TO_SHARE}"),
        };
        // The character itself is not shown: it is part of the token.
        if let Some(at) = text.chars().position(|c| !c.is_ascii_graphic()) {
            return Err(problem(format!(
                "{source}holds a character that is not printable ASCII (character {} of {}), but a job token is \
                 printable ASCII without spaces",
                at + 1,
                text.chars().count()
            )));
        }
        if text.len() < MIN_JOB_TOKEN_CHARS {
            return Err(problem(format!(
                "{source}holds {} characters, fewer than the {MIN_JOB_TOKEN_CHARS} a job token needs",
                text.len()
            )));
        }
        Ok(Self { text: text.to_string() })
    }
}

impl fmt::Debug for JobToken {
    /// `JobToken(<redacted>)`: the text never reaches a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

impl PartialEq for JobToken {
    /// Compares in time independent of where the texts differ (their lengths are not secret).
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.secret(), other.secret());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
    }
}

impl Eq for JobToken {}
