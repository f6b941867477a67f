//! The fused Adam/AdamW update as a CubeCL kernel, launched in place on Burn tensors of the
//! CubeCL backend (CUDA, wgpu, CubeCL's CPU runtime: one kernel source for all).
//!
//! Hyper-parameters and the step's bias corrections are runtime scalars, so one compiled kernel
//! serves every step (per dtype pair and AMSGrad flag). Loads are vectorised 4 elements wide over
//! the largest multiple of 4 elements; the remaining 0-3 elements (the tail) are a second,
//! scalar launch of the same kernel at an element offset. The end of the file is `FusedAdam`'s
//! host side of this path (moments in, kernel launch, state out).

use burn::backend::ops::FloatTensorOps;
use burn::optim::{AdamState, LearningRate};
use burn::tensor::{DType, Tensor, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use burn_shard_cube::{from_cube, into_cube};
use cubecl::prelude::*;

use crate::fused_adam::{FusedAdam, adam_state};
use crate::hyper::AdamScalars;

/// `β·old + (1-β)·x`: one moment update.
#[cube]
fn next_moment<F: Float, N: Size>(old: Vector<F, N>, x: Vector<F, N>, beta: f32, one_minus_beta: f32) -> Vector<F, N> {
    old * Vector::new(F::cast_from(beta)) + x * Vector::new(F::cast_from(one_minus_beta))
}

/// [`AdamScalars`] as the kernels receive them, plus the launch's first slot (`offset`).
#[derive(CubeLaunch, CubeType)]
struct KernelScalars {
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    l2: f32,
    moment_scale: f32,
    moment_divisor: f32,
    variance_divisor: f32,
    epsilon: f32,
    decay: f32,
    lr: f32,
    offset: usize,
}

/// Slot `i` of one Adam step, shared by both kernels: updates the moments (and, with
/// `amsgrad`, their running maximum) in place from the gradient `g` and returns the new value
/// of the parameter `p`: Burn's expression in Burn's order, `p·decay − δ·lr` with
/// `δ = (m·moment_scale / moment_divisor) / (sqrt(v / variance_divisor) + ε)` (see
/// [`AdamScalars`]). A GPU compiler may contract `a·b − c` into a fused multiply-add and use
/// its own division and square root, so this is Burn's formula, not necessarily its bits.
#[cube]
fn adam_slot<F: Float, N: Size>(
    p: Vector<F, N>,
    g: Vector<F, N>,
    exp_avg: &mut [Vector<F, N>],
    exp_avg_sq: &mut [Vector<F, N>],
    max_exp_avg_sq: &mut [Vector<F, N>],
    i: usize,
    s: &KernelScalars,
    #[comptime] amsgrad: bool,
) -> Vector<F, N> {
    let g = p * Vector::new(F::cast_from(s.l2)) + g;
    let m = next_moment(exp_avg[i], g, s.beta_1, s.one_minus_beta_1);
    let v = next_moment(exp_avg_sq[i], g * g, s.beta_2, s.one_minus_beta_2);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    let mut v_used = v;
    if amsgrad {
        v_used = <Vector<F, N> as FloatOps>::max(max_exp_avg_sq[i], v);
        max_exp_avg_sq[i] = v_used;
    }
    let m_hat = m * Vector::new(F::cast_from(s.moment_scale)) / Vector::new(F::cast_from(s.moment_divisor));
    let v_hat = v_used / Vector::new(F::cast_from(s.variance_divisor));
    let delta = m_hat / (Vector::sqrt(v_hat) + Vector::new(F::cast_from(s.epsilon)));
    p * Vector::new(F::cast_from(s.decay)) - delta * Vector::new(F::cast_from(s.lr))
}

/// The `f32` step in place: `param`, moments and, with `amsgrad`, their running maximum (a
/// placeholder that is not touched without it; one compiled kernel per value of the flag).
#[cube(launch)]
fn fused_adam<F: Float, N: Size>(
    param: &mut [Vector<F, N>],
    grad: &[Vector<F, N>],
    exp_avg: &mut [Vector<F, N>],
    exp_avg_sq: &mut [Vector<F, N>],
    max_exp_avg_sq: &mut [Vector<F, N>],
    s: KernelScalars,
    #[comptime] amsgrad: bool,
) {
    let i = ABSOLUTE_POS + s.offset;
    if i < param.len() {
        param[i] = adam_slot(param[i], grad[i], exp_avg, exp_avg_sq, max_exp_avg_sq, i, &s, amsgrad);
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
    s: KernelScalars,
    #[comptime] amsgrad: bool,
) {
    let i = ABSOLUTE_POS + s.offset;
    if i < master.len() {
        let g = Vector::<f32, N>::cast_from(grad[i]);
        let w = adam_slot::<f32, N>(master[i], g, exp_avg, exp_avg_sq, max_exp_avg_sq, i, &s, amsgrad);
        master[i] = w;
        param[i] = Vector::<P, N>::cast_from(w);
    }
}

/// The launch argument of [`KernelScalars`] for `s`, starting at slot `offset`.
fn kernel_scalars(s: &AdamScalars, offset: usize) -> KernelScalarsLaunch {
    KernelScalarsLaunch::new(
        s.beta_1,
        s.one_minus_beta_1,
        s.beta_2,
        s.one_minus_beta_2,
        s.l2,
        s.moment_scale,
        s.moment_divisor,
        s.variance_divisor,
        s.epsilon,
        s.decay,
        s.lr,
        offset,
    )
}

/// Whether the CubeCL runtime behind `device` can run kernels on `dtype`: a wgpu adapter
/// without `SHADER_F16` (Mesa's OpenGL one, say) has no `f16`, and wgpu has no `bf16`. `false`
/// for a device that is not a plain CubeCL device. Check it before relying on a dtype, never
/// assume it from the device kind.
pub fn cube_supports(device: &burn::tensor::Device, dtype: DType) -> bool {
    use cubecl::ir::{ElemType, FloatKind};
    let kind = match dtype {
        DType::F64 => FloatKind::F64,
        DType::F32 => FloatKind::F32,
        DType::F16 => FloatKind::F16,
        DType::BF16 => FloatKind::BF16,
        _ => return false,
    };
    burn_shard_cube::cube_device(device).is_some_and(|d| d.client().properties().supports_type(ElemType::Float(kind)))
}

/// Whether `tensor` lives on Burn's CubeCL backend (so the kernel can run on it), with Burn's
/// `fusion` feature on or off.
pub(crate) fn applies<const D: usize>(tensor: &Tensor<D>) -> bool {
    tensor.dtype() == DType::F32 && burn_shard_cube::is_cube(tensor)
}

/// `t` (shape `[n]`, dtype `dtype`) as a CubeCL buffer the kernels may index as `n` contiguous
/// elements from its handle's start, and write to when `write` is set. Strided or offset
/// views are made contiguous, and a buffer another tensor still shares is copied before
/// writing; the checks here are what the `unsafe` launches rely on.
///
/// # Panics
/// When `t` is not `[n]` of `dtype` on the CubeCL backend (the callers check this first).
fn buffer(t: Tensor<1>, n: usize, dtype: DType, write: bool) -> CubeTensor {
    assert_eq!(
        (t.dims()[0], t.dtype()),
        (n, dtype),
        "fused Adam: buffer of the wrong length or dtype"
    );
    let mut cube = into_cube(t).expect("checked by `applies`");
    // The allocator may round a buffer up, so "holds n elements" is a lower bound.
    let holds_n = |c: &CubeTensor| c.is_contiguous() && c.handle.size() as usize >= n * dtype.size();
    if !holds_n(&cube) {
        cube = burn_cubecl::kernel::into_contiguous(cube);
    }
    if write && !cube.can_mut() {
        // Shared (e.g. still held by the caller): write into a copy instead.
        cube = CubeBackend::float_add_scalar(cube, 0.0f32.into());
    }
    assert!(
        holds_n(&cube) && cube.meta.num_elements() == n,
        "fused Adam: could not get a contiguous buffer of {n} elements"
    );
    cube
}

/// Elements per vector in the kernel's body.
const VECTOR: usize = 4;

/// Runs `launch(width, len, threads, offset)` over `n` elements: the body as `n / VECTOR`
/// vectors of `VECTOR` elements (slots `0..n/VECTOR`), then the 0-3 element tail as scalars
/// (slots `n - n % VECTOR..n` of the same buffers seen as `n` scalars).
fn body_and_tail(n: usize, mut launch: impl FnMut(usize, usize, usize, usize)) {
    let body = n / VECTOR;
    if body > 0 {
        launch(VECTOR, body, body, 0);
    }
    if !n.is_multiple_of(VECTOR) {
        launch(1, n, n - body * VECTOR, body * VECTOR);
    }
}

/// The AMSGrad buffer the kernels bind when AMSGrad is off: one vector of zeros, never indexed.
fn placeholder(like: &Tensor<1>) -> Tensor<1> {
    Tensor::from_data(
        TensorData::new(vec![0.0f32; VECTOR], [VECTOR]),
        (&like.device(), DType::F32),
    )
}

/// Cube count and dimension for `threads` threads on `client`.
fn grid(client: &Client, threads: usize) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new(client, threads);
    (
        cubecl::calculate_cube_count_elemwise(client, threads, cube_dim),
        cube_dim,
    )
}

/// The optimizer-state buffers of one step on `n` elements: `exp_avg`, `exp_avg_sq` and the
/// AMSGrad maximum, or without AMSGrad the placeholder of `VECTOR` elements, each checked by
/// [`buffer`].
struct StateBuffers {
    m: CubeTensor,
    v: CubeTensor,
    vm: CubeTensor,
    amsgrad: bool,
}

impl StateBuffers {
    fn new(n: usize, exp_avg: Tensor<1>, exp_avg_sq: Tensor<1>, max_exp_avg_sq: Option<Tensor<1>>) -> Self {
        let amsgrad = max_exp_avg_sq.is_some();
        let vm = match max_exp_avg_sq {
            Some(t) => buffer(t, n, DType::F32, true),
            None => buffer(placeholder(&exp_avg), VECTOR, DType::F32, true),
        };
        let m = buffer(exp_avg, n, DType::F32, true);
        let v = buffer(exp_avg_sq, n, DType::F32, true);
        Self { m, v, vm, amsgrad }
    }

    /// Launch arguments of the three buffers for `len` slots of `width` elements.
    fn args(&self, len: usize, width: usize) -> [BufferArg; 3] {
        let vm_len = if self.amsgrad { len } else { VECTOR / width };
        [arg(&self.m, len), arg(&self.v, len), arg(&self.vm, vm_len)]
    }

    /// `(exp_avg, exp_avg_sq, max_exp_avg_sq)` as tensors again.
    fn into_tensors(self) -> (Tensor<1>, Tensor<1>, Option<Tensor<1>>) {
        let amsgrad = self.amsgrad;
        (tensor(self.m), tensor(self.v), amsgrad.then(|| tensor(self.vm)))
    }
}

/// `t` as a launch argument of `len` slots.
fn arg(t: &CubeTensor, len: usize) -> BufferArg {
    // SAFETY: every buffer passed here went through `buffer`, which checked that it holds
    // `n ≥ len·width` contiguous elements of its dtype (the placeholder: `VECTOR` elements for
    // `VECTOR / width` slots).
    unsafe { BufferArg::from_raw_parts(t.handle.clone(), len) }
}

fn tensor(t: CubeTensor) -> Tensor<1> {
    from_cube(t)
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
    let (p, g) = (buffer(param, n, DType::F32, true), buffer(grad, n, DType::F32, false));
    let state = StateBuffers::new(n, exp_avg, exp_avg_sq, max_exp_avg_sq);
    body_and_tail(n, |width, len, threads, offset| {
        let (cube_count, cube_dim) = grid(&p.client, threads);
        let [m, v, vm] = state.args(len, width);
        fused_adam::launch::<f32>(
            &p.client,
            cube_count,
            cube_dim,
            width,
            arg(&p, len),
            arg(&g, len),
            m,
            v,
            vm,
            kernel_scalars(s, offset),
            state.amsgrad,
        )
    });
    let (m, v, vm) = state.into_tensors();
    (tensor(p), m, v, vm)
}

/// Whether the mixed-precision kernel takes `tensor` as the parameter or gradient of a master
/// on `device`: same device, not tracked, `f32`, `bf16` or `f16`.
pub(crate) fn applies_with_master<const D: usize>(tensor: &Tensor<D>, device: &burn::tensor::Device) -> bool {
    matches!(tensor.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && tensor.device() == *device
        && burn_shard_cube::is_cube(tensor)
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
    let (p_dtype, g_dtype) = (param.dtype(), grad.dtype());
    let (w, p, g) = (
        buffer(master, n, DType::F32, true),
        buffer(param, n, p_dtype, true),
        buffer(grad, n, g_dtype, false),
    );
    let state = StateBuffers::new(n, exp_avg, exp_avg_sq, max_exp_avg_sq);
    body_and_tail(n, |width, len, threads, offset| {
        let (cube_count, cube_dim) = grid(&w.client, threads);
        let client = &w.client;
        macro_rules! launch_as {
            ($p:ty, $g:ty) => {{
                let [m, v, vm] = state.args(len, width);
                fused_adam_master::launch::<$p, $g>(
                    client,
                    cube_count,
                    cube_dim,
                    width,
                    arg(&w, len),
                    arg(&p, len),
                    arg(&g, len),
                    m,
                    v,
                    vm,
                    kernel_scalars(s, offset),
                    state.amsgrad,
                )
            }};
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
    });
    let (m, v, vm) = state.into_tensors();
    (tensor(w), tensor(p), m, v, vm)
}

/// `(master, param, exp_avg, exp_avg_sq, max_exp_avg_sq)` after a mixed-precision step.
pub(crate) type MasterStep = (Tensor<1>, Tensor<1>, Tensor<1>, Tensor<1>, Option<Tensor<1>>);

/// Burn's wgpu device on a Vulkan CPU adapter (Mesa's lavapipe), the device CI runs the kernel
/// on: where a Vulkan CPU adapter exists and CubeCL's automatic choice of graphics API (which
/// Burn's `Device::wgpu` follows) settles on Vulkan.
///
/// Vulkan only, although wgpu also finds Mesa's OpenGL CPU adapter (llvmpipe) on machines with
/// Mesa's GL libraries and no Vulkan driver: there the suite's multi-rank wgpu tests ran for
/// minutes each and then stopped for good inside CubeCL (2026-12-03: the fusion stream's
/// fused-matmul autotune waiting on `Client::exclusive` while the device thread waited in
/// `StreamId::executes`), and that adapter has no `f16` shaders.
///
/// # Errors
/// A message naming the fix when no Vulkan CPU adapter exists (install `mesa-vulkan-drivers`),
/// or when the automatic choice settles on another API (a GPU reached only through it).
#[cfg(feature = "wgpu")]
pub fn wgpu_cpu_device() -> Result<burn::tensor::Device, String> {
    use cubecl::device::WgpuDeviceKind;
    use cubecl::wgpu::{AutoGraphicsApi, Backend, GraphicsApi};
    cubecl::Device::vulkan(WgpuDeviceKind::Cpu).map_err(|e| {
        format!(
            "no Vulkan CPU adapter ({e:?}); install Mesa's lavapipe: apt-get install mesa-vulkan-drivers libvulkan1 \
             (or `cargo xtask setup --no-llvm --no-mpi --no-minilm`)"
        )
    })?;
    let api = <AutoGraphicsApi as GraphicsApi>::backend();
    if api != Backend::Vulkan {
        return Err(format!(
            "wgpu's automatic choice settles on {api:?} here, not on the Vulkan CPU adapter the kernel tests need"
        ));
    }
    Ok(burn::tensor::Device::wgpu(burn::tensor::DeviceKind::Cpu))
}

impl FusedAdam {
    pub(crate) fn fused_cube<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Option<AdamState<D>>) {
        let shape = tensor.shape();
        let n = shape.num_elements();
        let flat = |t: Tensor<D>| t.reshape([n]);
        let (time, m, v, vmax) = self.moments(&tensor, state);
        let time = time + 1;
        let scalars = self.hyper.scalars(lr, time);
        let (p, m, v, vmax) =
            crate::cube::adam_step(&scalars, flat(tensor), flat(grad), flat(m), flat(v), vmax.map(flat));
        let back = |t: Tensor<1>| -> Tensor<D> { t.reshape(shape.clone()) };
        let state = adam_state(time, back(m), back(v), vmax.map(back));
        (back(p), Some(state))
    }

    pub(crate) fn fused_cube_master<const D: usize>(
        &self,
        lr: LearningRate,
        master: Tensor<D>,
        param: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Tensor<D>, Option<AdamState<D>>) {
        let shape = master.shape();
        let n = shape.num_elements();
        let flat = |t: Tensor<D>| t.reshape([n]);
        let (time, m, v, vmax) = self.moments(&master, state);
        let time = time + 1;
        let scalars = self.hyper.scalars(lr, time);
        let (w, p, m, v, vmax) = crate::cube::adam_step_master(
            &scalars,
            flat(master),
            flat(param),
            flat(grad),
            flat(m),
            flat(v),
            vmax.map(flat),
        );
        let back = |t: Tensor<1>| -> Tensor<D> { t.reshape(shape.clone()) };
        let state = adam_state(time, back(m), back(v), vmax.map(back));
        (back(w), back(p), Some(state))
    }
}
