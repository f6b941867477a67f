//! `f32` master weights for buckets of `bf16`/`f16` parameters.
//!
//! Mixed-precision training (Micikevicius et al., "Mixed Precision Training", 2018) keeps an
//! `f32` copy of the weights for the optimizer: an update smaller than half a `bf16` ulp of the
//! weight would round away in `bf16`, while it accumulates in `f32`. ZeRO partitions that copy
//! with the optimizer state (Rajbhandari et al., 2020, §3: `K = 12` bytes per parameter for
//! mixed-precision Adam: master, momentum, variance).

use std::any::Any;

use burn::optim::{AdamState, LearningRate, Optimizer};
use burn::tensor::{DType, Tensor};
use burn_shard_kernels::FusedAdam;

/// Whether parameters of `dtype` are trained through an `f32` master copy (`bf16`, `f16`);
/// `f32` and `f64` parameters are stepped directly.
pub(crate) fn needs_master(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// One step of `optim` on this rank's `f32` `master` shard (`[len]`) from `grad` (`[len]`, the
/// parameters' dtype); returns `(master, param, state)` with `param` the new master rounded to
/// `param`'s dtype. [`FusedAdam`] does it in one pass; any other optimizer steps the master and
/// the result is cast.
pub(crate) fn step_with_master<O: Optimizer>(
    optim: &O,
    lr: LearningRate,
    master: Tensor<1>,
    param: Tensor<1>,
    grad: Tensor<1>,
    state: Option<O::State<1>>,
) -> (Tensor<1>, Tensor<1>, Option<O::State<1>>) {
    if let Some(fused) = (optim as &dyn Any).downcast_ref::<FusedAdam>() {
        // O is FusedAdam, so O::State<1> is AdamState<1>: the casts below cannot fail.
        let state = state.map(|s| *cast_box::<_, AdamState<1>>(s));
        let (master, param, state) = fused.step_with_master(lr, master, param, grad, state);
        return (master, param, state.map(|s| *cast_box::<_, O::State<1>>(s)));
    }
    let dtype = param.dtype();
    drop(param);
    let (master, state) = optim.step(lr, master, grad.cast(DType::F32), state);
    let param = master.clone().cast(dtype);
    (master, param, state)
}

fn cast_box<A: 'static, B: 'static>(value: A) -> Box<B> {
    (Box::new(value) as Box<dyn Any>)
        .downcast::<B>()
        .expect("the optimizer's state type was checked through its TypeId")
}
