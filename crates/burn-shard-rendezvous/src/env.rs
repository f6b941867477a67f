//! [`RendezvousEnv`]: a process's place in the job, read from the variables a launcher sets.

use std::collections::HashMap;

use crate::process_env::process_var;
use crate::{JOB_TOKEN, JOB_TOKEN_FILE, JobToken, RendezvousError, token};

/// `RANK`: this process's rank in `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// `WORLD_SIZE`: number of ranks in the job, over all nodes.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// `LOCAL_RANK`: this process's index on its node; the GPU it uses.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// `LOCAL_WORLD_SIZE`: number of ranks on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// `MASTER_ADDR`: host name or IP address of rank 0's machine, where the rendezvous runs.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// `MASTER_PORT`: TCP port of the rendezvous on rank 0's machine.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// Where this process sits in a multi-process job: the variables that `burn-shard-run` and
/// PyTorch's `torchrun` set for every process they start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// `RANK`, in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`, at least 1.
    pub world_size: usize,
    /// `LOCAL_RANK`, in `0..local_world_size`: the index of this process's GPU on its node.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`, in `1..=world_size`.
    pub local_world_size: usize,
    /// `MASTER_ADDR`, without brackets around an IPv6 address.
    pub master_addr: String,
    /// `MASTER_PORT`, in `1..=65535`.
    pub master_port: u16,
    /// The job's secret, from `BURN_SHARD_JOB_TOKEN` or the owner-only file named by
    /// `BURN_SHARD_JOB_TOKEN_FILE`: the store serves only processes that hold it.
    pub token: JobToken,
}

impl RendezvousEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT` and the job token (`BURN_SHARD_JOB_TOKEN`, or the file named by
    /// `BURN_SHARD_JOB_TOKEN_FILE`, see [`JobToken::from_env`]) from this process's environment.
    ///
    /// # Errors
    /// [`RendezvousError::Env`] naming the first variable that is missing, not UTF-8, not a number,
    /// or out of range (e.g. `RANK >= WORLD_SIZE`); for the token, also both token variables
    /// set, a token too short, or a token file readable by others (the fix: `chmod 600`).
    pub fn from_env() -> Result<Self, RendezvousError> {
        Self::parse(process_var)
    }

    /// Like [`RendezvousEnv::from_env`], from the given `(name, value)` pairs instead of the
    /// process environment (other names are ignored).
    ///
    /// # Errors
    /// As [`RendezvousEnv::from_env`].
    pub fn from_vars<K: AsRef<str>, V: AsRef<str>>(
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, RendezvousError> {
        let vars: HashMap<String, String> = vars
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_string(), v.as_ref().to_string()))
            .collect();
        Self::parse(|var| Ok(vars.get(var).cloned()))
    }

    fn parse(get: impl Fn(&'static str) -> Result<Option<String>, RendezvousError>) -> Result<Self, RendezvousError> {
        let required = |var: &'static str| -> Result<String, RendezvousError> {
            match get(var)? {
                Some(value) => Ok(value.trim().to_string()),
                None => Err(RendezvousError::Env {
                    var,
                    problem: "is not set".into(),
                }),
            }
        };
        let number = |var: &'static str| -> Result<usize, RendezvousError> {
            let text = required(var)?;
            text.parse().map_err(|_| RendezvousError::Env {
                var,
                problem: format!("is {text:?}, expected a non-negative integer"),
            })
        };
        let below = |var: &'static str, value: usize, limit_var: &'static str, limit: usize| {
            if value < limit {
                Ok(value)
            } else {
                Err(RendezvousError::Env {
                    var,
                    problem: format!("is {value} but {limit_var} is {limit} (valid values: 0..{limit_var})"),
                })
            }
        };
        let world_size = number(WORLD_SIZE)?;
        if world_size == 0 {
            return Err(RendezvousError::Env {
                var: WORLD_SIZE,
                problem: "is 0, expected at least 1".into(),
            });
        }
        let rank = below(RANK, number(RANK)?, WORLD_SIZE, world_size)?;
        let local_world_size = number(LOCAL_WORLD_SIZE)?;
        if local_world_size == 0 || local_world_size > world_size {
            return Err(RendezvousError::Env {
                var: LOCAL_WORLD_SIZE,
                problem: format!("is {local_world_size} but WORLD_SIZE is {world_size}, expected 1..=WORLD_SIZE"),
            });
        }
        let local_rank = below(LOCAL_RANK, number(LOCAL_RANK)?, LOCAL_WORLD_SIZE, local_world_size)?;
        let addr = required(MASTER_ADDR)?;
        // Accept "[::1]" as well as "::1": brackets are how IPv6 addresses are written with a port.
        let master_addr = addr
            .strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(&addr);
        if master_addr.is_empty() {
            return Err(RendezvousError::Env {
                var: MASTER_ADDR,
                problem: "is empty, expected the host name or IP address of rank 0's machine".into(),
            });
        }
        let port = required(MASTER_PORT)?;
        let master_port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => {
                return Err(RendezvousError::Env {
                    var: MASTER_PORT,
                    problem: format!("is {port:?}, expected a TCP port in 1..=65535"),
                });
            }
        };
        let token = JobToken::from_lookup(&get)?.ok_or_else(|| RendezvousError::Env {
            var: JOB_TOKEN,
            problem: format!(
                "is not set, nor {JOB_TOKEN_FILE}: the rendezvous serves only processes that hold the job's token \
                 (burn-shard-run sets it for the ranks it starts; under another launcher, {})",
                token::HOW_TO_SHARE
            ),
        })?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr: master_addr.to_string(),
            master_port,
            token,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with brackets around an IPv6 address (`[::1]:29500`).
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}
