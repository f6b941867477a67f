//! [`FusedAdam`]: Burn's `Optimizer` trait on top of the fused kernels.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{
    Adam, AdamConfig, AdamState, AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, LearningRate, Optimizer,
};
use burn::tensor::{DType, Device, Tensor};

use crate::{AdamHyper, cpu};

/// Configuration of [`FusedAdam`], with Burn's defaults and Burn's builder style.
///
/// | field | [`FusedAdamConfig::adam`] | [`FusedAdamConfig::adamw`] |
/// |---|---|---|
/// | `beta_1` | 0.9 | 0.9 |
/// | `beta_2` | 0.999 | 0.999 |
/// | `epsilon` | 1e-5 (Burn's; PyTorch uses 1e-8) | 1e-5 |
/// | `weight_decay` | 0 (L2 penalty) | 1e-4 (decoupled) |
/// | `amsgrad` | false | false |
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FusedAdamConfig {
    hyper: AdamHyper,
}

impl FusedAdamConfig {
    /// Adam (L2 weight decay added to the gradient), as `burn::optim::AdamConfig::new()`.
    pub fn adam() -> Self {
        Self {
            hyper: AdamHyper {
                beta_1: 0.9,
                beta_2: 0.999,
                epsilon: 1e-5,
                weight_decay: 0.0,
                decoupled_weight_decay: false,
                amsgrad: false,
            },
        }
    }

    /// AdamW (decoupled weight decay), as `burn::optim::AdamWConfig::new()`.
    pub fn adamw() -> Self {
        Self {
            hyper: AdamHyper {
                weight_decay: 1e-4,
                decoupled_weight_decay: true,
                ..Self::adam().hyper
            },
        }
    }

    /// Sets `β1`.
    pub fn with_beta_1(mut self, beta_1: f32) -> Self {
        self.hyper.beta_1 = beta_1;
        self
    }

    /// Sets `β2`.
    pub fn with_beta_2(mut self, beta_2: f32) -> Self {
        self.hyper.beta_2 = beta_2;
        self
    }

    /// Sets `ε`.
    pub fn with_epsilon(mut self, epsilon: f32) -> Self {
        self.hyper.epsilon = epsilon;
        self
    }

    /// Sets the weight decay (L2 penalty for Adam, decoupled rate for AdamW).
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Self {
        self.hyper.weight_decay = weight_decay;
        self
    }

    /// Enables AMSGrad.
    pub fn with_amsgrad(mut self, amsgrad: bool) -> Self {
        self.hyper.amsgrad = amsgrad;
        self
    }

    /// The hyper-parameters.
    pub fn hyper(&self) -> AdamHyper {
        self.hyper
    }

    /// Builds the optimizer.
    pub fn init(&self) -> FusedAdam {
        let h = self.hyper;
        let fallback = if h.decoupled_weight_decay {
            Fallback::AdamW(
                AdamWConfig::new()
                    .with_beta_1(h.beta_1)
                    .with_beta_2(h.beta_2)
                    .with_epsilon(h.epsilon)
                    .with_weight_decay(h.weight_decay)
                    .with_amsgrad(h.amsgrad)
                    .build(),
            )
        } else {
            let decay = (h.weight_decay != 0.0).then(|| WeightDecayConfig::new(h.weight_decay));
            Fallback::Adam(
                AdamConfig::new()
                    .with_beta_1(h.beta_1)
                    .with_beta_2(h.beta_2)
                    .with_epsilon(h.epsilon)
                    .with_weight_decay(decay)
                    .with_amsgrad(h.amsgrad)
                    .build(),
            )
        };
        FusedAdam {
            hyper: h,
            fallback,
            fused: true,
            clips_gradients: false,
        }
    }
}

/// The fields of Burn's `AdamConfig` / `AdamWConfig`, read through their serde form (Burn keeps
/// the fields private; `Config` types are serde types by contract).
#[derive(serde::Deserialize)]
struct BurnAdamFields {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    amsgrad: bool,
    /// A number (AdamW) or `null` / `{"penalty": x}` (Adam).
    weight_decay: serde_json::Value,
    #[serde(default)]
    cautious_weight_decay: bool,
}

impl BurnAdamFields {
    fn read(config: &impl serde::Serialize) -> Option<Self> {
        serde_json::from_value(serde_json::to_value(config).ok()?).ok()
    }

    fn weight_decay(&self) -> Option<f32> {
        match &self.weight_decay {
            serde_json::Value::Null => Some(0.0),
            serde_json::Value::Number(n) => n.as_f64().map(|x| x as f32),
            serde_json::Value::Object(o) => o.get("penalty")?.as_f64().map(|x| x as f32),
            _ => None,
        }
    }

    fn config(&self, decoupled_weight_decay: bool) -> Option<FusedAdamConfig> {
        Some(FusedAdamConfig {
            hyper: AdamHyper {
                beta_1: self.beta_1,
                beta_2: self.beta_2,
                epsilon: self.epsilon,
                weight_decay: self.weight_decay()?,
                decoupled_weight_decay,
                amsgrad: self.amsgrad,
            },
        })
    }
}

impl FusedAdam {
    /// The fused optimizer with the hyper-parameters of Burn's `config` (ε included: Burn's
    /// default 1e-5 stays 1e-5). On paths without a fused implementation it steps with
    /// `config.build()` itself, so results equal Burn's within `f32` rounding everywhere.
    ///
    /// Like `config.build()`, the result does not clip gradients; see
    /// [`FusedAdam::clips_gradients`].
    pub fn from_burn_adam(config: &AdamConfig) -> Self {
        let fused = BurnAdamFields::read(config).and_then(|f| f.config(false));
        Self::from_burn(config, fused, Fallback::Adam(config.build()))
    }

    /// As [`FusedAdam::from_burn_adam`], for AdamW. Cautious weight decay (Burn's
    /// `cautious_weight_decay`) has no fused implementation: such a config always steps with
    /// Burn's `AdamW`.
    pub fn from_burn_adamw(config: &AdamWConfig) -> Self {
        let fused = BurnAdamFields::read(config)
            .filter(|f| !f.cautious_weight_decay)
            .and_then(|f| f.config(true));
        Self::from_burn(config, fused, Fallback::AdamW(config.build()))
    }

    fn from_burn(config: &impl serde::Serialize, fused: Option<FusedAdamConfig>, fallback: Fallback) -> Self {
        // Read on its own, so a renamed field elsewhere cannot hide a clipping request.
        let clips_gradients = serde_json::to_value(config)
            .ok()
            .and_then(|v| v.get("grad_clipping").map(|g| !g.is_null()))
            .unwrap_or(false);
        match fused {
            Some(config) => FusedAdam {
                hyper: config.hyper,
                fallback,
                fused: true,
                clips_gradients,
            },
            // Fields Burn may rename or options without a fused form: Burn's optimizer alone.
            None => FusedAdam {
                hyper: FusedAdamConfig::adam().hyper,
                fallback,
                fused: false,
                clips_gradients,
            },
        }
    }

    /// Whether the Burn config this was built from asked for gradient clipping, which a bare
    /// optimizer does not apply (Burn's `ModuleOptimizer` does; so does not `config.build()`).
    pub fn clips_gradients(&self) -> bool {
        self.clips_gradients
    }
}

/// The implementation a [`FusedAdam`] step runs for a given tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPath {
    /// The fused CPU loop ([`crate::cpu::adam_step`]) on Burn's `Flex` backend.
    FusedCpu,
    /// The CubeCL kernel on Burn's CubeCL backend.
    CubeKernel,
    /// Burn's own Adam/AdamW (other backends, other dtypes, autodiff tensors).
    BurnFallback,
}

#[derive(Clone)]
enum Fallback {
    Adam(Adam),
    AdamW(AdamW),
}

/// Adam / AdamW whose step is one fused pass on `f32` tensors of Burn's CPU (`Flex`) backend,
/// and Burn's own implementation on every other backend or dtype.
///
/// The state is Burn's [`AdamState`] (`momentum.time`, `momentum.moment_1`,
/// `momentum.moment_2`, `momentum.max_moment_2`), so a record written by `FusedAdam` loads into
/// Burn's `Adam`/`AdamW` and back ([`FusedAdam::from_adamw_state`] for `AdamWState`, whose
/// fields are the same). Updates equal Burn's within `f32` rounding.
#[derive(Clone)]
pub struct FusedAdam {
    hyper: AdamHyper,
    fallback: Fallback,
    /// `false` when the configuration has no fused form: every step is Burn's.
    fused: bool,
    clips_gradients: bool,
}

impl FusedAdam {
    /// Converts Burn's AdamW state (same fields) into this optimizer's state.
    pub fn from_adamw_state<const D: usize>(state: AdamWState<D>) -> AdamState<D> {
        AdamState {
            momentum: state.momentum,
        }
    }

    /// Converts this optimizer's state into Burn's AdamW state.
    pub fn to_adamw_state<const D: usize>(state: AdamState<D>) -> AdamWState<D> {
        AdamWState {
            momentum: state.momentum,
        }
    }

    /// The hyper-parameters of the fused update; `None` when this optimizer always steps with
    /// Burn's (see [`FusedAdam::from_burn_adamw`]).
    pub fn hyper(&self) -> Option<AdamHyper> {
        self.fused.then_some(self.hyper)
    }

    /// One mixed-precision step: updates the `f32` master copy `master` (shape `S`) and the state
    /// from `grad` (shape `S`, `f32`, `bf16` or `f16`), and returns `(master, param, state)` where
    /// `param` (shape `S`, the dtype of the `param` given: `bf16`, `f16` or `f32`) is the new
    /// master rounded to that dtype. `param`'s values are not read; its buffer is reused when
    /// this step holds the only reference.
    ///
    /// On `Flex` tensors this is one fused pass ([`cpu::adam_step_master`]), on the CubeCL
    /// backend one kernel (feature `cube`; the device must support the dtype: wgpu has no
    /// `bf16`); elsewhere it is [`Optimizer::step`] on the master followed by a cast. Updates equal those of
    /// `step(lr, master, grad.cast(F32), state)` within `f32` rounding.
    pub fn step_with_master<const D: usize>(
        &self,
        lr: LearningRate,
        master: Tensor<D>,
        param: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Tensor<D>, Option<AdamState<D>>) {
        let state = state.map(|s| conform_state(s, &master));
        let path = match state_fits(state.as_ref(), &master) {
            true => self.master_path_for(&master, &param, &grad),
            false => StepPath::BurnFallback,
        };
        match path {
            StepPath::FusedCpu => return self.fused_cpu_master(lr, master, param, grad, state),
            #[cfg(feature = "cube")]
            StepPath::CubeKernel => return self.fused_cube_master(lr, master, param, grad, state),
            _ => {}
        }
        let dtype = param.dtype();
        drop(param);
        let (master, state) = self.step(lr, master, grad.cast(DType::F32), state);
        let param = master.clone().cast(dtype);
        (master, param, state)
    }

    /// Which implementation [`FusedAdam::step_with_master`] uses for these tensors.
    pub fn master_path_for<const D: usize>(&self, master: &Tensor<D>, param: &Tensor<D>, grad: &Tensor<D>) -> StepPath {
        let shapes_match = param.shape() == master.shape() && grad.shape() == master.shape();
        let path = self.path_for(master);
        let low = [DType::BF16, DType::F16, DType::F32];
        let on_flex = |t: &Tensor<D>| !t.is_autodiff() && t.device() == Device::flex() && low.contains(&t.dtype());
        if shapes_match && path == StepPath::FusedCpu && on_flex(param) && on_flex(grad) {
            return StepPath::FusedCpu;
        }
        #[cfg(feature = "cube")]
        if shapes_match
            && path == StepPath::CubeKernel
            && crate::cube::applies_with_master(param, &master.device())
            && crate::cube::applies_with_master(grad, &master.device())
        {
            return StepPath::CubeKernel;
        }
        StepPath::BurnFallback
    }

    fn fused_cpu_master<const D: usize>(
        &self,
        lr: LearningRate,
        master: Tensor<D>,
        param: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Tensor<D>, Option<AdamState<D>>) {
        let (time, m, v, vmax) = self.moments(&master, state);
        let (mut m, mut v, mut vmax) = (flex_owned(m), flex_owned(v), vmax.map(flex_owned));
        let time = time + 1;
        let (mut w, mut p, g) = (flex_owned(master), flex_owned(param), flex_readable(grad));
        let scalars = self.hyper.scalars(lr, time);
        let w_slice = owned_slice(&mut w);
        let (m_slice, v_slice) = (owned_slice(&mut m), owned_slice(&mut v));
        let vmax_slice = vmax.as_mut().map(owned_slice);
        // One monomorphised loop per (param, grad) dtype pair.
        macro_rules! run {
            ($p:ty, $g:ty) => {
                cpu::adam_step_master::<$p, $g>(
                    &scalars,
                    w_slice,
                    p.try_storage_mut::<$p>()
                        .expect("flex_owned returns a uniquely held buffer"),
                    g.as_slice::<$g>().expect("made contiguous by flex_readable"),
                    m_slice,
                    v_slice,
                    vmax_slice,
                )
            };
        }
        use half::{bf16, f16};
        let result = match (p.dtype(), g.dtype()) {
            (DType::BF16, DType::BF16) => run!(bf16, bf16),
            (DType::BF16, DType::F32) => run!(bf16, f32),
            (DType::F16, DType::F16) => run!(f16, f16),
            (DType::F16, DType::F32) => run!(f16, f32),
            (DType::F32, DType::F32) => run!(f32, f32),
            (DType::BF16, DType::F16) => run!(bf16, f16),
            (DType::F16, DType::BF16) => run!(f16, bf16),
            (DType::F32, DType::BF16) => run!(f32, bf16),
            (DType::F32, DType::F16) => run!(f32, f16),
            (pd, gd) => unreachable!("step_with_master checked the dtypes, got {pd:?} / {gd:?}"),
        };
        result.expect("buffers of one parameter have one shape");
        let back = |t: FlexTensor| Tensor::<D>::from_primitive::<Flex>(t);
        let state = adam_state(time, back(m), back(v), vmax.map(back));
        (back(w), back(p), Some(state))
    }

    /// This step's `(time, m, v, vmax)`: the state's moments, or `f32` zeros shaped and placed
    /// like `like` on the first step; `vmax` only with AMSGrad. `time` is the step count before
    /// this step.
    fn moments<const D: usize>(
        &self,
        like: &Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (usize, Tensor<D>, Tensor<D>, Option<Tensor<D>>) {
        let zeros = || Tensor::<D>::zeros(like.shape(), (&like.device(), DType::F32));
        let (time, m, v, vmax) = match state {
            Some(s) => (
                s.momentum.time,
                s.momentum.moment_1,
                s.momentum.moment_2,
                s.momentum.max_moment_2,
            ),
            None => (0, zeros(), zeros(), None),
        };
        let vmax = match (self.hyper.amsgrad, vmax) {
            (true, Some(t)) => Some(t),
            (true, None) => Some(zeros()),
            (false, _) => None,
        };
        (time, m, v, vmax)
    }

    /// Which implementation [`Optimizer::step`] uses for `tensor`.
    pub fn path_for<const D: usize>(&self, tensor: &Tensor<D>) -> StepPath {
        if !self.fused {
            return StepPath::BurnFallback;
        }
        if Self::fused_cpu_applies(tensor) {
            return StepPath::FusedCpu;
        }
        #[cfg(feature = "cube")]
        if crate::cube::applies(tensor) {
            return StepPath::CubeKernel;
        }
        StepPath::BurnFallback
    }

    /// Whether `tensor` can take the fused CPU path: `f32` on the `Flex` device, no autodiff.
    fn fused_cpu_applies<const D: usize>(tensor: &Tensor<D>) -> bool {
        tensor.dtype() == DType::F32 && !tensor.is_autodiff() && tensor.device() == Device::flex()
    }

    fn fused_cpu<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Option<AdamState<D>>) {
        let numel = tensor.shape().num_elements();
        // Work on the Flex buffers themselves: the parameter and the moments are updated in
        // place when this step owns them, and the gradient is only read (it may stay shared).
        let (time, m, v, vmax) = self.moments(&tensor, state);
        let time = time + 1;
        let (mut p, mut m, mut v, mut vmax) = (flex_owned(tensor), flex_owned(m), flex_owned(v), vmax.map(flex_owned));
        let g = flex_readable(grad);
        let scalars = self.hyper.scalars(lr, time);
        cpu::adam_step(
            &scalars,
            owned_slice(&mut p),
            g.as_slice::<f32>().expect("made contiguous f32 by flex_readable"),
            owned_slice(&mut m),
            owned_slice(&mut v),
            vmax.as_mut().map(owned_slice),
        )
        .expect("buffers of one parameter have one shape");
        debug_assert_eq!(p.layout().num_elements(), numel);
        let back = |t: FlexTensor| Tensor::<D>::from_primitive::<Flex>(t);
        let state = adam_state(time, back(m), back(v), vmax.map(back));
        (back(p), Some(state))
    }
}

#[cfg(feature = "cube")]
impl FusedAdam {
    fn fused_cube<const D: usize>(
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

    fn fused_cube_master<const D: usize>(
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

impl Optimizer for FusedAdam {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        // A gradient of another float dtype is cast to the parameter's, as the update needs.
        let grad = if grad.dtype() != tensor.dtype() {
            grad.cast(tensor.dtype())
        } else {
            grad
        };
        let state = state.map(|s| conform_state(s, &tensor));
        if same_layout(&tensor, &grad) && state_fits(state.as_ref(), &tensor) {
            match self.path_for(&tensor) {
                StepPath::FusedCpu => return self.fused_cpu(lr, tensor, grad, state),
                #[cfg(feature = "cube")]
                StepPath::CubeKernel => return self.fused_cube(lr, tensor, grad, state),
                _ => {}
            }
        }
        match &self.fallback {
            Fallback::Adam(adam) => adam.step(lr, tensor, grad, state),
            Fallback::AdamW(adamw) => {
                let (t, s) = adamw.step(lr, tensor, grad, state.map(|s| AdamWState { momentum: s.momentum }));
                (t, s.map(Self::from_adamw_state))
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        <Adam as Optimizer>::to_device(state, device)
    }
}

/// Whether `b` can be read alongside `a` by a fused path: same shape, dtype and device, and not
/// tracked by autodiff.
fn same_layout<const D: usize>(a: &Tensor<D>, b: &Tensor<D>) -> bool {
    a.shape() == b.shape() && a.dtype() == b.dtype() && a.device() == b.device() && !b.is_autodiff()
}

/// Whether `state`'s moments are `f32` tensors shaped and placed like `like` (a state loaded from
/// elsewhere may not be; Burn's own step then handles it).
fn state_fits<const D: usize>(state: Option<&AdamState<D>>, like: &Tensor<D>) -> bool {
    let Some(state) = state else { return true };
    let fits = |t: &Tensor<D>| {
        t.dtype() == DType::F32 && t.shape() == like.shape() && t.device() == like.device() && !t.is_autodiff()
    };
    let m = &state.momentum;
    fits(&m.moment_1) && fits(&m.moment_2) && m.max_moment_2.as_ref().is_none_or(fits)
}

/// `state` with its moments in `like`'s dtype and on its device (a state loaded from a
/// checkpoint of another precision or device); unchanged when they already are.
fn conform_state<const D: usize>(state: AdamState<D>, like: &Tensor<D>) -> AdamState<D> {
    let (dtype, device) = (like.dtype(), like.device());
    let conform = |t: Tensor<D>| {
        let t = if t.device() != device { t.to_device(&device) } else { t };
        if t.dtype() != dtype { t.cast(dtype) } else { t }
    };
    let m = state.momentum;
    adam_state(
        m.time,
        conform(m.moment_1),
        conform(m.moment_2),
        m.max_moment_2.map(conform),
    )
}

/// Burn's Adam state after step `time` (1-based) with moments `m`, `v` and, with AMSGrad, the
/// running maximum `vmax` of `v`.
fn adam_state<const D: usize>(time: usize, m: Tensor<D>, v: Tensor<D>, vmax: Option<Tensor<D>>) -> AdamState<D> {
    let momentum = AdaptiveMomentumState {
        time,
        moment_1: m,
        moment_2: v,
        max_moment_2: vmax,
    };
    AdamState { momentum }
}

/// The Flex buffer of a float tensor, owned by this step: a uniquely held, contiguous buffer
/// that starts at offset 0 is taken as is (no copy); anything else is copied once.
fn flex_owned<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let t = t.try_into_primitive::<Flex>().expect("checked by fused_cpu_applies");
    let exact = t.is_unique()
        && t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.layout().num_elements() * t.dtype().size();
    if exact { t } else { FlexTensor::from_data(t.into_data()) }
}

/// The Flex buffer of a float tensor to read: shared buffers are read in place.
fn flex_readable<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let t = t.try_into_primitive::<Flex>().expect("checked by fused_cpu_applies");
    let contiguous = match t.dtype() {
        DType::BF16 => t.as_slice::<half::bf16>().is_some(),
        DType::F16 => t.as_slice::<half::f16>().is_some(),
        _ => t.as_slice::<f32>().is_some(),
    };
    if contiguous { t } else { t.to_contiguous() }
}

fn owned_slice(t: &mut FlexTensor) -> &mut [f32] {
    t.try_storage_mut::<f32>()
        .expect("flex_owned returns a uniquely held buffer")
}
