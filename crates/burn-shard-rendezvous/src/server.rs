//! [`StoreServer`]: the key-value store that rank 0 hosts, one thread per connected rank.
//!
//! Rules: a connection is served only once it proved the job token (`auth.rs`), within
//! [`StoreLimits::handshake_timeout`]; the connections open at once, the bytes held and each
//! key and value are bounded by [`StoreLimits`], checked before the store spends what they
//! bound; values are shared (`Arc`), so that a `get` sends a large one without copying it (a small one is
//! copied into the reply).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::wire::{self, Request};
use crate::{JobToken, RendezvousError, StoreLimits, auth};

/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// Values up to this size are sent in one write with their reply's header.
const ONE_WRITE_BYTES: usize = 64 << 10;

/// A TCP key-value store for the rendezvous of a job (like PyTorch's `TCPStore` server): keys
/// are strings, values bytes; [`StoreClient`](super::StoreClient)s set, wait for and add to
/// keys. It runs on background threads until dropped; dropping it closes every connection.
///
/// It serves only clients that prove they hold its [`JobToken`] (a challenge-response; the
/// token never crosses the wire), and bounds what they can cost it ([`StoreLimits`]). It does
/// not encrypt: on a network where others can read the traffic between nodes, they can read
/// the keys and values.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    token: JobToken,
    limits: StoreLimits,
    store: Mutex<Store>,
    /// Notified whenever a key is written (and on stop), to wake waiting `get`s.
    changed: Condvar,
    stop: AtomicBool,
    /// The open connections, so that dropping the server can close them, and whether each has
    /// proved the token.
    connections: Mutex<HashMap<u64, Connection>>,
    next_connection: AtomicU64,
}

#[derive(Debug)]
struct Connection {
    stream: TcpStream,
    proved: bool,
    /// The peer's address, for [`StoreLimits::max_handshakes_per_peer`].
    ip: std::net::IpAddr,
}

/// The keys and values, and the bytes they take.
#[derive(Debug, Default)]
struct Store {
    values: HashMap<String, Arc<Vec<u8>>>,
    /// Bytes of every key plus its value.
    stored: usize,
    /// Bytes of the values being received, reserved before they are read.
    receiving: usize,
}

impl Store {
    /// Bytes `key` and its value take now (0 when absent).
    fn entry_bytes(&self, key: &str) -> usize {
        self.values.get(key).map_or(0, |v| key.len() + v.len())
    }

    /// Bytes held (stored plus being received) once `key` holds `len` bytes instead.
    fn held_after(&self, key: &str, len: usize) -> usize {
        (self.stored + self.receiving + key.len() + len).saturating_sub(self.entry_bytes(key))
    }

    fn insert(&mut self, key: String, value: Arc<Vec<u8>>) {
        self.stored = self.stored - self.entry_bytes(&key) + key.len() + value.len();
        self.values.insert(key, value);
    }
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock cannot leave the map half-written (every write is one
        // insert with its count), so a poisoned lock is still consistent.
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, HashMap<u64, Connection>> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StoreServer {
    /// Listens on `addr` (e.g. `"0.0.0.0:29500"`; port 0 picks a free port, see
    /// [`StoreServer::local_addr`]) with the default [`StoreLimits`], serving the clients that
    /// hold `token`, until dropped.
    ///
    /// # Errors
    /// As [`StoreServer::bind_with_limits`].
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug, token: JobToken) -> Result<Self, RendezvousError> {
        Self::bind_with_limits(addr, token, StoreLimits::default())
    }

    /// [`StoreServer::bind`] with the given limits.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] when the address cannot be bound (port in use, address not of
    /// this machine), naming the port to change, or when `limits` are invalid
    /// ([`StoreLimits::validate`]).
    pub fn bind_with_limits(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: JobToken,
        limits: StoreLimits,
    ) -> Result<Self, RendezvousError> {
        limits.validate()?;
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
        let shared = Arc::new(Shared {
            token,
            limits,
            store: Mutex::default(),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            connections: Mutex::default(),
            next_connection: AtomicU64::new(0),
        });
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

    /// The limits it enforces.
    pub fn limits(&self) -> &StoreLimits {
        &self.shared.limits
    }

    /// Number of clients connected now that proved the job token.
    pub fn clients(&self) -> usize {
        self.shared.connections().values().filter(|c| c.proved).count()
    }

    /// Number of connections open now: the clients, and those still in their handshake (at
    /// most [`StoreLimits::max_connections`]).
    pub fn open_connections(&self) -> usize {
        self.shared.connections().len()
    }

    /// Bytes of keys and values the store holds now (at most
    /// [`StoreLimits::max_stored_bytes`]).
    pub fn stored_bytes(&self) -> usize {
        self.shared.store().stored
    }

    /// The keys starting with `prefix` and their values, read in place (for the host's own
    /// bookkeeping, without a connection).
    pub(super) fn values_under(&self, prefix: &str) -> Vec<(String, Vec<u8>)> {
        self.shared
            .store()
            .values
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(key, value)| (key.clone(), value.to_vec()))
            .collect()
    }

    /// Waits until no client is connected, or `timeout` passes; returns whether none is.
    /// Dropping the server while a rank still talks to it fails that rank's next request, so
    /// the host waits here for the others to leave first. Connections that have not proved the
    /// token are not waited for.
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
        drop(self.shared.store());
        self.shared.changed.notify_all();
        for connection in self.shared.connections().values() {
            let _ = connection.stream.shutdown(std::net::Shutdown::Both);
        }
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => admit(stream, peer, &shared),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) => {
                // Transient (e.g. too many open files, or the peer reset before accept): keep serving.
                tracing::warn!("rendezvous: accept failed: {e}");
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Registers a new connection and starts its thread, or refuses it when the store already
/// has `max_connections` open, or `max_handshakes_per_peer` of this peer's still proving the
/// token (then without a thread: it costs nothing past this call).
fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) {
    let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
    {
        let mut connections = shared.connections();
        let pending_from_peer = connections.values().filter(|c| !c.proved && c.ip == peer.ip()).count();
        let refused = if connections.len() >= shared.limits.max_connections {
            Some("max_connections")
        } else if pending_from_peer >= shared.limits.max_handshakes_per_peer {
            Some("max_handshakes_per_peer")
        } else {
            None
        };
        if let Some(limit) = refused {
            drop(connections);
            tracing::debug!(%peer, "rendezvous: refused a connection past {limit}");
            auth::refuse_busy(&stream);
            return;
        }
        match stream.try_clone() {
            Ok(clone) => {
                let connection = Connection {
                    stream: clone,
                    proved: false,
                    ip: peer.ip(),
                };
                connections.insert(id, connection);
            }
            Err(e) => {
                drop(connections);
                tracing::warn!(%peer, "rendezvous: cannot register a connection: {e}");
                return;
            }
        }
    }
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
        shared.connections().remove(&id);
    }
}

/// Proves the token with one client, then answers its requests until it disconnects or the
/// server stops.
fn serve(stream: &TcpStream, id: u64, shared: &Shared) -> io::Result<()> {
    // The accepted socket may inherit the listener's non-blocking mode on some platforms.
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    if shared.stop.load(Ordering::SeqCst) {
        return Ok(()); // stopped between accept and registration: Drop may not have seen this stream
    }
    let handshake = shared.limits.handshake_timeout;
    stream.set_write_timeout(Some(handshake))?;
    if !auth::accept(stream, &shared.token, Instant::now() + handshake)? {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "wrong proof of the job token",
        ));
    }
    if let Some(connection) = shared.connections().get_mut(&id) {
        connection.proved = true;
    }
    // Clients hold their connection for the whole job and may be idle for long.
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    let mut reader = stream;
    let mut writer = stream;
    while let Some(incoming) = read_request(&mut reader, shared)? {
        let reply = match incoming {
            Incoming::Request(request) => match answer(request, shared) {
                Some(reply) => reply,
                // The server is stopping: close without a reply, so a waiting client reports
                // the lost store rather than a key that was "not set".
                None => return Ok(()),
            },
            Incoming::Refused { status, limit } => Reply::refusal(status, limit),
        };
        reply.write(&mut writer)?;
    }
    Ok(())
}

/// What the server read of one request.
enum Incoming {
    Request(Request),
    /// Its key or value was over a limit (`status` [`wire::TOO_LARGE`] or [`wire::FULL`],
    /// `limit` in bytes); its bytes were read and dropped.
    Refused {
        status: u8,
        limit: usize,
    },
}

/// Reads the next request; `None` when the client closed the connection between requests. A
/// value is read only into room reserved under `max_stored_bytes` (released by [`answer`]).
fn read_request(r: &mut impl Read, shared: &Shared) -> io::Result<Option<Incoming>> {
    let limits = &shared.limits;
    let mut op = [0u8; 1];
    match r.read_exact(&mut op) {
        Ok(()) => {}
        // Nothing read: the client closed the connection between requests.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let op = op[0];
    if ![wire::SET, wire::GET, wire::ADD].contains(&op) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown request {op}"),
        ));
    }
    let key_len = wire::read_u32(r)? as usize;
    let key = if key_len > limits.max_key_bytes {
        wire::skip(r, key_len as u64)?;
        None
    } else {
        let mut key = vec![0u8; key_len];
        r.read_exact(&mut key)?;
        Some(String::from_utf8(key).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))?)
    };
    let too_large_key = Incoming::Refused {
        status: wire::TOO_LARGE,
        limit: limits.max_key_bytes,
    };
    Ok(Some(match op {
        wire::SET => {
            let len = wire::read_u32(r)? as usize;
            let Some(key) = key else {
                wire::skip(r, len as u64)?;
                return Ok(Some(too_large_key));
            };
            if len > limits.max_value_bytes {
                wire::skip(r, len as u64)?;
                return Ok(Some(Incoming::Refused {
                    status: wire::TOO_LARGE,
                    limit: limits.max_value_bytes,
                }));
            }
            {
                let mut store = shared.store();
                if store.held_after(&key, len) > limits.max_stored_bytes {
                    drop(store);
                    wire::skip(r, len as u64)?;
                    return Ok(Some(Incoming::Refused {
                        status: wire::FULL,
                        limit: limits.max_stored_bytes,
                    }));
                }
                store.receiving += len;
            }
            let mut value = vec![0u8; len];
            if let Err(e) = r.read_exact(&mut value) {
                shared.store().receiving -= len;
                return Err(e);
            }
            Incoming::Request(Request::Set { key, value })
        }
        wire::GET => {
            let wait = Duration::from_millis(wire::read_u64(r)?);
            match key {
                Some(key) => Incoming::Request(Request::Get { key, wait }),
                None => too_large_key,
            }
        }
        _ => {
            let delta = wire::read_u64(r)? as i64;
            match key {
                Some(key) => Incoming::Request(Request::Add { key, delta }),
                None => too_large_key,
            }
        }
    }))
}

/// A reply: its header, and a value sent after it without a copy.
struct Reply {
    header: Vec<u8>,
    value: Option<Arc<Vec<u8>>>,
}

impl Reply {
    fn status(status: u8) -> Self {
        Self {
            header: vec![status],
            value: None,
        }
    }

    fn refusal(status: u8, limit: usize) -> Self {
        let mut header = vec![status];
        header.extend_from_slice(&(limit as u64).to_le_bytes());
        Self { header, value: None }
    }

    fn write(mut self, w: &mut impl Write) -> io::Result<()> {
        match self.value {
            // One write for small replies: with TCP_NODELAY, two would be two packets.
            Some(value) if value.len() <= ONE_WRITE_BYTES => {
                self.header.extend_from_slice(&value);
                w.write_all(&self.header)
            }
            Some(value) => {
                w.write_all(&self.header)?;
                w.write_all(&value)
            }
            None => w.write_all(&self.header),
        }
    }
}

/// The reply to `request`; `None` when the server stopped while the request waited. A `set`'s
/// reserved room is released here.
fn answer(request: Request, shared: &Shared) -> Option<Reply> {
    let limits = &shared.limits;
    Some(match request {
        Request::Set { key, value } => {
            let mut store = shared.store();
            store.receiving -= value.len();
            if store.held_after(&key, value.len()) > limits.max_stored_bytes {
                // Another set took the room while this value arrived.
                return Some(Reply::refusal(wire::FULL, limits.max_stored_bytes));
            }
            store.insert(key, Arc::new(value));
            drop(store);
            shared.changed.notify_all();
            Reply::status(wire::OK)
        }
        Request::Get { key, wait } => {
            let store = shared.store();
            let (store, _) = shared
                .changed
                .wait_timeout_while(store, wait, |s| {
                    !s.values.contains_key(&key) && !shared.stop.load(Ordering::SeqCst)
                })
                .unwrap_or_else(PoisonError::into_inner);
            match store.values.get(&key) {
                Some(value) => {
                    let mut header = vec![wire::OK];
                    // Values were limited to MAX_VALUE_BYTES when set, so the length fits in u32.
                    header.extend_from_slice(&(value.len() as u32).to_le_bytes());
                    Reply {
                        header,
                        value: Some(value.clone()),
                    }
                }
                None if shared.stop.load(Ordering::SeqCst) => return None,
                None => Reply::status(wire::NOT_FOUND),
            }
        }
        Request::Add { key, delta } => {
            let mut store = shared.store();
            let current = match store.values.get(&key) {
                Some(value) => match <[u8; 8]>::try_from(value.as_slice()) {
                    Ok(bytes) => i64::from_le_bytes(bytes),
                    Err(_) => return Some(Reply::status(wire::NOT_COUNTER)),
                },
                None if store.held_after(&key, 8) > limits.max_stored_bytes => {
                    return Some(Reply::refusal(wire::FULL, limits.max_stored_bytes));
                }
                None => 0,
            };
            let sum = current.wrapping_add(delta);
            store.insert(key, Arc::new(sum.to_le_bytes().to_vec()));
            drop(store);
            shared.changed.notify_all();
            let mut header = vec![wire::OK];
            header.extend_from_slice(&sum.to_le_bytes());
            Reply { header, value: None }
        }
    })
}
