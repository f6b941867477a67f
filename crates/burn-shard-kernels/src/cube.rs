//! The fused Adam/AdamW update as a CubeCL kernel, launched in place on Burn tensors of the
//! CubeCL backend (CUDA, wgpu, CubeCL's CPU runtime: one kernel source for all).
//!
//! Hyper-parameters and the step's bias corrections are runtime scalars, so one compiled kernel
//! serves every step. Loads are vectorised 4 elements wide over the largest multiple of 4
//! elements; the remaining 0-3 elements (the tail) are a second, scalar launch of the same
//! kernel at an element offset.

use burn::tensor::{Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::AdamScalars;

/// `β·old + (1-β)·x`: one moment update.
#[cube]
fn next_moment<F: Float, N: Size>(old: Vector<F, N>, x: Vector<F, N>, beta: f32, one_minus_beta: f32) -> Vector<F, N> {
    old * Vector::new(F::cast_from(beta)) + x * Vector::new(F::cast_from(one_minus_beta))
}

/// `p·decay - step_size·m / (sqrt(v)·inv_sqrt_bc2 + ε)`: the parameter update.
#[cube]
fn updated_param<F: Float, N: Size>(
    p: Vector<F, N>,
    m: Vector<F, N>,
    v: Vector<F, N>,
    epsilon: f32,
    decay: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
) -> Vector<F, N> {
    let denom = Vector::sqrt(v) * Vector::new(F::cast_from(inv_sqrt_bc2)) + Vector::new(F::cast_from(epsilon));
    p * Vector::new(F::cast_from(decay)) - Vector::new(F::cast_from(step_size)) * m / denom
}

#[cube(launch)]
fn fused_adam<F: Float, N: Size>(
    param: &mut [Vector<F, N>],
    grad: &[Vector<F, N>],
    exp_avg: &mut [Vector<F, N>],
    exp_avg_sq: &mut [Vector<F, N>],
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    epsilon: f32,
    l2: f32,
    decay: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
    offset: usize,
) {
    let i = ABSOLUTE_POS + offset;
    if i < param.len() {
        let p = param[i];
        let g = grad[i] + p * Vector::new(F::cast_from(l2));
        let m = next_moment(exp_avg[i], g, beta_1, one_minus_beta_1);
        let v = next_moment(exp_avg_sq[i], g * g, beta_2, one_minus_beta_2);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = updated_param(p, m, v, epsilon, decay, step_size, inv_sqrt_bc2);
    }
}

/// [`fused_adam`] with AMSGrad: the update uses the running maximum of the second moment.
#[cube(launch)]
fn fused_amsgrad<F: Float, N: Size>(
    param: &mut [Vector<F, N>],
    grad: &[Vector<F, N>],
    exp_avg: &mut [Vector<F, N>],
    exp_avg_sq: &mut [Vector<F, N>],
    max_exp_avg_sq: &mut [Vector<F, N>],
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    epsilon: f32,
    l2: f32,
    decay: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
    offset: usize,
) {
    let i = ABSOLUTE_POS + offset;
    if i < param.len() {
        let p = param[i];
        let g = grad[i] + p * Vector::new(F::cast_from(l2));
        let m = next_moment(exp_avg[i], g, beta_1, one_minus_beta_1);
        let v = next_moment(exp_avg_sq[i], g * g, beta_2, one_minus_beta_2);
        let vm = <Vector<F, N> as FloatOps>::max(max_exp_avg_sq[i], v);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        max_exp_avg_sq[i] = vm;
        param[i] = updated_param(p, m, vm, epsilon, decay, step_size, inv_sqrt_bc2);
    }
}

/// The mixed-precision step: updates the `f32` `master`, moments (and, with `amsgrad`, their
/// running maximum) from a `G` gradient, and writes the master rounded to `P` into `param`.
/// Without `amsgrad`, `max_exp_avg_sq` is a placeholder that is not touched.
#[cube(launch)]
fn fused_adam_master<P: Float, G: Float, N: Size>(
    master: &mut [Vector<f32, N>],
    param: &mut [Vector<P, N>],
    grad: &[Vector<G, N>],
    exp_avg: &mut [Vector<f32, N>],
    exp_avg_sq: &mut [Vector<f32, N>],
    max_exp_avg_sq: &mut [Vector<f32, N>],
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    epsilon: f32,
    l2: f32,
    decay: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
    offset: usize,
    #[comptime] amsgrad: bool,
) {
    let i = ABSOLUTE_POS + offset;
    if i < master.len() {
        let w = master[i];
        let g = Vector::<f32, N>::cast_from(grad[i]) + w * Vector::new(l2);
        let m = next_moment::<f32, N>(exp_avg[i], g, beta_1, one_minus_beta_1);
        let v = next_moment::<f32, N>(exp_avg_sq[i], g * g, beta_2, one_minus_beta_2);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        let mut v_used = v;
        if amsgrad {
            v_used = <Vector<f32, N> as FloatOps>::max(max_exp_avg_sq[i], v);
            max_exp_avg_sq[i] = v_used;
        }
        let w = updated_param::<f32, N>(w, m, v_used, epsilon, decay, step_size, inv_sqrt_bc2);
        master[i] = w;
        param[i] = Vector::<P, N>::cast_from(w);
    }
}

/// Whether `tensor` lives on Burn's CubeCL backend (so the kernel can run on it).
pub(crate) fn applies<const D: usize>(tensor: &Tensor<D>) -> bool {
    !tensor.is_autodiff()
        && tensor.dtype() == burn::tensor::DType::F32
        && matches!(tensor.device().as_dispatch(), burn::backend::DispatchDevice::Cube(_))
}

/// A uniquely owned, contiguous flat `f32` buffer on the CubeCL backend.
fn writable(t: Tensor<1>) -> CubeTensor {
    let cube = t.try_into_primitive::<CubeBackend>().expect("checked by `applies`");
    if cube.handle.can_mut() {
        return cube;
    }
    // Shared (e.g. still held by the caller): write into a copy instead.
    let copy = Tensor::<1>::from_primitive::<CubeBackend>(cube).add_scalar(0.0);
    copy.try_into_primitive::<CubeBackend>().expect("same backend")
}

fn readable(t: Tensor<1>) -> CubeTensor {
    t.try_into_primitive::<CubeBackend>().expect("checked by `applies`")
}

/// Elements per vector in the kernel's body.
const VECTOR: usize = 4;

/// One fused step in place on flat `[n]` tensors of the CubeCL backend; returns the updated
/// `(param, exp_avg, exp_avg_sq, max_exp_avg_sq)`.
pub(crate) fn adam_step(
    s: &AdamScalars,
    param: Tensor<1>,
    grad: Tensor<1>,
    exp_avg: Tensor<1>,
    exp_avg_sq: Tensor<1>,
    max_exp_avg_sq: Option<Tensor<1>>,
) -> (Tensor<1>, Tensor<1>, Tensor<1>, Option<Tensor<1>>) {
    let n = param.dims()[0];
    if n == 0 {
        return (param, exp_avg, exp_avg_sq, max_exp_avg_sq);
    }
    let (p, g, m, v) = (writable(param), readable(grad), writable(exp_avg), writable(exp_avg_sq));
    let vmax = max_exp_avg_sq.map(writable);
    let body = n / VECTOR;
    if body > 0 {
        // Vectors 0..body, each VECTOR elements.
        launch(s, [&p, &g, &m, &v], vmax.as_ref(), VECTOR, body, body, 0);
    }
    if !n.is_multiple_of(VECTOR) {
        // Elements body·VECTOR..n, one per thread, in the same buffers.
        launch(
            s,
            [&p, &g, &m, &v],
            vmax.as_ref(),
            1,
            n,
            n - body * VECTOR,
            body * VECTOR,
        );
    }
    let back = |t: CubeTensor| Tensor::<1>::from_primitive::<CubeBackend>(t);
    (back(p), back(m), back(v), vmax.map(back))
}

/// Launches the kernel on `threads` consecutive slots starting at slot `offset` of buffers
/// seen as `len` slots of `width` elements each.
fn launch(
    s: &AdamScalars,
    [p, g, m, v]: [&CubeTensor; 4],
    vmax: Option<&CubeTensor>,
    width: usize,
    len: usize,
    threads: usize,
    offset: usize,
) {
    let client = p.client.clone();
    let cube_dim = CubeDim::new(&client, threads);
    let cube_count = cubecl::calculate_cube_count_elemwise(&client, threads, cube_dim);
    // SAFETY: every buffer holds at least `len·width` f32 elements (one flat parameter).
    let arg = |t: &CubeTensor| unsafe { BufferArg::from_raw_parts(t.handle.clone(), len) };
    match vmax {
        None => fused_adam::launch::<f32>(
            &client,
            cube_count,
            cube_dim,
            width,
            arg(p),
            arg(g),
            arg(m),
            arg(v),
            s.beta_1,
            s.one_minus_beta_1,
            s.beta_2,
            s.one_minus_beta_2,
            s.epsilon,
            s.l2,
            s.decay,
            s.step_size,
            s.inv_sqrt_bc2,
            offset,
        ),
        Some(vm) => fused_amsgrad::launch::<f32>(
            &client,
            cube_count,
            cube_dim,
            width,
            arg(p),
            arg(g),
            arg(m),
            arg(v),
            arg(vm),
            s.beta_1,
            s.one_minus_beta_1,
            s.beta_2,
            s.one_minus_beta_2,
            s.epsilon,
            s.l2,
            s.decay,
            s.step_size,
            s.inv_sqrt_bc2,
            offset,
        ),
    }
}

/// Whether the mixed-precision kernel takes `tensor` as the parameter or gradient of a master
/// on `device`: same device, not tracked, `f32`, `bf16` or `f16`.
pub(crate) fn applies_with_master<const D: usize>(tensor: &Tensor<D>, device: &burn::tensor::Device) -> bool {
    use burn::tensor::DType;
    !tensor.is_autodiff()
        && matches!(tensor.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && tensor.device() == *device
}

/// One mixed-precision step in place on flat `[n]` tensors of the CubeCL backend: `master`,
/// `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` are `f32`; `param` and `grad` are `f32`, `bf16` or
/// `f16` (the device must support the type). Returns the updated
/// `(master, param, exp_avg, exp_avg_sq, max_exp_avg_sq)`.
pub(crate) fn adam_step_master(
    s: &AdamScalars,
    master: Tensor<1>,
    param: Tensor<1>,
    grad: Tensor<1>,
    exp_avg: Tensor<1>,
    exp_avg_sq: Tensor<1>,
    max_exp_avg_sq: Option<Tensor<1>>,
) -> MasterStep {
    let n = master.dims()[0];
    if n == 0 {
        return (master, param, exp_avg, exp_avg_sq, max_exp_avg_sq);
    }
    let amsgrad = max_exp_avg_sq.is_some();
    // Without AMSGrad the kernel still binds a maximum buffer: one vector of placeholder zeros.
    let placeholder = || Tensor::from_data(TensorData::new(vec![0.0f32; VECTOR], [VECTOR]), &master.device());
    let vmax = max_exp_avg_sq.unwrap_or_else(placeholder);
    let (w, p, g) = (writable(master), writable(param), readable(grad));
    let (m, v, vm) = (writable(exp_avg), writable(exp_avg_sq), writable(vmax));
    let body = n / VECTOR;
    let run = |width: usize, len: usize, threads: usize, offset: usize| {
        let client = w.client.clone();
        let cube_dim = CubeDim::new(&client, threads);
        let cube_count = cubecl::calculate_cube_count_elemwise(&client, threads, cube_dim);
        // SAFETY: the data buffers hold `len·width` elements; the placeholder maximum buffer is
        // never indexed when `amsgrad` is false.
        let arg = |t: &CubeTensor| unsafe { BufferArg::from_raw_parts(t.handle.clone(), len) };
        macro_rules! launch_as {
            ($p:ty, $g:ty) => {
                fused_adam_master::launch::<$p, $g>(
                    &client,
                    cube_count,
                    cube_dim,
                    width,
                    arg(&w),
                    arg(&p),
                    arg(&g),
                    arg(&m),
                    arg(&v),
                    arg(&vm),
                    s.beta_1,
                    s.one_minus_beta_1,
                    s.beta_2,
                    s.one_minus_beta_2,
                    s.epsilon,
                    s.l2,
                    s.decay,
                    s.step_size,
                    s.inv_sqrt_bc2,
                    offset,
                    amsgrad,
                )
            };
        }
        use burn::tensor::DType::{BF16, F16, F32};
        use half::{bf16, f16};
        match (p.dtype, g.dtype) {
            (BF16, BF16) => launch_as!(bf16, bf16),
            (BF16, F32) => launch_as!(bf16, f32),
            (F16, F16) => launch_as!(f16, f16),
            (F16, F32) => launch_as!(f16, f32),
            (F32, F32) => launch_as!(f32, f32),
            (BF16, F16) => launch_as!(bf16, f16),
            (F16, BF16) => launch_as!(f16, bf16),
            (F32, BF16) => launch_as!(f32, bf16),
            (F32, F16) => launch_as!(f32, f16),
            (pd, gd) => unreachable!("checked by applies_with_master: {pd:?} / {gd:?}"),
        }
    };
    if body > 0 {
        run(VECTOR, body, body, 0);
    }
    if !n.is_multiple_of(VECTOR) {
        run(1, n, n - body * VECTOR, body * VECTOR);
    }
    let back = |t: CubeTensor| Tensor::<1>::from_primitive::<CubeBackend>(t);
    (back(w), back(p), back(m), back(v), amsgrad.then(|| back(vm)))
}

/// `(master, param, exp_avg, exp_avg_sq, max_exp_avg_sq)` after a mixed-precision step.
pub(crate) type MasterStep = (Tensor<1>, Tensor<1>, Tensor<1>, Tensor<1>, Option<Tensor<1>>);

/// Zeros `[n]` on the device of `like`.
pub(crate) fn zeros_like(like: &Tensor<1>) -> Tensor<1> {
    let n = like.dims()[0];
    Tensor::from_data(TensorData::new(vec![0.0f32; n], [n]), &like.device())
}

/// Burn's wgpu device on a CPU adapter (Mesa's lavapipe), the device CI runs the kernel on.
///
/// # Errors
/// A message naming the fix when no such adapter exists (install `mesa-vulkan-drivers`).
#[cfg(feature = "wgpu")]
pub fn wgpu_cpu_device() -> Result<burn::tensor::Device, String> {
    use cubecl::device::WgpuDeviceKind;
    cubecl::Device::wgpu(WgpuDeviceKind::Cpu).map_err(|e| {
        format!("no wgpu CPU adapter ({e:?}); install Mesa's lavapipe: apt-get install mesa-vulkan-drivers libvulkan1")
    })?;
    Ok(burn::tensor::Device::wgpu(burn::tensor::DeviceKind::Cpu))
}
