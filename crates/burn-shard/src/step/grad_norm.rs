//! The L2 norm of the averaged gradient over all ranks, per parameter and global, and the
//! clipping that uses it.
//!
//! Each rank sums the squares of the pieces of each parameter in the range it owns (the whole
//! bucket at stage 0, its shard at stages 1-3), so every element is counted once and the zero
//! padding of buckets and shards is never read. At stages 1-3 the per-parameter sums are then
//! all-reduced (one collective of one `f32` per parameter); at stage 0 every rank holds the whole
//! averaged gradient and the sums are already global. Every rank thus gets the same norms, and
//! one non-finite element on any rank makes the global norm non-finite on all of them.

use burn::optim::grad_clipping::GradientClipping;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_shard_comm::{Collective, ReduceOp};

use crate::error::ShardError;
use crate::model::layout::FlatLayout;
use crate::step::stage_plan::StagePlan;

/// L2 norms of the gradient averaged over the ranks.
#[derive(Clone, Debug)]
pub(crate) struct GradNorms {
    /// The norm of each layout slot's whole gradient (all ranks' pieces), in `f32` as Burn's
    /// `clip_by_norm` computes it.
    pub(crate) per_slot: Vec<f32>,
    /// The norm of the whole gradient (every trainable parameter).
    pub(crate) total: f64,
}

/// Measures the norms. `grads[b]` is bucket `b`'s averaged gradient over this rank's owned
/// range (`plan.owned_range`), of any float dtype (squares are summed in `f32`, in `f64` for
/// `f64` gradients; the per-parameter sums are exchanged in `f32`).
///
/// # Errors
/// [`ShardError::Comm`] when the all-reduce of the per-parameter sums fails.
pub(crate) fn measure(
    layout: &FlatLayout,
    plan: &StagePlan,
    comm: &dyn Collective,
    grads: &[Tensor<1>],
    device: &Device,
) -> Result<GradNorms, ShardError> {
    let slots = layout.slots().len();
    if slots == 0 {
        return Ok(GradNorms {
            per_slot: Vec::new(),
            total: 0.0,
        });
    }
    let mut sums: Vec<Option<Tensor<1>>> = vec![None; slots];
    for (bucket, grad) in layout.buckets().iter().zip(grads) {
        let range = plan.owned_range(bucket, comm.rank());
        for index in bucket.slots.clone() {
            let slot = &layout.slots()[index];
            if let Some(part) = slot.within(&range) {
                let piece = grad
                    .clone()
                    .narrow(0, slot.offset + part.start - range.start, part.len());
                // f32 for bf16/f16/f32 pieces (as Burn's clip_by_norm); f64 pieces sum in f64.
                let piece = match piece.dtype() {
                    DType::F64 => piece,
                    _ => piece.cast(DType::F32),
                };
                sums[index] = Some(piece.square().sum().cast(DType::F32));
            }
        }
    }
    let zero = || Tensor::<1>::from_data(TensorData::new(vec![0.0f32], [1]), device);
    let mut sums = Tensor::cat(sums.into_iter().map(|s| s.unwrap_or_else(zero)).collect(), 0);
    if plan.owned_ranges_partition() && comm.world_size() > 1 {
        sums = comm.all_reduce(sums, ReduceOp::Sum)?;
    }
    let sums: Vec<f32> = sums.into_data().convert::<f32>().iter::<f32>().collect();
    Ok(GradNorms {
        total: sums.iter().map(|&s| f64::from(s)).sum::<f64>().sqrt(),
        per_slot: sums.iter().map(|s| s.sqrt()).collect(),
    })
}

/// The factor clipping by global norm multiplies every gradient by:
/// `min(1, max_norm / (total + 1e-6))`, PyTorch's `torch.nn.utils.clip_grad_norm_` (whose
/// `1e-6` keeps a zero gradient finite). `1` for a non-finite `total` (the step is then skipped
/// by the loss scaler, or the optimizer sees the non-finite gradient, as in PyTorch with
/// `error_if_nonfinite=False`).
pub(crate) fn global_clip_coef(max_norm: f32, total: f64) -> f32 {
    if !total.is_finite() {
        return 1.0;
    }
    (f64::from(max_norm) / (total + 1e-6)).min(1.0) as f32
}

/// `grad · coef`, multiplied in `f32` and returned in `grad`'s dtype (as Burn's `clip_by_norm`
/// multiplies); `grad` itself when `coef` is 1.
pub(crate) fn scale(grad: Tensor<1>, coef: f32) -> Tensor<1> {
    if coef >= 1.0 {
        return grad;
    }
    let dtype = grad.dtype();
    match dtype {
        DType::F32 | DType::F64 => grad.mul_scalar(coef),
        _ => grad.cast(DType::F32).mul_scalar(coef).cast(dtype),
    }
}

/// Burn's per-parameter clipping applied to `piece`, a piece of a parameter's gradient whose
/// whole gradient has L2 norm `norm`: `Value` clamps each element (Burn's own
/// `clip_gradient`, element-wise, so exact on pieces); `Norm(t)` multiplies by
/// `min(1, t / (norm + f32::MIN_POSITIVE))`, Burn's `clip_by_norm` formula with the norm of the
/// whole parameter instead of the piece's.
pub(crate) fn clip_piece(clipping: &GradientClipping, piece: Tensor<1>, norm: f32) -> Tensor<1> {
    match clipping {
        GradientClipping::Value(_) => clipping.clip_gradient(piece),
        GradientClipping::Norm(threshold) => scale(piece, (threshold / (norm + f32::MIN_POSITIVE)).min(1.0)),
    }
}
