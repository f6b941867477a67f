//! [`StoreServer`]: the key-value store that rank 0 hosts, one thread per connected rank.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::wire::{self, Request};
use crate::RendezvousError;

/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// How long a new connection may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP key-value store for the rendezvous of a job (like PyTorch's `TCPStore` server): keys
/// are strings, values bytes; [`StoreClient`](super::StoreClient)s set, wait for and add to
/// keys. It runs on background threads until dropped; dropping it closes every connection.
///
/// It trusts its clients: anyone who can reach the port can read and write keys. Bind it to a
/// network that only the job's machines can reach.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Shared {
    values: Mutex<HashMap<String, Vec<u8>>>,
    /// Notified whenever a key is written (and on stop), to wake waiting `get`s.
    changed: Condvar,
    stop: AtomicBool,
    /// The open connections, so that dropping the server can close them.
    connections: Mutex<HashMap<u64, TcpStream>>,
    next_connection: AtomicU64,
}

impl Shared {
    fn values(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-written (every write is one
        // insert), so a poisoned lock is still consistent.
        self.values.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StoreServer {
    /// Listens on `addr` (e.g. `"0.0.0.0:29500"`; port 0 picks a free port, see
    /// [`StoreServer::local_addr`]) and serves until dropped.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when the address cannot be bound (port in use, address not of
    /// this machine), naming the port to change.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self, RendezvousError> {
        let listener = TcpListener::bind(&addr).map_err(|e| {
            RendezvousError::Rendezvous(format!(
                "rank 0 cannot host the rendezvous on {addr:?}: {e}; choose a free MASTER_PORT \
                 (the same on every rank), or stop the job that holds this one"
            ))
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| RendezvousError::Rendezvous(format!("the rendezvous socket has no address: {e}")))?;
        // Non-blocking accept, so the loop can see the stop flag without a wake-up connection.
        listener
            .set_nonblocking(true)
            .map_err(|e| RendezvousError::Rendezvous(format!("rendezvous socket: {e}")))?;
        let shared = Arc::new(Shared::default());
        let accept = thread::Builder::new()
            .name("rendezvous-accept".into())
            .spawn({
                let shared = shared.clone();
                move || accept_loop(listener, shared)
            })
            .map_err(|e| RendezvousError::Rendezvous(format!("cannot start the rendezvous thread: {e}")))?;
        tracing::debug!(%local, "rendezvous store listening");
        Ok(Self {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Number of clients connected now.
    pub fn clients(&self) -> usize {
        self.shared.connections().len()
    }

    /// The keys starting with `prefix` and their values, read in place (for the host's own
    /// bookkeeping, without a connection).
    pub(super) fn values_under(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        self.shared
            .values()
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect()
    }

    /// Waits until no client is connected, or `timeout` passes; returns whether none is.
    /// Dropping the server while a rank still talks to it fails that rank's next request, so
    /// the host waits here for the others to leave first.
    pub fn wait_for_clients_to_leave(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.clients() == 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(ACCEPT_POLL);
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Take the lock so that no `get` is between its check and its wait while we notify.
        drop(self.shared.values());
        self.shared.changed.notify_all();
        for stream in self.shared.connections().values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
                let spawned = thread::Builder::new().name(format!("rendezvous-{peer}")).spawn({
                    let shared = shared.clone();
                    move || {
                        if let Err(e) = serve(&stream, id, &shared) {
                            tracing::debug!(%peer, "rendezvous connection closed: {e}");
                        }
                        shared.connections().remove(&id);
                    }
                });
                if let Err(e) = spawned {
                    tracing::warn!(%peer, "rendezvous: cannot start a connection thread: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) => {
                // Transient (e.g. too many open files, or the peer reset before accept): keep serving.
                tracing::warn!("rendezvous: accept failed: {e}");
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Answers one client's requests until it disconnects or the server stops.
fn serve(stream: &TcpStream, id: u64, shared: &Shared) -> io::Result<()> {
    // The accepted socket may inherit the listener's non-blocking mode on some platforms.
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    shared.connections().insert(id, stream.try_clone()?);
    if shared.stop.load(Ordering::SeqCst) {
        return Ok(()); // stopped between accept and registration: Drop did not see this stream
    }
    let mut reader = stream;
    let mut writer = stream;
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let mut hello = [0u8; wire::HELLO.len()];
    reader.read_exact(&mut hello)?;
    if hello != wire::HELLO {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a rendezvous client"));
    }
    writer.write_all(&wire::HELLO)?;
    // Clients hold their connection for the whole job and may be idle for long.
    stream.set_read_timeout(None)?;
    while let Some(request) = Request::read(&mut reader)? {
        match answer(request, shared) {
            Some(reply) => writer.write_all(&reply)?,
            // The server is stopping: close without a reply, so a waiting client reports the
            // lost store rather than a key that was "not set".
            None => return Ok(()),
        }
    }
    Ok(())
}

/// The reply to `request`; `None` when the server stopped while the request waited.
fn answer(request: Request, shared: &Shared) -> Option<Vec<u8>> {
    Some(match request {
        Request::Set { key, value } => {
            shared.values().insert(key, value);
            shared.changed.notify_all();
            vec![wire::OK]
        }
        Request::Get { key, wait } => {
            let values = shared.values();
            let (values, _) = shared
                .changed
                .wait_timeout_while(values, wait, |v| {
                    !v.contains_key(&key) && !shared.stop.load(Ordering::SeqCst)
                })
                .unwrap_or_else(PoisonError::into_inner);
            match values.get(&key) {
                Some(value) => {
                    let mut reply = vec![wire::OK];
                    // Values were limited to MAX_VALUE_BYTES when set, so the length fits in u32.
                    let _ = wire::put_bytes(&mut reply, value);
                    reply
                }
                None if shared.stop.load(Ordering::SeqCst) => return None,
                None => vec![wire::NOT_FOUND],
            }
        }
        Request::Add { key, delta } => {
            let mut values = shared.values();
            let entry = values.entry(key).or_insert_with(|| 0i64.to_le_bytes().to_vec());
            let Ok(current) = <[u8; 8]>::try_from(entry.as_slice()) else {
                return Some(vec![wire::NOT_COUNTER]);
            };
            let sum = i64::from_le_bytes(current).wrapping_add(delta);
            *entry = sum.to_le_bytes().to_vec();
            drop(values);
            shared.changed.notify_all();
            let mut reply = vec![wire::OK];
            reply.extend_from_slice(&sum.to_le_bytes());
            reply
        }
    })
}
