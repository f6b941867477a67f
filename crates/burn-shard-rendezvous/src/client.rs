//! [`StoreClient`]: one rank's connection to the rendezvous store.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::seconds;
use super::wire::{self, Request};
use crate::auth::{self, Handshake};
use crate::{JOB_TOKEN, JOB_TOKEN_FILE, JobToken, RendezvousError};

/// Longest single connection attempt; attempts repeat until the caller's timeout.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between connection attempts (rank 0 may not be listening yet).
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Extra time a `get` waits for the server's reply beyond the server-side wait (network delay).
const REPLY_SLACK: Duration = Duration::from_secs(5);

/// One rank's connection to a [`StoreServer`](super::StoreServer) (like PyTorch's `TCPStore`
/// client). Requests from one client are sent one at a time (a `get` that waits blocks the
/// client's other calls); use one client per thread for concurrent waits.
///
/// After an I/O error the connection is unusable and every later call returns that error:
/// connect again.
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    timeout: Duration,
    connection: Mutex<Connection>,
    barriers: AtomicU64,
}

#[derive(Debug)]
struct Connection {
    stream: TcpStream,
    /// Why the connection is no longer usable.
    broken: Option<String>,
}

impl StoreClient {
    /// Connects to the store at `addr` (`"host:port"`, `"[v6]:port"`), proves that this process
    /// holds the job's `token` and checks that the store holds it too, retrying until `timeout`
    /// (seconds granularity is enough: the rank hosting the store may start later than this one).
    /// `timeout` also bounds every later `set` and `add`.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when nothing answered at `addr` within `timeout` (or only
    /// a store serving its maximum of connections), when another program, not a rendezvous
    /// store, answered there, or at once when the store holds another job token (the message
    /// names `BURN_SHARD_JOB_TOKEN`: give every node the same one).
    pub fn connect(addr: &str, token: &JobToken, timeout: Duration) -> Result<Self, RendezvousError> {
        let deadline = Instant::now() + timeout;
        let mut last_error = String::from("no address to try");
        loop {
            match addr.to_socket_addrs() {
                Ok(candidates) => {
                    for candidate in candidates {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let attempt = left.min(ATTEMPT_TIMEOUT).max(Duration::from_millis(1));
                        let handshake = TcpStream::connect_timeout(&candidate, attempt)
                            .and_then(|s| auth::connect(s, token, Instant::now() + attempt));
                        match handshake {
                            Ok(Handshake::Accepted(stream)) => {
                                return Ok(Self {
                                    addr: addr.to_string(),
                                    timeout,
                                    connection: Mutex::new(Connection { stream, broken: None }),
                                    barriers: AtomicU64::new(0),
                                });
                            }
                            Ok(Handshake::Stranger(stranger)) => {
                                return Err(RendezvousError::Rendezvous(format!(
                                    "{candidate} ({addr}) answered, but not as a burn-shard rendezvous ({stranger}): \
                                     another program (or another burn-shard version) holds that port; choose a free \
                                     MASTER_PORT, the same on every rank"
                                )));
                            }
                            Ok(Handshake::WrongToken) => {
                                return Err(RendezvousError::Rendezvous(format!(
                                    "the rendezvous at {candidate} ({addr}) holds another job token than this \
                                     process: give every process of the job the same {JOB_TOKEN} (or \
                                     {JOB_TOKEN_FILE}); burn-shard-run passes its own to the ranks it starts, so \
                                     with several nodes set the same one on every node. If they are the same, \
                                     another job holds MASTER_PORT there: choose another"
                                )));
                            }
                            Ok(Handshake::Busy) => {
                                last_error = format!(
                                    "{candidate}: the store serves its maximum of connections \
                                     (StoreLimits::max_connections on rank 0) and refused this one"
                                );
                            }
                            Err(e) => last_error = format!("{candidate}: {e}"),
                        }
                    }
                }
                Err(e) => last_error = format!("cannot resolve {addr}: {e}"),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RendezvousError::Rendezvous(format!(
                    "no rendezvous at {addr} after {} (last error: {last_error}): is rank 0 running, \
                     and are MASTER_ADDR and MASTER_PORT the same on every rank?",
                    seconds(timeout)
                )));
            }
            thread::sleep(left.min(RETRY_PAUSE));
        }
    }

    /// The address this client connected to, as given to [`StoreClient::connect`].
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Closes the connection; later calls return an error.
    pub(crate) fn close(&self) {
        let mut connection = self.connection.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = connection.stream.shutdown(std::net::Shutdown::Both);
        connection.broken = Some(format!("the connection to the rendezvous at {} was closed", self.addr));
    }

    /// Sets `key` to `value` (replacing any value) and wakes every rank waiting for it.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when the key is over [`MAX_KEY_BYTES`](super::MAX_KEY_BYTES)
    /// or the value over [`MAX_VALUE_BYTES`](super::MAX_VALUE_BYTES) bytes (checked here), when
    /// the store refuses it for its own [`StoreLimits`](crate::StoreLimits) (a key or value
    /// over its size limits, or more bytes than it may hold: the message names the limit; the
    /// connection stays usable), or when the store is gone or silent for the connect timeout.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), RendezvousError> {
        check_key(key)?;
        if value.len() > wire::MAX_VALUE_BYTES {
            return Err(RendezvousError::Rendezvous(format!(
                "the value for '{key}' has {} bytes, over the store's limit of {} bytes",
                value.len(),
                wire::MAX_VALUE_BYTES
            )));
        }
        let request = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        let status = self.exchange("set", key, &request, self.timeout, |_, _| Ok(()))?;
        self.expect_ok(status, "set", key)
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when the key is still unset after `timeout` (the message names
    /// the key and the wait), the key is over the store's limit, or the store is gone.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
        self.try_get(key, timeout)?.ok_or_else(|| {
            RendezvousError::Rendezvous(format!(
                "key '{key}' was not set within {}: the rank that publishes it (usually rank 0) \
                 has not got that far; see its output for an error",
                seconds(timeout)
            ))
        })
    }

    /// Like [`StoreClient::get`], with `None` instead of an error when the key stays unset
    /// (`timeout` zero: whether it is set now, without waiting).
    ///
    /// # Errors
    /// As [`StoreClient::get`], but for a key that stays unset.
    pub fn try_get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, RendezvousError> {
        check_key(key)?;
        let request = Request::Get {
            key: key.to_string(),
            wait: timeout,
        };
        let mut value = None;
        let status = self.exchange(
            "get",
            key,
            &request,
            timeout.saturating_add(REPLY_SLACK),
            |r, status| {
                if status == wire::OK {
                    value = Some(wire::read_bytes(r, wire::MAX_VALUE_BYTES)?);
                }
                Ok(())
            },
        )?;
        match status {
            wire::NOT_FOUND => Ok(None),
            status => self.expect_ok(status, "get", key).map(|()| value),
        }
    }

    /// Adds `delta` to the counter `key` (created at 0) and returns its new value; `delta` 0
    /// reads it. Counters are stored as 8 little-endian bytes.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when `key` holds a value set by [`StoreClient::set`] that is not
    /// 8 bytes long, when a new counter would take the store over its
    /// [`StoreLimits::max_stored_bytes`](crate::StoreLimits::max_stored_bytes), or the store is gone.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, RendezvousError> {
        check_key(key)?;
        let request = Request::Add {
            key: key.to_string(),
            delta,
        };
        let mut sum = 0;
        let status = self.exchange("add", key, &request, self.timeout, |r, status| {
            if status == wire::OK {
                sum = wire::read_u64(r)? as i64;
            }
            Ok(())
        })?;
        match status {
            wire::NOT_COUNTER => Err(RendezvousError::Rendezvous(format!(
                "key '{key}' holds a value that is not a counter; use another key for add"
            ))),
            status => self.expect_ok(status, "add", key).map(|()| sum),
        }
    }

    /// Returns once `world_size` ranks have entered this barrier (their `n`-th call of
    /// `barrier` on their own client meets the others' `n`-th call).
    ///
    /// # Errors
    /// [`RendezvousError::InvalidWorldSize`] when `world_size == 0`; [`RendezvousError::Rendezvous`] when not
    /// every rank arrived within `timeout` (the message says how many did) or more than
    /// `world_size` ranks arrived (ranks disagree on `WORLD_SIZE`, or two jobs share the store).
    pub fn barrier(&self, world_size: usize, timeout: Duration) -> Result<(), RendezvousError> {
        if world_size == 0 {
            return Err(RendezvousError::InvalidWorldSize(world_size));
        }
        let n = self.barriers.fetch_add(1, Ordering::Relaxed);
        let count_key = format!("burn-shard/barrier/{n}/count");
        let done_key = format!("burn-shard/barrier/{n}/done");
        let arrived = self.add(&count_key, 1)?;
        let world = world_size as i64;
        if arrived > world {
            return Err(RendezvousError::Rendezvous(format!(
                "{arrived} ranks entered barrier #{n} but world_size is {world_size}: WORLD_SIZE differs \
                 between ranks, or two jobs use the same MASTER_ADDR:MASTER_PORT"
            )));
        }
        // The last rank to arrive releases the others.
        if arrived == world {
            self.set(&done_key, &[])?;
        }
        if self.try_get(&done_key, timeout)?.is_some() {
            return Ok(());
        }
        let arrived = self.add(&count_key, 0).unwrap_or(arrived);
        Err(RendezvousError::Rendezvous(format!(
            "only {arrived} of {world_size} ranks reached barrier #{n} within {}: a rank failed or is \
             stuck before it (see the output of the missing ranks)",
            seconds(timeout)
        )))
    }

    /// Sends `request` and reads the status byte, then lets `read_rest` read the rest of the
    /// reply. An I/O error breaks the connection (the reply stream is no longer in step).
    fn exchange(
        &self,
        op: &str,
        key: &str,
        request: &Request,
        reply_timeout: Duration,
        read_rest: impl FnOnce(&mut TcpStream, u8) -> io::Result<()>,
    ) -> Result<u8, RendezvousError> {
        let mut connection = self.connection.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = &connection.broken {
            return Err(RendezvousError::Rendezvous(why.clone()));
        }
        let stream = &mut connection.stream;
        // Both directions bounded: a store that stopped reading would otherwise block the send.
        let bound = Some(reply_timeout.max(Duration::from_millis(1)));
        let result = stream
            .set_read_timeout(bound)
            .and_then(|()| stream.set_write_timeout(bound))
            .and_then(|()| request.write(stream))
            .and_then(|()| {
                let status = wire::read_u8(stream)?;
                if status == wire::TOO_LARGE || status == wire::FULL {
                    return Ok(Err((status, wire::read_u64(stream)?)));
                }
                read_rest(stream, status)?;
                Ok(Ok(status))
            });
        let reply = result.map_err(|e| {
            let why = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                    "the rendezvous at {} did not answer {op} '{key}' within {}: is rank 0's process alive?",
                    self.addr,
                    seconds(reply_timeout)
                ),
                _ => format!(
                    "lost the connection to the rendezvous at {} during {op} '{key}' ({e}): rank 0, which \
                     hosts it, has exited or failed; see its output",
                    self.addr
                ),
            };
            connection.broken = Some(why.clone());
            RendezvousError::Rendezvous(why)
        })?;
        reply.map_err(|(status, limit)| self.refused(op, key, request, status, limit))
    }

    /// The error of a request the store refused for a limit (the connection stays usable).
    fn refused(&self, op: &str, key: &str, request: &Request, status: u8, limit: u64) -> RendezvousError {
        let value = match request {
            Request::Set { value, .. } => value.len(),
            Request::Get { .. } | Request::Add { .. } => 8,
        };
        let shown: String = key.chars().take(64).collect();
        let shown = if shown.len() < key.len() {
            format!("{shown}...")
        } else {
            shown
        };
        RendezvousError::Rendezvous(if status == wire::FULL {
            format!(
                "the rendezvous at {} refused {op} '{shown}' ({} bytes of key and value): the store would hold \
                 more than its limit of {limit} bytes of keys and values (StoreLimits::max_stored_bytes where rank \
                 0 hosts it); store less, or raise that limit",
                self.addr,
                key.len() + value
            )
        } else {
            format!(
                "the rendezvous at {} refused {op} '{shown}': its key ({} bytes) or value ({value} bytes) is over \
                 the store's limit of {limit} bytes (StoreLimits::max_key_bytes and max_value_bytes where rank 0 \
                 hosts it); use a shorter key or a smaller value, or raise that limit",
                self.addr,
                key.len()
            )
        })
    }

    fn expect_ok(&self, status: u8, op: &str, key: &str) -> Result<(), RendezvousError> {
        if status == wire::OK {
            Ok(())
        } else {
            Err(RendezvousError::Rendezvous(format!(
                "the rendezvous at {} answered {op} '{key}' with unknown status {status}: \
                 all ranks must run the same burn-shard version",
                self.addr
            )))
        }
    }
}

fn check_key(key: &str) -> Result<(), RendezvousError> {
    if key.len() > wire::MAX_KEY_BYTES {
        return Err(RendezvousError::Rendezvous(format!(
            "a key of {} bytes is over the store's limit of {} bytes",
            key.len(),
            wire::MAX_KEY_BYTES
        )));
    }
    Ok(())
}
