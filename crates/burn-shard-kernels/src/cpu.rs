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
    let simd = Simd::detect();
    match max_exp_avg_sq {
        None => chunks.for_each(|(((p, g), m), v)| simd.adam(s, p, g, m, v)),
        Some(vmax) => chunks
            .zip(vmax.par_chunks_mut(CHUNK))
            .for_each(|((((p, g), m), v), vm)| simd.amsgrad(s, p, g, m, v, vm)),
    }
    Ok(())
}

/// The widest vector instructions this CPU has, picked once per step at run time: the default
/// x86-64 target only guarantees SSE2, while the element-wise loop gains from AVX2 and FMA
/// (twice the lanes, fused multiply-adds), as PyTorch's CPU kernels do.
#[derive(Clone, Copy)]
enum Simd {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

impl Simd {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return Simd::Avx2Fma;
        }
        Simd::Baseline
    }

    fn adam(self, s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        match self {
            Simd::Baseline => adam_chunk(s, p, g, m, v),
            // SAFETY: `detect` checked that the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2Fma => unsafe { adam_chunk_avx2(s, p, g, m, v) },
        }
    }

    fn amsgrad(self, s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], vm: &mut [f32]) {
        match self {
            Simd::Baseline => amsgrad_chunk(s, p, g, m, v, vm),
            // SAFETY: `detect` checked that the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2Fma => unsafe { amsgrad_chunk_avx2(s, p, g, m, v, vm) },
        }
    }
}

/// [`adam_chunk`] compiled for AVX2 + FMA (the body is inlined and vectorised for them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adam_chunk_avx2(s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    adam_chunk(s, p, g, m, v)
}

/// [`amsgrad_chunk`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn amsgrad_chunk_avx2(s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], vm: &mut [f32]) {
    amsgrad_chunk(s, p, g, m, v, vm)
}

/// The element-wise update; written as one straight loop over zipped slices so LLVM
/// vectorises it (no bounds checks, no branches).
#[inline(always)]
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

#[inline(always)]
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
