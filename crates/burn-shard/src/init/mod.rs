//! [`ShardConfig::init`] and [`ShardConfig::init_pretrained`]: the pipeline that turns a model
//! and an optimizer into a sharded pair. In order: the mesh of hybrid sharding (`mesh`), the
//! refusals of models and options the step would get wrong (`checks`), where the optimizer state
//! and stage-3 shards live (`homes`, the placement policy), one agreement across ranks on everything that changes the collectives
//! (`agreement`: the layouts, the step's options, the pretrained plan and one hash of the
//! config), rank 0's values entry by entry, then hooks (stages 0-2) or shards (stage 3,
//! `stage3`). `config/` holds the configuration alone.

mod agreement;
mod checks;
mod homes;
mod mesh;
mod stage3;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use burn::module::Module;
use burn::optim::grad_clipping::GradientClipping;
use burn_shard_comm::{Collective, Mesh};

use crate::bucket::hook::AttachHooks;
use crate::bucket::reducer::{BucketReducer, reduces_in_backward};
use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::model::buffers::Buffers;
use crate::model::census::Census;
use crate::model::layout::{FlatLayout, ParamSlot};
use crate::model::pretrained::Pretrained;
use crate::model::pretrained::plan::PretrainedPlan;
use crate::model::root_values::{RootValues, SyncEntries};
use crate::optim::groups::clipping_key;
use crate::optim::into_optimizer::IntoOptimizer;
use crate::optim::into_optimizer::OptimizerGroup;
use crate::optim::master::MasterWeightStep;
use crate::run::Base;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;
use crate::stage::Stage;
use crate::step::options::StepOptions;
use crate::step::stage_plan::StagePlan;

impl ShardConfig {
    /// Wraps `model` and `optim` for this rank: builds the flat layout, checks that every rank
    /// built the same one, and gives every rank rank 0's parameters and buffers so all ranks
    /// start identical (as PyTorch DDP does at construction). Every rank must call it.
    ///
    /// **Large models: build them lazily.** Every `burn::nn` module's parameters are lazy until
    /// their first `val()` (Burn's `Param::uninitialized`), and `init` keeps them so: it lays
    /// the model out from each parameter's lazy shape, device and the device's default float
    /// dtype, then goes through the entries one at a time in module order: rank 0 runs the
    /// entry's initializer and broadcasts the value (`numel` elements), every other rank
    /// receives it without running its own, and at stage 3 each rank keeps its shard and drops
    /// the rest before the next entry exists. So during `init` a stage-3 rank holds its shards
    /// plus about one parameter (with ranks as threads, the process holds one model's shards
    /// plus one parameter per rank), and a stage 0-2 rank one copy of the model. The values are
    /// bitwise those single-device Burn initialises from the same seed in module order (only
    /// rank 0 draws from the random generator). Values travel in record form (Burn's save
    /// mapper applied, the receivers' load mapper: `LinearLayout::Col`). What makes a model
    /// eager before `init`: reading a parameter (`val()`; `num_params` does not), a forward pass,
    /// a mapper that reads or rebuilds values (`Param::map`, `consume`) or loading a record; an
    /// eager model works too, at one whole copy per rank. Cloning the model shares the lazy
    /// state: a clone kept by the caller keeps every parameter rank 0 initialises. To start
    /// from pretrained weights without a whole copy per rank, see
    /// [`ShardConfig::init_pretrained`].
    ///
    /// `optim` is anything [`IntoOptimizer`] accepts; Burn's `AdamConfig` / `AdamWConfig` select
    /// the fused Adam step ([`burn_shard_kernels::FusedAdam`]) where the backend has one.
    ///
    /// A model with no trainable parameter (a frozen teacher, an evaluation-only model) is
    /// accepted: it is sharded like any other, and its optimizer holds no state (its `step`
    /// only keeps the buffers in sync). To shard two models on one rank, pass each an
    /// `Arc` of the same collective (`Arc<C>` is a `Collective`).
    ///
    /// Gradient clipping in Burn's config (`grad_clipping`) is applied as Burn's
    /// `ModuleOptimizer` applies it, per parameter (see [`ShardedOptimizer`]).
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig) (zero bucket size, a model with no tensor, `f16` parameters
    /// without a [`LossScaler`](crate::LossScaler), a `max_grad_norm` that is not positive, clipping by global norm
    /// and by each parameter's norm together, an invalid loss scaler),
    /// [`ShardError::UnsupportedParam`](crate::ShardError::UnsupportedParam) (stage 3: a trainable parameter
    /// that carries a reparameterization of its own), [`ShardError::UnsupportedDtype`](crate::ShardError::UnsupportedDtype),
    /// [`ShardError::DuplicateParam`](crate::ShardError::DuplicateParam), [`ShardError::ConfigMismatch`](crate::ShardError::ConfigMismatch) (ranks passed different
    /// configs; checked first, on every rank), [`ShardError::LayoutMismatch`](crate::ShardError::LayoutMismatch) (ranks built
    /// different models), [`ShardError::UnsupportedBackend`](crate::ShardError::UnsupportedBackend) (stage 3 on a device without burn-shard's
    /// gather op: LibTorch, NdArray, or CubeCL without the `cube` feature), [`ShardError::Comm`](crate::ShardError::Comm).
    pub fn init<M: Module, O: IntoOptimizer, C: Collective + 'static>(
        &self,
        model: M,
        optim: O,
        comm: C,
    ) -> Result<(M, ShardedOptimizer<O::Optimizer>), ShardError> {
        self.init_from(model, None, optim, comm)
    }

    /// [`ShardConfig::init`] with pretrained weights loaded straight into the shards: every
    /// float entry the file holds takes its value from it on every rank (no broadcast, and its
    /// initializer never runs), at stage 3 reading only the bytes of the rank's shard where
    /// the file allows (see [`Pretrained`]); entries it does not hold and
    /// [`Pretrained::allow_missing`] names are initialised as by `init`. So a model that fits
    /// only sharded starts from a checkpoint without any rank holding it whole: build it lazily
    /// (as `burn::nn` modules are), do not load the record into it first. The values equal
    /// those burn-store's `load_from` gives a whole model from the same file, with the same
    /// key remapping and adapter (bitwise for a tensor of the parameter's dtype).
    ///
    /// Memory per rank during `init`: at stage 3 its shards plus one parameter (a tensor read
    /// whole: see [`Pretrained`]); at stages 0-2 one copy of the model.
    ///
    /// # Errors
    /// Those of `init`; [`ShardError::PretrainedMismatch`](crate::ShardError::PretrainedMismatch) on every rank, before any entry is
    /// read or changed, when the file does not fit the model (every entry missing from it,
    /// every tensor of another shape or kind of dtype, every tensor left unused, each named
    /// with both shapes); the error `pretrained` kept ([`ShardError::PretrainedRead`](crate::ShardError::PretrainedRead): the
    /// file could not be opened; [`ShardError::InvalidConfig`](crate::ShardError::InvalidConfig): a pattern is not a regex);
    /// [`ShardError::PretrainedRead`](crate::ShardError::PretrainedRead) when a tensor cannot be read. A rank that fails alone
    /// stops the group: the others return [`ShardError::Comm`](crate::ShardError::Comm) naming it.
    pub fn init_pretrained<M: Module, O: IntoOptimizer, C: Collective + 'static>(
        &self,
        model: M,
        pretrained: Pretrained,
        optim: O,
        comm: C,
    ) -> Result<(M, ShardedOptimizer<O::Optimizer>), ShardError> {
        self.init_from(model, Some(pretrained), optim, comm)
    }

    fn init_from<M: Module, O: IntoOptimizer, C: Collective + 'static>(
        &self,
        model: M,
        pretrained: Option<Pretrained>,
        optim: O,
        comm: C,
    ) -> Result<(M, ShardedOptimizer<O::Optimizer>), ShardError> {
        let world: Arc<dyn Collective> = Arc::new(comm);
        let base = Base {
            frozen: self.checkpoint.frozen_entries,
            origin: pretrained.as_ref().map(|p| p.origin.clone()),
        };
        // The first collective: the same config everywhere, before a mesh is split by it.
        let mesh = agreement::check_same_config(world.as_ref(), self).and_then(|()| mesh::mesh(self, world.clone()));
        // With a mesh, aborting its world aborts the rank's sub-groups too.
        let abort = match &mesh {
            Ok(Some(mesh)) => mesh.world().clone(),
            _ => world.clone(),
        };
        let result = mesh.and_then(|mesh| {
            let clipping = optim.grad_clipping()?;
            let (optim, groups) = optim.into_parts()?;
            let comm = mesh.as_ref().map_or(world, |mesh| mesh.shard().clone());
            let optim = Optimizers {
                base: optim,
                clipping,
                groups,
            };
            init_with(self, model, pretrained, optim, comm, mesh).map(|(model, optim)| {
                (
                    model,
                    optim
                        .with_base(base)
                        .with_saves_in_flight(self.checkpoint.saves_in_flight),
                )
            })
        });
        if let Err(e) = &result {
            // A rank that fails alone (bad model) must not leave the others waiting.
            abort.abort(&format!("rank {} failed in ShardConfig::init: {e}", abort.rank()));
        }
        result
    }
}

/// The optimizer `init` was given: the base, its per-parameter clipping, and the groups.
struct Optimizers<O> {
    base: O,
    clipping: Option<GradientClipping>,
    groups: Vec<OptimizerGroup<O>>,
}

impl<O: MasterWeightStep> Optimizers<O> {
    /// The index of the last group that matches `slot`, `None` for the base (Burn's rule).
    fn group_of(&self, slot: &ParamSlot) -> Option<usize> {
        self.groups
            .iter()
            .rposition(|(g, _, _)| g.matches(&slot.id, Some(&slot.path)))
    }

    /// The optimizer that steps `slot`.
    fn optim_of(&self, slot: &ParamSlot) -> &O {
        self.group_of(slot).map_or(&self.base, |i| &self.groups[i].1)
    }

    /// Whether the optimizer that steps `slot` reads whole parameters.
    fn wants_whole(&self, slot: &ParamSlot) -> bool {
        self.optim_of(slot).needs_whole_params()
    }

    /// A hash of which group steps each slot of `layout`, each optimizer's type and each
    /// clipping: what the ranks agree on at `init`.
    fn fingerprint(&self, layout: &FlatLayout) -> u64 {
        let mut h = DefaultHasher::new();
        layout.slots().iter().for_each(|slot| self.group_of(slot).hash(&mut h));
        (self.base.fingerprint(), clipping_key(self.clipping.as_ref())).hash(&mut h);
        for (_, optim, clipping) in &self.groups {
            (optim.fingerprint(), clipping_key(clipping.as_ref())).hash(&mut h);
        }
        h.finish()
    }

    /// Refusals that come before any work: a parameter its optimizer cannot step (Muon given
    /// one that is not 2-D).
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] naming the fix.
    fn check(&self, layout: &FlatLayout) -> Result<(), ShardError> {
        for slot in layout.slots() {
            self.optim_of(slot).check_param(&slot.path, &slot.shape)?;
        }
        Ok(())
    }
}

fn init_with<M: Module, O: MasterWeightStep>(
    config: &ShardConfig,
    model: M,
    pretrained: Option<Pretrained>,
    optims: Optimizers<O>,
    comm: Arc<dyn Collective>,
    mesh: Option<Arc<Mesh>>,
) -> Result<(M, ShardedOptimizer<O>), ShardError> {
    let clipping = optims.clipping.clone();
    // `comm` is where the state is sharded (the shard group of a mesh); the world agrees on
    // the layout and starts from one rank's values, and names the files of each rank.
    let world = mesh.as_ref().map_or(comm.clone(), |mesh| mesh.world().clone());
    if config.checkpoint.saves_in_flight == 0 {
        return Err(ShardError::InvalidConfig(
            "saves_in_flight is 0: a background save needs room for itself; pass at least 1 to \
             ShardConfig::with_saves_in_flight"
                .into(),
        ));
    }
    let census = Census::of(&model);
    checks::refuse_sharded(&census)?;
    // From the file's header alone: a file that does not fit fails here, on every rank.
    let pretrained = pretrained
        .map(|pretrained| PretrainedPlan::resolve(pretrained, &census))
        .transpose()?;
    checks::check_step_options(config, &census, clipping.as_ref())?;
    if config.stage == Stage::Three {
        checks::refuse_stage3_misfits(&census)?;
    }
    let layout = match StagePlan::owns_whole_params(config.stage, comm.world_size()) {
        true => FlatLayout::from_module_owning(&model, comm.world_size(), config.bucket_numel, |slot| {
            optims.wants_whole(slot)
        })?,
        false => FlatLayout::from_module(&model, comm.world_size(), config.bucket_numel)?,
    };
    if layout.slots().is_empty() {
        tracing::info!(
            rank = comm.rank(),
            "no trainable parameter: the sharded optimizer holds no state (frozen or evaluation-only model; \
             build the model on an autodiff device to train it)"
        );
    }
    // Frozen parameters and buffers are not trained but must be identical too: the ranks
    // agree on every float entry (`everything`) and each takes rank 0's values.
    let everything = FlatLayout::with_frozen(&model, comm.world_size(), config.bucket_numel)?;
    let device = checks::compute_device(&model, &everything)?;
    let homes = homes::homes(config, &device, world.rank())?;
    if config.stage == Stage::Three {
        crate::backend::check_stage3_device(&device)?;
    }
    let options = StepOptions {
        max_grad_norm: config.max_grad_norm,
        loss_scaler: config.loss_scaler.clone(),
        clipping,
        device: device.clone(),
        state_home: homes.state,
        swap: homes.swap,
        stores_shards: homes.params.as_ref().is_some_and(|home| home.store.is_some()),
    };
    agreement::check_same_models(
        world.as_ref(),
        [&layout, &everything],
        &options,
        optims.fingerprint(&layout),
        pretrained.as_ref(),
        &device,
    )?;
    // After the agreement, so that every rank refuses alike.
    optims.check(&layout)?;
    let buffers = Buffers::of(&census);
    let root = RootValues::new(world.clone(), &model, &census, pretrained)?;
    if config.stage == Stage::Three {
        // Entry by entry: each is synced and sharded before the next exists.
        let (model, optim) = stage3::shard_parameters(
            config,
            model,
            optims.base,
            options,
            root,
            [comm, world],
            census,
            buffers,
            homes.params,
        )?;
        // The ranks agreed on the groups with the models above.
        return Ok((model, optim.with_mesh(mesh).add_groups(optims.groups)?));
    }
    let plan = StagePlan::whole(config.stage);
    let mut sync = SyncEntries { census: &census, root };
    let model = model.map(&mut sync);
    sync.root.finish()?;
    let layout = Arc::new(layout);
    let overlaps = config.overlap_comm && reduces_in_backward(comm.as_ref(), &device) && !layout.slots().is_empty();
    let (model, reducer) = match plan.bucket_reduction() {
        Some(reduction) if overlaps => {
            let reducer = BucketReducer::new(comm.clone(), layout.clone(), reduction, device);
            let hooks = AttachHooks {
                reducer: reducer.clone(),
                layout: &layout,
                census: &census,
            };
            (model.apply_reparameterization(hooks), Some(reducer))
        }
        _ => (model, None),
    };
    let optim = ShardedOptimizer::new(optims.base, comm, layout, plan, census, buffers, options)
        .with_bucket_reducer(reducer)
        .with_mesh(mesh)
        .add_groups(optims.groups)?;
    Ok((model, optim))
}
