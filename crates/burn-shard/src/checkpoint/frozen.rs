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

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ParamId};
use burn::tensor::TensorData;
use sha2::{Digest, Sha256};

use super::held::HeldValues;
use super::load::check_same_model;
use super::meta::{BaseMeta, CheckpointMeta, EntryMeta};
use super::pieces::piece;
use crate::error::{CheckpointError, ShardError, listed};
use crate::model::census::{Entry, EntryKind};
use crate::optim::master::MasterWeightStep;
use crate::run::FrozenEntries;
use crate::step::agreement::sum_u64;
use crate::step::optimizer::ShardedOptimizer;

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

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Whether this run's checkpoints hold `entry` by fingerprint alone: a parameter the
    /// optimizer does not train, with [`FrozenEntries::Fingerprinted`] (buffers change in
    /// training and are always saved).
    pub(crate) fn refers_to(&self, id: &ParamId, entry: &Entry) -> bool {
        self.base.frozen == FrozenEntries::Fingerprinted
            && entry.kind != EntryKind::Buffer
            && self.layout.slot_of(id).is_none()
    }

    /// The fingerprints of the model's entries that `select` picks, by module path. A
    /// collective: each rank hashes the piece of each entry it holds (see the module docs),
    /// the ranks agree that every one could (`op` names the operation in errors), and one
    /// all-reduce sums the pieces. Every rank returns the same map; no collective runs when
    /// `select` picks nothing (every rank decides alike: the same census and options).
    ///
    /// # Errors
    /// [`ShardError::UnknownParam`] (not the model `init` returned) or [`ShardError::Nvme`]
    /// (a shard file that cannot be read) on the rank that failed,
    /// [`CheckpointError::PeerFailed`] on the others; [`ShardError::Comm`].
    pub(crate) fn fingerprints<M: Module>(
        &self,
        model: &M,
        select: impl Fn(&ParamId, &Entry) -> bool,
        op: &str,
    ) -> Result<HashMap<String, u64>, ShardError> {
        let (rank, world_size, stage) = (self.comm.rank(), self.comm.world_size(), self.stage());
        let entries: Vec<_> = self
            .saved_entries()
            .into_iter()
            .filter(|(id, entry, _)| select(id, entry))
            .collect();
        if entries.is_empty() {
            return Ok(HashMap::new());
        }
        let local = (|| {
            let mut held = HeldValues::of(model, &entries, self.plan.shards_parameters());
            let mut sums = Vec::with_capacity(entries.len());
            for (id, entry, holding) in &entries {
                let sum = match piece(stage, *holding, entry.numel(), rank, world_size) {
                    Some(range) => {
                        partial_fingerprint(&held.take(id, entry, *holding, range.clone())?.read()?, range.start)
                    }
                    None => 0,
                };
                sums.push(sum);
            }
            Ok(sums)
        })();
        let local = self.agree(local, op)?;
        let summed = sum_u64(self.comm.as_ref(), &local)?;
        Ok(entries
            .iter()
            .map(|(_, entry, _)| entry.path.clone())
            .zip(summed)
            .collect())
    }

    /// Before a load: when the checkpoint in `dir` (its metadata `meta`) holds entries by fingerprint alone, checks
    /// that the model's values of them are the base it was trained on, and that they are frozen
    /// here too (their optimizer state is not in the checkpoint). A collective; every rank
    /// returns the same outcome.
    ///
    /// # Errors
    /// [`CheckpointError::BaseMismatch`] naming the base and the entries that differ;
    /// [`CheckpointError::ModelMismatch`] for an entry trainable here; those of
    /// [`ShardedOptimizer::fingerprints`].
    pub(crate) fn check_base<M: Module>(&self, model: &M, dir: &Path, meta: &CheckpointMeta) -> Result<(), ShardError> {
        let expected: HashMap<&str, &str> = meta
            .entries
            .iter()
            .filter_map(|e| e.fingerprint.as_deref().map(|f| (e.path.as_str(), f)))
            .collect();
        if expected.is_empty() {
            return Ok(());
        }
        // Another model (a frozen entry of another shape or dtype) is named as such, not as
        // another base. The same on every rank: the same metadata and census.
        check_same_model(meta, &self.saved_entries())?;
        // The same census and layout on every rank: every rank refuses alike.
        if let Some((_, entry, _)) = self
            .saved_entries()
            .into_iter()
            .find(|(id, entry, _)| expected.contains_key(entry.path.as_str()) && self.layout.slot_of(id).is_some())
        {
            return Err(CheckpointError::ModelMismatch(format!(
                "`{}` was frozen in the run that saved {} (which holds its fingerprint, not its values or optimizer \
                 state) and is trainable here; load the checkpoint with it frozen (as when saved), then unfreeze it",
                entry.path,
                dir.display()
            ))
            .into());
        }
        let found = self.fingerprints(
            model,
            |_, entry| expected.contains_key(entry.path.as_str()),
            "load_checkpoint",
        )?;
        // Entries missing from the model are `read_checkpoint`'s to name (another model).
        let differ: Vec<&str> = meta
            .entries
            .iter()
            .filter_map(|e| {
                let wanted = e.fingerprint.as_deref()?;
                let fingerprint = found.get(&e.path)?;
                (to_hex(*fingerprint) != wanted).then_some(e.path.as_str())
            })
            .collect();
        match differ.is_empty() {
            true => Ok(()),
            false => Err(CheckpointError::BaseMismatch {
                dir: dir.to_path_buf(),
                base: describe(meta.base.as_ref()),
                differ: first_few(&differ),
            }
            .into()),
        }
    }
}
