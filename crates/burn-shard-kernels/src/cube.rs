//! The fused Adam/AdamW update as a CubeCL kernel, launched in place on Burn tensors of the
//! CubeCL backend (CUDA, wgpu, CubeCL's CPU runtime: one kernel source for all).
//!
//! Hyper-parameters and the step's bias corrections are runtime scalars, so one compiled kernel
//! serves every step. Loads are vectorised with the widest vector size (4, 2 or 1 elements)
//! that divides the length, so odd lengths run correctly with scalar loads.

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
) {
    let i = ABSOLUTE_POS;
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
) {
    let i = ABSOLUTE_POS;
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

fn vector_size(len: usize) -> usize {
    [4usize, 2, 1].into_iter().find(|w| len % w == 0).unwrap_or(1)
}

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
    let client = p.client.clone();
    let width = vector_size(n);
    let vectors = n / width;
    let cube_dim = CubeDim::new(&client, vectors);
    let cube_count = cubecl::calculate_cube_count_elemwise(&client, vectors, cube_dim);
    let arg = |t: &CubeTensor| unsafe { BufferArg::from_raw_parts(t.handle.clone(), vectors) };
    match &vmax {
        None => fused_adam::launch::<f32>(
            &client,
            cube_count,
            cube_dim,
            width,
            arg(&p),
            arg(&g),
            arg(&m),
            arg(&v),
            s.beta_1,
            s.one_minus_beta_1,
            s.beta_2,
            s.one_minus_beta_2,
            s.epsilon,
            s.l2,
            s.decay,
            s.step_size,
            s.inv_sqrt_bc2,
        ),
        Some(vm) => fused_amsgrad::launch::<f32>(
            &client,
            cube_count,
            cube_dim,
            width,
            arg(&p),
            arg(&g),
            arg(&m),
            arg(&v),
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
        ),
    }
    let back = |t: CubeTensor| Tensor::<1>::from_primitive::<CubeBackend>(t);
    (back(p), back(m), back(v), vmax.map(back))
}

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
