//! The code's shape, checked so it stays as `docs/ARCHITECTURE.md` describes it: the core crate's
//! layers import only downward, its modules import each other without cycles, and the
//! architecture document names every source file of the workspace and no file that is gone.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The repository's root (this package lives in `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every `.rs` file below `dir`, as paths relative to `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(base, &path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.strip_prefix(base).unwrap().to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// The layers of `crates/burn-shard/src`, bottom first: the first path component of a file
/// (folder or file stem) names its layer, and a file may import (`crate::x`) only from its
/// own layer or one listed before it. `bucket` and `fsdp` are the public pages that re-export
/// what users name.
const CORE_LAYERS: &[&[&str]] = &[
    &["error"],
    &["run"],
    &["stage"],
    &["backend"],
    &["model"],
    &["optim"],
    &["overlap"],
    &["hooks"],
    &["step"],
    &["checkpoint"],
    &["config"],
    &["estimate"],
    &["bucket", "fsdp"],
    &["lib"],
];

fn layer_of(component: &str) -> Option<usize> {
    CORE_LAYERS.iter().position(|layer| layer.contains(&component))
}

/// The code of a Rust file without its comments (doc links may point anywhere).
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.split("//").next().unwrap_or("")))
        .filter(|(_, code)| !code.trim().is_empty())
}

/// Every `crate::name` a line of code names.
fn crate_paths(code: &str) -> Vec<&str> {
    code.match_indices("crate::")
        .filter(|(at, _)| !code[..*at].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        .map(|(at, m)| {
            let rest = &code[at + m.len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

#[test]
fn core_layers_import_only_downward() {
    let src = root().join("crates/burn-shard/src");
    let mut upward = Vec::new();
    for file in rust_files(&src) {
        let component = file.split('/').next().unwrap().trim_end_matches(".rs");
        let Some(own) = layer_of(component) else {
            upward.push(format!(
                "{file}: its layer `{component}` is not in CORE_LAYERS (add it where it belongs)"
            ));
            continue;
        };
        let text = fs::read_to_string(src.join(&file)).unwrap();
        for (line, code) in code_lines(&text) {
            for name in crate_paths(code) {
                let target = match layer_of(name) {
                    Some(target) => target,
                    // `crate::ShardError` and the like: root re-exports hide the layer.
                    None if name.starts_with(char::is_uppercase) && component != "lib" => {
                        upward.push(format!(
                            "{file}:{line}: `crate::{name}` goes through the root re-export; import it from its module"
                        ));
                        continue;
                    }
                    None => continue,
                };
                if target > own {
                    upward.push(format!(
                        "{file}:{line}: layer `{component}` imports `crate::{name}`, a layer above it"
                    ));
                }
            }
        }
    }
    assert!(
        upward.is_empty(),
        "upward imports in burn-shard:\n{}",
        upward.join("\n")
    );
}

/// The module a source file of `crates/burn-shard/src` defines (`overlap/mod.rs` ->
/// `overlap`, `step/optimizer.rs` -> `step::optimizer`).
fn module_of(file: &str) -> String {
    let stem = file.trim_end_matches(".rs");
    stem.trim_end_matches("/mod").replace('/', "::")
}

/// The modules of `modules` that a line of code in `module` names, through `crate::a::b::..`
/// (the longest prefix that is a module) or `super::x`.
fn named_modules(code: &str, module: &str, modules: &BTreeSet<String>) -> Vec<String> {
    let mut named = Vec::new();
    let path_at = |rest: &str| -> Vec<String> {
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        rest[..end]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    for (at, m) in code.match_indices("crate::") {
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let parts = path_at(&code[at + m.len()..]);
        if let Some(target) = (1..=parts.len())
            .rev()
            .map(|k| parts[..k].join("::"))
            .find(|p| modules.contains(p))
        {
            named.push(target);
        }
    }
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    for (at, m) in code.match_indices("super::") {
        let parts = path_at(&code[at + m.len()..]);
        if let Some(first) = parts.first() {
            let target = if parent.is_empty() {
                first.clone()
            } else {
                format!("{parent}::{first}")
            };
            if modules.contains(&target) {
                named.push(target);
            }
        }
    }
    named.retain(|t| t != module);
    named
}

/// No two modules of burn-shard import each other, directly or through others: each file's
/// place in the layers says what it may use, and a loop would make two files one concern.
#[test]
fn core_modules_import_without_cycles() {
    let src = root().join("crates/burn-shard/src");
    let files = rust_files(&src);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = module_of(file);
        let text = fs::read_to_string(src.join(file)).unwrap();
        let targets = edges.entry(module.clone()).or_default();
        for (_, code) in code_lines(&text) {
            targets.extend(named_modules(code, &module, &modules));
        }
    }
    // A module is on a cycle when it reaches itself; report each cycle's path once.
    let mut cycles = BTreeSet::new();
    for start in &modules {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((at, path)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let mut cycle = path.clone();
                    let first = cycle.iter().enumerate().min_by_key(|(_, m)| m.as_str()).unwrap().0;
                    cycle.rotate_left(first);
                    cycles.insert(cycle.join(" -> "));
                } else if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    assert!(modules.contains("step::optimizer") && edges["step::optimizer"].contains("step::stage_plan"));
    assert!(
        cycles.is_empty(),
        "import cycles in burn-shard:\n{}",
        cycles.into_iter().collect::<Vec<_>>().join("\n")
    );
}

/// The folders whose `.rs` files `docs/ARCHITECTURE.md` must name: each under a heading
/// `### <folder>` as a list item that starts with the file's path relative to the folder in
/// backticks.
fn documented_folders() -> Vec<String> {
    let mut folders: Vec<String> = fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| format!("crates/{}/src", e.unwrap().file_name().to_string_lossy()))
        .collect();
    folders.extend(
        [
            "examples/src",
            "examples/shakespeare",
            "examples/finetune_minilm",
            "examples/finetune_stories",
        ]
        .map(String::from),
    );
    folders.extend(["xtask/src", "tests/suite"].map(String::from));
    folders.retain(|f| root().join(f).is_dir());
    folders.sort();
    folders
}

/// The file paths listed under `### <folder>` in the architecture document.
fn listed_files(doc: &str, folder: &str) -> Option<BTreeSet<String>> {
    let heading = format!("### `{folder}`");
    let start = doc.lines().position(|l| l.trim() == heading)?;
    Some(
        doc.lines()
            .skip(start + 1)
            .take_while(|l| !l.starts_with('#'))
            .filter_map(|l| l.trim_start().strip_prefix("- `"))
            .filter_map(|l| l.split('`').next())
            .flat_map(|item| item.split(", ").map(str::to_string).collect::<Vec<_>>())
            .collect(),
    )
}

#[test]
fn architecture_doc_names_every_source_file() {
    let doc = fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    let mut wrong = Vec::new();
    for folder in documented_folders() {
        let Some(listed) = listed_files(&doc, &folder) else {
            wrong.push(format!("no section `### `{folder}`` in docs/ARCHITECTURE.md"));
            continue;
        };
        let present: BTreeSet<String> = rust_files(&root().join(&folder)).into_iter().collect();
        for missing in present.difference(&listed) {
            wrong.push(format!("{folder}/{missing} is not described in docs/ARCHITECTURE.md"));
        }
        for gone in listed.difference(&present) {
            wrong.push(format!(
                "docs/ARCHITECTURE.md describes {folder}/{gone}, which does not exist"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/ARCHITECTURE.md is out of date:\n{}",
        wrong.join("\n")
    );
}
