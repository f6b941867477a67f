//! Ring algorithms on host `f32` buffers.
//!
//! Each rank sends only to `rank + 1` and receives only from `rank - 1` (mod `world_size`),
//! as in NCCL's ring. Per rank and buffer of `S` bytes this moves `(N-1)/N·S` for
//! reduce-scatter and all-gather and `2(N-1)/N·S` for all-reduce (Patarasuk & Yuan, 2009,
//! "Bandwidth optimal all-reduce algorithms for clusters of workstations").
//!
//! Determinism: chunk `c` is always summed in the same ring order (starting at rank `c+1`),
//! whatever the thread timing, and all-reduce all-gathers the finished chunks, so every rank
//! ends with bitwise-identical values.

use std::ops::Range;

use crate::CommError;

/// The two neighbours of one rank in the ring, for one collective call.
pub(crate) trait RingLink {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Sends `payload` to rank `rank + 1`.
    fn send(&mut self, payload: Vec<f32>) -> Result<(), CommError>;
    /// Receives the next payload from rank `rank - 1`.
    fn recv(&mut self) -> Result<Vec<f32>, CommError>;
}

/// Element range of chunk `i` when `len` elements are split over `n` ranks as evenly as possible.
pub(crate) fn chunk(len: usize, n: usize, i: usize) -> Range<usize> {
    (i * len / n)..((i + 1) * len / n)
}

/// Ring reduce-scatter (sum) in place; returns the range of `buf` this rank now holds reduced.
pub(crate) fn reduce_scatter(link: &mut dyn RingLink, buf: &mut [f32]) -> Result<Range<usize>, CommError> {
    let (n, r, len) = (link.world_size(), link.rank(), buf.len());
    for step in 0..n - 1 {
        let send_c = (r + 2 * n - step - 1) % n;
        let recv_c = (r + 2 * n - step - 2) % n;
        link.send(buf[chunk(len, n, send_c)].to_vec())?;
        let incoming = link.recv()?;
        let target = &mut buf[chunk(len, n, recv_c)];
        debug_assert_eq!(target.len(), incoming.len());
        for (a, b) in target.iter_mut().zip(incoming) {
            *a += b;
        }
    }
    Ok(chunk(len, n, r))
}

/// Ring all-gather in place: on entry this rank's chunk of `buf` is valid, on exit all are.
pub(crate) fn all_gather(link: &mut dyn RingLink, buf: &mut [f32]) -> Result<(), CommError> {
    let (n, r, len) = (link.world_size(), link.rank(), buf.len());
    for step in 0..n - 1 {
        let send_c = (r + n - step) % n;
        let recv_c = (r + 2 * n - step - 1) % n;
        link.send(buf[chunk(len, n, send_c)].to_vec())?;
        let incoming = link.recv()?;
        buf[chunk(len, n, recv_c)].copy_from_slice(&incoming);
    }
    Ok(())
}

/// Ring broadcast from `root`: each rank but the one before `root` forwards the whole buffer
/// to its successor ((N-1)·S bytes in all; not chunk-pipelined).
pub(crate) fn broadcast(link: &mut dyn RingLink, buf: Vec<f32>, root: usize) -> Result<Vec<f32>, CommError> {
    let (n, r) = (link.world_size(), link.rank());
    let buf = if r == root { buf } else { link.recv()? };
    if (r + 1) % n != root {
        link.send(buf.clone())?;
    }
    Ok(buf)
}
