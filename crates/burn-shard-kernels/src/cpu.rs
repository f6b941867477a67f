//! The fused Adam/AdamW update on host slices: one pass, multi-threaded, auto-vectorised.

use rayon::prelude::*;

use crate::{AdamScalars, KernelError};

/// Elements per rayon task: large enough to amortise scheduling, small enough to balance
/// (256 KiB of each `f32` buffer).
const CHUNK: usize = 1 << 16;

/// One fused step, in place: `param`, `exp_avg` (`m`), `exp_avg_sq` (`v`) and, with AMSGrad,
/// `max_exp_avg_sq` are updated from `grad`. All slices have the same length (elements).
///
/// # Errors
/// [`KernelError::LengthMismatch`] when the lengths differ.
pub fn adam_step(
    s: &AdamScalars,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    max_exp_avg_sq: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let n = param.len();
    let max_len = max_exp_avg_sq.as_ref().map(|m| m.len());
    if grad.len() != n || exp_avg.len() != n || exp_avg_sq.len() != n || max_len.is_some_and(|l| l != n) {
        return Err(KernelError::LengthMismatch {
            param: n,
            grad: grad.len(),
            exp_avg: exp_avg.len(),
            exp_avg_sq: exp_avg_sq.len(),
            max: max_len,
        });
    }
    let chunks = param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(exp_avg.par_chunks_mut(CHUNK))
        .zip(exp_avg_sq.par_chunks_mut(CHUNK));
    match max_exp_avg_sq {
        None => chunks.for_each(|(((p, g), m), v)| adam_chunk(s, p, g, m, v)),
        Some(vmax) => chunks
            .zip(vmax.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), vm)| amsgrad_chunk(s, p, g, m, v, vm)),
    }
    Ok(())
}

/// The element-wise update; written as one straight loop over zipped slices so LLVM
/// vectorises it (no bounds checks, no branches).
#[inline]
fn adam_chunk(s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g + s.l2 * *p;
        let mi = s.beta_1 * *m + s.one_minus_beta_1 * g;
        let vi = s.beta_2 * *v + s.one_minus_beta_2 * g * g;
        *m = mi;
        *v = vi;
        *p = *p * s.decay - s.step_size * mi / (vi.sqrt() * s.inv_sqrt_bc2 + s.epsilon);
    }
}

#[inline]
fn amsgrad_chunk(s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], vmax: &mut [f32]) {
    for ((((p, &g), m), v), vmax) in p
        .iter_mut()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(vmax.iter_mut())
    {
        let g = g + s.l2 * *p;
        let mi = s.beta_1 * *m + s.one_minus_beta_1 * g;
        let vi = s.beta_2 * *v + s.one_minus_beta_2 * g * g;
        let vm = vmax.max(vi);
        *m = mi;
        *v = vi;
        *vmax = vm;
        *p = *p * s.decay - s.step_size * mi / (vm.sqrt() * s.inv_sqrt_bc2 + s.epsilon);
    }
}
