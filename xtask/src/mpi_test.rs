//! `cargo xtask mpi-test`: the MPI suite. Builds the workspace with the `mpi` feature (the
//! shakespeare job included, which the suite runs under `mpirun`), then runs the suite's `mpi`
//! module: collectives against the in-process backend, sharded training at stages 0-3 against
//! single-process training, and the error paths, on 2-3 processes.

use std::process::Command;

/// Arguments of `cargo xtask mpi-test`.
#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_: &Args) -> Result<(), String> {
    if crate::setup::which("mpirun").is_none() {
        return Err(
            "mpirun is not installed: run `cargo xtask setup` (Debian's openmpi-bin and libopenmpi-dev)".into(),
        );
    }
    // `--workspace` keeps Burn's features those of the default build, so nothing of Burn rebuilds.
    cargo(&[
        "build",
        "--release",
        "--workspace",
        "--features",
        "burn-shard-examples/mpi",
    ])?;
    cargo(&[
        "test",
        "--release",
        "--workspace",
        "--features",
        "burn-shard-tests/mpi",
        "--",
        "mpi::",
    ])
}

fn cargo(args: &[&str]) -> Result<(), String> {
    println!("cargo {}", args.join(" "));
    let status = Command::new(env!("CARGO"))
        .args(args)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cargo {} failed ({status})", args.join(" ")))
    }
}
