//! How every rank of `ShardConfig::init` starts from rank 0's values: one float entry at a
//! time, in traversal order.
//!
//! Rank 0 reads each entry's value (which runs a lazy entry's initializer, so a lazy model is
//! materialised on rank 0 one entry at a time) and broadcasts it; every other rank receives it
//! into that entry without ever running its own initializer (Burn's `transform_for_load`, the
//! route a record load takes into a lazy parameter). So the values are those a single device
//! gets when it initialises the same model in traversal order from the same seed, bitwise, at
//! every world size, and no other rank draws from the device's random generator meanwhile
//! (ranks as threads share it).
//!
//! What it costs, for `Ψ` elements of `b` bytes over `N` ranks: one broadcast per entry
//! (DeepSpeed's `zero.Init` and PyTorch's `sync_module_states` broadcast from rank 0 as well),
//! `Ψ·b` bytes received by each rank, and the initialisation compute on rank 0 alone. Memory:
//! an entry's value exists on a rank from the moment it is received (or initialised, on rank 0)
//! until the stage-3 sharder has kept its shard of it, so during `init` a stage-3 rank holds
//! its shards plus about one entry (the largest, in the worst case), and a stage 0-2 rank one
//! copy of the model, never the two or three a broadcast of whole buckets took.
//!
//! With pretrained weights (`ShardConfig::init_pretrained`), an entry the file holds is read
//! from the file by every rank instead (no broadcast, no initializer); at stage 3, where the
//! entry's bytes are a range of the file, each rank reads only its shard's range
//! ([`RootValues::sync_shard`]). Entries the file does not hold go as above.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Shape, Tensor};
use burn_shard_comm::Collective;

use crate::error::ShardError;
use crate::model::census::{Census, Entry};
use crate::model::flat::{plain_device, replace_value, stand_in, values_by_id};
use crate::model::layout::SUPPORTED;
use crate::model::pretrained::plan::PretrainedPlan;

/// Gives each float entry rank 0's value; see the module docs. Holds the first error: after
/// it, entries pass through unchanged and no further collective is issued (`init` then aborts
/// the group, so the other ranks' pending broadcast fails instead of waiting).
pub(crate) struct RootValues {
    comm: Arc<dyn Collective>,
    /// Rank 0's running-state buffers, received before the model is mapped (see
    /// [`RootValues::new`]).
    buffers: HashMap<ParamId, Tensor<1>>,
    /// Where entries come from a pretrained file instead of rank 0.
    pretrained: Option<PretrainedPlan>,
    error: Option<ShardError>,
}

impl RootValues {
    /// Receives rank 0's running-state buffers first, outside any mapping of the model:
    /// ranks that are threads may share one `RunningState` (clones share it), and Burn holds
    /// its lock while a mapper maps it, so a broadcast issued from inside that mapping would
    /// wait for a rank that waits for the lock. Buffers are small (BatchNorm's statistics).
    ///
    /// Buffers the pretrained file holds are read from it by every rank instead.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a broadcast fails, [`ShardError::PretrainedRead`] when a
    /// buffer cannot be read from the file.
    pub(crate) fn new<M: Module>(
        comm: Arc<dyn Collective>,
        model: &M,
        census: &Census,
        pretrained: Option<PretrainedPlan>,
    ) -> Result<Self, ShardError> {
        let mut buffers = HashMap::new();
        if let Some(plan) = &pretrained {
            let device = plain_device(model)?;
            for (id, entry) in census.buffers().filter(|(id, _)| plan.has(id)) {
                buffers.insert(id, plan.read_whole(&id, entry, &device)?);
            }
        }
        let ids: HashSet<ParamId> = census
            .buffers()
            .filter(|(id, e)| e.numel() > 0 && SUPPORTED.contains(&e.dtype) && !buffers.contains_key(id))
            .map(|(id, _)| id)
            .collect();
        if comm.world_size() > 1 && !ids.is_empty() {
            let mut mine = values_by_id(model, &ids);
            for (id, entry) in census.buffers().filter(|(id, _)| ids.contains(id)) {
                let sent = match mine.remove(&id) {
                    Some(value) if comm.rank() == 0 => value,
                    _ => Tensor::<1>::zeros([entry.numel()], (&plain_device(model)?, entry.dtype)),
                };
                buffers.insert(id, comm.broadcast(sent, 0)?);
            }
        }
        Ok(Self {
            comm,
            buffers,
            pretrained,
            error: None,
        })
    }

    /// `param` holding rank 0's value of `entry` (shape `entry.shape`, dtype `entry.dtype`).
    /// On rank 0 the value is the parameter's own (initialised here if it was lazy); on
    /// every other rank it replaces the parameter's value, whose initializer never runs.
    /// Entries of a dtype the collectives do not carry (a quantized frozen base) and empty
    /// ones pass through: ranks built from one clone already hold them identically.
    pub(crate) fn sync<const D: usize>(&mut self, param: Param<Tensor<D>>, entry: &Entry) -> Param<Tensor<D>> {
        let numel = entry.numel();
        if self.error.is_some() || numel == 0 || !SUPPORTED.contains(&entry.dtype) {
            return param;
        }
        let root = self.comm.rank() == 0;
        let from_file = self.pretrained.as_ref().is_some_and(|plan| plan.has(&param.id));
        if let Some(value) = self.buffers.remove(&param.id) {
            return if root && !from_file {
                param
            } else {
                replace_value(param, value)
            };
        }
        if let Some(plan) = self.pretrained.as_ref().filter(|_| from_file) {
            let device = param.lazy_device().without_autodiff();
            return match plan.read_whole(&param.id, entry, &device) {
                Ok(record) => take_record(param, entry, record),
                Err(e) => {
                    self.error = Some(e);
                    param
                }
            };
        }
        let sent = if root {
            let value = param.base();
            if let Some(e) = built_otherwise(entry, &value) {
                self.error = Some(e);
                return param;
            }
            if self.comm.world_size() == 1 {
                return param;
            }
            // In record form (Burn's save mapper applied): a receiver that is still lazy
            // takes it as a record load takes it, through the load mapper (a `Linear` with
            // `LinearLayout::Col` stores its weight transposed and saves it back).
            param.transform_for_save().base().inner().reshape([numel])
        } else {
            let device: Device = param.lazy_device().without_autodiff();
            Tensor::<1>::zeros([numel], (&device, entry.dtype))
        };
        match self.comm.broadcast(sent, 0) {
            Ok(_) if root => param,
            Ok(record) => take_record(param, entry, record),
            Err(e) => {
                self.error = Some(e.into());
                param
            }
        }
    }

    /// Stage 3: `param` and this rank's shard of it, elements `[start, start + len)` of its
    /// flattened value (`[len]`, zero-padded past its end), when the pretrained file holds it
    /// and that range can be read alone: `param` then holds a stand-in of its value (no memory,
    /// no initializer run) and only the shard's bytes are read. Otherwise `param` after
    /// [`RootValues::sync`], and no shard (the sharder cuts it from the whole value).
    pub(crate) fn sync_shard<const D: usize>(
        &mut self,
        param: Param<Tensor<D>>,
        entry: &Entry,
        start: usize,
        len: usize,
    ) -> (Param<Tensor<D>>, Option<Tensor<1>>) {
        let plan = match &self.pretrained {
            Some(plan) if self.error.is_none() && plan.ranged(&param.id) => plan,
            _ => return (self.sync(param, entry), None),
        };
        let device = param.lazy_device().without_autodiff();
        match plan.read_range(&param.id, entry, start, len, &device) {
            Ok(shard) => (stand_in(param), Some(shard)),
            Err(e) => {
                self.error = Some(e);
                (param, None)
            }
        }
    }

    /// Whether an entry failed: the caller leaves the rest as they are.
    pub(crate) fn failed(&self) -> bool {
        self.error.is_some()
    }

    /// The first error, if any.
    pub(crate) fn finish(self) -> Result<(), ShardError> {
        self.error.map_or(Ok(()), Err)
    }
}

/// `param` holding `record` (`[numel]`, record form: before the entry's load mapper). A lazy
/// entry takes it as a record load does; an eager one holds the value form, so a record that
/// a load mapper turns into its value (`LinearLayout::Col`) goes through that mapper first, at
/// the record shape the census read.
fn take_record<const D: usize>(param: Param<Tensor<D>>, entry: &Entry, record: Tensor<1>) -> Param<Tensor<D>> {
    if !param.is_initialized() || !entry.has_load_mapper {
        return replace_value(param, record);
    }
    let id = param.id;
    let record: Tensor<D> = record.reshape(Shape::from(entry.record_shape.clone()));
    let value = param.clone().transform_for_load(record, id).base().inner();
    replace_value(param, value.reshape([entry.numel()]))
}

/// Rank 0's value differs from what the census read without initialising it: a lazy entry
/// whose own initializer made another dtype than its device's default, another shape than its
/// lazy shape (after its load mapper), or ignored the `require_grad` Burn passed it.
fn built_otherwise<const D: usize>(entry: &Entry, value: &Tensor<D>) -> Option<ShardError> {
    let (dtype, shape, require_grad) = (value.dtype(), value.shape().to_vec(), value.is_require_grad());
    let (found, fix) = if dtype != entry.dtype {
        (
            format!(
                "dtype {dtype:?} where its device's default float dtype is {:?}",
                entry.dtype
            ),
            "set the dtype on the device (Device::configure with DeviceConfig::float_dtype) or cast the model before init",
        )
    } else if shape != entry.shape {
        (
            format!("shape {shape:?} where its lazy shape is {:?}", entry.shape),
            "make the initializer build the shape it declares (Param::uninitialized's `shape`)",
        )
    } else if require_grad != entry.require_grad {
        (
            format!(
                "a value that {} grad where the parameter is set to {}",
                if require_grad { "requires" } else { "does not require" },
                if entry.require_grad { "train" } else { "stay frozen" }
            ),
            "call `.require_grad()` on the value when the initializer's `require_grad` argument is true (Burn's \
             initializers do), or freeze the parameter with `set_require_grad(false)` before init",
        )
    } else {
        return None;
    };
    Some(ShardError::InvalidConfig(format!(
        "parameter `{}` was built lazily and its initializer made {found}; ShardConfig::init lays the model out before \
         any parameter exists, from the lazy shape, the device's default float dtype and the require-grad setting: {fix}",
        entry.path
    )))
}

/// Stages 0-2: [`RootValues::sync`] on every float entry of a module, as a `ModuleMapper`.
pub(crate) struct SyncEntries<'a> {
    pub(crate) census: &'a Census,
    pub(crate) root: RootValues,
}

impl ModuleMapper for SyncEntries<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match self.census.get(&param.id) {
            Some(entry) => self.root.sync(param, entry),
            None => param,
        }
    }
}
