//! Which Burn backends burn-shard's own autodiff ops exist for: stage 3's all-gather and unit
//! boundary ([`crate::fsdp::gather_op`]) and the stage 0-2 bucket hook
//! ([`crate::bucket::hook`]). They are backend extensions, implemented for Burn's CPU
//! `Flex` backend and, with this crate's `cube` feature, for the CubeCL backend (CUDA, wgpu,
//! CubeCL's CPU runtime) with Burn's `fusion` feature on or off. Burn panics when an extension
//! runs on a backend it was not implemented for, so [`check_stage3_device`] turns that into an
//! error at `ShardConfig::init`, and stages 0-2 without the hook reduce in the step instead.

use burn::backend::DispatchDevice;
use burn::tensor::Device;

use crate::error::ShardError;

/// Whether burn-shard's ops run on `device` (autodiff or not).
pub(crate) fn has_ops(device: &Device) -> bool {
    match device.clone().without_autodiff().as_dispatch() {
        DispatchDevice::Flex(_) => true,
        #[cfg(feature = "cube")]
        DispatchDevice::Cube(_) => true,
        _ => false,
    }
}

/// Stage 3 needs its gather op on the model's device: `Ok` where it exists, otherwise
/// [`ShardError::UnsupportedBackend`] naming the backend and the fix.
pub(crate) fn check_stage3_device(device: &Device) -> Result<(), ShardError> {
    if has_ops(device) {
        return Ok(());
    }
    let device = format!("{:?}", device.clone().without_autodiff().as_dispatch());
    // Without the `cube` feature this crate cannot name the CubeCL variant, so it reads Burn's
    // printed form. No test reaches this function's error: the suite's builds have only Flex
    // and CubeCL devices, which both have the op.
    let fix = if device.starts_with("Cube") {
        "enable burn-shard's `cube` feature (burn-shard = { features = [\"cube\"] })".to_string()
    } else {
        "build the model on Burn's Flex CPU device (Device::flex()) or a CubeCL device (cuda, wgpu) with \
         burn-shard's `cube` feature; stages 0-2 train on any backend"
            .to_string()
    };
    Err(ShardError::UnsupportedBackend {
        device,
        missing: "stage 3's all-gather op".into(),
        fix,
    })
}
