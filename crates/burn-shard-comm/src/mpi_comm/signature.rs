//! The signature check: before each collective the ranks all-gather what they are about to call
//! ([`CallSig`] as words), so ranks that call different things all get [`CommError::Mismatch`]
//! instead of MPI's undefined behaviour; [`bucket_sig`] is the signature of a grouped call.

use ::mpi::request::StaticScope;
use ::mpi::traits::*;
use burn::tensor::DType;

use super::comm::{MpiComm, State};
use super::pinned::Pinned;
use crate::CommError;
use crate::call_sig::{CallSig, SIG_WORDS};
use crate::host::HostBuffer;
use crate::stats::CollectiveKind;

impl MpiComm {
    /// All-gathers every rank's signature of call `seq`; the first rank whose signature differs
    /// from this rank's is a [`CommError::Mismatch`], found by every rank from the same data.
    pub(super) fn compare_signatures(&self, state: &mut State, seq: u64, sig: &CallSig) -> Result<(), CommError> {
        let ours = sig.to_words(seq);
        let send = Pinned::new(ours.to_vec());
        let mut recv = Pinned::new(vec![0u64; SIG_WORDS * self.world_size]);
        // SAFETY: `send` and `recv` stay allocated until `wait` returns Ok (then they are taken
        // back below) or forever (an abandoned call leaks them); nothing else touches them.
        let request = unsafe {
            state
                .data
                .immediate_all_gather_into(StaticScope, send.as_static(), recv.as_static_mut())
        };
        self.wait(state, request, sig)?;
        // SAFETY: the all-gather completed, so MPI no longer uses either buffer.
        let (_, all) = unsafe { (send.into_vec(), recv.into_vec()) };
        let Some((peer, theirs)) = all
            .chunks(SIG_WORDS)
            .enumerate()
            .find(|(_, words)| *words != ours.as_slice())
        else {
            return Ok(());
        };
        let theirs = match CallSig::from_words(theirs) {
            Some((their_seq, their_sig)) => format!("call #{their_seq} {their_sig}"),
            None => format!("an unknown call {theirs:?} (another burn-shard version?)"),
        };
        let err = CommError::Mismatch {
            seq,
            rank: self.rank,
            ours: format!("call #{seq} {sig}"),
            peer,
            theirs,
        };
        // Every rank sees the same table and fails here: no notice is needed.
        self.mark_aborted(format!("rank {}: {err}", self.rank));
        Err(err)
    }
}

/// The signature of a grouped call: its total length, and a tag that hashes every tensor's
/// length and dtype, so ranks with different buckets of equal total length mismatch too.
pub(super) fn bucket_sig(kind: CollectiveKind, buffers: &[HostBuffer]) -> CallSig {
    // FNV-1a (Fowler, Noll, Vo), 64-bit.
    let mut tag: u64 = 0xcbf2_9ce4_8422_2325;
    for b in buffers {
        let (len, dtype) = (b.values.len() as u64, format!("{:?}", b.dtype));
        for byte in len.to_le_bytes().iter().chain(dtype.as_bytes()) {
            tag = (tag ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    CallSig {
        kind,
        len: buffers.iter().map(|b| b.values.len()).sum(),
        dtype: DType::F32,
        root: 0,
        tag: tag.max(1),
    }
}
