//! The rendezvous: how the processes of a multi-node job find each other before any collective
//! exists (to share the NCCL id, for instance).
//!
//! Rank 0 hosts a small TCP key-value store ([`StoreServer`], like PyTorch's `TCPStore`) at
//! `MASTER_ADDR:MASTER_PORT`; every rank, rank 0 included, connects to it as a [`StoreClient`]
//! and sets, waits for and counts keys. [`RendezvousEnv`] reads the launcher's variables and
//! [`Rendezvous`] does both steps for this process, then checks that the job's ranks add up
//! (each `RANK` once, one `WORLD_SIZE`, nobody missing). No serde, no async, no Burn (its
//! dependencies are `thiserror`, `tracing`, and `getrandom`, `hmac` and `sha2` for the token),
//! so the launcher `burn-shard-run` uses it too, for the variables' names and the token. The
//! keys it uses start with `burn-shard/`.
//!
//! Who may join: the store serves only processes that prove they hold the job's [`JobToken`]
//! (`BURN_SHARD_JOB_TOKEN`, or an owner-only file named by `BURN_SHARD_JOB_TOKEN_FILE`), by an
//! HMAC-SHA256 challenge-response in both directions; the token never crosses the wire. What
//! one client can cost it is bounded by [`StoreLimits`]: connections, bytes held, key and
//! value sizes, and the time to prove the token.

mod auth;
mod client;
mod env;
mod error;
mod limits;
mod membership;
mod process_env;
mod server;
mod token;
mod wire;

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

pub use client::StoreClient;
pub use env::{LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, RendezvousEnv, WORLD_SIZE};
pub use error::RendezvousError;
pub use limits::{
    DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HANDSHAKES_PER_PEER, DEFAULT_MAX_STORED_BYTES,
    StoreLimits,
};
pub use server::StoreServer;
pub use token::{GENERATED_JOB_TOKEN_BYTES, JOB_TOKEN, JOB_TOKEN_FILE, JobToken, MIN_JOB_TOKEN_CHARS};
pub use wire::{MAX_KEY_BYTES, MAX_VALUE_BYTES};

/// Default time to wait for the rendezvous and for keys (60 s): long enough for the last
/// process of a job to start, short enough that a missing rank is reported soon.
pub const RENDEZVOUS_DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// This process's membership in the job's rendezvous: the store client, and on rank 0 the
/// store itself.
///
/// Dropping it disconnects. Dropping rank 0's also closes the store, but first waits (up to the
/// timeout given to [`Rendezvous::new`]) until every other rank has dropped its own, so that no
/// rank loses the store in the middle of a request: drop it on every rank once done with it.
#[derive(Debug)]
pub struct Rendezvous {
    env: RendezvousEnv,
    client: StoreClient,
    server: Option<StoreServer>,
    timeout: Duration,
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        if let Some(server) = &self.server {
            self.client.close();
            if !server.wait_for_clients_to_leave(self.timeout) {
                tracing::warn!(
                    clients = server.clients(),
                    "closing the rendezvous store while ranks are still connected to it"
                );
            }
        }
    }
}

impl Rendezvous {
    /// On rank 0, starts the store on port `MASTER_PORT` of every interface of this machine,
    /// serving only the holders of `env.token`, with [`StoreLimits::for_world_size`]; then, on
    /// every rank, connects to `MASTER_ADDR:MASTER_PORT` with that token, waiting up to `timeout`
    /// for rank 0 to be listening; then registers this rank's `RANK` and `WORLD_SIZE` and waits, up
    /// to `timeout` again, until every rank of the job has registered.
    ///
    /// The join succeeds only when rank 0's `WORLD_SIZE` ranks registered, each `RANK` once, all
    /// with rank 0's `WORLD_SIZE`. A problem is reported on every rank, with the same message,
    /// as soon as one rank finds it (not at each rank's timeout): so a launch that gave two
    /// processes the same `RANK` fails at once instead of hanging in its first collective.
    /// A problematic process that registers only after the whole job has joined fails alone
    /// (the others have already started without it).
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when:
    /// - rank 0 cannot bind the port or resolve `MASTER_ADDR`;
    /// - a rank finds no store within `timeout` (rank 0 is not running, or `MASTER_ADDR` or
    ///   `MASTER_PORT` differ between ranks);
    /// - at once, when rank 0's store holds another job token than this rank (the message names
    ///   `BURN_SHARD_JOB_TOKEN`: give every node the same one);
    /// - two processes registered with the same `RANK` (the message names it);
    /// - a rank's `WORLD_SIZE` differs from rank 0's, which is how a `RANK` beyond rank 0's
    ///   `WORLD_SIZE` shows (the message names both sizes);
    /// - not every rank registered within `timeout` (counted from each rank's own registration;
    ///   the first rank to give up fails the others): the message says how many of how many
    ///   ranks joined, and names the missing ones;
    /// - the store is lost while joining (rank 0 exited).
    ///
    /// On rank 0, a failed join returns at once, but the store keeps answering in the background
    /// (holding `MASTER_PORT`) for at most `timeout` more, until every process the job is known
    /// to have has read the problem: so ranks still starting report it rather than a lost store.
    pub fn new(env: RendezvousEnv, timeout: Duration) -> Result<Self, RendezvousError> {
        let server = if env.rank == 0 {
            let limits = StoreLimits::for_world_size(env.world_size);
            Some(StoreServer::bind_with_limits(
                listen_addr(&env)?,
                env.token.clone(),
                limits,
            )?)
        } else {
            None
        };
        let client = StoreClient::connect(&env.master(), &env.token, timeout)?;
        let mut rendezvous = Self {
            env,
            client,
            server,
            timeout,
        };
        let joined = membership::join(
            &rendezvous.client,
            rendezvous.env.rank,
            rendezvous.env.world_size,
            timeout,
        );
        if joined.is_err()
            && let Some(server) = rendezvous.server.take()
        {
            rendezvous.client.close();
            membership::serve_stragglers(server, timeout);
        }
        joined.map(|()| rendezvous)
    }

    /// Reads the launcher's variables and the job token ([`RendezvousEnv::from_env`]) and joins the rendezvous with
    /// [`RENDEZVOUS_DEFAULT_TIMEOUT`].
    ///
    /// # Errors
    /// [`RendezvousError::Env`] for missing or malformed variables, else as [`Rendezvous::new`].
    pub fn from_env() -> Result<Self, RendezvousError> {
        Self::new(RendezvousEnv::from_env()?, RENDEZVOUS_DEFAULT_TIMEOUT)
    }

    /// This process's rank, world size and rendezvous address.
    pub fn env(&self) -> &RendezvousEnv {
        &self.env
    }

    /// The connection to the store, to set and get keys.
    pub fn store(&self) -> &StoreClient {
        &self.client
    }

    /// Where the store listens, on rank 0 (`None` on the other ranks).
    pub fn server_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(StoreServer::local_addr)
    }

    /// Returns once all `world_size` ranks have called their `n`-th barrier. (Dropping the
    /// rendezvous right after is safe: rank 0's waits for the others to leave.)
    ///
    /// # Errors
    /// As [`StoreClient::barrier`]: the message says how many ranks arrived within `timeout`.
    pub fn barrier(&self, timeout: Duration) -> Result<(), RendezvousError> {
        self.client.barrier(self.env.world_size, timeout)
    }
}

/// The address rank 0 listens on: every interface, in the family of `MASTER_ADDR` (binding to
/// `MASTER_ADDR` itself would fail where a host name resolves to a loopback alias, as Debian's
/// `127.0.1.1`, and other nodes could not reach it).
fn listen_addr(env: &RendezvousEnv) -> Result<SocketAddr, RendezvousError> {
    let resolved: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| {
            RendezvousError::Rendezvous(format!(
                "rank 0 cannot resolve MASTER_ADDR {:?}: {e}; set it to this machine's host name or IP address",
                env.master_addr
            ))
        })?
        .collect();
    let ip: std::net::IpAddr = if !resolved.is_empty() && resolved.iter().all(SocketAddr::is_ipv6) {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    };
    Ok(SocketAddr::new(ip, env.master_port))
}

/// A duration for messages, in seconds (`60 s`, `0.25 s`).
fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}
