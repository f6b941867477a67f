//! `cargo xtask setup`: prepares a Debian/Ubuntu machine for the non-default builds.
//!
//! - Mesa's lavapipe (`mesa-vulkan-drivers`, `libvulkan1`): a Vulkan driver on the CPU, so the
//!   CubeCL kernel tests run through wgpu without a GPU.
//! - CubeCL's LLVM bundle (needed by `cubecl-cuda` and `cubecl-cpu`, so by the `cuda`
//!   feature): CubeCL's build script downloads a prebuilt LLVM from a host that offline machines
//!   cannot reach. Debian's `llvm-22-dev` stands in for it: its files are linked where the
//!   bundler looks, with a wrapper around `llvm-config` that rewrites the one flag the bundler
//!   misreads, and the bundler's "installed" marker. (LLVM 22 in place of the bundled 23.1 is a
//!   mismatch upstream does not support; the CPU and PTX tests are the canary.)
//!
//! - OpenMPI (`libopenmpi-dev`, `openmpi-bin`) and `libclang-dev` (rsmpi's build generates its
//!   bindings with bindgen): the `mpi` feature and `cargo xtask mpi-test`.
//!
//! - all-MiniLM-L6-v2's pretrained weights for the `finetune-minilm` example and its test
//!   (`cargo xtask fetch-minilm`).
//!
//! Every step checks first and says what it did; running it twice changes nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Arguments of `cargo xtask setup`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Skip lavapipe.
    #[arg(long)]
    no_lavapipe: bool,
    /// Skip the LLVM bundle (only needed for the `cuda` feature and CubeCL's CPU runtime).
    #[arg(long)]
    no_llvm: bool,
    /// Skip fetching all-MiniLM-L6-v2 (only needed by the finetune-minilm example).
    #[arg(long)]
    no_minilm: bool,
    /// Skip OpenMPI (only needed for the `mpi` feature).
    #[arg(long)]
    no_mpi: bool,
}

const MPI_PACKAGES: [&str; 3] = ["libopenmpi-dev", "openmpi-bin", "libclang-dev"];

const LLVM_PACKAGES: [&str; 5] = [
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "libxml2-dev",
];
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

pub fn run(args: &Args) -> Result<(), String> {
    if !Path::new("/etc/debian_version").exists() || which("apt-get").is_none() {
        return Err("cargo xtask setup automates Debian/Ubuntu (apt-get). Elsewhere install a Vulkan CPU driver \
                    (Mesa lavapipe) and, for the `cuda` feature, let CubeCL download its LLVM bundle (needs access to github.com)"
            .into());
    }
    if !args.no_lavapipe {
        lavapipe()?;
    }
    if !args.no_llvm {
        llvm_bundle()?;
    }
    if !args.no_mpi {
        mpi()?;
    }
    if !args.no_minilm {
        burn_shard_examples::minilm_weights::fetch(&burn_shard_examples::minilm_weights::default_model_dir())?;
    }
    println!("setup: done");
    Ok(())
}

fn mpi() -> Result<(), String> {
    let headers = Path::new("/usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h").exists() || which("mpicc").is_some();
    if which("mpirun").is_some() && headers && libclang_installed() {
        println!("OpenMPI: already installed");
        return Ok(());
    }
    apt_install(&MPI_PACKAGES)?;
    if which("mpirun").is_none() {
        return Err("openmpi-bin installed but mpirun is not on PATH".into());
    }
    println!("OpenMPI: installed {}", MPI_PACKAGES.join(" "));
    Ok(())
}

/// Whether a libclang that bindgen can load is installed (Debian: `libclang-dev`).
fn libclang_installed() -> bool {
    ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"]
        .iter()
        .any(|dir| {
            std::fs::read_dir(dir)
                .map(|d| {
                    d.flatten()
                        .any(|e| e.file_name().to_string_lossy().starts_with("libclang"))
                })
                .unwrap_or(false)
        })
        || Path::new("/usr/lib/llvm-14/lib/libclang.so").exists()
}

fn lavapipe() -> Result<(), String> {
    if lavapipe_installed() {
        println!("lavapipe: already installed");
        return Ok(());
    }
    apt_install(&["mesa-vulkan-drivers", "libvulkan1"])?;
    if !lavapipe_installed() {
        return Err("mesa-vulkan-drivers installed but no lvp_icd*.json under /usr/share/vulkan/icd.d".into());
    }
    println!("lavapipe: installed mesa-vulkan-drivers and libvulkan1");
    Ok(())
}

fn lavapipe_installed() -> bool {
    std::fs::read_dir("/usr/share/vulkan/icd.d")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("lvp_icd"))
        })
        .unwrap_or(false)
}

/// Where CubeCL's LLVM bundler looks for its LLVM: `<data dir>/tracel/tracel-llvm-<version>`.
fn llvm_bundle_prefix() -> Result<PathBuf, String> {
    let version = bundler_version()?;
    Ok(data_local_dir()?.join("tracel").join(format!("tracel-llvm-{version}")))
}

/// Whether the LLVM that the `cuda` feature builds with is in place (set up by this task, or
/// downloaded by CubeCL's own build where the network allows).
pub(crate) fn llvm_bundle_ready() -> Result<bool, String> {
    let prefix = llvm_bundle_prefix()?;
    Ok(prefix.join(".tracel-llvm-installed").exists() && prefix.join("bin").join("llvm-config").exists())
}

fn llvm_bundle() -> Result<(), String> {
    let prefix = llvm_bundle_prefix()?;
    let marker = prefix.join(".tracel-llvm-installed");
    let config = prefix.join("bin").join("llvm-config");
    if llvm_bundle_ready()? {
        println!("LLVM bundle: already set up at {}", prefix.display());
        return Ok(());
    }
    if !Path::new(LLVM_PREFIX).join("bin/llvm-config").exists() {
        apt_install(&LLVM_PACKAGES)?;
    } else {
        println!("LLVM 22: already installed at {LLVM_PREFIX}");
    }
    let bin = prefix.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("cannot create {}: {e}", bin.display()))?;
    for (name, target) in [("lib", "lib"), ("include", "include")] {
        symlink(&Path::new(LLVM_PREFIX).join(target), &prefix.join(name))?;
    }
    let tools = std::fs::read_dir(Path::new(LLVM_PREFIX).join("bin")).map_err(|e| format!("{LLVM_PREFIX}/bin: {e}"))?;
    for tool in tools.flatten() {
        if tool.file_name() != "llvm-config" {
            symlink(&tool.path(), &bin.join(tool.file_name()))?;
        }
    }
    // Debian's llvm-config prints libz3 as a full path, which the bundler turns into
    // `-llibz3`: rewrite it to `-lz3`.
    let wrapper = format!(
        "#!/bin/sh\n# Written by `cargo xtask setup`: Debian's LLVM 22 standing in for CubeCL's bundle.\n\
         {LLVM_PREFIX}/bin/llvm-config \"$@\" | sed 's#/usr/lib/x86_64-linux-gnu/libz3.so#-lz3#'\n"
    );
    let _ = std::fs::remove_file(&config);
    std::fs::write(&config, wrapper).map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    set_executable(&config)?;
    std::fs::write(&marker, "").map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    println!(
        "LLVM bundle: linked {LLVM_PREFIX} into {} (if an earlier build failed on the bundle, run `cargo clean -p cubecl-llvm`)",
        prefix.display()
    );
    Ok(())
}

/// The `tracel-llvm-bundler` version in Cargo.lock: the folder name the bundler looks for.
fn bundler_version() -> Result<String, String> {
    let lock = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock"))
        .map_err(|e| format!("cannot read Cargo.lock: {e}"))?;
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "name = \"tracel-llvm-bundler\""
            && let Some(v) = lines.next().and_then(|l| l.trim().strip_prefix("version = \""))
        {
            return Ok(v.trim_end_matches('"').to_string());
        }
    }
    Err("Cargo.lock has no tracel-llvm-bundler: nothing to set up for this CubeCL version".into())
}

/// `$XDG_DATA_HOME` or `~/.local/share`, where the bundler (through `dirs::data_local_dir`) looks.
fn data_local_dir() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    let home = std::env::var_os("HOME").ok_or("HOME is not set")?;
    Ok(PathBuf::from(home).join(".local/share"))
}

fn apt_install(packages: &[&str]) -> Result<(), String> {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    let sudo: &[&str] = if root { &[] } else { &["sudo"] };
    if !root && which("sudo").is_none() {
        return Err(format!(
            "installing {packages:?} needs root: run `cargo xtask setup` as root or install sudo"
        ));
    }
    println!("apt-get install {}", packages.join(" "));
    let run = |args: &[&str]| -> Result<(), String> {
        let (cmd, rest) = [sudo, args]
            .concat()
            .split_first()
            .map(|(c, r)| (c.to_string(), r.to_vec()))
            .unwrap();
        let status = Command::new(&cmd)
            .args(&rest)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| format!("cannot run {cmd}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("`{}` failed ({status})", args.join(" ")))
        }
    };
    run(&["apt-get", "update", "-qq"])?;
    let mut install = vec!["apt-get", "install", "-y", "-qq", "--no-install-recommends"];
    install.extend_from_slice(packages);
    run(&install).map_err(|e| {
        format!("{e}: are {packages:?} in your apt sources? (Debian 12 has llvm-22-dev in bookworm-security)")
    })
}

fn symlink(target: &Path, link: &Path) -> Result<(), String> {
    if std::fs::read_link(link).map(|t| t == target).unwrap_or(false) {
        return Ok(());
    }
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link)
        .map_err(|e| format!("cannot link {} -> {}: {e}", link.display(), target.display()))
}

pub(crate) fn set_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("{}: {e}", path.display()))
}

pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
}
