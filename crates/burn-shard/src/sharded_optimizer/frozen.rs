//! A run's frozen entries as its checkpoints hold them ([`FrozenEntries::Fingerprinted`]):
//! which entries a save names by fingerprint, the fingerprints of the model's pieces (a
//! collective), and a load's check of the base it starts from. The fingerprint itself is
//! `checkpoint/frozen.rs`'s.
//!
//! [`FrozenEntries::Fingerprinted`]: crate::FrozenEntries::Fingerprinted

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ParamId};

use crate::checkpoint::frozen::{describe, first_few, partial_fingerprint, to_hex};
use crate::checkpoint::held::HeldValues;
use crate::checkpoint::meta::CheckpointMeta;
use crate::checkpoint::pieces::piece;
use crate::error::{CheckpointError, ShardError};
use crate::model::census::{Entry, EntryKind};
use crate::optim::master::MasterWeightStep;
use crate::run::FrozenEntries;
use crate::sharded_optimizer::load::check_same_model;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;
use crate::step::agreement::sum_u64;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Whether this run's checkpoints hold `entry` by fingerprint alone: a parameter the
    /// optimizer does not train, with [`FrozenEntries::Fingerprinted`] (buffers change in
    /// training and are always saved).
    pub(crate) fn refers_to(&self, id: &ParamId, entry: &Entry) -> bool {
        self.run.base.frozen == FrozenEntries::Fingerprinted
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
            let mut held = HeldValues::of(model, &entries, self.plan.params().shards_parameters());
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
