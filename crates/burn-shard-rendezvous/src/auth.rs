//! The store's handshake: a client and the store prove to each other that they hold the same
//! [`JobToken`] before any key is read or written, and the token itself never crosses the wire.
//!
//! 1. client → store: [`HELLO`], `client_nonce` (32 random bytes);
//! 2. store → client: [`HELLO`], then [`BUSY`] (and the store closes: it serves as many
//!    connections as it may), or [`OK`], `server_nonce` (32 random bytes), `server_proof`;
//! 3. client → store: `client_proof`, once it has checked `server_proof` (so a client that
//!    reached a store of another job, or an impostor on `MASTER_PORT`, stops here);
//! 4. store → client: [`OK`], or [`BAD_TOKEN`] and the store closes.
//!
//! `server_proof = HMAC-SHA256(token, SERVER_CONTEXT || client_nonce || server_nonce)` and
//! `client_proof = HMAC-SHA256(token, CLIENT_CONTEXT || server_nonce || client_nonce)`: fresh
//! nonces on both sides make every proof single-use, and the two contexts keep one side's proof
//! from serving as the other's. Proofs are checked in constant time (`hmac`'s `verify_slice`).
//! The store gives a connection [`StoreLimits::handshake_timeout`](crate::StoreLimits) for
//! steps 1 and 3 together, however the bytes trickle in.
//!
//! What this does not do: encrypt. Anyone on the path between the nodes can read the keys and
//! values (the NCCL id) and take over a connection after its handshake; on such networks run
//! the job inside a VPN or an encrypted overlay.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::JobToken;
use crate::wire::{BAD_TOKEN, BUSY, HELLO, OK};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of each side's challenge.
const NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
const PROOF_BYTES: usize = 32;
/// What the store's proof is of (the protocol version included, so proofs of another version
/// never verify).
const SERVER_CONTEXT: &[u8] = b"burn-shard rendezvous BSRDV002: store proves the job token";
/// What a client's proof is of.
const CLIENT_CONTEXT: &[u8] = b"burn-shard rendezvous BSRDV002: client proves the job token";

/// How a client's handshake ended.
pub(crate) enum Handshake {
    /// Both sides proved the token: the connection is ready for requests.
    Accepted(TcpStream),
    /// Something that is not a rendezvous store answered (what it sent, for the message).
    Stranger(String),
    /// The store serves as many connections as it may.
    Busy,
    /// The store's proof is of another token, or the store refused this client's.
    WrongToken,
}

/// The client's side of the handshake on a connected `stream`, each read bounded by `deadline`.
pub(crate) fn connect(mut stream: TcpStream, token: &JobToken, deadline: Instant) -> io::Result<Handshake> {
    stream.set_nodelay(true)?;
    let client_nonce = nonce()?;
    stream.write_all(&[&HELLO[..], &client_nonce].concat())?;
    let mut hello = [0u8; HELLO.len()];
    read_exact_by(&stream, &mut hello, deadline)?;
    if hello != HELLO {
        return Ok(Handshake::Stranger(format!(
            "it sent {:?}",
            String::from_utf8_lossy(&hello)
        )));
    }
    let mut status = [0u8; 1];
    read_exact_by(&stream, &mut status, deadline)?;
    match status[0] {
        OK => {}
        BUSY => return Ok(Handshake::Busy),
        other => return Ok(Handshake::Stranger(format!("its handshake status is {other}"))),
    }
    let mut server_nonce = [0u8; NONCE_BYTES];
    let mut server_proof = [0u8; PROOF_BYTES];
    read_exact_by(&stream, &mut server_nonce, deadline)?;
    read_exact_by(&stream, &mut server_proof, deadline)?;
    if mac(token, SERVER_CONTEXT, &client_nonce, &server_nonce)
        .verify_slice(&server_proof)
        .is_err()
    {
        return Ok(Handshake::WrongToken);
    }
    let proof = mac(token, CLIENT_CONTEXT, &server_nonce, &client_nonce)
        .finalize()
        .into_bytes();
    stream.write_all(&proof)?;
    read_exact_by(&stream, &mut status, deadline)?;
    Ok(match status[0] {
        OK => Handshake::Accepted(stream),
        BAD_TOKEN => Handshake::WrongToken,
        other => Handshake::Stranger(format!("it answered the token's proof with status {other}")),
    })
}

/// The store's side of the handshake, bounded by `deadline`: `Ok(true)` once the client proved
/// the token, `Ok(false)` when its proof was wrong (it has been told), an error when it sent
/// something else or too little in time.
pub(crate) fn accept(mut stream: &TcpStream, token: &JobToken, deadline: Instant) -> io::Result<bool> {
    let mut hello = [0u8; HELLO.len()];
    let mut client_nonce = [0u8; NONCE_BYTES];
    read_exact_by(stream, &mut hello, deadline)?;
    if hello != HELLO {
        // Our hello first, so that a client of another burn-shard version reads the version it
        // met and says so, instead of retrying until its timeout.
        let _ = stream.write_all(&HELLO[..]);
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a rendezvous client"));
    }
    read_exact_by(stream, &mut client_nonce, deadline)?;
    let server_nonce = nonce()?;
    let server_proof = mac(token, SERVER_CONTEXT, &client_nonce, &server_nonce)
        .finalize()
        .into_bytes();
    stream.write_all(&[&HELLO[..], &[OK], &server_nonce, &server_proof].concat())?;
    let mut client_proof = [0u8; PROOF_BYTES];
    read_exact_by(stream, &mut client_proof, deadline)?;
    let proved = mac(token, CLIENT_CONTEXT, &server_nonce, &client_nonce)
        .verify_slice(&client_proof)
        .is_ok();
    stream.write_all(&[if proved { OK } else { BAD_TOKEN }])?;
    Ok(proved)
}

/// The store's answer to a connection over its limit, sent without reading it: the hello and
/// [`BUSY`]. Never blocks (the socket is switched to non-blocking; a full buffer drops it).
pub(crate) fn refuse_busy(mut stream: &TcpStream) {
    let _ = stream.set_nonblocking(true);
    // What the client already sent, so that closing is a clean end rather than a reset that
    // could discard the answer before the client reads it.
    let mut sent = [0u8; HELLO.len() + NONCE_BYTES];
    let _ = stream.read(&mut sent);
    let _ = stream.write_all(&[&HELLO[..], &[BUSY]].concat());
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

fn mac(token: &JobToken, context: &[u8], first: &[u8], second: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length: `new_from_slice` cannot fail for it.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(token.secret()).expect("HMAC accepts keys of any length");
    mac.update(context);
    mac.update(first);
    mac.update(second);
    mac
}

fn nonce() -> io::Result<[u8; NONCE_BYTES]> {
    let mut nonce = [0u8; NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|e| io::Error::other(format!("the system's random source failed: {e}")))?;
    Ok(nonce)
}

/// `read_exact` that gives up at `deadline` in total, not per read: a peer trickling one byte
/// at a time cannot hold the connection longer.
fn read_exact_by(stream: &TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut reader = stream;
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the handshake took too long"));
        }
        stream.set_read_timeout(Some(left))?;
        match reader.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the handshake took too long"));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
