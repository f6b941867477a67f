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
        FusedAdam { hyper: h, fallback }
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

    /// The hyper-parameters.
    pub fn hyper(&self) -> AdamHyper {
        self.hyper
    }

    /// Which implementation [`Optimizer::step`] uses for `tensor`.
    pub fn path_for<const D: usize>(&self, tensor: &Tensor<D>) -> StepPath {
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
        let shape = tensor.shape();
        let numel = shape.num_elements();
        let zeros = || FlexTensor::zeros(shape.clone(), DType::F32);
        // Work on the Flex buffers themselves: the parameter and the moments are updated in
        // place when this step owns them, and the gradient is only read (it may stay shared).
        let (time, m, v, vmax) = match state {
            Some(s) => (
                s.momentum.time,
                flex_owned(s.momentum.moment_1),
                flex_owned(s.momentum.moment_2),
                s.momentum.max_moment_2.map(flex_owned),
            ),
            None => (0, zeros(), zeros(), None),
        };
        let vmax = match (self.hyper.amsgrad, vmax) {
            (true, Some(t)) => Some(t),
            (true, None) => Some(zeros()),
            (false, _) => None,
        };
        let time = time + 1;
        let (mut p, mut m, mut v, mut vmax) = (flex_owned(tensor), m, v, vmax);
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
        let momentum = AdaptiveMomentumState {
            time,
            moment_1: back(m),
            moment_2: back(v),
            max_moment_2: vmax.map(back),
        };
        (back(p), Some(AdamState { momentum }))
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
        let p = flat(tensor);
        let (time, m, v, vmax) = match state {
            Some(s) => (
                s.momentum.time,
                flat(s.momentum.moment_1),
                flat(s.momentum.moment_2),
                s.momentum.max_moment_2.map(flat),
            ),
            None => (0, crate::cube::zeros_like(&p), crate::cube::zeros_like(&p), None),
        };
        let vmax = match (self.hyper.amsgrad, vmax) {
            (true, Some(t)) => Some(t),
            (true, None) => Some(crate::cube::zeros_like(&p)),
            (false, _) => None,
        };
        let time = time + 1;
        let scalars = self.hyper.scalars(lr, time);
        let (p, m, v, vmax) = crate::cube::adam_step(&scalars, p, flat(grad), m, v, vmax);
        let back = |t: Tensor<1>| -> Tensor<D> { t.reshape(shape.clone()) };
        let momentum = AdaptiveMomentumState {
            time,
            moment_1: back(m),
            moment_2: back(v),
            max_moment_2: vmax.map(back),
        };
        (back(p), Some(AdamState { momentum }))
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
        if grad.shape() == tensor.shape() {
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

/// The Flex buffer of an `f32` tensor, owned by this step: a uniquely held, contiguous buffer
/// that starts at offset 0 is taken as is (no copy); anything else is copied once.
fn flex_owned<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let t = t.try_into_primitive::<Flex>().expect("checked by fused_cpu_applies");
    let exact = t.is_unique()
        && t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.layout().num_elements() * DType::F32.size();
    if exact { t } else { FlexTensor::from_data(t.into_data()) }
}

/// The Flex buffer of an `f32` tensor to read: shared buffers are read in place.
fn flex_readable<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let t = t.try_into_primitive::<Flex>().expect("checked by fused_cpu_applies");
    if t.as_slice::<f32>().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

fn owned_slice(t: &mut FlexTensor) -> &mut [f32] {
    t.try_storage_mut::<f32>()
        .expect("flex_owned returns a uniquely held buffer")
}
