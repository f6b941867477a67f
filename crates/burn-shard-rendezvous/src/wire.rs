//! The store's wire format: one request, one reply, in order, over one TCP connection per client.
//!
//! A connection opens with the handshake of `auth.rs`: [`HELLO`] both ways (so a client that
//! reached some other program on `MASTER_PORT` says so instead of misreading its bytes), then
//! the proof of the job token both ways. Only then are requests read.
//! Integers are little-endian. A request is `op: u8`, `key_len: u32`, `key` (UTF-8), then:
//! - [`SET`]: `value_len: u32`, `value` → reply [`OK`];
//! - [`GET`]: `wait_ms: u64` → reply [`OK`], `value_len: u32`, `value`; or [`NOT_FOUND`] once
//!   the key stayed absent for `wait_ms`;
//! - [`ADD`]: `delta: i64` → reply [`OK`], `sum: i64`; or [`NOT_COUNTER`] when the key holds a
//!   value that is not an 8-byte counter.
//!
//! Any request may instead be answered [`TOO_LARGE`], `limit: u64` (its key or value is over
//! the store's limit, in bytes), and a `set` or an `add` that creates a counter [`FULL`],
//! `limit: u64` (the store would hold more bytes than that): the request's bytes were read and
//! dropped, the connection stays in step.

use std::io::{self, Read, Write};
use std::time::Duration;

/// First bytes of every connection, in both directions (protocol name and version).
pub(crate) const HELLO: [u8; 8] = *b"BSRDV002";

/// Longest key the wire format carries, in bytes (a store may accept less:
/// [`StoreLimits::max_key_bytes`](crate::StoreLimits::max_key_bytes)).
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest value the wire format carries, in bytes (64 MiB; a store may accept less:
/// [`StoreLimits::max_value_bytes`](crate::StoreLimits::max_value_bytes)).
pub const MAX_VALUE_BYTES: usize = 64 << 20;

pub(crate) const SET: u8 = 1;
pub(crate) const GET: u8 = 2;
pub(crate) const ADD: u8 = 3;

pub(crate) const OK: u8 = 0;
pub(crate) const NOT_FOUND: u8 = 1;
pub(crate) const NOT_COUNTER: u8 = 2;
/// A key or value over the store's limit; followed by the limit (`u64`, bytes).
pub(crate) const TOO_LARGE: u8 = 3;
/// The store would hold more than its limit; followed by the limit (`u64`, bytes).
pub(crate) const FULL: u8 = 4;
/// Handshake: the store serves as many connections as it may; it closes this one.
pub(crate) const BUSY: u8 = 5;
/// Handshake: the client's proof of the job token is wrong; the store closes the connection.
pub(crate) const BAD_TOKEN: u8 = 6;

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

pub(crate) fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Reads and drops `len` bytes, a chunk at a time (a refused value is never held whole).
pub(crate) fn skip(r: &mut impl Read, len: u64) -> io::Result<()> {
    let skipped = io::copy(&mut r.take(len), &mut io::sink())?;
    if skipped < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A request is one buffer: the op byte, the key as `len: u32` little-endian and its bytes,
    /// then the value (`len` and bytes), the wait in milliseconds (`u64`) or the delta (`i64`).
    #[test]
    fn requests_are_written_as_the_wire_format_says() {
        let mut out = Vec::new();
        let set = Request::Set {
            key: "k".into(),
            value: vec![7, 8],
        };
        set.write(&mut out).unwrap();
        assert_eq!(out, [SET, 1, 0, 0, 0, b'k', 2, 0, 0, 0, 7, 8]);
        let mut out = Vec::new();
        Request::Get {
            key: "ab".into(),
            wait: Duration::from_millis(258),
        }
        .write(&mut out)
        .unwrap();
        assert_eq!(out, [GET, 2, 0, 0, 0, b'a', b'b', 2, 1, 0, 0, 0, 0, 0, 0]);
        let mut out = Vec::new();
        Request::Add {
            key: String::new(),
            delta: -1,
        }
        .write(&mut out)
        .unwrap();
        assert_eq!(out, [ADD, 0, 0, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255]);
    }

    /// Bytes read back as written; a length over the reader's limit is refused before anything
    /// is allocated for it, and a short stream is an error, not a hang or a short value.
    #[test]
    fn byte_strings_round_trip_and_oversized_or_short_ones_are_refused() {
        let mut buf = Vec::new();
        put_bytes(&mut buf, b"value").unwrap();
        assert_eq!(read_bytes(&mut buf.as_slice(), 5).unwrap(), b"value");
        let err = read_bytes(&mut buf.as_slice(), 4).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        let huge = u32::MAX.to_le_bytes();
        assert_eq!(
            read_bytes(&mut huge.as_slice(), MAX_VALUE_BYTES).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let short = [5u8, 0, 0, 0, b'v'];
        assert_eq!(
            read_bytes(&mut short.as_slice(), 5).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
