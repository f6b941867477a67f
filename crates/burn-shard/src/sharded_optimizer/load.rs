//! Loading: each rank takes the ranges its own layout needs from whichever files hold them, so
//! a checkpoint of any world size and stage resumes at any other.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

use burn::lr_scheduler::LrSchedulerRecord;
use burn::module::Module;
use burn::optim::StateSource;
use burn::tensor::{Device, Tensor, TensorData};

use crate::checkpoint::files::{RankFiles, digest};
use crate::checkpoint::format::{SCHEDULER, master_name, param_name, state_name, state_prefix};
use crate::checkpoint::lineage::name_of;
use crate::checkpoint::meta::{CheckpointMeta, EntryMeta, Lineage, dtype_name};
use crate::checkpoint::options::Restored;
use crate::checkpoint::pieces::{Holding, piece, stepped};
use crate::error::CheckpointError;
use crate::error::ShardError;
use crate::fsdp::exchange;
use crate::fsdp::shard::Shard;
use crate::model::flat;
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;
use crate::step::slot_state::LoadedSlots;

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    /// Loads the checkpoint in `dir` into `model` (the one `init` returned) and this optimizer,
    /// and returns the model and what the save was given ([`Restored`]: the payload, and the
    /// scheduler state when the checkpoint holds one). A collective: every rank calls it.
    ///
    /// The checkpoint may come from any world size and any stage: each rank reads the element
    /// ranges its own layout needs (values, Burn's optimizer state of each parameter with its
    /// step count, `f32` masters) from whichever rank files hold them. The same world size and
    /// stage continue bitwise as if never interrupted. Entries are matched by module path, so a
    /// rebuilt model (new `ParamId`s) loads too. Frozen entries the checkpoint holds by
    /// fingerprint alone keep the model's values, which must be the base the checkpoint was
    /// trained on (load it first, as the run that saved it did).
    ///
    /// A new run starts here: the next checkpoints record `dir` as their parent, and the next
    /// save into a directory holding later checkpoints of another lineage sets them aside (see
    /// [`ShardedOptimizer::save_checkpoint`]). Loading changes nothing in `dir`; with
    /// [`NvmeOffload`](crate::NvmeOffload) it writes the loaded optimizer state to the swap
    /// file, beside the live state until every rank has read all of its own.
    ///
    /// `model` is consumed: pass a clone (it shares the parameters) to keep training it when
    /// the load fails. A checkpoint saved with a scheduler's state
    /// ([`SaveOptions::with_scheduler`](crate::checkpoint::SaveOptions::with_scheduler)) has
    /// it read and verified too: a corrupt `scheduler.bpk` fails the load like any other file.
    ///
    /// # Errors
    /// [`CheckpointError::Incomplete`], [`CheckpointError::Missing`],
    /// [`CheckpointError::Corrupt`] (a file that fails its digest, truncated or altered),
    /// [`CheckpointError::ModelMismatch`] (another model: names the parameter and both shapes),
    /// [`CheckpointError::BaseMismatch`] (a checkpoint saved with
    /// [`FrozenEntries::Fingerprinted`](crate::FrozenEntries::Fingerprinted) loaded into a model
    /// without its base: names the base and the entries that differ),
    /// wrapped in [`ShardError::Checkpoint`]. A rank that fails makes every rank fail with its
    /// message; the model and optimizer given are then unchanged.
    pub fn load_checkpoint<M: Module>(&mut self, model: M, dir: impl AsRef<Path>) -> Result<(M, Restored), ShardError> {
        let dir = dir.as_ref();
        // Gradients handed to the stage 0-2 reducer belong to the model before the load (a
        // collective: every rank is here).
        if let Some(reducer) = &self.bucket_reducer {
            reducer.discard()?;
        }
        // A background save completes first (it may be the checkpoint loaded here); a failed
        // one stays for the next save or `wait_for_checkpoint` to report.
        self.settle_save_keeping_failure(true)?;
        // A checkpoint that refers to its frozen base: the model must hold that base (checked
        // before anything is read or changed).
        let meta = self.agree_everywhere(CheckpointMeta::read(dir).map_err(ShardError::from), "load_checkpoint")?;
        self.check_base(&model, dir, &meta)?;
        // The optimizer state goes where it will live (the swap file, with NVMe offload) slot
        // by slot as it is read, so a load holds one slot of it in memory at a time; it becomes
        // the live state only once every rank has read all of its own.
        let mut slots = self.slots.loading();
        let has_scheduler = meta.files.iter().any(|f| f.name == SCHEDULER);
        let loaded = self
            .read_checkpoint(&model, dir, &meta, &mut slots)
            .and_then(|read| match has_scheduler {
                true => Ok((read, Some(read_scheduler(dir, &meta)?))),
                false => Ok((read, None)),
            });
        let ((values, shards, payload, scaler, lineage), scheduler) =
            self.agree_everywhere(loaded, "load_checkpoint")?;
        // The scale continues where it was (every rank reads the same one, so all fail
        // together on a bad one, before anything else changes); a run without a scaler ignores
        // a saved one.
        if let (Some(mine), Some(saved)) = (&mut self.loss_scaler, scaler) {
            mine.resume(&saved)?;
        }
        // A new run starts here: its checkpoints continue the loaded one's history.
        self.run.lineage = Lineage::resumed_from(&name_of(dir), lineage.as_ref());
        self.slots.replace(slots);
        // Micro-batch sums of the model before the load do not belong to the loaded one.
        self.drop_kept_sums();
        let model = flat::replace_values(model, values);
        let model = match self.plan.params().shards_parameters() {
            true => exchange::replace_shards(model, shards),
            false => model,
        };
        Ok((model, Restored { payload, scheduler }))
    }

    /// Everything a load changes, read and checked before anything is changed.
    #[allow(clippy::type_complexity)]
    fn read_checkpoint<M: Module>(
        &self,
        model: &M,
        dir: &Path,
        meta: &CheckpointMeta,
        slots: &mut LoadedSlots<O::State<1>>,
    ) -> Result<
        (
            HashMap<burn::module::ParamId, Tensor<1>>,
            HashMap<burn::module::ParamId, Shard>,
            serde_json::Value,
            Option<crate::optim::loss_scale::LossScaler>,
            Option<Lineage>,
        ),
        ShardError,
    > {
        let (rank, world_size, stage) = (self.comm.rank(), self.comm.world_size(), self.stage());

        let entries = self.saved_entries();
        check_same_model(meta, &entries)?;
        let by_path: HashMap<&str, &EntryMeta> = meta.entries.iter().map(|e| (e.path.as_str(), e)).collect();
        let device = flat::plain_device(model)?;
        // Every value must land: the model must be the one `init` (or `step`) returned.
        let present = flat::ids_of(model);
        // Where each stage-3 shard lives now, which is where its loaded value is made: host
        // memory with parameter offload, so a load never holds the shards on the device; the
        // rank's shard file with NVMe parameter offload, written as each shard is read (beside
        // the live shards, whose space a failed load keeps).
        let shard_specs = match self.plan.params().shards_parameters() {
            true => exchange::collect_specs(model),
            false => HashMap::new(),
        };
        for (id, entry, holding) in &entries {
            let found = match holding.is_sharded() {
                true => shard_specs.contains_key(id),
                false => present.contains(id),
            };
            if !found {
                return Err(ShardError::UnknownParam {
                    path: entry.path.clone(),
                    id: id.to_string(),
                });
            }
        }
        let mut files = RankFiles::new(dir, meta);
        let (mut values, mut shards) = (HashMap::new(), HashMap::new());
        for (id, entry, holding) in &entries {
            let saved = by_path[entry.path.as_str()];
            if !saved.is_held() {
                continue; // the base's: the model keeps its value (`check_base` compared it)
            }
            let name = param_name(&entry.path);
            let numel = entry.numel();
            match holding.is_sharded() {
                // A parameter stepped whole by its owner is held as chunks all the same.
                true => {
                    let own = piece(stage, Holding::Chunks, numel, rank, world_size);
                    let chunk = numel.div_ceil(world_size);
                    let data = match &own {
                        Some(range) => files.read_range(saved, &name, range.clone())?,
                        None => TensorData::from_bytes_vec(Vec::new(), [0], entry.dtype),
                    };
                    let spec = &shard_specs[id];
                    let shard = padded(data, chunk, &spec.shard.device());
                    shards.insert(*id, spec.ctx.home().to_home(shard));
                }
                false => {
                    let data = files.read_range(saved, &name, 0..numel)?;
                    let dtype = data.dtype();
                    values.insert(*id, Tensor::from_data(data, (&device, dtype)));
                }
            }
            let range = stepped(stage, *holding, numel, rank, world_size);
            let (Some(index), Some(range)) = (self.layout.slot_of(id), range) else {
                continue;
            };
            // The optimizer steps the range, or at stage 3 the whole shard with its padding
            // (zeros: their gradient is zero, so they stay zero), or the whole parameter its
            // owner steps.
            let stepped = match (holding, self.plan.params().shards_parameters()) {
                (Holding::Owned(_), _) | (_, false) => range.len(),
                (_, true) => self.layout.slots()[index].numel,
            };
            // An optimizer that reads whole parameters rebuilds a state of the parameter's shape.
            let optim = self.groups.optim(index);
            let shape = optim.needs_whole_params().then_some(&entry.shape[..]);
            let state_device = self.slots.device(&device);
            let state = read_state(&mut files, saved, range.clone(), stepped, optim, shape, &state_device)?;
            let name = master_name(&entry.path);
            let master = match has_tensor(&mut files, saved, &range, &name)? {
                true => Some(padded(
                    files.read_range(saved, &name, range)?,
                    stepped,
                    &self.slots.device(&device),
                )),
                false => None,
            };
            slots.put(index, state, master)?;
        }
        // The loaded shards' writes to the shard file (NVMe parameter offload) are done and
        // succeeded before the ranks agree on the load.
        self.plan.params().flush_home()?;
        Ok((
            values,
            shards,
            meta.payload.clone(),
            meta.loss_scaler.clone(),
            meta.lineage.clone(),
        ))
    }
}

/// The scheduler record of the checkpoint in `dir` (whose `meta` lists it), verified against
/// its digest.
fn read_scheduler(dir: &Path, meta: &CheckpointMeta) -> Result<LrSchedulerRecord, CheckpointError> {
    let path = dir.join(SCHEDULER);
    let expected = meta
        .files
        .iter()
        .find(|f| f.name == SCHEDULER)
        .ok_or_else(|| CheckpointError::ModelMismatch(format!("{} holds no scheduler state", dir.display())))?;
    let (bytes, sha256) = digest(&path)?;
    if bytes != expected.bytes || sha256 != expected.sha256 {
        return Err(CheckpointError::Corrupt {
            file: path,
            reason: "size or SHA-256 differ from the checkpoint's record".into(),
        });
    }
    let raw = std::fs::read(&path).map_err(|e| CheckpointError::io(&path, e))?;
    let len = raw.len();
    let bytes = TensorData::from_bytes_vec(raw, [len], burn::tensor::DType::U8).into_bytes();
    LrSchedulerRecord::from_bytes(bytes).map_err(|e| CheckpointError::Corrupt {
        file: path,
        reason: e.to_string(),
    })
}

/// The model's entries and the checkpoint's must be the same: paths, shapes and dtypes.
pub(super) fn check_same_model(
    meta: &CheckpointMeta,
    entries: &[(burn::module::ParamId, &crate::model::census::Entry, Holding)],
) -> Result<(), ShardError> {
    let by_path: HashMap<&str, &EntryMeta> = meta.entries.iter().map(|e| (e.path.as_str(), e)).collect();
    for (_, entry, _) in entries {
        let Some(saved) = by_path.get(entry.path.as_str()) else {
            return Err(CheckpointError::ModelMismatch(format!(
                "the model's `{}` (shape {:?}) is not in the checkpoint",
                entry.path, entry.shape
            ))
            .into());
        };
        if saved.shape != entry.shape || saved.dtype != dtype_name(entry.dtype) {
            return Err(CheckpointError::ModelMismatch(format!(
                "`{}` is {:?} {} in the model and {:?} {} in the checkpoint",
                entry.path,
                entry.shape,
                dtype_name(entry.dtype),
                saved.shape,
                saved.dtype
            ))
            .into());
        }
    }
    if let Some(extra) = meta
        .entries
        .iter()
        .find(|s| !entries.iter().any(|(_, e, _)| e.path == s.path))
    {
        return Err(CheckpointError::ModelMismatch(format!(
            "the checkpoint's `{}` (shape {:?}) is not in the model",
            extra.path, extra.shape
        ))
        .into());
    }
    Ok(())
}

/// `data` (`[len]`) zero-padded to `[to]` elements, as a tensor on `device`.
fn padded(data: TensorData, to: usize, device: &Device) -> Tensor<1> {
    let (len, dtype) = (data.num_elements(), data.dtype());
    let mut bytes = data.into_bytes().to_vec();
    bytes.resize(to.max(len) * dtype.size(), 0);
    Tensor::from_data(TensorData::from_bytes_vec(bytes, [to.max(len)], dtype), (device, dtype))
}

/// Whether the file holding the start of `range` of `entry` has tensor `name`.
fn has_tensor(
    files: &mut RankFiles,
    entry: &EntryMeta,
    range: &Range<usize>,
    name: &str,
) -> Result<bool, CheckpointError> {
    match holder(entry, range) {
        Some(rank) => Ok(files.tensors_under(rank, name)?.iter().any(|rest| rest.is_empty())),
        None => Ok(false),
    }
}

/// The rank whose piece holds the first element of `range`.
fn holder(entry: &EntryMeta, range: &Range<usize>) -> Option<usize> {
    entry
        .pieces
        .iter()
        .find(|p| p.start <= range.start && range.start < p.end)
        .map(|p| p.rank)
}

/// Burn's optimizer state of elements `range` of `entry`, padded to `stepped` elements, or
/// `None` when the checkpoint has none (the parameter had not received a gradient yet),
/// rebuilt by `optim`: flat, or with `shape` the whole parameter's state of that shape.
fn read_state<O: MasterWeightStep>(
    files: &mut RankFiles,
    entry: &EntryMeta,
    range: Range<usize>,
    stepped: usize,
    optim: &O,
    shape: Option<&[usize]>,
    device: &Device,
) -> Result<Option<O::State<1>>, CheckpointError> {
    let prefix = state_prefix(&entry.path);
    let Some(rank) = holder(entry, &range) else {
        return Ok(None);
    };
    let fields = files.tensors_under(rank, &prefix)?;
    let scalars: BTreeMap<String, burn_pack::Scalar> = files.scalars_under(rank, &prefix)?.into_iter().collect();
    if fields.is_empty() && scalars.is_empty() {
        return Ok(None);
    }
    let mut source = StateSource::new(scalars);
    let state_rank = shape.map_or(1, |shape| optim.state_rank(shape));
    for field in fields {
        let name = state_name(&entry.path, &field);
        let data = match shape {
            // A whole parameter's state, shaped as its optimizer keeps it.
            Some(_) => files.read_state_field(entry, &name, state_rank)?,
            None => padded(files.read_range(entry, &name, range.clone())?, stepped, device).into_data(),
        };
        source.insert_tensor(field, data);
    }
    let state = optim.rebuild_state(state_rank, &mut source, device);
    match state {
        Some(state) => Ok(Some(state)),
        None => Err(CheckpointError::ModelMismatch(format!(
            "the optimizer state saved for `{}` is not this optimizer's (was it saved with another optimizer?)",
            entry.path
        ))),
    }
}
