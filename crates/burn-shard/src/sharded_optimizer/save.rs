//! Saving: every rank writes its pieces, rank 0 the metadata, and the directory appears whole.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ParamId};
use burn::tensor::{Tensor, TensorData};

use crate::bucket::reducer::BucketReducer;
use crate::checkpoint::files::{RankFile, digest, read_digest};
use crate::checkpoint::format::Writing;
use crate::checkpoint::format::{
    SCHEDULER, begin, check_name, discard, finish, master_name, param_name, parent_of, partial_dir, state_name,
    version_for, write_atomically,
};
use crate::checkpoint::frozen::{base_fingerprint, to_hex};
use crate::checkpoint::held::HeldValues;
use crate::checkpoint::lineage::{abandoned_dir, name_of, set_aside, to_set_aside};
use crate::checkpoint::meta::{BaseMeta, CheckpointMeta, EntryMeta, FileMeta, Lineage, dtype_name};
use crate::checkpoint::options::SaveOptions;
use crate::checkpoint::pieces::{Holding, piece, pieces};
use crate::error::CheckpointError;
use crate::error::ShardError;
use crate::model::census::{Entry, EntryKind};
use crate::model::layout::SUPPORTED;
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;
use crate::sharded_optimizer::save_in_flight::SaveInFlight;
use crate::stage::Stage;
use crate::step::agreement::{after_failed_save, sum_u64};
use crate::step::slot_state::SavedTensor;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Saves `model` (the one `step` returned) and this optimizer into the new directory `dir`,
    /// with what `options` carries ([`SaveOptions`]: a JSON payload such as the step, the data
    /// position and the seed; a learning-rate scheduler's state) for
    /// [`ShardedOptimizer::load_checkpoint`] to hand back. A `&serde_json::Value` is options
    /// holding that payload: `optim.save_checkpoint(&model, dir, &payload)`. A collective: every
    /// rank calls it with the same `dir` and the same kind of save, on a filesystem every rank
    /// sees.
    ///
    /// Each rank writes only what it holds: its range of each trainable parameter's values,
    /// optimizer state (Burn's state of that parameter, step count included) and `f32` master;
    /// at stage 3 its shard of every sharded parameter; rank 0 the buffers and other whole
    /// entries, `meta.json` and the scheduler's state. See the [module docs](crate::checkpoint)
    /// for the layout.
    ///
    /// **In the background** ([`SaveOptions::in_background`]) the call returns as soon as this
    /// rank's part is staged: its values, optimizer state and masters in memory copied into
    /// host memory. A background thread per rank writes the same files; training goes on
    /// meanwhile, and the steps that follow cannot change what is written (the copies are the
    /// checkpoint's own). With NVMe offload, what is on disk is not copied: the writer reads it
    /// from the swap and shard files, and until it has written this rank's file, the steps
    /// write those slots and shards elsewhere in the files (copy-on-write: each file grows by
    /// at most the state the save reads, per save in flight; the space is reused by the steps
    /// after). The checkpoint is complete (`meta.json`, `COMPLETE`, the rename) once every rank
    /// has written: rank 0 completes it at the first `step` that finds every writer done, or at
    /// [`ShardedOptimizer::wait_for_checkpoint`], which a run calls before it ends. The writers
    /// run no collective. One save is in flight at a time (more with
    /// `ShardConfig::with_saves_in_flight`, each holding its own staged copy): the next save
    /// first waits for the oldest one and returns its error if it failed (a foreground save and
    /// a load wait for every one; a load leaves a failure for the next save or
    /// `wait_for_checkpoint`). A failure seen at a step is logged (`tracing::error!`, every
    /// rank) and returned by the next save or `wait_for_checkpoint`; `DIR.partial` is then
    /// removed and no earlier checkpoint is touched. Host memory: the staged bytes of this
    /// rank's file ([`MemoryReport::checkpoint_staging_bytes`]) until the save settles.
    ///
    /// A run resumed from a checkpoint (see [`ShardedOptimizer::load_checkpoint`]) first sets
    /// aside, in `dir`'s parent, the complete checkpoints that sort after the one it resumed
    /// from and are not of its history: they move into `abandoned-<run id>/` there (see the
    /// [module docs](crate::checkpoint#lineage)). Before writing, rank 0 removes what crashed
    /// saves left there (`*.partial`); a failed save removes its own `DIR.partial`.
    ///
    /// [`MemoryReport::checkpoint_staging_bytes`]: crate::MemoryReport::checkpoint_staging_bytes
    ///
    /// # Errors
    /// [`CheckpointError::Exists`] when `dir` exists (and is not set aside),
    /// [`CheckpointError::Io`] when a file cannot be written (then `dir` is not created,
    /// `DIR.partial` is removed, and no earlier checkpoint is touched),
    /// [`CheckpointError::PeerFailed`] on the ranks that did not fail themselves, wrapped in
    /// [`ShardError::Checkpoint`]; [`ShardError::Comm`]. Every rank returns an error when one
    /// rank fails, and the group stays usable: training can go on.
    /// [`ShardError::HalfAppliedStep`] once a step failed half-way: nothing is written. In the
    /// background: those checked before staging, and the previous background save's error.
    pub fn save_checkpoint<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
        options: impl Into<SaveOptions>,
    ) -> Result<(), ShardError> {
        let options = options.into();
        self.by_shard_group_zero(
            "save_checkpoint",
            || self.save_in_group(model, dir.as_ref(), options),
            || self.refuse_half_applied("save a checkpoint"),
        )
    }

    /// Sets aside now what this run's next save into the checkpoint directory `root` would
    /// (see [`ShardedOptimizer::save_checkpoint`]): after a load, the complete checkpoints of
    /// `root` that sort after the loaded one and are not of its history move into
    /// `root/abandoned-<run id>/`; nothing for a fresh run. A collective: rank 0 moves, every
    /// rank returns the same new paths (or the same failure); with hybrid sharding the ranks of
    /// shard group 0 do, and the other groups' ranks return no path. Call it after resuming to have
    /// the move, and the `tracing::warn!` that names it, at the start of the run rather than at
    /// its first save.
    ///
    /// # Errors
    /// [`CheckpointError::Io`] when `root` cannot be listed or a checkpoint cannot be moved
    /// (those moved before stay moved), [`CheckpointError::PeerFailed`] on the other ranks,
    /// wrapped in [`ShardError::Checkpoint`]; [`ShardError::Comm`].
    pub fn set_aside_abandoned(&self, root: impl AsRef<Path>) -> Result<Vec<PathBuf>, ShardError> {
        // Hybrid sharding: shard group 0 moves them (the other groups write no checkpoint) and
        // the others learn its outcome.
        self.by_shard_group_zero(
            "set_aside_abandoned",
            || self.set_aside_in_group(root.as_ref()),
            || Ok(Vec::new()),
        )
    }

    /// Runs `in_group` on the ranks of shard group 0 and `elsewhere` on the others, then gives
    /// every rank the outcome of its replica in group 0 (one all-reduce over the replicas):
    /// what only one copy of the state does (writing a checkpoint). `in_group` alone when flat.
    ///
    /// # Errors
    /// The rank's own error, [`CheckpointError::PeerFailed`] naming the replica that failed,
    /// [`ShardError::Comm`].
    fn by_shard_group_zero<T>(
        &self,
        op: &str,
        in_group: impl FnOnce() -> Result<T, ShardError>,
        elsewhere: impl FnOnce() -> Result<T, ShardError>,
    ) -> Result<T, ShardError> {
        let result = match self.writes_checkpoints() {
            true => in_group(),
            false => elsewhere(),
        };
        self.agree_across_replicas(result, op)
    }

    /// With hybrid sharding, `result` agreed over the replica group (every rank gets its own
    /// error, or [`CheckpointError::PeerFailed`] naming the replica that failed); `result` itself
    /// when flat.
    fn agree_across_replicas<T>(&self, result: Result<T, ShardError>, op: &str) -> Result<T, ShardError> {
        match self.replicate() {
            Some(replicate) => crate::step::agreement::agree(replicate, result, op),
            None => result,
        }
    }

    /// [`ShardedOptimizer::set_aside_abandoned`] within the shard group.
    fn set_aside_in_group(&self, root: &Path) -> Result<Vec<PathBuf>, ShardError> {
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

    /// The save of [`ShardedOptimizer::save_checkpoint`] within the shard group (every rank
    /// when flat). With hybrid sharding the ranks of shard group 0 save, as a flat run of
    /// `shard_size` ranks would; the other groups hold the same state and write nothing, and
    /// every rank then learns the outcome from its replica of group 0.
    fn save_in_group<M: Module>(&self, model: &M, dir: &Path, options: SaveOptions) -> Result<(), ShardError> {
        let SaveOptions {
            payload,
            scheduler,
            background,
        } = options;
        let payload = &payload;
        let op = match background {
            true => "save_checkpoint (background)",
            false => "save_checkpoint",
        };
        // Before any collective: a rank whose step failed half-way refuses here; the others
        // fail at their first collective, the group having been aborted by that step. A name
        // no checkpoint may have is refused by every rank alike.
        self.refuse_half_applied("save a checkpoint")?;
        check_name(dir)?;
        // Earlier background saves complete first (a background save waits only for the
        // oldest, while `saves_in_flight` are in flight), and their failure is reported here.
        match background {
            true => self.make_room_for_save()?,
            false => self.wait_for_checkpoint()?,
        }
        let (rank, world_size) = (self.comm.rank(), self.comm.world_size());
        let partial = partial_dir(dir);
        let root = parent_of(dir);
        let lineage = self.agreed_lineage()?;
        // 1. Every rank checks the target and finds what to set aside (one filesystem: they
        //    agree).
        let pending = self.pending.count()
            + self.bucket_reducer.as_ref().map_or(0, BucketReducer::pending_slots)
            + self.plan.params().stored_grad_count();
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
        let aside = self.agree(checked, op)?;
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
        let saved = self.agree(prepared, op).and_then(|()| {
            // 3. The frozen entries the checkpoint refers to instead of holding: their
            //    fingerprints, summed over the ranks' pieces (a collective; none without them).
            let fingerprints = self.fingerprints(model, |id, entry| self.refers_to(id, entry), op)?;
            // 4. This rank's file, and rank 0's scheduler record and metadata, as of now: read
            //    when written (synchronous), or copied into host memory here (background).
            let file = self.rank_file(model, background);
            let scheduler = match (rank, scheduler) {
                (0, Some(record)) => Some(
                    record
                        .into_bytes()
                        .map_err(|e| ShardError::from(CheckpointError::io(&partial.join(SCHEDULER), e))),
                )
                .transpose(),
                _ => Ok(None),
            };
            let (file, scheduler) = self.agree(file.and_then(|f| Ok((f, scheduler?))), op)?;
            let meta = (rank == 0).then(|| self.metadata(world_size, payload, &lineage, &fingerprints));
            let staged_bytes = file.held_bytes();
            let write = {
                let partial = partial.clone();
                move || -> Result<(), ShardError> {
                    file.write(&partial, rank)?;
                    match scheduler {
                        Some(bytes) => Ok(write_atomically(&partial.join(SCHEDULER), &bytes)?),
                        None => Ok(()),
                    }
                }
            };
            // 5. Rank 0 completes the directory once every rank has written. Until then no
            //    other save of this process takes `DIR.partial` for a leftover (`writing` lives
            //    as long as the commit).
            let commit = {
                let (partial, dir) = (partial.clone(), dir.to_path_buf());
                let writing = background.then(|| Writing::mark(&partial));
                move || -> Result<(), ShardError> {
                    let _writing = writing;
                    match meta {
                        Some(meta) => Ok(finish(&dir, &with_files(meta, &partial, world_size)?)?),
                        None => Ok(()),
                    }
                }
            };
            if background {
                let spawned = std::thread::Builder::new()
                    .name(format!("burn-shard-save-{rank}"))
                    .spawn(write)
                    .map_err(|e| CheckpointError::io(&partial, format!("cannot start the writer thread: {e}")));
                let (started, spawned) = match spawned {
                    Ok(writer) => (Some(writer), Ok(())),
                    Err(e) => (None, Err(ShardError::from(e))),
                };
                if let Err(e) = self.agree(spawned, op) {
                    // Another rank could not start its writer: this one's is done before
                    // `DIR.partial` is removed.
                    if let Some(writer) = started {
                        let _ = writer.join();
                    }
                    return Err(e);
                }
                let discarded = partial.clone();
                self.put_in_flight(SaveInFlight::new(
                    dir.to_path_buf(),
                    started.expect("agreed: every rank started its writer"),
                    Box::new(commit),
                    Box::new(move || discard(&discarded)),
                    staged_bytes,
                ));
                return Ok(());
            }
            self.agree(write(), op)?;
            self.agree(commit(), op)
        });
        if let Err(e) = &saved {
            after_failed_save(self.comm.as_ref(), e, || discard(&partial));
        }
        saved
    }

    /// [`ShardedOptimizer::agree`], then, with hybrid sharding, across the replicas too: a
    /// shard group that fails (a node that cannot read the checkpoint) fails every group, so
    /// the replicas never go on from different states.
    pub(crate) fn agree_everywhere<T>(&self, result: Result<T, ShardError>, op: &str) -> Result<T, ShardError> {
        let result = self.agree(result, op);
        self.agree_across_replicas(result, op)
    }

    /// This run's lineage with rank 0's run id on every rank (each rank draws its own id at
    /// `init` and at a load; rank 0's is the one saved). A collective.
    fn agreed_lineage(&self) -> Result<Lineage, ShardError> {
        let mine = u64::from_str_radix(&self.run.lineage.run, 16).unwrap_or_default();
        // Rank 0's id; the other ranks add zeros.
        let sent = if self.comm.rank() == 0 { mine } else { 0 };
        let run = sum_u64(self.comm.as_ref(), &[sent])?[0];
        Ok(Lineage {
            run: format!("{run:016x}"),
            ..self.run.lineage.clone()
        })
    }

    /// Ends one step of a collective file operation on every rank with the same outcome: the
    /// ranks all-reduce which of them failed; a rank that failed returns its own error, every
    /// other rank [`CheckpointError::PeerFailed`] naming it. No rank is left waiting, and the
    /// group stays usable.
    pub(crate) fn agree<T>(&self, result: Result<T, ShardError>, op: &str) -> Result<T, ShardError> {
        crate::step::agreement::agree(self.comm.as_ref(), result, op)
    }

    /// This rank's file: every entry the checkpoint holds (not those it refers to by
    /// fingerprint), with its optimizer state and master. With `staged`, every tensor in
    /// memory is copied into host memory now, so that the next steps, which update parameters
    /// and state in place, cannot change what is written; what NVMe offload keeps on disk is
    /// read by the writer, from bytes the steps leave alone until it is done. Without
    /// `staged`, each tensor is read when the writer reaches it (one in memory at a time).
    fn rank_file<M: Module>(&self, model: &M, staged: bool) -> Result<RankFile, ShardError> {
        let (rank, world_size) = (self.comm.rank(), self.comm.world_size());
        let entries: Vec<_> = self
            .saved_entries()
            .into_iter()
            .filter(|(id, entry, _)| !self.refers_to(id, entry))
            .collect();
        let stage = self.stage();
        let mut file = RankFile::default();
        let mut held = HeldValues::of(model, &entries, self.plan.params().shards_parameters());
        // The first failure of this rank: with stage 3's whole parameters it still sends its
        // shard of every later one (zeros), so that no rank of the group waits, then returns it.
        let mut failed = None;
        for (id, entry, holding) in &entries {
            let gathered = match holding {
                Holding::Owned(owner) => self.gather_owned(*id, entry, *owner, &mut held, &mut failed)?,
                _ => None,
            };
            if failed.is_some() {
                continue;
            }
            let Some(range) = piece(stage, *holding, entry.numel(), rank, world_size) else {
                continue;
            };
            let written = (|| {
                let name = param_name(&entry.path);
                match gathered {
                    // In host memory now: the gathered parameter leaves the device at once.
                    Some(whole) => file.push(name, whole),
                    None => {
                        let value = held.take(id, entry, *holding, range.clone())?;
                        match staged && !value.is_on_disk() {
                            true => file.push(name, owned(value.read()?)),
                            // Read when the writer reaches it (from the shard file with NVMe
                            // parameter offload): not a second copy of every parameter. In the
                            // background too for a shard on disk: the steps never write a stored
                            // shard in place, and the reader keeps its bytes until it is done.
                            false => file.push_deferred(name, value.dtype(), vec![range.len()], move || value.read()),
                        }
                    }
                }
                match self.layout.slot_of(id) {
                    Some(index) => self.push_optimizer_piece(&mut file, index, &entry.path, range.len(), staged),
                    None => Ok(()),
                }
            })();
            if let Err(e) = written {
                failed = Some(e);
            }
        }
        failed.map_or(Ok(file), Err)
    }

    /// Stage 3: the whole value of a parameter stepped whole by `owner` (`Holding::Owned`), which
    /// saves it whole beside its whole state: every rank of the shard group sends its shard (one
    /// all-gather), zeros when it could not read it or `failed` holds an earlier failure of this
    /// rank (a read failure is kept there). `Some` on the owner, in host memory; `None` elsewhere.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when the all-gather fails.
    fn gather_owned(
        &self,
        id: ParamId,
        entry: &Entry,
        owner: usize,
        held: &mut HeldValues,
        failed: &mut Option<ShardError>,
    ) -> Result<Option<TensorData>, ShardError> {
        let (rank, world_size) = (self.comm.rank(), self.comm.world_size());
        let chunk = entry.numel().div_ceil(world_size);
        let shard = match failed {
            Some(_) => None,
            // On the compute device: with parameter offload the shards live in host memory.
            None => match held
                .take(&id, entry, Holding::Owned(owner), 0..chunk)
                .and_then(|v| v.shard())
            {
                Ok(shard) => Some(shard.to_device(&self.device)),
                Err(e) => {
                    *failed = Some(e);
                    None
                }
            },
        };
        let shard = shard.unwrap_or_else(|| Tensor::zeros([chunk], (&self.device, entry.dtype)));
        let whole = self.comm.all_gather(shard)?.narrow(0, 0, entry.numel());
        Ok((rank == owner && failed.is_none()).then(|| whole.into_data()))
    }

    /// Rank 0: the checkpoint's metadata as of now, without the files (see [`with_files`]).
    fn metadata(
        &self,
        world_size: usize,
        payload: &serde_json::Value,
        lineage: &Lineage,
        fingerprints: &HashMap<String, u64>,
    ) -> CheckpointMeta {
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
            origin: self.run.base.origin.clone(),
            fingerprint: base_fingerprint(&entries),
        });
        CheckpointMeta {
            format_version: version_for(base.is_some()),
            lineage: Some(lineage.clone()),
            loss_scaler: self.loss_scaler.clone(),
            world_size,
            stage: stage.number(),
            base,
            entries,
            files: Vec::new(),
            payload: payload.clone(),
        }
    }

    /// The entries a checkpoint holds, in traversal order, with where their elements live.
    pub(crate) fn saved_entries(&self) -> Vec<(ParamId, &Entry, Holding<'_>)> {
        self.census
            .entries()
            .filter(|(_, e)| e.numel() > 0 && SUPPORTED.contains(&e.dtype))
            .map(|(id, entry)| {
                let holding = match (self.plan.params().shards_parameters(), self.layout.slot_of(&id)) {
                    (true, Some(index)) if let Some(owner) = self.owners.of(index) => Holding::Owned(owner.rank),
                    (true, _) if entry.kind == EntryKind::Param => Holding::Chunks,
                    (true, _) => Holding::Whole,
                    (false, Some(index)) => Holding::Slot(&self.layout, index),
                    (false, None) => Holding::Whole,
                };
                (id, entry, holding)
            })
            .collect()
    }

    /// This rank's optimizer state and master of slot `index`: a flat piece's trimmed to `len`
    /// elements (a stage-3 shard's padding is not saved), a whole parameter's as its optimizer
    /// keeps it. (`staged`: copied into host memory now, see [`ShardedOptimizer::rank_file`].)
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when `staged` and the swap file cannot be read;
    /// [`ShardError::InvalidConfig`] for a flat piece's state of fewer elements than the piece.
    fn push_optimizer_piece(
        &self,
        file: &mut RankFile,
        index: usize,
        path: &str,
        len: usize,
        staged: bool,
    ) -> Result<(), ShardError> {
        let saved = self.slots.saved(index);
        // A parameter stepped whole keeps its state as its optimizer made it (any shape: a
        // factored one of fewer elements, a preconditioner of more); a flat piece's state is
        // one value per element, trimmed to the piece (a stage-3 shard's padding is not saved).
        let whole = self.groups.optim(index).needs_whole_params();
        if !whole
            && let Some((field, numel)) = saved.state.iter().find_map(|(field, t)| {
                let numel = match t {
                    SavedTensor::InMemory(data) => data.num_elements(),
                    SavedTensor::OnDisk(on_disk) => on_disk.1.shape.num_elements(),
                };
                (numel < len).then_some((field, numel))
            })
        {
            return Err(ShardError::InvalidConfig(format!(
                "the optimizer state `{field}` of `{path}` has {numel} elements for a piece of {len}: an optimizer \
                 stepping flat pieces must keep one value per element (ElementWise's contract); step it on whole \
                 parameters (AnyOptimizer::whole_params) to checkpoint another state"
            )));
        }
        let cut = move |data: TensorData| if whole { data } else { trim(data, len) };
        let names = saved.state.into_iter().map(|(field, t)| (state_name(path, &field), t));
        for (name, tensor) in names.chain(saved.master.map(|t| (master_name(path), t))) {
            match tensor {
                SavedTensor::InMemory(data) if staged => file.push(name, owned(cut(data))),
                SavedTensor::InMemory(data) => file.push(name, cut(data)),
                // NVMe offload: read from the swap file when written, one tensor at a time, in
                // the background too: the reader pins the slot's bytes, so the steps meanwhile
                // write the slot elsewhere in the file (`Swapper::slot_reader`).
                SavedTensor::OnDisk(on_disk) => {
                    let (reader, field) = *on_disk;
                    let shape = match whole {
                        true => field.shape.iter().copied().collect(),
                        false => vec![len],
                    };
                    file.push_deferred(name, field.dtype, shape, move || Ok(cut(reader.read(&field)?)))
                }
            }
        }
        for (field, value) in saved.scalars {
            file.push_scalar(state_name(path, &field), value);
        }
        Ok(())
    }
}

/// `data` in bytes of its own: a staged tensor must not share memory with a tensor that a
/// later step may update in place.
fn owned(data: TensorData) -> TensorData {
    let (shape, dtype) = (data.shape().clone(), data.dtype());
    TensorData::from_bytes_vec(data.as_bytes().to_vec(), shape, dtype)
}

/// `meta` with every rank file's (and the scheduler record's) size and digest, read from
/// `partial` once every rank has written.
fn with_files(mut meta: CheckpointMeta, partial: &Path, world_size: usize) -> Result<CheckpointMeta, CheckpointError> {
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
    meta.files = files;
    Ok(meta)
}

/// The first `len` elements of a 1-D `data` (a stage-3 shard's state without its padding).
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
