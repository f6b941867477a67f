//! [`ShardedOptimizer`]: one ZeRO step around one of Burn's optimizers.

use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use burn::module::{Module, ParamGroup};
use burn::optim::GradientsParams;
use burn::optim::grad_clipping::GradientClipping;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor};
use burn_shard_comm::{Collective, Mesh};

use crate::bucket::reducer::{BucketReducer, Early};
use crate::error::ShardError;
use crate::fsdp::unit_reducer::add_to_grads;
use crate::model::buffers::Buffers;
use crate::model::census::Census;
use crate::model::flat::{self, tensor_bytes};
use crate::model::layout::FlatLayout;
use crate::model::memory::PeakTracker;
use crate::optim::groups::Groups;
use crate::optim::into_optimizer::IntoOptimizer;
use crate::optim::into_optimizer::OptimizerGroup;
use crate::optim::loss_scale::{self, LossScaler, LossScaling};
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::save_in_flight::SaveQueue;
use crate::stage::Stage;
use crate::step::agreement;
use crate::step::bucket_grads::{BucketGrads, StoredGrads};
use crate::step::context::StepContext;
use crate::step::last_step::LastStep;
use crate::step::measure::{self, Clip, Measured, check_one_norm_clipping};
use crate::step::options::StepOptions;
use crate::step::pending::PendingGradients;
use crate::step::reduce;
use crate::step::slot_state::SlotStates;
use crate::step::stage_plan::StagePlan;
use crate::step::update::Update;
use crate::step::whole_owner::WholeOwners;

/// A Burn optimizer whose state (stages 1-3), gradients (stages 2-3) and parameters (stage 3)
/// are partitioned over the ranks of a [`Collective`]. Built by
/// [`ShardConfig::init`](crate::ShardConfig::init).
///
/// Each bucket of the [`FlatLayout`] is reduced as one flat buffer; then the piece of each
/// parameter in this rank's range of the bucket (its whole bucket at stage 0, its shard at
/// stages 1-2, its local shards at stage 3) is stepped by `O::step` with that parameter's own
/// state: Burn's own optimizer, so the update math is Burn's, or
/// [`FusedAdam`](burn_shard_kernels::FusedAdam) when Burn's Adam/AdamW config was passed (see
/// [`IntoOptimizer`](crate::IntoOptimizer)).
///
/// A parameter that received a gradient on no rank keeps its value and its state (step count,
/// moments, master), as with Burn's `ModuleOptimizer`.
/// Adam, AdamW and SGD (with or without momentum) are element-wise, so the flat step equals
/// Burn's per-parameter step element for element. Optimizers that mix elements of a tensor
/// (per-tensor norms: LAMB, Muon, Adafactor) would see buckets instead of parameters and must
/// not be used here.
///
/// What a step does with the averaged gradient before the optimizer sees it, in this order
/// (each on the owned range only, with norms summed over the ranks, so it equals single-device
/// training):
/// 1. divide by the loss scale ([`LossScaler`], `f16`); a non-finite global norm skips the step
///    on every rank;
/// 2. clip by global norm ([`ShardConfig::with_max_grad_norm`](crate::ShardConfig::with_max_grad_norm),
///    PyTorch's `clip_grad_norm_`);
/// 3. Burn's per-parameter clipping of the parameter's group (`grad_clipping` of a Burn config,
///    or of [`ShardedOptimizer::with_group`]): `Norm(t)` with the norm of the whole parameter,
///    `Value(t)` element-wise, both exactly as Burn's `ModuleOptimizer` clips.
///
/// Parameter groups ([`ShardedOptimizer::with_group`], Burn's `ParamGroup`) choose each
/// parameter's hyper-parameters (no weight decay on biases and norms), and a
/// `ModuleLearningRate` passed to `step` its learning rate, as in Burn.
pub struct ShardedOptimizer<O: MasterWeightStep> {
    /// The optimizer (and per-parameter clipping) of each parameter.
    pub(crate) groups: Groups<O>,
    /// The parameters' (plain) device, where small agreement collectives place their tensors.
    pub(crate) device: Device,
    /// Where the state is sharded: every rank, or this rank's shard group of `mesh`.
    pub(crate) comm: Arc<dyn Collective>,
    /// Hybrid sharding ([`ShardConfig::with_replicas`](crate::ShardConfig::with_replicas)): the
    /// world, and the replica group each gradient shard is averaged over; `None` when flat.
    pub(crate) mesh: Option<Arc<Mesh>>,
    pub(crate) layout: Arc<FlatLayout>,
    pub(crate) plan: StagePlan,
    /// The model's float entries as `init` found them (paths, full shapes, kinds).
    pub(crate) census: Census,
    /// Per layout slot: the optimizer state and `f32` master of this rank's piece.
    pub(crate) slots: SlotStates<O>,
    /// Stage 3: the rank that steps each parameter an optimizer reads whole (none below).
    pub(crate) owners: WholeOwners,
    /// Running-state buffers, averaged over the ranks at every step.
    buffers: Buffers,
    /// Clip by global norm to this (`ShardConfig::with_max_grad_norm`).
    max_grad_norm: Option<f32>,
    /// `f16` loss scaling (`ShardConfig::with_loss_scaler`).
    pub(crate) loss_scaler: Option<LossScaler>,
    /// The bits of the scale a loss was last multiplied by ([`ShardedOptimizer::scale_loss`],
    /// [`LossScaling`]) since the last optimizer call, 0 for none: checked and cleared by each
    /// `step` and `accumulate`.
    loss_scaled: Arc<AtomicU32>,
    /// Whether a step failed half-way (see [`StepGuard`]).
    guard: StepGuard,
    /// What the last optimizer call measured (norm, applied, overlap, bytes), for the reports.
    pub(crate) last: LastStep,
    /// The micro-batch sums the next step adds (`accumulate`, and buckets reduced inside
    /// micro-batch backwards).
    pub(crate) pending: PendingGradients,
    /// Stages 0-2 reducing inside backward (see [`crate::bucket`]); `None` where they reduce in
    /// the step alone.
    pub(crate) bucket_reducer: Option<BucketReducer>,
    /// This run's history and base, saved with its checkpoints.
    pub(crate) run: RunRecord,
    /// The checkpoints being written in the background.
    pub(crate) saves: SaveQueue,
}

/// Whether a step failed half-way: set while a step updates the parameters and the optimizer
/// state, bucket by bucket, where an error leaves them half updated; the error of such a step
/// refuses every later step, `accumulate`, `map_params` and save
/// ([`ShardError::HalfAppliedStep`]).
#[derive(Default)]
struct StepGuard {
    updating: bool,
    half_applied: Option<String>,
}

/// What this run's checkpoints record of the run.
#[derive(Default)]
pub(crate) struct RunRecord {
    /// A new run id at `init` and at every load, and the checkpoint loaded (see
    /// [`crate::run::Lineage`]).
    pub(crate) lineage: crate::run::Lineage,
    /// What checkpoints hold of frozen entries, and the pretrained file the run started from
    /// (`ShardConfig::with_frozen_entries`, `init_pretrained`).
    pub(crate) base: crate::run::Base,
}

/// `optim`, given to [`ShardedOptimizer::with_group`], as the base optimizer's type `O`.
///
/// # Errors
/// [`ShardError::InvalidConfig`] for a config that carries its own clipping, an
/// [`OptimizerGroups`](crate::OptimizerGroups) with groups (whose groups `with_group` would
/// drop), or an optimizer of another type on a base that is not an
/// [`AnyOptimizer`](crate::AnyOptimizer); what `into_parts` returns.
fn group_optimizer<O: MasterWeightStep, C: IntoOptimizer>(optim: C) -> Result<O, ShardError> {
    if optim.grad_clipping()?.is_some() {
        return Err(ShardError::InvalidConfig(
            "the optimizer config given to with_group carries its own grad_clipping; pass the clipping as \
             with_group's grad_clipping argument (as ModuleOptimizer::with_group takes it) and remove it from the \
             config"
                .to_string(),
        ));
    }
    let (optim, groups) = optim.into_parts()?;
    if !groups.is_empty() {
        return Err(ShardError::InvalidConfig(format!(
            "with_group was given an OptimizerGroups with {} groups, which it would drop: give it to \
             ShardConfig::init, or add its groups with with_group one by one",
            groups.len()
        )));
    }
    O::from_group(optim)
}

impl<O: MasterWeightStep> ShardedOptimizer<O> {
    pub(crate) fn new(
        optim: O,
        comm: Arc<dyn Collective>,
        layout: Arc<FlatLayout>,
        plan: StagePlan,
        census: Census,
        buffers: Buffers,
        options: StepOptions,
    ) -> Self {
        let (slots, buckets) = (layout.slots().len(), layout.buckets().len());
        Self {
            groups: Groups::new(optim, options.clipping, &layout),
            device: options.device,
            comm,
            mesh: None,
            layout,
            plan,
            census,
            slots: SlotStates::new(slots, options.swap, options.state_home),
            owners: WholeOwners::default(),
            buffers,
            max_grad_norm: options.max_grad_norm,
            loss_scaler: options.loss_scaler,
            loss_scaled: Arc::default(),
            guard: StepGuard::default(),
            last: LastStep::default(),
            pending: PendingGradients::new(slots, buckets),
            bucket_reducer: None,
            run: RunRecord {
                lineage: crate::run::Lineage::fresh(),
                base: crate::run::Base::default(),
            },
            saves: SaveQueue::new(1),
        }
    }

    /// The base this run's checkpoints refer to (see [`crate::run::Base`]).
    pub(crate) fn with_base(mut self, base: crate::run::Base) -> Self {
        self.run.base = base;
        self
    }

    /// Hybrid sharding: `comm` is the mesh's shard group.
    pub(crate) fn with_mesh(mut self, mesh: Option<Arc<Mesh>>) -> Self {
        self.mesh = mesh;
        self
    }

    /// Every rank of the job: `comm` when flat, the mesh's world with hybrid sharding. What
    /// every rank must decide alike goes through it (which slots have a gradient, the
    /// buffers' mean).
    pub(crate) fn world(&self) -> &dyn Collective {
        world_and_replicate(&self.comm, self.mesh.as_deref()).0
    }

    /// With hybrid sharding, the group this rank's gradient shards are averaged over.
    pub(crate) fn replicate(&self) -> Option<&dyn Collective> {
        world_and_replicate(&self.comm, self.mesh.as_deref()).1
    }

    /// Whether this rank writes checkpoints: every rank when flat, the ranks of shard group 0
    /// with hybrid sharding (the other groups hold the same state).
    pub(crate) fn writes_checkpoints(&self) -> bool {
        self.mesh.as_ref().is_none_or(|mesh| mesh.replica_index() == 0)
    }

    /// Stages 0-2: the reducer the model's hooks hand their gradients to.
    pub(crate) fn with_bucket_reducer(mut self, reducer: Option<BucketReducer>) -> Self {
        self.bucket_reducer = reducer;
        self
    }

    /// Stages 0-2: ends the reducer's backwards (see [`crate::bucket`]) and returns the buckets
    /// it reduced, with those kept from `accumulate`, and which slots they hold; `None` without
    /// a reducer. Every rank calls this first, at the same point.
    fn take_early(&mut self, is_step: bool) -> Result<Option<Early>, ShardError> {
        let Some(reducer) = &self.bucket_reducer else {
            return Ok(None);
        };
        let mut early = reducer.finish(is_step)?;
        self.last.overlapped_buckets = early.started_in_backward;
        self.pending.merge_reduced_into(&mut early);
        Ok(Some(early))
    }

    /// Steps the parameters `group` matches with `optim` and `grad_clipping` instead, as Burn's
    /// `ModuleOptimizer::with_group`: a parameter takes the last group that matches it (by
    /// `ParamId` or module path, e.g. `ParamGroup::from_regex(r"(bias|gamma|beta)$")` for the
    /// recipe "no weight decay on biases and norm weights"), and `grad_clipping` `None` means no
    /// per-parameter clipping for the group. The parameters it matches keep their optimizer state
    /// (step count, moments, `f32` masters), unlike Burn's `with_group`, which resets it: a run
    /// resumed with [`ShardedOptimizer::load_checkpoint`] continues the same whether its groups
    /// are added before or after the load (groups added before the first step, as usual, give
    /// Burn's numbers either way). That holds for groups whose optimizer has the base's type:
    /// the load rebuilds each state with the optimizer that steps it then, so a group of
    /// another type (Lion beside AdamW, Muon) must be in place before the load, best given to
    /// `init` in [`OptimizerGroups`](crate::OptimizerGroups). A collective: every rank calls it
    /// with the same groups (checked; a rank whose group is refused fails the others too).
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] when `optim` is a Burn config that carries its own
    /// `grad_clipping` (pass it as `grad_clipping` instead, as Burn's `with_group` takes it),
    /// when the group clips by norm and the configuration clips by global norm too, or when
    /// `optim` cannot step flat shards; [`ShardError::LayoutMismatch`] when ranks added
    /// different groups; [`ShardError::Comm`].
    ///
    /// `optim` may be of another type than the base optimizer when the base is an
    /// [`AnyOptimizer`](crate::AnyOptimizer) (from [`OptimizerGroups`](crate::OptimizerGroups),
    /// `MuonConfig`, `LambConfig` or `AdafactorConfig`); a group whose optimizer needs whole
    /// parameters must be given to `init` in [`OptimizerGroups`](crate::OptimizerGroups) at
    /// stages 1-2 (the layout decides where parameters live), unless each parameter it
    /// matches already lies in one rank's range.
    pub fn with_group<C: IntoOptimizer>(
        mut self,
        group: ParamGroup,
        optim: C,
        grad_clipping: Option<GradientClipping>,
    ) -> Result<Self, ShardError> {
        let built = group_optimizer::<O, C>(optim)
            .and_then(|optim| check_one_norm_clipping(self.max_grad_norm, grad_clipping.as_ref()).map(|()| optim))
            .and_then(|optim| self.check_state_on_disk(&group, &optim).map(|()| optim));
        // Every rank takes part in the agreement, also one whose group was refused here (its
        // fingerprint then matches no other), so that none waits for it.
        let ours = match built {
            Ok(optim) => {
                // The matched slots keep their optimizer state (step count, moments, masters),
                // where Burn's `ModuleOptimizer::with_group` drops it: a group added after
                // `load_checkpoint` resumes (a state made by another optimizer type is not reused).
                self.groups.add(group, optim, grad_clipping, &self.layout);
                Ok(self.groups.fingerprint())
            }
            Err(e) => Err(e),
        };
        let fingerprint = *ours.as_ref().unwrap_or(&0);
        let agreed = crate::model::layout::check_same_layout(self.world(), fingerprint, &self.device);
        ours?;
        agreed?;
        // The same answer on every rank: they agreed on the groups and the optimizers' types.
        self.assign_owners();
        self.check_params()?;
        Ok(self)
    }

    /// With the state on disk, refuses a group that gives a parameter an optimizer of another
    /// type: its state on disk is the old optimizer's, which the new one cannot read back (in
    /// memory it is dropped at the next step instead).
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] naming the parameter and the fix.
    fn check_state_on_disk(&self, group: &ParamGroup, optim: &O) -> Result<(), ShardError> {
        if !self.slots.swaps() {
            return Ok(());
        }
        let slots = self.layout.slots().iter().enumerate();
        let mut changed = slots.filter(|(_, slot)| group.matches(&slot.id, Some(&slot.path)));
        match changed.find(|(index, _)| self.groups.optim(*index).fingerprint() != optim.fingerprint()) {
            Some((_, slot)) => Err(ShardError::InvalidConfig(format!(
                "with the optimizer state on disk (Home::Disk), with_group cannot give `{}` an optimizer of another \
                 type than the one whose state is on disk: give the group to ShardConfig::init in OptimizerGroups",
                slot.path
            ))),
            None => Ok(()),
        }
    }

    /// Adds the groups `init` was given (each `(selector, optimizer, clipping)`, later ones
    /// taking precedence; the ranks agreed on them with the models) and checks that each
    /// parameter's optimizer can step it where it lives.
    ///
    /// # Errors
    /// As [`ShardedOptimizer::with_group`].
    pub(crate) fn add_groups(mut self, groups: Vec<OptimizerGroup<O>>) -> Result<Self, ShardError> {
        for (group, optim, grad_clipping) in groups {
            check_one_norm_clipping(self.max_grad_norm, grad_clipping.as_ref())?;
            self.groups.add(group, optim, grad_clipping, &self.layout);
        }
        self.assign_owners();
        self.check_params()?;
        Ok(self)
    }

    /// Stage 3: gives each parameter whose optimizer reads it whole an owner, which steps it
    /// ([`WholeOwners::assign`]); called whenever the groups change. A parameter keeps its
    /// owner while its optimizer reads it whole, so a group added after steps or a load moves
    /// no other parameter's state; one that changes between whole and flat starts a new state
    /// and master (the old one has another shape), as Burn's `with_group` does for every
    /// parameter it matches.
    fn assign_owners(&mut self) {
        if !self.plan.gathers_whole_to_owner() {
            return;
        }
        let owners = WholeOwners::assign(
            &self.layout,
            |index| self.full_shape(index).to_vec(),
            self.comm.world_size(),
            &self.owners,
            |index| self.groups.optim(index).needs_whole_params(),
        );
        for index in 0..self.layout.slots().len() {
            if owners.of(index) != self.owners.of(index) {
                self.slots.forget(index);
            }
        }
        self.owners = owners;
    }

    /// The full shape of slot `index`'s parameter (stage 3's slots are its `[chunk]`).
    pub(crate) fn full_shape(&self, index: usize) -> &[usize] {
        let slot = &self.layout.slots()[index];
        self.census.get(&slot.id).map_or(&slot.shape, |entry| &entry.shape)
    }

    /// Checks that each slot's optimizer can step it ([`MasterWeightStep::check_param`], with
    /// the parameter's full shape) and, when it needs whole parameters, that this stage gives
    /// them whole: every parameter at stage 0, those the layout put in one rank's range at
    /// stages 1-2, and at stage 3 to their owner.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] naming the first parameter that fails and the fix.
    pub(crate) fn check_params(&self) -> Result<(), ShardError> {
        for (index, slot) in self.layout.slots().iter().enumerate() {
            let optim = self.groups.optim(index);
            optim.check_param(&slot.path, self.full_shape(index))?;
            if !optim.needs_whole_params() {
                continue;
            }
            let world_size = self.comm.world_size();
            if self.plan.holds_whole(&self.layout, index) || self.owners.of(index).is_some() {
                continue;
            }
            return Err(ShardError::InvalidConfig(format!(
                "`{}` (shape {:?}) is stepped by an optimizer that reads whole parameters, but at {:?} over {world_size} \
                 ranks this rank holds a piece of it: give the group to ShardConfig::init in OptimizerGroups \
                 (OptimizerGroups::new(base).with_group(group, optimizer, clipping)), so that the layout gives each of \
                 its parameters whole to one rank, instead of adding it with with_group after init",
                slot.path,
                slot.shape,
                self.plan.stage(),
            )));
        }
        Ok(())
    }

    /// Averages `grads` over the ranks, updates this rank's shard with Burn's optimizer and
    /// all-gathers the result, returning `model` with every rank holding identical parameters
    /// (stages 0-2) or its updated shards (stage 3), and identical running-state buffers (their
    /// mean over ranks, see the crate docs).
    ///
    /// `grads` are this rank's gradients (`GradientsParams::from_grads(loss.backward(), &model)`)
    /// for its part of the global batch; with equal local batch sizes and a mean loss, their
    /// average is the gradient of the global batch. A trainable parameter that received no
    /// gradient on a rank counts as a zero gradient there; one that received a gradient on no
    /// rank is left as it is, optimizer state included, exactly as Burn's `ModuleOptimizer`
    /// leaves it: its step count, moments and master do not move, so a parameter first used at
    /// a later step (a conditional branch, an expert) takes the first Adam step of its own when
    /// it is. Only parameters trainable at `init` are in the layout: one frozen then and made
    /// trainable later needs a new `init`.
    ///
    /// At stages 0-2 with [`ShardConfig::overlap_comm`](crate::ShardConfig::overlap_comm) (the
    /// default, where the collective overlaps), buckets are reduced inside backward from the
    /// second step on, and their gradients are not in `grads`: this call takes them from the
    /// rank's reducer (see [`crate::bucket`]). Edits to `grads` then reach only the gradients
    /// that are there; to edit every gradient before the step, turn `overlap_comm` off.
    ///
    /// At stage 3 `grads` already hold this rank's shards of the mean gradients (reduce-scattered
    /// inside backward), and a parameter left out of `grads` is not stepped, as in Burn. This
    /// holds while the backwards between two optimizer calls have the structure learned before
    /// the first call; when it changes, the last reduce-scatters are still in flight when
    /// `backward()` returns, this call adds their shards to `grads` (whatever was left out),
    /// and the structure is learned again.
    ///
    /// `lr` is one learning rate (`f64`, e.g. from a Burn `LrScheduler`) or Burn's
    /// `ModuleLearningRate` (per-group rates from a `ModuleLrScheduler`); every rank must pass
    /// the same. Gradients given to [`ShardedOptimizer::accumulate`] since the last step are
    /// added to `grads`. With a [`LossScaler`], a step whose gradient overflowed on any rank
    /// leaves the parameters and the optimizer state unchanged on every rank (running-state
    /// buffers are still averaged; see [`ShardedOptimizer::loss_scaler`]).
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a collective fails (the group is then aborted: stop training);
    /// [`ShardError::UnknownParam`] / [`ShardError::ShapeChanged`] when `model` is not the
    /// module returned by `init`; [`ShardError::LossNotScaled`] when a loss scaler is
    /// configured and no loss since the last optimizer call went through
    /// [`ShardedOptimizer::scale_loss`]; [`ShardError::HalfAppliedStep`] once a step failed
    /// while it was updating (a disk that filled, a collective lost mid-update): this and every
    /// later step, `accumulate`, `map_params` and save are refused, since some buckets hold the
    /// new values and some the old; resume from the last checkpoint.
    pub fn step<M: Module>(
        &mut self,
        lr: impl Into<ModuleLearningRate>,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, ShardError> {
        self.run_step(lr.into(), model, grads, None)
    }

    /// [`ShardedOptimizer::step`], with `items` this rank's share of the global batch (see
    /// [`ShardedOptimizer::step_with_items`]) when given, the ranks' gradients averaged with
    /// equal weights when not.
    pub(crate) fn run_step<M: Module>(
        &mut self,
        lr: ModuleLearningRate,
        model: M,
        grads: GradientsParams,
        items: Option<u64>,
    ) -> Result<M, ShardError> {
        // The shards are about to change: no gather of this pass is used again.
        self.plan.params().end_gather_pass();
        let result = self
            .check_call("step")
            // A background save whose writers are all done completes here (every rank is here).
            .and_then(|()| self.settle_save_keeping_failure(false))
            .and_then(|()| self.step_with(&lr, model, grads, items));
        if let Err(e) = &result {
            if std::mem::take(&mut self.guard.updating) && self.guard.half_applied.is_none() {
                self.guard.half_applied = Some(e.to_string());
            }
            // A rank that fails alone (a wrong model, say) must not leave the others waiting.
            self.world().abort(&format!(
                "rank {} failed in ShardedOptimizer::step: {e}",
                self.world().rank()
            ));
        }
        result
    }

    /// Refuses `op` (what the caller is about to do, "save a checkpoint") once a step failed
    /// half-way.
    ///
    /// # Errors
    /// [`ShardError::HalfAppliedStep`] after a step failed while it was updating: `op` would see
    /// parameters and optimizer state of two different steps.
    pub(crate) fn refuse_half_applied(&self, op: &str) -> Result<(), ShardError> {
        match &self.guard.half_applied {
            Some(cause) => Err(ShardError::HalfAppliedStep {
                op: op.to_string(),
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// What `step` and `accumulate` (`op`) check before they take a gradient: no step failed
    /// half-way, and the backwards since the last call scaled their loss by the current scale
    /// when a loss scaler is configured and the model has a parameter to step (a frozen teacher
    /// has none). Local: every rank finds the same.
    ///
    /// # Errors
    /// [`ShardError::HalfAppliedStep`], [`ShardError::LossNotScaled`].
    fn check_call(&self, op: &str) -> Result<(), ShardError> {
        self.refuse_half_applied(op)?;
        let trains = !self.layout.slots().is_empty();
        loss_scale::check_scaled(self.loss_scaler.as_ref().filter(|_| trains), &self.loss_scaled)
    }

    /// Drops every gradient handed to the optimizer since the last `step` or `accumulate`
    /// without applying it: the micro-batch sums `accumulate` kept, at stages 0-2 the
    /// gradients of backwards whose buckets were reduced inside backward, and at stage 3 the
    /// last units' reductions still in flight and, with
    /// [`Home::Disk`](crate::Home::Disk) for the parameters, every
    /// gradient shard on disk (there the step applies every gradient shard reduced since the
    /// last `step`, `accumulate` or `discard_gradients`, whatever `grads` holds). Call it after a
    /// backward whose gradients you do not step with (a NaN loss you skip, an auxiliary
    /// backward): reduced inside backward, they would otherwise add to the next step, as
    /// PyTorch's `.grad` does until `zero_grad()`. A collective: every rank calls it at the same
    /// point.
    ///
    /// # Errors
    /// [`ShardError::Comm`] when a reduction in flight failed.
    pub fn discard_gradients(&mut self) -> Result<(), ShardError> {
        // The discarded backward's scaled loss does not cover the next one.
        self.loss_scaled.store(0, std::sync::atomic::Ordering::SeqCst);
        // Stage 3: the last units' reductions still in flight belong to the discarded backward.
        self.plan.params().discard_in_flight();
        self.drop_kept_sums();
        match &self.bucket_reducer {
            Some(reducer) => reducer.discard(),
            None => Ok(()),
        }
    }

    /// Drops the micro-batch sums kept until the next step: unreduced (`accumulate`) and
    /// reduced inside backward.
    pub(crate) fn drop_kept_sums(&mut self) {
        self.pending.clear();
        drop(self.plan.params().take_stored_grads());
    }

    /// Stage 3: returns the first error a collective met inside forward or backward (gathers
    /// and reduce-scatters cannot return errors through Burn's autodiff; they record them and
    /// use zeros). `step` checks this itself; call it after an evaluation pass run outside it.
    pub fn check_collectives(&self) -> Result<(), ShardError> {
        self.plan.params().take_error().map_or(Ok(()), Err)
    }

    /// Adds `grads` (one micro-batch's gradients, `GradientsParams::from_grads(loss.backward(),
    /// &model)`) to those the next [`ShardedOptimizer::step`] applies, without communicating at
    /// stages 0-2 (PyTorch DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`): `k`
    /// micro-batches then one step send the bytes of one step. The sum is kept per parameter,
    /// unreduced and whole (stages 0-2: one full gradient per rank, as DDP's `no_sync`).
    /// Stage 3 reduce-scatters each micro-batch's gradients inside its backward, as it must to
    /// free the gathered parameters, so every micro-batch sends its reduce-scatter (and its
    /// all-gathers) and only the sharded sums are kept; the step then adds nothing on the wire.
    ///
    /// The step adds the sums, so to train on the mean over `k` equal micro-batches divide each
    /// micro-batch's loss by `k` (as with PyTorch and Burn's `GradientsAccumulator`).
    ///
    /// # Errors
    /// As [`ShardedOptimizer::step`].
    pub fn accumulate<M: Module>(&mut self, model: &M, mut grads: GradientsParams) -> Result<(), ShardError> {
        add_to_grads(model, self.plan.params().take_reduced(), &mut grads);
        let result = self
            .check_call("accumulate gradients")
            .and_then(|()| self.take_early(false))
            .and_then(|early| {
                self.check_collectives()?;
                let (parts, _) = flat::take_grads(model, &self.layout, &mut grads)?;
                // Reduced already: kept reduced, added by the step.
                self.pending.keep(early, parts);
                if let Some(reducer) = self.bucket_reducer.as_ref().filter(|r| r.armed()) {
                    // The next backward is expected to end in a step: its buckets carry these
                    // sums, so the step has nothing left to reduce.
                    reducer.seed(self.pending.unreduced_mut());
                }
                Ok(())
            });
        if let Err(e) = &result {
            self.world().abort(&format!(
                "rank {} failed in ShardedOptimizer::accumulate: {e}",
                self.world().rank()
            ));
        }
        result
    }

    /// The step, one phase after the other (each in its own file of `step/`, with the step's
    /// [`StepContext`]): collect the gradients, (1) agree on which slots have one, reduce them
    /// and cut them to the owned ranges, unscaled (`reduce.rs`; stored gradient shards are cut
    /// as each bucket is read, `bucket_grads.rs`), (2) measure norms and decide clipping or a
    /// skip (`measure.rs`; a skipped step ends there), (3) update and publish the parameters
    /// (`update.rs`), then rebuild the model and average the buffers.
    fn step_with<M: Module>(
        &mut self,
        lr: &ModuleLearningRate,
        model: M,
        mut grads: GradientsParams,
        items: Option<u64>,
    ) -> Result<M, ShardError> {
        let mut temp = PeakTracker::default();
        self.last.applied = false;
        self.last.optimizer_time = std::time::Duration::ZERO;
        // Stage 3: the gradients were reduce-scattered inside backward (the last units' may
        // still be in flight); a collective that failed there left its error behind.
        add_to_grads(&model, self.plan.params().take_reduced(), &mut grads);
        self.check_gathers()?;
        // Stages 0-2: the buckets reduced inside backward (none without a reducer).
        let early = self.take_early(true)?;

        let (mut grad_parts, device) = flat::take_grads(&model, &self.layout, &mut grads)?;
        drop(grads);
        self.pending.add_to_step(&mut grad_parts, self.layout.slots().iter());
        // Stage 3 with NVMe parameter offload: the gradient shards backward wrote to disk.
        let stored = StoredGrads::from_plan(&self.plan, &self.layout, &self.device, &mut grad_parts);
        let any_stored = stored.as_ref().is_some_and(StoredGrads::any);
        let Some(device) = device.or_else(|| any_stored.then(|| self.device.clone())) else {
            // No trainable parameter (a frozen teacher): only the buffers move.
            self.last.applied = true;
            return self.buffers.sync(self.world(), model);
        };
        // From the fields, not `self.world()`: the step updates other fields while `cx` lives.
        let (world, replicate) = world_and_replicate(&self.comm, self.mesh.as_deref());
        let item_scale = items
            .map(|items| crate::step::agreement::item_scale(world, items))
            .transpose()?;
        let cx = StepContext {
            layout: &self.layout,
            plan: &self.plan,
            comm: self.comm.as_ref(),
            world,
            replicate,
            device,
            loss_scale: self.loss_scaler.as_ref().map(LossScaler::scale),
            item_scale,
        };

        // Phase 1: which slots have a gradient, and the reduced gradients.
        let (has_grad, reduce_in_step) = reduce::presence(
            &cx,
            &grad_parts,
            early.as_ref(),
            self.bucket_reducer.as_ref(),
            self.owners.any(),
        )?;
        let early_reduced = early.map(|e| e.reduced).unwrap_or_default();
        let grads = match stored {
            Some(stored) => {
                self.last.gradients_bytes = 0;
                BucketGrads::Stored(stored)
            }
            None => {
                let reduced = reduce::reduce_buckets(&cx, grad_parts, early_reduced, &reduce_in_step, &mut temp)?;
                self.last.gradients_bytes = reduced.iter().map(tensor_bytes).sum();
                BucketGrads::Held(reduce::owned_gradients(&cx, reduced)?.into_iter().map(Some).collect())
            }
        };

        // Phase 2: norms and the loss scaler's verdict.
        let needs_norms = self.max_grad_norm.is_some() || self.loss_scaler.is_some() || self.groups.clips_by_norm();
        let measured = measure::measure(&cx, &grads, needs_norms, self.loss_scaler.as_mut())?;
        self.last.grad_norm = measured.grad_norm();
        let Measured::Apply(norms) = measured else {
            self.plan.params().skip_step();
            return self.buffers.sync(self.world(), model);
        };

        // Phase 3: the update, published; the model rebuilt from it.
        let update = Update {
            cx: &cx,
            lr,
            clip: Clip::new(self.max_grad_norm, norms.as_ref()),
            has_grad: &has_grad,
            groups: &self.groups,
            slots: &mut self.slots,
            overlap: self.bucket_reducer.is_some(),
            optimizer_time: &mut self.last.optimizer_time,
            updating: &mut self.guard.updating,
            owners: &self.owners,
        };
        let updated = update.run(&model, grads, &mut temp)?;
        self.guard.updating = false;
        self.last.temporary_peak_bytes = self.plan.params().temporary_peak(temp.peak());
        let keep: Vec<bool> = has_grad.iter().map(|g| !g).collect();
        let model = updated.write_into(model, &self.layout, &keep);
        if let Some(store) = self.plan.params().shard_store() {
            self.last.param_io = store.take_io();
        }
        self.last.applied = true;
        self.buffers.sync(self.world(), model)
    }

    /// Stage 3: as [`ShardedOptimizer::check_collectives`], and with NVMe parameter offload the
    /// ranks agree (one all-reduce of a flag per rank): a shard file that could not be read in
    /// forward or backward fails this step on every rank, the others naming the rank.
    fn check_gathers(&self) -> Result<(), ShardError> {
        if self.plan.params().shard_store().is_none() {
            return self.check_collectives();
        }
        // The gradient shards backward queued for writing are on disk, or their failure known.
        let own = self.check_collectives().and(self.plan.params().flush_home());
        self.agree_on_disk(own, "in forward or backward")
    }

    /// NVMe offload: gives a phase (`when`) of this optimizer the same outcome on every rank
    /// ([`agreement::agree_on_disk`], on the parameters' device, naming this rank's swap or
    /// shard-file directory).
    ///
    /// # Errors
    /// As [`agreement::agree_on_disk`].
    pub(crate) fn agree_on_disk(&self, own: Result<(), ShardError>, when: &str) -> Result<(), ShardError> {
        let dir = agreement::disk_dir(&self.slots, &self.plan);
        agreement::agree_on_disk(self.comm.as_ref(), own, &self.device, when, dir)
    }

    /// Every rank of the job: the collective passed to `init` (e.g. to average a loss for
    /// logging), and with hybrid sharding the mesh's world, whose failures abort the rank's
    /// sub-groups too.
    pub fn comm(&self) -> &dyn Collective {
        self.world()
    }

    /// With hybrid sharding ([`ShardConfig::with_replicas`](crate::ShardConfig::with_replicas)),
    /// this rank's mesh: its shard and replica groups, whose [`Collective::stats`] split the
    /// traffic into what stays in a shard group and what crosses replicas. `None` when flat.
    pub fn mesh(&self) -> Option<&Mesh> {
        self.mesh.as_deref()
    }

    /// The optimizer each flat shard is stepped with (e.g. to ask a
    /// [`FusedAdam`](burn_shard_kernels::FusedAdam) which path it takes): the one `init` was
    /// given (groups added with [`ShardedOptimizer::with_group`] have their own).
    pub fn optimizer(&self) -> &O {
        self.groups.base()
    }

    /// The loss scaler (current scale, steps skipped), when one was configured.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.loss_scaler.as_ref()
    }

    /// `loss` in `f32` multiplied by the loss scale (unchanged without a [`LossScaler`]): call
    /// `backward` on this. The product is taken in `f32` so that an `f16` loss times the scale
    /// (`2^16` by default) does not overflow; backward casts the scaled gradient back to the
    /// loss's dtype.
    ///
    /// Without this call (or [`LossScaling::scale_loss`]) for any backward since the last
    /// optimizer call, the next `step` or `accumulate` fails with
    /// [`ShardError::LossNotScaled`] when a loss scaler other than `LossScaler::fixed(1.0)` is
    /// configured: it would divide unscaled gradients by the scale.
    pub fn scale_loss<const D: usize>(&self, loss: Tensor<D>) -> Tensor<D> {
        self.loss_scaling().scale_loss(loss)
    }

    /// A handle that scales losses for this optimizer's next `step` or `accumulate`, for code
    /// that cannot reach the optimizer (burn-train's `TrainStep`, which burn-shard-train's
    /// `ShardedStrategy` serves through `burn_shard_train::scale_loss`). Take a new one after
    /// each optimizer call: the scale changes.
    pub fn loss_scaling(&self) -> LossScaling {
        LossScaling::new(
            self.loss_scaler.as_ref().map(LossScaler::scale),
            self.loss_scaled.clone(),
        )
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> Stage {
        self.plan.stage()
    }

    /// Whether a forward pass of the model is a collective (stage 3: every sharded parameter is
    /// all-gathered when read), so that every rank must run the same forwards in the same
    /// order, in evaluation too; `false` at stages 0-2, where a forward is local.
    pub fn forward_is_collective(&self) -> bool {
        self.plan.params().shards_parameters()
    }

    /// Makes the `f32` masters follow values changed outside the optimizer: when a
    /// `bf16`/`f16` parameter is next stepped, each element whose value no longer equals its
    /// master rounded to the parameter's dtype (an edit, new values loaded) takes the
    /// parameter's value; every other element keeps its master and the sub-ulp progress in it.
    /// Call it after changing such a model's values yourself ([`ShardedOptimizer::map_params`]
    /// calls it); without it the step keeps updating the old masters and overwrites the edit.
    /// Costs one comparison of each stepped piece with its master at that step.
    pub fn reset_master_weights(&mut self) {
        self.slots.mark_edited();
    }
}

/// The world (`comm` when flat) and, with hybrid sharding, the replica group of an optimizer
/// whose state is sharded over `comm` (the mesh's shard group when there is a `mesh`).
fn world_and_replicate<'a>(
    comm: &'a Arc<dyn Collective>,
    mesh: Option<&'a Mesh>,
) -> (&'a dyn Collective, Option<&'a dyn Collective>) {
    match mesh {
        Some(mesh) => (mesh.world().as_ref(), Some(mesh.replicate().as_ref())),
        None => (comm.as_ref(), None),
    }
}
