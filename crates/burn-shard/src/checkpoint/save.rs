//! Saving: every rank writes its pieces, rank 0 the metadata, and the directory appears whole.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::lr_scheduler::LrSchedulerRecord;
use burn::module::{Module, ParamId};
use burn::tensor::{DType, Tensor, TensorData};
use burn_shard_comm::ReduceOp;

use super::files::{RankFile, digest, read_digest};
use super::format::{
    SCHEDULER, begin, discard, finish, master_name, param_name, parent_of, partial_dir, state_name, version_for,
    write_atomically,
};
use super::frozen::{base_fingerprint, to_hex};
use super::held::HeldValues;
use super::lineage::{abandoned_dir, name_of, set_aside, to_set_aside};
use super::meta::{BaseMeta, CheckpointMeta, EntryMeta, FileMeta, Lineage, dtype_name};
use super::pieces::{Holding, piece, pieces};
use crate::error::CheckpointError;
use crate::error::ShardError;
use crate::model::census::{Entry, EntryKind};
use crate::model::layout::SUPPORTED;
use crate::optim::master::MasterWeightStep;
use crate::overlap::bucket_reducer::BucketReducer;
use crate::stage::Stage;
use crate::step::optimizer::ShardedOptimizer;
use crate::step::slot_state::SavedTensor;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Saves `model` (the one `step` returned) and this optimizer into the new directory `dir`,
    /// with `payload` (the step, the data position, the seed, a scheduler's state: anything
    /// JSON) for [`ShardedOptimizer::load_checkpoint`] to hand back. A collective: every rank
    /// calls it with the same `dir`, on a filesystem every rank sees.
    ///
    /// Each rank writes only what it holds: its range of each trainable parameter's values,
    /// optimizer state (Burn's state of that parameter, step count included) and `f32` master;
    /// at stage 3 its shard of every sharded parameter; rank 0 the buffers and other whole
    /// entries, and `meta.json`. See the [module docs](crate::checkpoint) for the layout.
    ///
    /// A run resumed from a checkpoint (see [`ShardedOptimizer::load_checkpoint`]) first sets
    /// aside, in `dir`'s parent, the complete checkpoints that sort after the one it resumed
    /// from and are not of its history: they move into `abandoned-<run id>/` there (see the
    /// [module docs](crate::checkpoint#lineage)). Before writing, rank 0 removes what crashed
    /// saves left there (`*.partial`); a failed save removes its own `DIR.partial`.
    ///
    /// # Errors
    /// [`CheckpointError::Exists`] when `dir` exists (and is not set aside),
    /// [`CheckpointError::Io`] when a file cannot be written (then `dir` is not created,
    /// `DIR.partial` is removed, and no earlier checkpoint is touched),
    /// [`CheckpointError::PeerFailed`] on the ranks that did not fail themselves, wrapped in
    /// [`ShardError::Checkpoint`]; [`ShardError::Comm`]. Every rank returns an error when one
    /// rank fails, and the group stays usable: training can go on.
    /// [`ShardError::HalfAppliedStep`] once a step failed half-way: nothing is written.
    pub fn save_checkpoint<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        payload: &serde_json::Value,
    ) -> Result<(), ShardError> {
        self.save_impl(model, dir.as_ref(), payload, None)
    }

    /// As [`ShardedOptimizer::save_checkpoint`], with the state of a Burn learning-rate
    /// scheduler (`scheduler.to_record()`, any scheduler: written by rank 0 as `scheduler.bpk`
    /// and covered by the digests); [`ShardedOptimizer::load_checkpoint_with_scheduler`]
    /// returns it.
    ///
    /// # Errors
    /// As [`ShardedOptimizer::save_checkpoint`].
    pub fn save_checkpoint_with_scheduler<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        payload: &serde_json::Value,
        scheduler: LrSchedulerRecord,
    ) -> Result<(), ShardError> {
        self.save_impl(model, dir.as_ref(), payload, Some(scheduler))
    }

    /// Sets aside now what this run's next save into the checkpoint directory `root` would
    /// (see [`ShardedOptimizer::save_checkpoint`]): after a load, the complete checkpoints of
    /// `root` that sort after the loaded one and are not of its history move into
    /// `root/abandoned-<run id>/`; nothing for a fresh run. A collective: rank 0 moves, every
    /// rank returns the same new paths (or the same failure). Call it after resuming to have
    /// the move, and the `tracing::warn!` that names it, at the start of the run rather than at
    /// its first save.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] when `root` cannot be listed or a checkpoint cannot be moved
    /// (those moved before stay moved), [`CheckpointError::PeerFailed`] on the other ranks,
    /// wrapped in [`ShardError::Checkpoint`]; [`ShardError::Comm`].
    pub fn set_aside_abandoned(&self, root: impl AsRef<Path>) -> Result<Vec<PathBuf>, ShardError> {
        let root = root.as_ref();
        let lineage = self.agreed_lineage()?;
        let planned = self.agree(
            to_set_aside(root, &lineage).map_err(ShardError::from),
            "set_aside_abandoned",
        )?;
        let moved = match self.comm.rank() {
            0 => set_aside(root, &lineage, &planned).map_err(ShardError::from),
            _ => Ok(planned
                .iter()
                .map(|d| abandoned_dir(root, &lineage.run).join(name_of(d)))
                .collect()),
        };
        self.agree(moved, "set_aside_abandoned")
    }

    fn save_impl<M: Module>(
        &self,
        model: &M,
        dir: &Path,
        payload: &serde_json::Value,
        scheduler: Option<LrSchedulerRecord>,
    ) -> Result<(), ShardError> {
        // Before any collective: a rank whose step failed half-way refuses here; the others
        // fail at their first collective, the group having been aborted by that step.
        self.refuse_half_applied("save a checkpoint")?;
        let (rank, world_size) = (self.comm.rank(), self.comm.world_size());
        let partial = partial_dir(dir);
        let root = parent_of(dir);
        let lineage = self.agreed_lineage()?;
        // 1. Every rank checks the target and finds what to set aside (one filesystem: they
        //    agree).
        let pending = self.pending.count()
            + self.bucket_reducer.as_ref().map_or(0, BucketReducer::pending_slots)
            + self.plan.stored_grad_count();
        let checked = match pending {
            // The sums would not be saved: refuse rather than lose them on resume.
            0 => to_set_aside(&root, &lineage)
                .and_then(|aside| {
                    let name = name_of(dir);
                    match dir.exists() && !aside.iter().any(|a| name_of(a) == name) {
                        true => Err(CheckpointError::Exists { dir: dir.to_path_buf() }),
                        false => Ok(aside),
                    }
                })
                .map_err(ShardError::from),
            _ => Err(ShardError::InvalidConfig(format!(
                "{pending} parameters hold gradients given to accumulate() and not yet applied; save the \
                 checkpoint after step()"
            ))),
        };
        let aside = self.agree(checked, "save_checkpoint")?;
        // 2. Rank 0 sets aside the abandoned checkpoints, clears leftovers and creates
        //    `DIR.partial`. From here on a failure removes `DIR.partial` (rank 0, once every
        //    rank is done with it).
        let prepared = match rank {
            0 => set_aside(&root, &lineage, &aside)
                .and_then(|_| begin(dir))
                .map(drop)
                .map_err(ShardError::from),
            _ => Ok(()),
        };
        let saved = self.agree(prepared, "save_checkpoint").and_then(|()| {
            // 3. The frozen entries the checkpoint refers to instead of holding: their
            //    fingerprints, summed over the ranks' pieces (a collective; none without them).
            let fingerprints = self.fingerprints(model, |id, entry| self.refers_to(id, entry), "save_checkpoint")?;
            // 4. Every rank writes its file; rank 0 also the scheduler's.
            let written = self
                .write_rank_file(model, &partial)
                .and_then(|()| match (rank, scheduler) {
                    (0, Some(record)) => {
                        let bytes = record
                            .into_bytes()
                            .map_err(|e| CheckpointError::io(&partial.join(SCHEDULER), e))?;
                        Ok(write_atomically(&partial.join(SCHEDULER), &bytes)?)
                    }
                    _ => Ok(()),
                });
            self.agree(written, "save_checkpoint")?;
            // 5. Rank 0 completes the directory.
            let finished = match rank {
                0 => self
                    .metadata(&partial, world_size, payload, &lineage, &fingerprints)
                    .and_then(|meta| Ok(finish(dir, &meta)?)),
                _ => Ok(()),
            };
            self.agree(finished, "save_checkpoint")
        });
        if let Err(e) = &saved {
            if rank == 0 {
                discard(&partial);
            }
            // Every rank reached the failure through `agree`: none returns before the removal
            // (unless the group itself failed).
            if !matches!(e, ShardError::Comm(_)) {
                let _ = self.comm.barrier();
            }
        }
        saved
    }

    /// This run's lineage with rank 0's run id on every rank (each rank draws its own id at
    /// `init` and at a load; rank 0's is the one saved). A collective.
    fn agreed_lineage(&self) -> Result<Lineage, ShardError> {
        let mine = u64::from_str_radix(&self.lineage.run, 16).unwrap_or_default();
        // Four 16-bit pieces: exact in f32; the other ranks add zeros.
        let pieces: Vec<f32> = (0..4)
            .map(|i| match self.comm.rank() {
                0 => ((mine >> (16 * i)) & 0xffff) as f32,
                _ => 0.0,
            })
            .collect();
        let device = burn::tensor::Device::flex();
        let summed = self
            .comm
            .all_reduce(
                Tensor::<1>::from_data(TensorData::new(pieces, [4]), (&device, DType::F32)),
                ReduceOp::Sum,
            )?
            .into_data()
            .convert::<f32>();
        let run = summed
            .iter::<f32>()
            .enumerate()
            .fold(0u64, |id, (i, piece)| id | ((piece as u64) << (16 * i)));
        Ok(Lineage {
            run: format!("{run:016x}"),
            ..self.lineage.clone()
        })
    }

    /// Ends one step of a collective file operation on every rank with the same outcome: the
    /// ranks all-reduce which of them failed; a rank that failed returns its own error, every
    /// other rank [`CheckpointError::PeerFailed`] naming it. No rank is left waiting, and the
    /// group stays usable.
    pub(crate) fn agree<T>(&self, result: Result<T, ShardError>, op: &str) -> Result<T, ShardError> {
        crate::step::agreement::agree(self.comm.as_ref(), result, op)
    }

    /// Writes this rank's file into `partial`: every entry the checkpoint holds (not those it
    /// refers to by fingerprint).
    fn write_rank_file<M: Module>(&self, model: &M, partial: &Path) -> Result<(), ShardError> {
        let (rank, world_size) = (self.comm.rank(), self.comm.world_size());
        let entries: Vec<_> = self
            .saved_entries()
            .into_iter()
            .filter(|(id, entry, _)| !self.refers_to(id, entry))
            .collect();
        let stage = self.stage();
        let mut file = RankFile::default();
        let mut held = HeldValues::of(model, &entries, self.plan.shards_parameters());
        for (id, entry, holding) in &entries {
            let Some(range) = piece(stage, *holding, entry.numel(), rank, world_size) else {
                continue;
            };
            let value = held.take(id, entry, *holding, range.clone())?;
            // Read when the writer reaches it (from the shard file with NVMe parameter
            // offload): a rank file is written with one tensor in memory at a time, not a
            // second copy of every parameter.
            file.push_deferred(param_name(&entry.path), value.dtype(), range.len(), move || {
                value.read()
            });
            if let Some(index) = self.layout.slot_of(id) {
                self.push_optimizer_piece(&mut file, index, &entry.path, range.len());
            }
        }
        file.write(partial, rank)
    }

    /// Rank 0: the checkpoint's metadata, with every rank file's digest.
    fn metadata(
        &self,
        partial: &Path,
        world_size: usize,
        payload: &serde_json::Value,
        lineage: &Lineage,
        fingerprints: &HashMap<String, u64>,
    ) -> Result<CheckpointMeta, ShardError> {
        let stage = self.stage();
        let entries: Vec<EntryMeta> = self
            .saved_entries()
            .iter()
            .map(|(id, entry, holding)| {
                let mut meta = entry_meta(*id, entry, *holding, stage, world_size, self);
                if let Some(fingerprint) = fingerprints.get(&entry.path) {
                    meta.pieces.clear();
                    meta.fingerprint = Some(to_hex(*fingerprint));
                }
                meta
            })
            .collect();
        let base = (!fingerprints.is_empty()).then(|| BaseMeta {
            origin: self.base.origin.clone(),
            fingerprint: base_fingerprint(&entries),
        });
        Ok(CheckpointMeta {
            format_version: version_for(base.is_some()),
            lineage: Some(lineage.clone()),
            loss_scaler: self.loss_scaler.clone(),
            world_size,
            stage: stage.number(),
            base,
            entries,
            files: {
                let mut files = (0..world_size)
                    .map(|r| read_digest(partial, r))
                    .collect::<Result<Vec<_>, _>>()?;
                let scheduler = partial.join(SCHEDULER);
                if scheduler.exists() {
                    let (bytes, sha256) = digest(&scheduler)?;
                    files.push(FileMeta {
                        name: SCHEDULER.to_string(),
                        bytes,
                        sha256,
                    });
                }
                files
            },
            payload: payload.clone(),
        })
    }

    /// The entries a checkpoint holds, in traversal order, with where their elements live.
    pub(crate) fn saved_entries(&self) -> Vec<(ParamId, &Entry, Holding<'_>)> {
        self.census
            .entries()
            .filter(|(_, e)| e.numel() > 0 && SUPPORTED.contains(&e.dtype))
            .map(|(id, entry)| {
                let holding = match (self.plan.shards_parameters(), self.layout.slot_of(&id)) {
                    (true, _) if entry.kind == EntryKind::Param => Holding::Chunks,
                    (true, _) => Holding::Whole,
                    (false, Some(index)) => Holding::Slot(&self.layout, index),
                    (false, None) => Holding::Whole,
                };
                (id, entry, holding)
            })
            .collect()
    }

    /// This rank's optimizer state and master of slot `index`, trimmed to `len` elements (a
    /// stage-3 shard's padding is not saved).
    fn push_optimizer_piece(&self, file: &mut RankFile, index: usize, path: &str, len: usize) {
        let saved = self.slots.saved(index);
        let names = saved.state.into_iter().map(|(field, t)| (state_name(path, &field), t));
        for (name, tensor) in names.chain(saved.master.map(|t| (master_name(path), t))) {
            match tensor {
                SavedTensor::InMemory(data) => file.push(name, trim(data, len)),
                // NVMe offload: read from the swap file when written, one tensor at a time.
                SavedTensor::OnDisk(on_disk) => {
                    let (reader, field) = *on_disk;
                    file.push_deferred(name, field.dtype, len, move || Ok(trim(reader.read(&field)?, len)))
                }
            }
        }
        for (field, value) in saved.scalars {
            file.push_scalar(state_name(path, &field), value);
        }
    }
}

/// The first `len` elements of a 1-D `data`.
fn trim(data: TensorData, len: usize) -> TensorData {
    if data.num_elements() == len {
        return data;
    }
    let size = data.dtype().size();
    let dtype = data.dtype();
    TensorData::from_bytes_vec(data.as_bytes()[..len * size].to_vec(), [len], dtype)
}

fn entry_meta<O: MasterWeightStep>(
    id: ParamId,
    entry: &Entry,
    holding: Holding,
    stage: Stage,
    world_size: usize,
    optim: &ShardedOptimizer<O>,
) -> EntryMeta {
    EntryMeta {
        path: entry.path.clone(),
        id: id.val(),
        shape: entry.shape.clone(),
        dtype: dtype_name(entry.dtype),
        kind: match entry.kind {
            EntryKind::Param | EntryKind::Sharded => "param",
            EntryKind::Reparameterized => "reparameterized",
            EntryKind::Buffer => "buffer",
        }
        .to_string(),
        trainable: optim.layout.slot_of(&id).is_some(),
        pieces: pieces(stage, holding, entry.numel(), world_size),
        fingerprint: None,
    }
}
