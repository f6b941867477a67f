//! Frozen entries held by fingerprint ([`FrozenEntries::Fingerprinted`]): a LoRA fine-tune's
//! checkpoints name its frozen base instead of rewriting it at every save.
//!
//! An entry's fingerprint is the wrapping sum, over its elements `i` (flattened, row-major), of
//! SplitMix64's finalizer of `i * 0x9E3779B97F4A7C15 XOR bits(i)`, `bits(i)` being the
//! element's bytes as a little-endian integer (finalizer: Steele, Lea and Flood, "Fast
//! splittable pseudorandom number generators", OOPSLA 2014). A sum over elements splits over
//! any partition of them, so each rank hashes only the piece it would have saved (its shard at
//! stage 3; rank 0 the whole entry at stages 0-2) and one all-reduce adds the pieces: a
//! checkpoint of any world size and stage is checked by ranks of any other, without any rank
//! reading a whole entry it does not hold. Each element's term depends on its index, so moved
//! elements change the sum. It names a base against accidents (another file, another
//! fine-tune's merged weights, a transposed load), not against an adversary.
//!
//! [`FrozenEntries::Fingerprinted`]: crate::FrozenEntries::Fingerprinted

use std::path::Path;

use burn::tensor::TensorData;
use sha2::{Digest, Sha256};

use super::meta::{BaseMeta, CheckpointMeta, EntryMeta};
use crate::error::{CheckpointError, listed};

/// The golden-ratio increment of SplitMix64, which spreads element indices over 64 bits.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finalizer: a bijection of `u64` that mixes every input bit into every output
/// bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fingerprint's terms of the elements in `data` (`[len]`, any dtype of at most 8 bytes),
/// which are elements `first..first + len` of their entry.
pub(crate) fn partial_fingerprint(data: &TensorData, first: usize) -> u64 {
    let size = data.dtype().size();
    data.as_bytes()
        .chunks_exact(size)
        .enumerate()
        .fold(0u64, |sum, (i, element)| {
            let mut bits = [0u8; 8];
            bits[..size].copy_from_slice(element);
            let index = (first + i) as u64;
            sum.wrapping_add(mix(index.wrapping_mul(GOLDEN) ^ u64::from_le_bytes(bits)))
        })
}

/// A fingerprint as `meta.json` writes it: 16 lowercase hex digits.
pub(crate) fn to_hex(fingerprint: u64) -> String {
    format!("{fingerprint:016x}")
}

/// The name of a base: SHA-256 of `PATH FINGERPRINT\n` for each entry held by fingerprint, in
/// the metadata's order.
pub(crate) fn base_fingerprint(entries: &[EntryMeta]) -> String {
    let mut hasher = Sha256::new();
    for entry in entries {
        if let Some(fingerprint) = &entry.fingerprint {
            hasher.update(format!("{} {fingerprint}\n", entry.path).as_bytes());
        }
    }
    format!("{:x}", hasher.finalize())
}

/// How errors name a base: its origin and the start of its fingerprint.
pub(crate) fn describe(base: Option<&BaseMeta>) -> String {
    let Some(base) = base else {
        return "(not recorded)".into();
    };
    let short: String = base.fingerprint.chars().take(16).collect();
    match &base.origin {
        Some(origin) => format!("`{origin}` (fingerprint {short})"),
        None => format!("that `init` gave the run that saved it (fingerprint {short})"),
    }
}

/// The first few of `paths` in backticks, and how many more.
pub(crate) fn first_few(paths: &[&str]) -> String {
    let quoted: Vec<String> = paths.iter().map(|p| format!("`{p}`")).collect();
    listed(&quoted, 4)
}

/// Refuses an offline operation on `dir` that needs the values of entries `meta` holds by
/// fingerprint alone (`kept`: the entries it would read); `fix` says what to do instead.
///
/// # Errors
/// [`CheckpointError::BaseNotSaved`] naming the base and the entries.
pub(crate) fn refuse_unheld(
    dir: &Path,
    meta: &CheckpointMeta,
    kept: &[EntryMeta],
    fix: &str,
) -> Result<(), CheckpointError> {
    let unheld: Vec<&str> = kept.iter().filter(|e| !e.is_held()).map(|e| e.path.as_str()).collect();
    match unheld.is_empty() {
        true => Ok(()),
        false => Err(CheckpointError::BaseNotSaved {
            dir: dir.to_path_buf(),
            base: describe(meta.base.as_ref()),
            entries: first_few(&unheld),
            fix: fix.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(values: &[f32]) -> TensorData {
        TensorData::new(values.to_vec(), [values.len()])
    }

    /// A fingerprint splits over any partition of the elements (what lets ranks of any world
    /// size and stage compute it from their own pieces), and moving an element changes it.
    #[test]
    fn fingerprints_add_over_any_partition_and_see_moved_elements() {
        let values: Vec<f32> = (0..23).map(|i| (i as f32 * 0.37).sin()).collect();
        let whole = partial_fingerprint(&data(&values), 0);
        for parts in 1..=5 {
            let chunk = values.len().div_ceil(parts);
            let sum = values.chunks(chunk).enumerate().fold(0u64, |sum, (i, piece)| {
                sum.wrapping_add(partial_fingerprint(&data(piece), i * chunk))
            });
            assert_eq!(sum, whole, "{parts} pieces of {chunk}");
        }
        let mut swapped = values.clone();
        swapped.swap(3, 17);
        assert_ne!(partial_fingerprint(&data(&swapped), 0), whole, "two elements swapped");
        assert_ne!(
            partial_fingerprint(&data(&values), 1),
            whole,
            "the same values one place later"
        );
    }
}
