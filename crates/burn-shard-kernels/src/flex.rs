//! The fused CPU path's host side: Burn's `Flex` buffers handed to the [`cpu`] loops in place
//! (owned buffers updated without a copy, shared gradients read without one).

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::optim::{AdamState, LearningRate};
use burn::tensor::{DType, Tensor};

use crate::cpu;
use crate::fused_adam::{FusedAdam, adam_state};

impl FusedAdam {
    pub(crate) fn fused_cpu<const D: usize>(
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

    pub(crate) fn fused_cpu_master<const D: usize>(
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
}

/// The Flex buffer of a float tensor, owned by this step: a uniquely held, contiguous buffer
/// that starts at offset 0 is taken as is (no copy); anything else is copied once.
pub(crate) fn flex_owned<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let t = t.try_into_primitive::<Flex>().expect("checked by fused_cpu_applies");
    let exact = t.is_unique()
        && t.is_contiguous()
        && t.layout().start_offset() == 0
        && t.bytes().len() == t.layout().num_elements() * t.dtype().size();
    if exact { t } else { FlexTensor::from_data(t.into_data()) }
}

/// The Flex buffer of a float tensor to read: shared buffers are read in place.
pub(crate) fn flex_readable<const D: usize>(t: Tensor<D>) -> FlexTensor {
    let t = t.try_into_primitive::<Flex>().expect("checked by fused_cpu_applies");
    let contiguous = match t.dtype() {
        DType::BF16 => t.as_slice::<half::bf16>().is_some(),
        DType::F16 => t.as_slice::<half::f16>().is_some(),
        _ => t.as_slice::<f32>().is_some(),
    };
    if contiguous { t } else { t.to_contiguous() }
}

pub(crate) fn owned_slice(t: &mut FlexTensor) -> &mut [f32] {
    t.try_storage_mut::<f32>()
        .expect("flex_owned returns a uniquely held buffer")
}
