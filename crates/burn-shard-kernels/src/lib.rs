//! Fused Adam / AdamW steps on flat `f32` shards.
//!
//! Burn's stock Adam builds one step from about ten tensor operations, each a pass over memory
//! with its own allocation. Here the whole update (moments, bias correction, weight decay,
//! parameter) is one pass that reads `param, grad, exp_avg, exp_avg_sq` and writes `param,
//! exp_avg, exp_avg_sq`: 28 bytes per `f32` element (32 with AMSGrad).
//!
//! - [`cpu`]: the fused update on slices, multi-threaded with rayon, auto-vectorised.
//! - `cube` (feature `cube`, or `wgpu`): the same update as a CubeCL kernel, run in place on
//!   Burn tensors of the CubeCL backend (CUDA, wgpu, CubeCL's CPU runtime).
//! - [`FusedAdam`] (`fused_adam.rs`; its steps in `optimizer.rs`, its configuration in
//!   `config.rs`, the choice of path in `path.rs`, the CPU path's `Flex` buffers in `flex.rs`):
//!   a `burn::optim::Optimizer` that runs the fused CPU path on Burn's pure-Rust
//!   `Flex` backend, the CubeCL kernel on the CubeCL backend (when built with it), and Burn's
//!   own Adam/AdamW elsewhere. Its state is Burn's
//!   [`AdamState`](burn::optim::AdamState), so checkpoints move between the two.

mod config;
pub mod cpu;
#[cfg(feature = "cube")]
mod cube;
mod error;
mod flex;
mod fused_adam;
mod hyper;
mod optimizer;
mod path;

pub use config::FusedAdamConfig;
pub use error::KernelError;
pub use fused_adam::FusedAdam;
pub use hyper::{AdamHyper, AdamScalars};
pub use path::StepPath;

#[cfg(feature = "cube")]
pub use burn_shard_cube::fusion_on;
#[cfg(feature = "cube")]
pub use cube::cube_supports;
#[cfg(feature = "wgpu")]
pub use cube::wgpu_cpu_device;
