//! The L2 norm of the averaged gradient over all ranks, per parameter and global, and the
//! clipping that uses it.
//!
//! Each rank measures the pieces of each parameter in the range it owns (the whole bucket at
//! stage 0, its shard at stages 1-3), so every element is counted once and the zero padding of
//! buckets and shards is never read: per piece, its largest magnitude `m` and the pairwise sum
//! of `(g/m)²` (see [`measure`]). At stages 1-3 these pairs are all-gathered (one collective of
//! two `f32` per parameter and rank); at stage 0 every rank holds the whole averaged gradient
//! and its pairs are already global. Every rank combines the same pairs in `f64`, so every rank
//! gets the same norms, exact to `f32` rounding at any size and finite for any finite gradient,
//! and one non-finite element on any rank makes the global norm non-finite on all of them.

use burn::optim::grad_clipping::GradientClipping;
use burn::tensor::{DType, Tensor, TensorData};

use crate::error::ShardError;
use crate::step::context::StepContext;

/// L2 norms of the gradient averaged over the ranks.
#[derive(Clone, Debug)]
pub(crate) struct GradNorms {
    /// The norm of each layout slot's whole gradient (all ranks' pieces), in `f32` as Burn's
    /// `clip_by_norm` computes it.
    pub(crate) per_slot: Vec<f32>,
    /// The norm of the whole gradient (every trainable parameter).
    pub(crate) total: f64,
}

/// Measures the norms. `grad(b)` gives bucket `b`'s averaged gradient over this rank's owned
/// range (`plan.owned_range`), of any float dtype.
///
/// Exact to `f32` rounding at any size, and free of overflow for any finite gradient: each
/// owned piece `g` is divided by its largest magnitude `m` (so every square is at most 1), its
/// squares are summed pairwise in blocks of [`SUM_BLOCK`] elements on the device, in `f64`
/// where the device has it (a sequential `f32` sum stops growing past `2^24` terms), and the
/// pairs `(m, Σ(g/m)²)` of every rank are
/// combined on the host in `f64` as `Σ m²·Σ(g/m)²` (the scaled sum of LAPACK's `xNRM2` and
/// Blue's algorithm, ACM TOMS 4(1), 1978). A non-finite element makes the norm non-finite.
///
/// `grad(index)` gives bucket `index`'s owned-range gradient (read from disk with NVMe
/// parameter offload, one bucket at a time).
///
/// # Errors
/// [`ShardError::Comm`] when the all-gather of the per-parameter pairs fails; what `grad`
/// returns.
pub(crate) fn measure(
    cx: &StepContext,
    grad: &mut dyn FnMut(usize) -> Result<Tensor<1>, ShardError>,
) -> Result<GradNorms, ShardError> {
    let (layout, plan, comm, device) = (cx.layout, cx.plan, cx.comm, &cx.device);
    let slots = layout.slots().len();
    if slots == 0 {
        return Ok(GradNorms {
            per_slot: Vec::new(),
            total: 0.0,
        });
    }
    // Per slot: [m, Σ(g/m)²] of this rank's piece, in f32 (zeros where it owns none).
    let mut pairs: Vec<Option<Tensor<1>>> = vec![None; slots];
    for (index, bucket) in layout.buckets().iter().enumerate() {
        let grad = grad(index)?;
        let range = plan.owned_range(bucket, comm.rank());
        for index in bucket.slots.clone() {
            let slot = &layout.slots()[index];
            if let Some(part) = slot.within(&range) {
                let piece = grad
                    .clone()
                    .narrow(0, slot.offset + part.start - range.start, part.len());
                pairs[index] = Some(scaled_square_sum(piece));
            }
        }
    }
    let zeros = || Tensor::<1>::from_data(TensorData::new(vec![0.0f32; 2], [2]), (device, DType::F32));
    let mut pairs = Tensor::cat(pairs.into_iter().map(|p| p.unwrap_or_else(zeros)).collect(), 0);
    if plan.owned_ranges_partition() && comm.world_size() > 1 {
        pairs = comm.all_gather(pairs)?;
    }
    let pairs: Vec<f32> = pairs.into_data().convert::<f32>().iter::<f32>().collect();
    // pairs: rank-major, [rank][slot][m, s].
    let mut squares = vec![0.0f64; slots];
    for rank in pairs.chunks(2 * slots) {
        for (sum, pair) in squares.iter_mut().zip(rank.chunks(2)) {
            let (m, s) = (f64::from(pair[0]), f64::from(pair[1]));
            *sum += m * m * s;
        }
    }
    Ok(GradNorms {
        total: squares.iter().sum::<f64>().sqrt(),
        per_slot: squares.iter().map(|s| s.sqrt() as f32).collect(),
    })
}

/// Elements summed sequentially at a time by [`pairwise_sum`]: `2^10`, so each level's
/// rounding error is bounded by `2^10` units of `f32` rounding however long the gradient.
const SUM_BLOCK: usize = 1 << 10;

/// `[m, Σ(g/m)²]` (`[2]`, `f32`) of a gradient piece `g` of any float dtype, with `m` its
/// largest magnitude (at least `f32::MIN_POSITIVE`, so a zero piece gives `[MIN_POSITIVE, 0]`).
/// Scaled, squared and summed in `f64` where the device has it (Burn's CPU backend, CUDA), so
/// the sum is exact to `f32` rounding; in `f32` elsewhere (wgpu), where the pairwise sum's
/// rounding (about `1e-6` relative) remains.
fn scaled_square_sum(piece: Tensor<1>) -> Tensor<1> {
    let accumulate = match piece.device().supports_dtype(DType::F64) {
        true => DType::F64,
        false => DType::F32,
    };
    let piece = piece.cast(accumulate);
    let m = piece.clone().abs().max().clamp_min(f32::MIN_POSITIVE);
    let scaled = piece.div(m.clone());
    let sum = pairwise_sum(scaled.square());
    Tensor::cat(vec![m.cast(DType::F32), sum.cast(DType::F32)], 0)
}

/// The sum of `x` (`[n]`) as `[1]`: blocks of [`SUM_BLOCK`] summed first, then their sums,
/// recursively (a pairwise sum with a wide base), so no partial sum adds more than
/// `SUM_BLOCK` terms.
fn pairwise_sum(x: Tensor<1>) -> Tensor<1> {
    let n = x.dims()[0];
    if n <= SUM_BLOCK {
        return x.sum();
    }
    let blocks = n / SUM_BLOCK;
    let head = x
        .clone()
        .narrow(0, 0, blocks * SUM_BLOCK)
        .reshape([blocks, SUM_BLOCK])
        .sum_dim(1)
        .reshape([blocks]);
    let head = pairwise_sum(head);
    match n - blocks * SUM_BLOCK {
        0 => head,
        rest => head.add(x.narrow(0, blocks * SUM_BLOCK, rest).sum()),
    }
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

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;

    /// The scaled square sum of a piece larger than a block (several levels of the pairwise
    /// sum, and a ragged tail) gives its norm within `f32` rounding of the `f64` norm, with
    /// magnitudes from 1e-30 to 1e30 (no under- or overflow), and a zero piece gives
    /// `[MIN_POSITIVE, 0]`.
    #[test]
    fn the_scaled_square_sum_gives_the_norm_of_any_magnitude() {
        let device = Device::flex();
        for scale in [1e-30f32, 1.0, 1e30] {
            let n = 3 * SUM_BLOCK * SUM_BLOCK / 2 + 17;
            let values: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.731).sin() + 0.01) * scale).collect();
            let want = values.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
            let piece = Tensor::<1>::from_data(TensorData::new(values, [n]), &device);
            let got: Vec<f32> = scaled_square_sum(piece).into_data().iter::<f32>().collect();
            let norm = f64::from(got[0]) * f64::from(got[1]).sqrt();
            assert!(
                ((norm - want) / want).abs() < 1e-6,
                "scale {scale}: {norm} against {want}"
            );
        }
        let zero = Tensor::<1>::zeros([5], &device);
        let got: Vec<f32> = scaled_square_sum(zero).into_data().iter::<f32>().collect();
        assert_eq!(got, [f32::MIN_POSITIVE, 0.0]);
    }
}
