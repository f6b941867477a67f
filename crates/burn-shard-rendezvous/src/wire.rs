//! The store's wire format: one request, one reply, in order, over one TCP connection per client.
//!
//! A connection opens with [`HELLO`] from the client, echoed by the server, so a client that
//! reached some other program on `MASTER_PORT` says so instead of misreading its bytes.
//! Integers are little-endian. A request is `op: u8`, `key_len: u32`, `key` (UTF-8), then:
//! - [`SET`]: `value_len: u32`, `value` → reply [`OK`];
//! - [`GET`]: `wait_ms: u64` → reply [`OK`], `value_len: u32`, `value`; or [`NOT_FOUND`] once
//!   the key stayed absent for `wait_ms`;
//! - [`ADD`]: `delta: i64` → reply [`OK`], `sum: i64`; or [`NOT_COUNTER`] when the key holds a
//!   value that is not an 8-byte counter.

use std::io::{self, Read, Write};
use std::time::Duration;

/// First bytes of every connection, in both directions (protocol name and version).
pub(crate) const HELLO: [u8; 8] = *b"BSRDV001";

/// Longest key the store accepts, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest value the store accepts, in bytes (64 MiB).
pub const MAX_VALUE_BYTES: usize = 64 << 20;

pub(crate) const SET: u8 = 1;
pub(crate) const GET: u8 = 2;
pub(crate) const ADD: u8 = 3;

pub(crate) const OK: u8 = 0;
pub(crate) const NOT_FOUND: u8 = 1;
pub(crate) const NOT_COUNTER: u8 = 2;

/// One request of a client.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    Set { key: String, value: Vec<u8> },
    Get { key: String, wait: Duration },
    Add { key: String, delta: i64 },
}

impl Request {
    pub(crate) fn write(&self, w: &mut impl Write) -> io::Result<()> {
        // One buffer, one write: with TCP_NODELAY, separate small writes would be separate packets.
        let mut buf = Vec::new();
        let (op, key) = match self {
            Request::Set { key, .. } => (SET, key),
            Request::Get { key, .. } => (GET, key),
            Request::Add { key, .. } => (ADD, key),
        };
        buf.push(op);
        put_bytes(&mut buf, key.as_bytes())?;
        match self {
            Request::Set { value, .. } => put_bytes(&mut buf, value)?,
            Request::Get { wait, .. } => {
                let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
                buf.extend_from_slice(&ms.to_le_bytes());
            }
            Request::Add { delta, .. } => buf.extend_from_slice(&delta.to_le_bytes()),
        }
        w.write_all(&buf)?;
        w.flush()
    }

    /// Reads the next request; `None` when the client closed the connection between requests.
    pub(crate) fn read(r: &mut impl Read) -> io::Result<Option<Self>> {
        let mut op = [0u8; 1];
        match r.read_exact(&mut op) {
            Ok(()) => {}
            // Nothing read: the client closed the connection between requests.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let key = String::from_utf8(read_bytes(r, MAX_KEY_BYTES)?)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))?;
        let request = match op[0] {
            SET => Request::Set {
                key,
                value: read_bytes(r, MAX_VALUE_BYTES)?,
            },
            GET => Request::Get {
                key,
                wait: Duration::from_millis(read_u64(r)?),
            },
            ADD => Request::Add {
                key,
                delta: read_u64(r)? as i64,
            },
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown request {other}"),
                ));
            }
        };
        Ok(Some(request))
    }
}

/// Appends `len: u32` and the bytes.
pub(crate) fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "over 4 GiB"))?;
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(bytes);
    Ok(())
}

/// Reads `len: u32` and that many bytes, refusing more than `max` (so a stray peer cannot make
/// the reader allocate gigabytes).
pub(crate) fn read_bytes(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{len} bytes exceed the limit of {max}"),
        ));
    }
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes)?;
    Ok(bytes)
}

pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
