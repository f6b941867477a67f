//! One parameter's sharded state, attached to Burn's `Param` as a reparameterization.
//!
//! The `Param`'s stored value is a *placeholder*: a tensor of the parameter's full (logical)
//! shape and dtype that holds one element, NaN, expanded (stride 0) to that shape, so it costs
//! no memory and cannot be mistaken for the weights by code that reads it (a user's visitor
//! given to `model.visit`; `visit_params` reads the weights). Stock layers that ask a parameter for its shape, element count or dtype
//! (`RmsNorm`, `BatchNorm`, the transformer layers), `num_params()` and the model's `Display`
//! therefore see the full parameter, as on one device. The placeholder is the autodiff leaf that
//! the stage-3 gather op hangs its reduce-scattered gradient on (`[1, .., 1, chunk]`, this rank's
//! shard of the mean gradient), keyed by the parameter's `ParamId` as usual.
//!
//! The shard itself (`[chunk]` elements, plain, not tracked by autodiff) lives in the attached
//! [`ShardedParam`]. Its `Module` impl is written by hand: module traversal does not see the
//! shard as a parameter (it would count twice), and the sharded optimizer reads and replaces
//! shards through [`crate::fsdp::exchange`].

use burn::backend::Dispatch;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor, Param,
    Reparameterization, Reparameterizer,
};
use burn::tensor::{Device, Shape, Tensor};

use crate::error::ShardError;
use crate::fsdp::context::FsdpContext;
use crate::fsdp::exchange;
use crate::fsdp::gather_op::{FsdpOps, GatherSpec};
use crate::fsdp::shard::Shard;
use crate::fsdp::spec::{ParamSpec, Phase, next_version};
use crate::fsdp::unit::current_unit;
use crate::model::census::{Census, EntryKind, SHARD_NAME};
use crate::model::layout::ParamSlot;
use crate::model::root_values::RootValues;
use crate::model::units::UnitPolicy;
use crate::overlap::call_tag::CallTag;

/// The reparameterization of a stage-3 parameter: it holds this rank's shard, and `param.val()`
/// all-gathers the full value on demand (see the module docs).
#[derive(Clone, Debug)]
pub struct ShardedParam {
    spec: GatherSpec,
}

impl ShardedParam {
    /// This rank's shard: `[chunk]` elements, `chunk = ceil(numel / world_size)`, the last
    /// rank's tail zero-padded; the parameter's dtype; not tracked by autodiff; in host memory
    /// with [`Home::Host`](crate::Home::Host) for the parameters (read from the
    /// rank's shard file with [`Home::Disk`](crate::Home::Disk) for the parameters),
    /// on the parameter's device otherwise.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the shard file cannot be read.
    pub fn shard(&self) -> Result<Tensor<1>, ShardError> {
        self.spec.shard.read()
    }

    /// The full (logical) shape of the parameter.
    pub fn full_shape(&self) -> &Shape {
        &self.spec.full_shape
    }
}

impl Reparameterization for ShardedParam {
    const NAME: &'static str = SHARD_NAME;

    fn apply<const D: usize>(&self, placeholder: Tensor<D>) -> Tensor<D> {
        let out = match current_unit() {
            Some((input, scope)) => {
                crate::fsdp::unit::note_gather();
                let mut spec = self.spec.clone();
                spec.param.unit_scope = Some(scope);
                <Dispatch as FsdpOps>::fsdp_all_gather_in_unit(placeholder.into_dispatch(), input, spec)
            }
            None => {
                let mut spec = self.spec.clone();
                // A unit named by `Stage3Config::units`: gathered and reduced with its unit, as
                // inside an `fsdp::unit` scope (without the unit input: see `Stage3Config::units`).
                spec.param.unit_scope = spec.policy_unit.map(|unit| spec.ctx.policy_scope(unit));
                <Dispatch as FsdpOps>::fsdp_all_gather(placeholder.into_dispatch(), spec)
            }
        };
        Tensor::from_dispatch(out)
    }
}

impl Module for ShardedParam {
    fn collect_devices(&self, mut devices: Devices) -> Devices {
        // The device the parameter computes on, also when its shard lives in host memory.
        let device = match self.spec.ctx.home().offloaded_compute() {
            Some(compute) => compute.clone(),
            None => self.spec.shard.device(),
        };
        if !devices.contains(&device) {
            devices.push(device);
        }
        devices
    }

    fn fork(self, device: &Device) -> Self {
        self.to_device(device)
    }

    fn to_device(mut self, device: &Device) -> Self {
        // The shard stays plain: autodiff tracks the placeholder, never the shard.
        let device = device.clone().without_autodiff();
        // With parameter offload the shard stays in host memory: `init` chose the compute
        // device, and a gather copies the shard there.
        if let Some(shard) = self.spec.shard.held()
            && shard.device() != device
            && self.spec.ctx.home().offloaded_compute().is_none()
        {
            let shard = shard.clone().to_device(&device);
            self.spec.set_shard(Shard::Held(shard));
        }
        self
    }

    fn train(self) -> Self {
        self
    }

    fn valid(&self) -> Self {
        self.clone()
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, _visitor: &mut V) {
        exchange::on_visit(&self.spec);
    }

    fn map<M: ModuleMapper>(mut self, _mapper: &mut M) -> Self {
        exchange::on_map(&mut self.spec);
        self
    }
}

impl ModuleDisplayDefault for ShardedParam {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .add_formatted(&format!("ShardedParam {{shard: [{}]}}", self.spec.shard.numel()))
            .optional()
    }
}

impl ModuleDisplay for ShardedParam {}

/// Gives every float entry rank 0's value ([`RootValues`]), one entry at a time, and replaces
/// every parameter that the [`Census`] calls a plain parameter by a full-shape placeholder
/// carrying [`ShardedParam`] with this rank's shard, before the next entry exists. Running-state buffers,
/// parameters that already carry a reparameterization (LoRA's frozen base) and empty
/// parameters are left whole. Records the trainable shards, in traversal order, as the slots
/// of the optimizer's local layout.
pub(crate) struct Sharder {
    pub(crate) ctx: FsdpContext,
    pub(crate) census: Census,
    /// Gives each entry rank 0's value before it is sharded (or kept whole).
    pub(crate) root: RootValues,
    /// `[chunk]` slots of the trainable shards, for `FlatLayout::from_slots`.
    pub(crate) slots: Vec<ParamSlot>,
    /// The units of `Stage3Config::units`, numbered as parameters are met.
    pub(crate) units: UnitPolicy,
}

impl Reparameterizer for &mut Sharder {
    type Reparam = ShardedParam;

    fn reparameterize<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<ShardedParam>) {
        let Some(entry) = self.census.get(&param.id) else {
            return (param, None);
        };
        let shardable = entry.kind == EntryKind::Param && entry.numel() > 0;
        let (n, r) = (self.ctx.comm().world_size(), self.ctx.comm().rank());
        let chunk = entry.numel().div_ceil(n);
        // Rank 0's value, on every rank, before the next entry exists (`model/root_values.rs`);
        // or this rank's shard alone, read from a pretrained file.
        let (param, read_shard) = match shardable {
            true => self.root.sync_shard(param, entry, r * chunk, chunk),
            false => (self.root.sync(param, entry), None),
        };
        if !shardable || self.root.failed() {
            return (param, None);
        }
        let (id, full, mapper) = param.consume();
        let require_grad = full.is_require_grad();
        let strategy = full.gradient_checkpointing_strategy();
        let is_autodiff = full.is_autodiff();
        let dtype = full.dtype();
        let full_shape = full.shape();
        let dims: [usize; D] = full.dims();
        let numel = full_shape.num_elements();
        let full = full.inner();
        let device = full.device();
        // Made where shards live (host memory with parameter offload).
        let home = self.ctx.home().shard_device(&device.clone().without_autodiff());
        let shard = match read_shard {
            // `full` is a stand-in (one element, expanded): only its settings are read.
            Some(shard) => shard.to_device(&home),
            None => {
                // Pad the flat parameter to `n·chunk` once, then every rank's slice exists,
                // also for parameters smaller than the group (a scalar on 4 ranks).
                let mut flat = full.reshape([numel]);
                if numel < n * chunk {
                    flat = Tensor::cat(vec![flat, Tensor::zeros([n * chunk - numel], (&device, dtype))], 0);
                }
                // A new buffer from data: a view of the full tensor would keep the full weight
                // alive.
                Tensor::<1>::from_data(flat.narrow(0, r * chunk, chunk).into_data(), (&home, dtype))
            }
        };
        // NaN, so that what reads the placeholder instead of the weights (a user's `model.visit`)
        // cannot mistake it for them; nothing of burn-shard's reads its value.
        let mut placeholder: Tensor<D> = Tensor::<1>::full([1], f32::NAN, (&device, dtype))
            .reshape([1usize; D])
            .expand(dims);
        if is_autodiff {
            placeholder = placeholder.autodiff();
            // The device does not carry the checkpointing strategy: copy it, or tensors of one
            // op would disagree (Burn panics on a mix).
            if let Some(strategy) = strategy {
                placeholder = placeholder.with_gradient_checkpointing_strategy(strategy);
            }
            if require_grad {
                placeholder = placeholder.require_grad();
            }
        }
        if require_grad {
            self.slots.push(ParamSlot {
                path: path.to_string(),
                id,
                shape: vec![chunk],
                numel: chunk,
                dtype,
                bucket: 0,
                offset: 0,
            });
        }
        let mut shard_dims = [1usize; D];
        shard_dims[D - 1] = chunk;
        let param = ParamSpec {
            id,
            // Written to the shard file with NVMe parameter offload (queued: `init` waits for
            // the writes and returns a failure).
            shard: self.ctx.home().to_home(shard),
            full_shape,
            shard_shape: Shape::new(shard_dims),
            numel,
            chunk,
            tag: CallTag::Param(path).value(),
            version: next_version(),
            phase: Phase::Forward,
            unit_scope: None,
            policy_unit: self.units.unit_of(path),
        };
        self.ctx.register(&param);
        let spec = GatherSpec {
            ctx: self.ctx.clone(),
            param,
        };
        (
            Param::from_mapped_value(id, placeholder, mapper),
            Some(ShardedParam { spec }),
        )
    }
}
