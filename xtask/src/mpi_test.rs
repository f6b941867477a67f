//! `cargo xtask mpi-test`: the MPI suite. Builds the test suite and the shakespeare job (which
//! the suite runs under `mpirun`) with the `mpi` feature in one cargo call, then runs the suite's
//! `mpi` module: collectives against the in-process backend, sharded training at stages 0-3
//! against single-process training, and the error paths, on 2-3 processes.
//!
//! Both cargo calls name the same packages' features (`--no-default-features` and the suite's
//! features given in full), so the second one rebuilds nothing. `--features` picks another
//! build of Burn (CI: `wgpu,autotune`, fusion off) and the test names after `--` run in it too,
//! so one extra build serves the MPI suite and the fusion-off wgpu tests.

use std::process::Command;

/// Arguments of `cargo xtask mpi-test`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Features of `burn-shard-tests` besides `mpi` (its defaults: Burn's GPU-user build).
    #[arg(long, default_value = "wgpu,fusion")]
    features: String,
    /// More test names (filters) to run in the same build, after the MPI tests (in a second run).
    #[arg(last = true)]
    more_tests: Vec<String>,
}

pub fn run(args: &Args) -> Result<(), String> {
    if crate::setup::which("mpirun").is_none() {
        return Err(
            "mpirun is not installed: run `cargo xtask setup` (Debian's openmpi-bin and libopenmpi-dev)".into(),
        );
    }
    let features: Vec<String> = args
        .features
        .split(',')
        .map(str::trim)
        .filter(|f| !f.is_empty())
        .chain(["mpi"])
        .map(|f| format!("burn-shard-tests/{f}"))
        .collect();
    let features = features.join(",");
    let common = ["--release", "--no-default-features", "--features", &features];
    let mut build = vec!["build", "-p", "burn-shard-examples", "-p", "burn-shard-tests"];
    build.extend(common);
    build.extend(["--bin", "shakespeare", "--test", "suite"]);
    cargo(&build)?;
    let test = |filters: &[&str]| {
        let mut test = vec!["test", "-p", "burn-shard-tests"];
        test.extend(common);
        test.extend(["--test", "suite", "--"]);
        test.extend(filters);
        cargo(&test)
    };
    test(&["mpi::"])?;
    // A second run of the same binary: the MPI tests' timeouts (mpirun, collectives) must not
    // share the two cores with other long tests.
    match args.more_tests.is_empty() {
        true => Ok(()),
        false => test(&args.more_tests.iter().map(String::as_str).collect::<Vec<_>>()),
    }
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
