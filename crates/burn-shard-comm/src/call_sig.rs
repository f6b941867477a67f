//! [`CallSig`]: what a rank called, compared between ranks so that mismatched collectives are
//! reported instead of mixing buffers or hanging.

use std::fmt;

use burn::tensor::DType;

use crate::stats::CollectiveKind;

/// What a rank called: the collective, the buffer it passed and what it says it moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CallSig {
    pub(crate) kind: CollectiveKind,
    /// Elements of the buffer this rank passed.
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    /// The broadcast root (0 for the other collectives).
    pub(crate) root: usize,
    /// What is being reduced or gathered (0: untagged).
    pub(crate) tag: u64,
}

// The word encoding serves the MPI backend only.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
/// Number of `u64` words of [`CallSig::to_words`], call number included.
pub(crate) const SIG_WORDS: usize = 6;

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
/// The dtypes a signature can name, by code (the index).
const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::Flex32];

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
impl CallSig {
    /// The call number `seq` and this signature as fixed-size words, for backends that compare
    /// signatures by exchanging them (MPI).
    pub(crate) fn to_words(&self, seq: u64) -> [u64; SIG_WORDS] {
        let dtype = DTYPES.iter().position(|d| *d == self.dtype).unwrap_or(DTYPES.len());
        [
            seq,
            self.kind as u64,
            self.len as u64,
            dtype as u64,
            self.root as u64,
            self.tag,
        ]
    }

    /// The call number and signature that [`CallSig::to_words`] wrote, for messages; `None`
    /// when the words are not a signature (a peer of another version).
    pub(crate) fn from_words(words: &[u64]) -> Option<(u64, Self)> {
        let [seq, kind, len, dtype, root, tag] = <[u64; SIG_WORDS]>::try_from(words).ok()?;
        Some((
            seq,
            Self {
                kind: *CollectiveKind::ALL.get(usize::try_from(kind).ok()?)?,
                len: usize::try_from(len).ok()?,
                dtype: *DTYPES.get(usize::try_from(dtype).ok()?)?,
                root: usize::try_from(root).ok()?,
                tag,
            },
        ))
    }
}

impl fmt::Display for CallSig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(len={}, {:?}", self.kind.name(), self.len, self.dtype)?;
        if self.kind == CollectiveKind::Broadcast {
            write!(f, ", root={}", self.root)?;
        }
        if self.tag != 0 {
            write!(f, ", tag={:#018x}", self.tag)?;
        }
        write!(f, ")")
    }
}
