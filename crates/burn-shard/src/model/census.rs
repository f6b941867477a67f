//! What each float entry of a module is, as far as sharding is concerned: a parameter, a
//! parameter that already carries a reparameterization (LoRA's frozen base), or a running-state
//! buffer (BatchNorm's running mean and variance).
//!
//! Burn's visitors see all three as `Param<Tensor<D>>`. They differ in what `Module::map` keeps:
//! a plain parameter keeps a reparameterization a mapper attaches, a parameter that has one
//! keeps its own (Burn re-attaches it after the mapper), and a `RunningState` keeps only the
//! value. So the census attaches a no-op probe to every entry of a clone and reads, in a visit,
//! which entries kept it. That needs no list of module types, so users' own modules with
//! `RunningState` buffers or reparameterizations are classified like Burn's.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId, Reparameterization, Reparameterizer};
use burn::tensor::{Bool, DType, Int, Tensor};

use crate::model::lazy::entry_meta;

/// What a float entry of a module is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EntryKind {
    /// A parameter with no reparameterization of its own (stage 3 shards it).
    Param,
    /// A parameter whose value passes through a reparameterization it already carries (LoRA's
    /// frozen base); stage 3 keeps it whole, since a parameter holds one reparameterization.
    Reparameterized,
    /// A running-state buffer (`RunningState`): never trained, never sharded, averaged over the
    /// ranks at every step (see `buffers.rs`).
    Buffer,
    /// A parameter that carries burn-shard's own reparameterization (a stage 0-2 gradient hook
    /// or a stage 3 shard): the model was already returned by `ShardConfig::init`.
    Sharded,
}

/// One float entry: its kind, module path, shape, dtype and whether it requires grad.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub(crate) kind: EntryKind,
    pub(crate) path: String,
    /// The module types it sits in, outermost first, as Burn's visitors name them
    /// (`["Struct:Model", "Vec", "Struct:Linear"]`): what burn-store's adapters key on.
    pub(crate) containers: Vec<String>,
    /// The value's shape (after the entry's load mapper, if any).
    pub(crate) shape: Vec<usize>,
    /// The shape a record of it has (Burn's `lazy_shape`: before the load mapper).
    pub(crate) record_shape: Vec<usize>,
    /// Whether a load mapper turns its record into its value (`LinearLayout::Col`).
    pub(crate) has_load_mapper: bool,
    pub(crate) dtype: DType,
    pub(crate) require_grad: bool,
}

/// The float entries of a module, in traversal order, by id.
#[derive(Clone, Debug, Default)]
pub(crate) struct Census {
    order: Vec<ParamId>,
    entries: HashMap<ParamId, Entry>,
    /// Module paths of the integer and boolean parameters (not entries: nothing shards them).
    non_float: Vec<String>,
}

impl Entry {
    /// Elements of the full entry.
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl Census {
    /// Classifies every float entry of `module` (one clone, mapped and visited; no tensor data
    /// is read or copied, and no lazy entry is initialised).
    pub(crate) fn of<M: Module>(module: &M) -> Self {
        let probed = module.clone().apply_reparameterization(AttachProbe);
        let mut visitor = CensusVisitor::default();
        probed.visit(&mut visitor);
        visitor.close_pending();
        visitor.census
    }

    /// The entry of `id`, if it is a float entry of the module.
    pub(crate) fn get(&self, id: &ParamId) -> Option<&Entry> {
        self.entries.get(id)
    }

    /// Every entry, in traversal order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (ParamId, &Entry)> {
        self.order.iter().map(|id| (*id, &self.entries[id]))
    }

    /// The module paths of the integer and boolean parameters.
    pub(crate) fn non_float_paths(&self) -> &[String] {
        &self.non_float
    }

    /// The running-state buffers, in traversal order.
    pub(crate) fn buffers(&self) -> impl Iterator<Item = (ParamId, &Entry)> {
        self.entries().filter(|(_, e)| e.kind == EntryKind::Buffer)
    }
}

/// The `Reparameterization::NAME` of burn-shard's stage 0-2 gradient hook
/// (`bucket/hook.rs`): defined here, where the census recognises it, so the hooks import
/// the model layer and not the other way round.
pub(crate) const BUCKET_HOOK_NAME: &str = "burn_shard_bucket_hook";
/// The `Reparameterization::NAME` of a stage-3 shard (`fsdp/sharded_param.rs`).
pub(crate) const SHARD_NAME: &str = "fsdp_shard";

/// The no-op reparameterization the census attaches.
#[derive(Module, Debug)]
struct Probe;

const PROBE_NAME: &str = "burn_shard_census_probe";

impl Reparameterization for Probe {
    const NAME: &'static str = PROBE_NAME;

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        base
    }
}

struct AttachProbe;

impl Reparameterizer for AttachProbe {
    type Reparam = Probe;

    fn reparameterize<const D: usize>(
        &mut self,
        _path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<Probe>) {
        (param, Some(Probe))
    }
}

/// Burn visits a parameter with a reparameterization as `visit_float(base)` followed by
/// `enter_module(NAME, "Reparameterization")`; an entry followed by anything else kept none.
#[derive(Default)]
struct CensusVisitor {
    path: Vec<String>,
    containers: Vec<String>,
    pending: Option<(ParamId, Entry)>,
    census: Census,
}

impl CensusVisitor {
    fn settle(&mut self, kind: EntryKind) {
        if let Some((id, mut entry)) = self.pending.take() {
            entry.kind = kind;
            self.census.order.push(id);
            self.census.entries.insert(id, entry);
        }
    }

    fn close_pending(&mut self) {
        self.settle(EntryKind::Buffer);
    }
}

impl ModuleVisitor for CensusVisitor {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if container_type == "Reparameterization" {
            let kind = match name {
                PROBE_NAME => EntryKind::Param,
                BUCKET_HOOK_NAME | SHARD_NAME => EntryKind::Sharded,
                _ => EntryKind::Reparameterized,
            };
            self.settle(kind);
        } else {
            self.close_pending();
        }
        self.path.push(name.to_string());
        self.containers.push(container_type.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.close_pending();
        self.path.pop();
        self.containers.pop();
    }

    fn visit_int<const D: usize>(&mut self, _param: &Param<Tensor<D, Int>>) {
        self.close_pending();
        self.census.non_float.push(self.path.join("."));
    }

    fn visit_bool<const D: usize>(&mut self, _param: &Param<Tensor<D, Bool>>) {
        self.close_pending();
        self.census.non_float.push(self.path.join("."));
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.close_pending();
        // Read without initialising: a lazy model stays lazy until `init` syncs it entry by entry.
        let meta = entry_meta(param);
        let entry = Entry {
            kind: EntryKind::Buffer,
            path: self.path.join("."),
            containers: self.containers.clone(),
            shape: meta.shape,
            record_shape: meta.record_shape,
            has_load_mapper: meta.has_load_mapper,
            dtype: meta.dtype,
            require_grad: meta.require_grad,
        };
        self.pending = Some((param.id, entry));
    }
}
