//! `cargo xtask gpu-bundle`: the GPU checks as one folder that runs on a machine with an NVIDIA
//! GPU but no Rust toolchain and no network (at most 64 MiB may travel there).
//!
//! Builds here, with the `cuda` feature (its LLVM from `cargo xtask setup`):
//! - `suite-fusion`: the test suite as GPU users build Burn (`fusion` and `autotune` on);
//! - `suite-no-fusion`: the same suite with Burn's `fusion` off (`CubeBackend` unwrapped);
//! - `gpu-bench`: the fused Adam kernel and the example GPT per stage (`examples/gpu_bench`),
//!
//! then strips them (`strip --strip-all`) and packs them into one solid archive,
//! `bin.tar.xz` (xz with a dictionary larger than the three binaries together: they share most
//! of their code, CubeCL's LLVM, CubeCL and Burn, which the archive then holds about once;
//! compressed one by one they came to 90.6 MiB on 2026-12-03, together to 49 MiB), next to the tiny
//! shakespeare text, a `MANIFEST.txt` (commit, build features, sizes) and `run.sh`
//! (`xtask/gpu_bundle/run.sh`), which finds the driver and CUDA's libraries (pip packages
//! included), runs the suites' `gpu::` tests and the benchmark, and writes the results into the
//! folder it is given. The whole folder must stay within [`MAX_BUNDLE_BYTES`].

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The bundle's size limit: 56 MiB. What travels to a lent GPU machine is capped at 64 MiB, and
/// the repository's working tree (about 6.3 MiB) travels with the bundle.
pub const MAX_BUNDLE_BYTES: u64 = 56 * 1024 * 1024;

static RUN_SH: &str = include_str!("../gpu_bundle/run.sh");

/// Arguments of `cargo xtask gpu-bundle`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The bundle folder (replaced). Default: target/gpu-bundle.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One build of the bundle: the packages, the cargo features and the targets it keeps, by
/// bundle name.
struct Build {
    what: &'static str,
    packages: &'static [&'static str],
    features: &'static str,
    /// (cargo target selection, the artifact's target name, the name in the bundle)
    targets: &'static [(&'static str, &'static str, &'static str)],
}

const BUILDS: [Build; 2] = [
    Build {
        what: "Burn's default features (fusion, autotune) + cuda",
        packages: &["burn-shard-tests", "burn-shard-examples"],
        features: "burn-shard-tests/cuda,burn-shard-tests/fusion,burn-shard-examples/cuda",
        targets: &[
            ("--test=suite", "suite", "suite-fusion"),
            ("--bin=gpu-bench", "gpu-bench", "gpu-bench"),
        ],
    },
    Build {
        what: "fusion off (autotune) + cuda",
        packages: &["burn-shard-tests"],
        features: "burn-shard-tests/cuda,burn-shard-tests/autotune",
        targets: &[("--test=suite", "suite", "suite-no-fusion")],
    },
];

pub fn run(args: &Args) -> Result<(), String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf();
    if !crate::setup::llvm_bundle_ready()? {
        return Err(
            "the cuda feature links CubeCL's LLVM, which is not set up here: run `cargo xtask setup` first \
             (on Debian/Ubuntu it links Debian's LLVM 22 where CubeCL's build looks)"
                .into(),
        );
    }
    for tool in ["strip", "xz", "tar"] {
        if crate::setup::which(tool).is_none() {
            return Err(format!(
                "`{tool}` is not installed: the bundle needs it (Debian: apt-get install binutils xz-utils tar)"
            ));
        }
    }
    let out = args.out.clone().unwrap_or_else(|| root.join("target/gpu-bundle"));
    if out.exists() {
        // Only an earlier bundle (or nothing) is replaced: `--out .` must not delete a project.
        let empty = std::fs::read_dir(&out).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty && !out.join("MANIFEST.txt").exists() {
            return Err(format!(
                "{} exists and is not an earlier bundle (no MANIFEST.txt): pick another --out or remove it",
                out.display()
            ));
        }
        std::fs::remove_dir_all(&out).map_err(|e| format!("cannot replace {}: {e}", out.display()))?;
    }
    // The stripped binaries wait in `staging` (beside the bundle, not in it) until packed.
    let staging = out.with_extension("staging");
    let _ = std::fs::remove_dir_all(&staging);
    let data = out.join("data");
    for dir in [&staging, &data] {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let mut manifest = vec![format!(
        "commit {} built {}",
        git_commit(&root),
        String::from_utf8_lossy(
            &Command::new("date")
                .arg("-u")
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default()
        )
        .trim()
    )];
    for build in &BUILDS {
        eprintln!("gpu-bundle: building {} ...", build.what);
        let artifacts = cargo_build(&root, build)?;
        for (_, target, name) in build.targets {
            let exe = artifacts
                .iter()
                .find(|(t, _)| t == target)
                .map(|(_, p)| p.clone())
                .ok_or_else(|| format!("cargo built no `{target}` executable"))?;
            let size = strip(&exe, &staging.join(name))?;
            manifest.push(format!("bin/{name}: {size} bytes stripped, built with {}", build.what));
        }
    }
    eprintln!("gpu-bundle: packing (xz, one solid archive; minutes) ...");
    let archive = out.join("bin.tar.xz");
    let size = pack(&staging, &archive)?;
    std::fs::remove_dir_all(&staging).map_err(|e| format!("cannot remove {}: {e}", staging.display()))?;
    manifest.push(format!(
        "bin.tar.xz: {size} bytes (the binaries above, unpacked into bin/ by run.sh)"
    ));
    let text = root.join("examples/data/tinyshakespeare.txt");
    std::fs::copy(&text, data.join("tinyshakespeare.txt"))
        .map_err(|e| format!("cannot copy {}: {e}", text.display()))?;
    let run_sh = out.join("run.sh");
    std::fs::write(&run_sh, RUN_SH).map_err(|e| format!("cannot write {}: {e}", run_sh.display()))?;
    crate::setup::set_executable(&run_sh)?;
    std::fs::write(out.join("MANIFEST.txt"), manifest.join("\n") + "\n")
        .map_err(|e| format!("cannot write the manifest: {e}"))?;
    let total = folder_bytes(&out)?;
    println!("{}", manifest.join("\n"));
    println!(
        "gpu-bundle: {} ({:.1} MiB of {:.0} MiB). On a GPU machine: {}/run.sh RESULTS_DIR",
        out.display(),
        total as f64 / 1048576.0,
        MAX_BUNDLE_BYTES as f64 / 1048576.0,
        out.display()
    );
    if total > MAX_BUNDLE_BYTES {
        return Err(format!(
            "the bundle is {total} bytes, over its limit of {MAX_BUNDLE_BYTES}: what travels to a GPU machine is capped at 64 MiB"
        ));
    }
    Ok(())
}

/// Builds `build`'s targets in release and returns (target name, executable) of each.
fn cargo_build(root: &Path, build: &Build) -> Result<Vec<(String, PathBuf)>, String> {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(root)
        .args(["build", "--release", "--no-default-features"])
        .args(build.packages.iter().flat_map(|p| ["-p", p]))
        .args(["--features", build.features, "--message-format=json-render-diagnostics"])
        .args(build.targets.iter().map(|(selection, _, _)| *selection))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let out = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("cargo build failed for {} (errors above)", build.what));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact")
        .filter_map(|v| {
            Some((
                v["target"]["name"].as_str()?.to_string(),
                PathBuf::from(v["executable"].as_str()?),
            ))
        })
        .collect())
}

/// Strips `exe` into `dest`; returns the stripped bytes.
fn strip(exe: &Path, dest: &Path) -> Result<u64, String> {
    let status = Command::new("strip")
        .arg("--strip-all")
        .arg(exe)
        .arg("-o")
        .arg(dest)
        .status()
        .map_err(|e| format!("cannot run strip: {e}"))?;
    if !status.success() {
        return Err(format!("strip failed on {}", exe.display()));
    }
    std::fs::metadata(dest).map(|m| m.len()).map_err(|e| e.to_string())
}

/// Packs the files of `dir` into the solid archive `archive` (`tar | xz`, one thread: xz's
/// threads would cut the input into blocks that share nothing); returns its bytes. xz's
/// dictionary is the smallest power of two in MiB that holds all the files, so that what one
/// binary shares with another is stored once; compressing takes about 10 times that in memory,
/// unpacking that much (512 MiB for the 480 MiB of binaries measured on 2026-12-03).
fn pack(dir: &Path, archive: &Path) -> Result<u64, String> {
    let mib = folder_bytes(dir)?.div_ceil(1 << 20).max(1).next_power_of_two();
    let dict = format!("--lzma2=preset=9,dict={mib}MiB");
    let file = std::fs::File::create(archive).map_err(|e| format!("cannot create {}: {e}", archive.display()))?;
    let mut tar = Command::new("tar")
        .arg("-cf")
        .arg("-")
        .arg("-C")
        .arg(dir)
        .arg(".")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run tar: {e}"))?;
    let tar_out = tar.stdout.take().expect("piped");
    let xz = Command::new("xz")
        .args(["-T1", "-c", &dict])
        .stdin(tar_out)
        .stdout(file)
        .status()
        .map_err(|e| format!("cannot run xz: {e}"))?;
    let tar = tar.wait().map_err(|e| format!("tar: {e}"))?;
    if !tar.success() || !xz.success() {
        return Err(format!("packing {} failed (tar {tar}, xz {xz})", dir.display()));
    }
    std::fs::metadata(archive).map(|m| m.len()).map_err(|e| e.to_string())
}

fn folder_bytes(dir: &Path) -> Result<u64, String> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| e.to_string())?;
        let meta = entry.metadata().map_err(|e| e.to_string())?;
        total += if meta.is_dir() {
            folder_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

fn git_commit(root: &Path) -> String {
    Command::new("git")
        .current_dir(root)
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}
