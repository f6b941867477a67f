//! What `init` refuses before any collective that moves values: options the step would get
//! wrong or silently ignore, models it cannot shard; and the device the model computes on.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::grad_clipping::GradientClipping;
use burn::tensor::{DType, Device, Tensor};

use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::model::census::{Census, EntryKind};
use crate::model::flat;
use crate::model::layout::FlatLayout;
use crate::step::measure::check_one_norm_clipping;

/// Refuses combinations the step would get wrong or silently ignore.
pub(super) fn check_step_options(
    config: &ShardConfig,
    census: &Census,
    clipping: Option<&GradientClipping>,
) -> Result<(), ShardError> {
    if let Some(max) = config.max_grad_norm
        && (max.is_nan() || max <= 0.0)
    {
        return Err(ShardError::InvalidConfig(format!(
            "max_grad_norm must be positive (f32::INFINITY measures without clipping), got {max}"
        )));
    }
    check_one_norm_clipping(config.max_grad_norm, clipping)?;
    match &config.loss_scaler {
        Some(scaler) => scaler.validate(),
        None => match census.entries().find(|(_, e)| e.require_grad && e.dtype == DType::F16) {
            // f16 gradients under- and overflow without scaling; bf16 has f32's range.
            Some((_, e)) => Err(ShardError::InvalidConfig(format!(
                "parameter `{}` is f16, which needs loss scaling: ShardConfig::with_loss_scaler(LossScaler::dynamic()) \
                 and optim.scale_loss(loss).backward(); or train in bf16, which needs none",
                e.path
            ))),
            None => Ok(()),
        },
    }
}

/// The plain device the model computes on, read without initialising anything: that of its
/// first entry in `everything` (in traversal order), else of its first tensor.
pub(super) fn compute_device<M: Module>(model: &M, layout: &FlatLayout) -> Result<Device, ShardError> {
    struct First<'a> {
        layout: &'a FlatLayout,
        device: Option<Device>,
    }
    impl ModuleVisitor for First<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.device.is_none() && self.layout.slot_of(&param.id).is_some() {
                self.device = Some(param.lazy_device().without_autodiff());
            }
        }
    }
    let mut first = First { layout, device: None };
    model.visit(&mut first);
    match first.device {
        Some(device) => Ok(device),
        None => flat::plain_device(model),
    }
}

/// Stage 3 shards a parameter by attaching a reparameterization, and a parameter holds one:
/// a trainable parameter that carries its own cannot be sharded, and its full gradient would
/// never be reduced. (LoRA freezes the bases it reparameterizes, so LoRA models pass; their
/// adapters are sharded.)
pub(super) fn refuse_stage3_misfits(census: &Census) -> Result<(), ShardError> {
    match census
        .entries()
        .find(|(_, e)| e.kind == EntryKind::Reparameterized && e.require_grad)
    {
        Some((_, e)) => Err(ShardError::UnsupportedParam {
            path: e.path.clone(),
            stage: 3,
            reason: "it is trainable and carries a reparameterization of its own, and stage 3 shards a parameter \
                     through a reparameterization (a parameter holds one); freeze it (as LoRA does with its bases), \
                     or train this model at stage 2"
                .to_string(),
        }),
        None => Ok(()),
    }
}

/// A model `init` returned carries its hooks (stages 0-2) or shards (stage 3), tied to that
/// call's optimizer: Burn keeps a parameter's reparameterization through every map, so a second
/// `init` could not replace them.
pub(super) fn refuse_sharded(census: &Census) -> Result<(), ShardError> {
    match census.entries().find(|(_, e)| e.kind == EntryKind::Sharded) {
        Some((_, e)) => Err(ShardError::InvalidConfig(format!(
            "parameter `{}` already carries burn-shard's gradient hook or shard: this model was returned by an \
             earlier ShardConfig::init, and belongs to that call's optimizer; build the model afresh (or load it from \
             a record or a consolidated checkpoint) and pass that to init",
            e.path
        ))),
        None => Ok(()),
    }
}
