//! The on-disk units both swap files share (the optimizer-state swap file and the stage-3 shard
//! file): space taken in whole 4 KiB blocks, and a CRC-32 over every piece of bytes written,
//! checked when it is read back.

/// Space is taken in whole blocks of this many bytes (a page, and a multiple of every disk's
/// logical block), so that no two pieces share a block.
pub(crate) const BLOCK: u64 = 4096;

/// Bytes a piece of `len` bytes reserves on disk: whole [`BLOCK`]s.
pub(crate) fn reserved(len: u64) -> u64 {
    len.div_ceil(BLOCK) * BLOCK
}

/// The CRC-32 (IEEE) of `bytes`, as written with them and compared when they are read back.
pub(crate) fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}
