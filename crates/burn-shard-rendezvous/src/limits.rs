//! [`StoreLimits`]: what one client, or many, can cost the rendezvous store. Each limit is
//! checked before the store spends what it bounds: a connection past `max_connections` gets no
//! thread, a value past `max_value_bytes` or past the room left under `max_stored_bytes` is
//! skipped as it arrives, never buffered.

use std::time::Duration;

use crate::{MAX_KEY_BYTES, MAX_VALUE_BYTES, RendezvousError};

/// Default [`StoreLimits::max_connections`]: 1024 open connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default [`StoreLimits::max_stored_bytes`]: 256 MiB of keys and values.
pub const DEFAULT_MAX_STORED_BYTES: usize = 256 << 20;
/// Default [`StoreLimits::max_handshakes_per_peer`]: 64 connections of one address still proving
/// the token.
pub const DEFAULT_MAX_HANDSHAKES_PER_PEER: usize = 64;

/// Default [`StoreLimits::handshake_timeout`]: 2 s.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// The limits of a [`StoreServer`](crate::StoreServer), with builder methods
/// (`StoreLimits::default().with_max_connections(64)`).
///
/// A request over a size limit is refused with an error on the client that names the limit,
/// and the connection stays usable; a connection over `max_connections`, or one that has not
/// proved the job token within `handshake_timeout`, is closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreLimits {
    /// Connections open at once, proved or still in their handshake; one more is closed at
    /// once, without a thread (default [`DEFAULT_MAX_CONNECTIONS`]; [`Rendezvous`](crate::Rendezvous)
    /// raises it to twice the world size for larger jobs).
    pub max_connections: usize,
    /// Connections from one IP address still in their handshake; one more from that address is
    /// closed at once (default [`DEFAULT_MAX_HANDSHAKES_PER_PEER`]). A host that opens
    /// connections and proves nothing therefore holds at most this many of `max_connections`,
    /// and the ranks of other hosts still get in; keep it at least the ranks per node.
    pub max_handshakes_per_peer: usize,
    /// Bytes of keys plus values the store holds, counting the values being received; a `set`
    /// or a new counter past it is refused (default [`DEFAULT_MAX_STORED_BYTES`]).
    pub max_stored_bytes: usize,
    /// Longest key, in bytes (default and at most [`MAX_KEY_BYTES`]).
    pub max_key_bytes: usize,
    /// Largest value, in bytes (default and at most [`MAX_VALUE_BYTES`]).
    pub max_value_bytes: usize,
    /// Time a new connection has to send its hello and prove the job token; one that sends
    /// nothing, too little or garbage is closed by then (default [`DEFAULT_HANDSHAKE_TIMEOUT`]).
    pub handshake_timeout: Duration,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_handshakes_per_peer: DEFAULT_MAX_HANDSHAKES_PER_PEER,
            max_stored_bytes: DEFAULT_MAX_STORED_BYTES,
            max_key_bytes: MAX_KEY_BYTES,
            max_value_bytes: MAX_VALUE_BYTES,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

impl StoreLimits {
    /// The defaults, with room for `world_size` ranks: at least twice as many connections.
    pub fn for_world_size(world_size: usize) -> Self {
        let defaults = Self::default();
        let max_connections = defaults.max_connections.max(world_size.saturating_mul(2));
        defaults.with_max_connections(max_connections)
    }

    /// Sets [`StoreLimits::max_connections`].
    pub fn with_max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections;
        self
    }

    /// Sets [`StoreLimits::max_stored_bytes`].
    pub fn with_max_stored_bytes(mut self, bytes: usize) -> Self {
        self.max_stored_bytes = bytes;
        self
    }

    /// Sets [`StoreLimits::max_key_bytes`].
    pub fn with_max_key_bytes(mut self, bytes: usize) -> Self {
        self.max_key_bytes = bytes;
        self
    }

    /// Sets [`StoreLimits::max_value_bytes`].
    pub fn with_max_value_bytes(mut self, bytes: usize) -> Self {
        self.max_value_bytes = bytes;
        self
    }

    /// Sets [`StoreLimits::max_handshakes_per_peer`].
    pub fn with_max_handshakes_per_peer(mut self, handshakes: usize) -> Self {
        self.max_handshakes_per_peer = handshakes;
        self
    }

    /// Sets [`StoreLimits::handshake_timeout`].
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Checks that the limits let a store work.
    ///
    /// # Errors
    /// [`RendezvousError::Rendezvous`] naming the field: no connection or handshake allowed, a
    /// key or value limit above the wire format's ([`MAX_KEY_BYTES`], [`MAX_VALUE_BYTES`]), no
    /// room for bytes, or a zero handshake timeout.
    pub fn validate(&self) -> Result<(), RendezvousError> {
        let fail = |msg: String| Err(RendezvousError::Rendezvous(format!("invalid store limits: {msg}")));
        if self.max_connections == 0 {
            return fail("max_connections is 0; allow at least one connection per rank".into());
        }
        if self.max_handshakes_per_peer == 0 {
            return fail("max_handshakes_per_peer is 0; allow at least the ranks of one node".into());
        }
        if self.max_stored_bytes == 0 {
            return fail("max_stored_bytes is 0; the rendezvous stores a few hundred bytes per rank".into());
        }
        if self.max_key_bytes > MAX_KEY_BYTES {
            return fail(format!(
                "max_key_bytes {} is over the wire format's {MAX_KEY_BYTES}",
                self.max_key_bytes
            ));
        }
        if self.max_value_bytes > MAX_VALUE_BYTES {
            return fail(format!(
                "max_value_bytes {} is over the wire format's {MAX_VALUE_BYTES}",
                self.max_value_bytes
            ));
        }
        if self.handshake_timeout.is_zero() {
            return fail("handshake_timeout is 0; give clients a second or two to prove the job token".into());
        }
        Ok(())
    }
}
