//! `cargo xtask mpi-test`: the MPI suite. Builds the test suite and the shakespeare job (which
//! the suite runs under `mpirun`) with the `mpi` feature in one cargo call, then runs the suite's
//! `mpi` module: collectives against the in-process backend, sharded training at stages 0-3
//! against single-process training, and the error paths, on 2-3 processes; then its
//! `cluster_mpi` module (jobs across a cluster of network namespaces; skipped without root).
//!
//! Both cargo calls name the same packages' features (`--no-default-features` and the suite's
//! features given in full), so the second one rebuilds nothing. `--features` picks another
//! build of Burn (CI: `wgpu,autotune`, fusion off) and the test names after `--` run in it too,
//! so one extra build serves the MPI suite and the fusion-off wgpu tests.

use std::path::PathBuf;
use std::process::Command;

/// Arguments of `cargo xtask mpi-test`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Features of `burn-shard-tests` besides `mpi` (its defaults: Burn's GPU-user build).
    #[arg(long, default_value = DEFAULT_FEATURES)]
    features: String,
    /// More test names (filters) to run in the same build, after the MPI tests (in a second run).
    #[arg(last = true)]
    more_tests: Vec<String>,
}

/// The suite's default features: Burn's GPU-user build.
const DEFAULT_FEATURES: &str = "wgpu,fusion";

pub fn run(args: &Args) -> Result<(), String> {
    let common = build(&args.features)?;
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let test = |filters: &[&str]| {
        let mut test = vec!["test", "-p", "burn-shard-tests"];
        test.extend(&common);
        test.extend(["--test", "suite", "--"]);
        test.extend(filters);
        cargo(&test)
    };
    test(&["mpi::", "--skip", "cluster_mpi::"])?;
    // The MPI jobs across a cluster of namespaces, one at a time: their timeouts (5 s) and
    // heartbeats must not share the two cores with the other MPI tests. CI's cluster scenario;
    // its duration is printed as a phase of its own.
    let started = std::time::Instant::now();
    test(&["cluster_mpi::", "--test-threads=1"])?;
    println!("-- cluster scenario (cluster_mpi): {} s", started.elapsed().as_secs());
    // A second run of the same binary: the MPI tests' timeouts (mpirun, collectives) must not
    // share the two cores with other long tests.
    match args.more_tests.is_empty() {
        true => Ok(()),
        false => test(&args.more_tests.iter().map(String::as_str).collect::<Vec<_>>()),
    }
}

/// The shakespeare job built with the `mpi` feature, as `cargo xtask mpi-test` builds it (so
/// neither rebuilds the other's), and its path.
///
/// # Errors
/// No `mpirun` (run `cargo xtask setup`), or the build failed.
pub fn build_shakespeare() -> Result<PathBuf, String> {
    build(DEFAULT_FEATURES)?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), PathBuf::from);
    Ok(target.join("release").join("shakespeare"))
}

/// Builds the suite and the shakespeare job with the `mpi` feature and `features` of the
/// suite; returns the cargo options that select that build.
fn build(features: &str) -> Result<Vec<String>, String> {
    if crate::setup::which("mpirun").is_none() {
        return Err(
            "mpirun is not installed: run `cargo xtask setup` (Debian's openmpi-bin and libopenmpi-dev)".into(),
        );
    }
    let features: Vec<String> = features
        .split(',')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .chain(["mpi"])
        .map(|f| format!("burn-shard-tests/{f}"))
        .collect();
    let common: Vec<String> = ["--release", "--no-default-features", "--features", &features.join(",")]
        .map(String::from)
        .to_vec();
    let mut build = vec!["build", "-p", "burn-shard-examples", "-p", "burn-shard-tests"];
    build.extend(common.iter().map(String::as_str));
    build.extend(["--bin", "shakespeare", "--bin", "comm-bench", "--test", "suite"]);
    cargo(&build)?;
    Ok(common)
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
