//! The fused Adam/AdamW update on host slices: one pass, multi-threaded, auto-vectorised.

use rayon::prelude::*;

use crate::error::KernelError;
use crate::hyper::AdamScalars;

/// Fewest elements per rayon task: below this, scheduling costs more than the work.
const MIN_CHUNK: usize = 1 << 16;

/// Elements per rayon task for `n` elements: one contiguous range per thread (each thread then
/// streams through its own memory, which the hardware prefetcher rewards), at least
/// [`MIN_CHUNK`], and a multiple of 64 so every task starts on a cache line of each buffer.
fn chunk_len(n: usize) -> usize {
    n.div_ceil(rayon::current_num_threads())
        .next_multiple_of(64)
        .max(MIN_CHUNK)
}

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
    let chunk = chunk_len(n);
    let chunks = param
        .par_chunks_mut(chunk)
        .zip(grad.par_chunks(chunk))
        .zip(exp_avg.par_chunks_mut(chunk))
        .zip(exp_avg_sq.par_chunks_mut(chunk));
    let simd = Simd::detect();
    match max_exp_avg_sq {
        None => chunks.for_each(|(((p, g), m), v)| simd.adam(s, p, g, m, v)),
        Some(vmax) => chunks
            .zip(vmax.par_chunks_mut(chunk))
            .for_each(|((((p, g), m), v), vm)| simd.amsgrad(s, p, g, m, v, vm)),
    }
    Ok(())
}

/// The widest vector instructions this CPU has, picked once per step at run time: the default
/// x86-64 target only guarantees SSE2 (4 lanes), while AVX2 has 8 and AVX-512 16, as PyTorch's
/// CPU kernels pick with their own capability dispatch. (Rust does not contract `a*b + c` into
/// fused multiply-adds, so results are the same on every tier.) The master-weight loop is not
/// dispatched: its `bf16`/`f16` conversions dominate.
#[derive(Clone, Copy)]
enum Simd {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
                return Simd::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Simd::Avx2Fma;
            }
        }
        Simd::Baseline
    }

    fn adam(self, s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        match self {
            Simd::Baseline => adam_chunk(s, p, g, m, v),
            // SAFETY: `detect` checked that the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2Fma => unsafe { adam_chunk_avx2(s, p, g, m, v) },
            // SAFETY: `detect` checked that the CPU has AVX-512F and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => unsafe { adam_chunk_avx512(s, p, g, m, v) },
        }
    }

    fn amsgrad(self, s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], vm: &mut [f32]) {
        match self {
            Simd::Baseline => amsgrad_chunk(s, p, g, m, v, vm),
            // SAFETY: `detect` checked that the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2Fma => unsafe { amsgrad_chunk_avx2(s, p, g, m, v, vm) },
            // SAFETY: `detect` checked that the CPU has AVX-512F and FMA.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => unsafe { amsgrad_chunk_avx512(s, p, g, m, v, vm) },
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

/// [`adam_chunk`] compiled for AVX-512F + FMA (16 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn adam_chunk_avx512(s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    adam_chunk(s, p, g, m, v)
}

/// [`amsgrad_chunk`] compiled for AVX-512F + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn amsgrad_chunk_avx512(
    s: &AdamScalars,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    vm: &mut [f32],
) {
    amsgrad_chunk(s, p, g, m, v, vm)
}

/// `β·old + (1-β)·x`: one moment update.
#[inline(always)]
fn next_moment(old: f32, x: f32, beta: f32, one_minus_beta: f32) -> f32 {
    beta * old + one_minus_beta * x
}

/// `p·decay − δ·lr` with `δ = (m·moment_scale / moment_divisor) / (sqrt(v / variance_divisor)
/// + ε)`: Burn's own expression in Burn's order (see [`AdamScalars`]), so that each rounding is
/// the one Burn's Flex backend makes and the result is bitwise Burn's `Adam`/`AdamW`.
#[inline(always)]
fn updated_param(s: &AdamScalars, p: f32, m: f32, v: f32) -> f32 {
    let delta = (m * s.moment_scale / s.moment_divisor) / ((v / s.variance_divisor).sqrt() + s.epsilon);
    p * s.decay - delta * s.lr
}

/// The element-wise update; written as one straight loop over zipped slices so LLVM
/// vectorises it (no bounds checks, no branches).
#[inline(always)]
fn adam_chunk(s: &AdamScalars, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = *p * s.l2 + g;
        *m = next_moment(*m, g, s.beta_1, s.one_minus_beta_1);
        *v = next_moment(*v, g * g, s.beta_2, s.one_minus_beta_2);
        *p = updated_param(s, *p, *m, *v);
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
        let g = *p * s.l2 + g;
        *m = next_moment(*m, g, s.beta_1, s.one_minus_beta_1);
        *v = next_moment(*v, g * g, s.beta_2, s.one_minus_beta_2);
        *vmax = vmax.max(*v);
        *p = updated_param(s, *p, *m, *vmax);
    }
}

/// A parameter or gradient element type the master-weight step reads or writes: `f32`,
/// `bf16` or `f16` (the update itself is always computed in `f32`).
pub trait Element: Copy + Send + Sync + 'static {
    /// Widens to `f32` (exact for all three types).
    fn to_f32(self) -> f32;
    /// Rounds an `f32` to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for half::bf16 {
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl Element for half::f16 {
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// One fused mixed-precision step, in place: the `f32` master copy `master`, `exp_avg`,
/// `exp_avg_sq` (and `max_exp_avg_sq` with AMSGrad) are updated from `grad` (any [`Element`]),
/// and the low-precision model copy `param` is written from the new master in the same pass
/// (`param[i] = P::from_f32(master[i])`). The `f32` update is the one [`adam_step`] makes. This is the mixed-precision Adam of Micikevicius et
/// al., "Mixed Precision Training" (2018), as ZeRO keeps it: the update is applied to the
/// `f32` master, so updates below the `bf16` resolution still accumulate.
///
/// # Errors
/// [`KernelError::LengthMismatch`] when the lengths (elements) differ.
pub fn adam_step_master<P: Element, G: Element>(
    s: &AdamScalars,
    master: &mut [f32],
    param: &mut [P],
    grad: &[G],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    max_exp_avg_sq: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let n = master.len();
    let max_len = max_exp_avg_sq.as_ref().map(|m| m.len());
    if param.len() != n
        || grad.len() != n
        || exp_avg.len() != n
        || exp_avg_sq.len() != n
        || max_len.is_some_and(|l| l != n)
    {
        return Err(KernelError::LengthMismatch {
            param: param.len(),
            grad: grad.len(),
            exp_avg: exp_avg.len(),
            exp_avg_sq: exp_avg_sq.len(),
            max: max_len,
        });
    }
    let chunk = chunk_len(n);
    let chunks = master
        .par_chunks_mut(chunk)
        .zip(param.par_chunks_mut(chunk))
        .zip(grad.par_chunks(chunk))
        .zip(exp_avg.par_chunks_mut(chunk))
        .zip(exp_avg_sq.par_chunks_mut(chunk));
    match max_exp_avg_sq {
        None => chunks.for_each(|((((w, p), g), m), v)| {
            for ((((w, p), g), m), v) in w
                .iter_mut()
                .zip(p.iter_mut())
                .zip(g)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                let g = *w * s.l2 + g.to_f32();
                *m = next_moment(*m, g, s.beta_1, s.one_minus_beta_1);
                *v = next_moment(*v, g * g, s.beta_2, s.one_minus_beta_2);
                *w = updated_param(s, *w, *m, *v);
                *p = P::from_f32(*w);
            }
        }),
        Some(vmax) => chunks
            .zip(vmax.par_chunks_mut(chunk))
            .for_each(|(((((w, p), g), m), v), vm)| {
                for (((((w, p), g), m), v), vm) in w
                    .iter_mut()
                    .zip(p.iter_mut())
                    .zip(g)
                    .zip(m.iter_mut())
                    .zip(v.iter_mut())
                    .zip(vm.iter_mut())
                {
                    let g = *w * s.l2 + g.to_f32();
                    *m = next_moment(*m, g, s.beta_1, s.one_minus_beta_1);
                    *v = next_moment(*v, g * g, s.beta_2, s.one_minus_beta_2);
                    *vm = vm.max(*v);
                    *w = updated_param(s, *w, *m, *vm);
                    *p = P::from_f32(*w);
                }
            }),
    }
    Ok(())
}
