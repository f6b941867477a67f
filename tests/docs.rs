//! The Rust snippets of README.md, of the guides under docs/ and of examples/README.md,
//! compiled as doctests by `cargo test --workspace` so that they cannot rot (run too, unless
//! marked `no_run`; the NCCL and MPI ones compile only with the `cuda` / `mpi` feature). No
//! snippet is `ignore`: the architecture test refuses one.
//! Hidden `# ` lines in the snippets hold the setup a reader does not need to see.
#![doc = include_str!("../README.md")]

/// docs/training.md
#[doc = include_str!("../docs/training.md")]
pub mod training {}

/// docs/checkpoints.md
#[doc = include_str!("../docs/checkpoints.md")]
pub mod checkpoints {}

/// docs/clusters.md
#[doc = include_str!("../docs/clusters.md")]
pub mod clusters {}

/// docs/fused-adam.md
#[doc = include_str!("../docs/fused-adam.md")]
pub mod fused_adam {}

/// docs/benchmarks.md (no Rust snippet today; included so that one added later is compiled)
#[doc = include_str!("../docs/benchmarks.md")]
pub mod benchmarks {}

/// examples/README.md
#[doc = include_str!("../examples/README.md")]
pub mod examples {}
