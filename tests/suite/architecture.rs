//! The code's shape, checked so it stays as `docs/ARCHITECTURE.md` describes it: the core crate's
//! layers import only downward, its modules (and the kernels crate's) import each other without
//! cycles, and the architecture document names every source file of the workspace and no file
//! that is gone.

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
    &["swap"],
    &["overlap"],
    &["fsdp"],
    &["bucket"],
    &["checkpoint"],
    &["step"],
    &["sharded_optimizer"],
    &["config"],
    &["init"],
    &["estimate"],
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

/// The first segment of every `crate::` path a line of code names (each member of a use tree:
/// `crate::{a::X, b}` names `a` and `b`).
fn crate_paths(code: &str) -> Vec<String> {
    code.match_indices("crate::")
        .filter(|(at, _)| !code[..*at].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        .flat_map(|(at, m)| use_tree_paths(&code[at + m.len()..]))
        .filter_map(|path| path.into_iter().next())
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
                let target = match layer_of(&name) {
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

/// The module a source file of a crate's `src` defines (`overlap/mod.rs` -> `overlap`,
/// `step/optimizer.rs` -> `step::optimizer`).
fn module_of(file: &str) -> String {
    let stem = file.trim_end_matches(".rs");
    stem.trim_end_matches("/mod").replace('/', "::")
}

/// The paths of a use tree starting at `text` (`a::b`, `a::{b, c::d as e}`, `a::*`, nested),
/// as segments (`*` kept as one); ends at the first character that cannot continue it.
fn use_tree_paths(text: &str) -> Vec<Vec<String>> {
    fn tree(chars: &[char], at: &mut usize) -> Vec<Vec<String>> {
        let skip = |at: &mut usize| {
            while *at < chars.len() && chars[*at].is_whitespace() {
                *at += 1;
            }
        };
        let mut prefix = Vec::new();
        loop {
            skip(at);
            match chars.get(*at) {
                Some('{') => {
                    *at += 1;
                    let mut paths = Vec::new();
                    loop {
                        skip(at);
                        match chars.get(*at) {
                            Some('}') | None => {
                                *at += 1;
                                break;
                            }
                            Some(',') => *at += 1,
                            // `b as c`: a rename, not another path.
                            Some('a')
                                if chars.get(*at + 1) == Some(&'s')
                                    && chars.get(*at + 2).is_some_and(|c| c.is_whitespace()) =>
                            {
                                *at += 2;
                                skip(at);
                                while *at < chars.len() && (chars[*at].is_alphanumeric() || chars[*at] == '_') {
                                    *at += 1;
                                }
                            }
                            _ => paths.extend(tree(chars, at).into_iter().map(|p| [prefix.clone(), p].concat())),
                        }
                    }
                    return paths;
                }
                Some('*') => {
                    *at += 1;
                    prefix.push("*".to_string());
                    return vec![prefix];
                }
                Some(c) if c.is_alphanumeric() || *c == '_' => {
                    let start = *at;
                    while *at < chars.len() && (chars[*at].is_alphanumeric() || chars[*at] == '_') {
                        *at += 1;
                    }
                    prefix.push(chars[start..*at].iter().collect());
                    if chars.get(*at..*at + 2) == Some(&[':', ':']) {
                        *at += 2;
                        continue;
                    }
                    return vec![prefix];
                }
                _ => return if prefix.is_empty() { Vec::new() } else { vec![prefix] },
            }
        }
    }
    let chars: Vec<char> = text.chars().collect();
    tree(&chars, &mut 0)
}

/// The modules that the code of `module` (comments removed, lines joined) names: each
/// `crate::` or `super::` path (use trees included) goes to the longest module it starts with,
/// or, naming an item of a module with no submodule in the path, to that module itself (the
/// crate root is `lib`); `mod x;` names the child `x`. Glob imports (`super::*`, the convention
/// of inline test modules) are left out.
fn named_modules(code: &str, module: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let parent: Vec<String> = match module.rsplit_once("::") {
        Some((p, _)) => p.split("::").map(str::to_string).collect(),
        None => Vec::new(),
    };
    let own: Vec<String> = if module == "lib" {
        Vec::new()
    } else {
        module.split("::").map(str::to_string).collect()
    };
    let name = |segments: &[String]| {
        if segments.is_empty() {
            "lib".to_string()
        } else {
            segments.join("::")
        }
    };
    let mut named = BTreeSet::new();
    for (keyword, base) in [("crate::", Vec::new()), ("super::", parent)] {
        for (at, m) in code.match_indices(keyword) {
            if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            for path in use_tree_paths(&code[at + m.len()..]) {
                if path.last().is_some_and(|s| s == "*") {
                    continue;
                }
                let full = [base.clone(), path].concat();
                let target = (base.len() + 1..=full.len())
                    .rev()
                    .map(|k| name(&full[..k]))
                    .find(|p| modules.contains(p))
                    .unwrap_or_else(|| name(&base));
                named.insert(target);
            }
        }
    }
    // `mod x;` declares (and so depends on) the child `x`.
    for (at, _) in code.match_indices("mod ") {
        if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + 4..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if rest[end..].trim_start().starts_with(';') {
            let child = name(&[own.clone(), vec![rest[..end].to_string()]].concat());
            if modules.contains(&child) {
                named.insert(child);
            }
        }
    }
    named.remove(module);
    named
}

/// The import graph of the crate whose sources are below `src`: every module (`module_of`) and
/// the modules its code names (`named_modules`).
fn import_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = rust_files(src);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let mut edges = BTreeMap::new();
    for file in &files {
        let module = module_of(file);
        let text = fs::read_to_string(src.join(file)).unwrap();
        let code: Vec<&str> = code_lines(&text).map(|(_, code)| code).collect();
        edges.insert(module.clone(), named_modules(&code.join(" "), &module, &modules));
    }
    edges
}

/// The cycles of an import graph: a module is on one when it reaches itself. Each cycle is
/// reported once, as its path (`a -> b -> c`) from its alphabetically first module.
fn import_cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    let mut cycles = BTreeSet::new();
    for start in edges.keys() {
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
    cycles
}

/// Fails naming every import cycle of `edges` (the modules of crate `name`).
fn assert_acyclic(edges: &BTreeMap<String, BTreeSet<String>>, name: &str) {
    let cycles = import_cycles(edges);
    assert!(
        cycles.is_empty(),
        "import cycles in {name}:\n{}",
        cycles.into_iter().collect::<Vec<_>>().join("\n")
    );
}

/// No two modules of burn-shard import each other, directly or through others: each file's
/// place in the layers says what it may use, and a loop would make two files one concern.
#[test]
fn core_modules_import_without_cycles() {
    let edges = import_graph(&root().join("crates/burn-shard/src"));
    // The reader sees what it must: a use tree's members, a parent's items, `mod` declarations.
    assert!(edges["sharded_optimizer::optimizer"].contains("step::stage_plan"));
    assert!(edges["sharded_optimizer::save"].contains("checkpoint::format"));
    assert!(edges["checkpoint"].contains("checkpoint::reshard") && edges["lib"].contains("checkpoint"));
    assert_acyclic(&edges, "burn-shard");
}

/// The modules of burn-shard-kernels import each other without cycles either: `FusedAdam`'s
/// type lives in `fused_adam.rs`, which the step paths (`flex`, `cube`, `path`) and the
/// optimizer import, instead of its methods spread over files that import one another.
#[test]
fn kernels_modules_import_without_cycles() {
    let edges = import_graph(&root().join("crates/burn-shard-kernels/src"));
    // The reader sees the crate's edges: the dispatch, a path, and the root's `mod` declarations.
    assert!(edges["optimizer"].contains("path") && edges["path"].contains("cube"));
    assert!(edges["cube"].contains("fused_adam") && edges["lib"].contains("cube"));
    assert_acyclic(&edges, "burn-shard-kernels");
}

/// No crate of the workspace has modules that import each other, directly or through others
/// (the two tests above also check what the reader sees in the core and the kernels). The
/// crate root is left out of the graph here: it declares every module and re-exports their
/// items, which the modules then import as `crate::Item`, so every module reaches it; the loops
/// refused are those between the modules themselves (`agent` and `restart`, `env` and `token`
/// were two).
#[test]
fn every_crates_modules_import_without_cycles() {
    let mut sources = vec![root().join("examples/src"), root().join("xtask/src")];
    for entry in fs::read_dir(root().join("crates")).unwrap() {
        sources.push(entry.unwrap().path().join("src"));
    }
    for src in sources {
        let name = src.strip_prefix(root()).unwrap().display().to_string();
        let mut edges = import_graph(&src);
        let roots = ["lib", "main"];
        edges.retain(|module, _| !roots.contains(&module.as_str()));
        edges
            .values_mut()
            .for_each(|to| to.retain(|m| !roots.contains(&m.as_str())));
        assert_acyclic(&edges, &name);
    }
}

/// The folders whose `.rs` files `docs/ARCHITECTURE.md` must name: each under a heading
/// `### <folder>` as a list item that starts with the file's path relative to the folder in
/// backticks.
fn documented_folders() -> Vec<String> {
    let mut folders: Vec<String> = fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| format!("crates/{}/src", e.unwrap().file_name().to_string_lossy()))
        .collect();
    // Every example program: a folder of `examples/` with a `main.rs`.
    folders.extend(fs::read_dir(root().join("examples")).unwrap().filter_map(|e| {
        let e = e.unwrap();
        e.path()
            .join("main.rs")
            .is_file()
            .then(|| format!("examples/{}", e.file_name().to_string_lossy()))
    }));
    folders.push("examples/src".to_string());
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

/// Every stage decision of the core goes through `StagePlan` (`step/stage_plan.rs`), as every
/// upward import is refused above: no file names a stage in the layers that run the step (they
/// ask the plan a question instead: `owned_range`, `params().shards_parameters()`, ...), and
/// stage 3's context (`FsdpContext`) is named only inside `fsdp/`, by the init that shards a
/// model (`init/stage3.rs`) and by the plan that holds it: the rest reaches stage 3 through the
/// `ParamHolding` trait (`fsdp/holding.rs`).
#[test]
fn stage_decisions_go_through_the_stage_plan() {
    let src = root().join("crates/burn-shard/src");
    let variants = ["Zero", "One", "Two", "Three"];
    let mut branches = Vec::new();
    for file in rust_files(&src) {
        if file == "step/stage_plan.rs" {
            continue;
        }
        let runs_the_step = [
            "model/",
            "optim/",
            "swap/",
            "overlap/",
            "fsdp/",
            "bucket/",
            "step/",
            "sharded_optimizer/",
        ]
        .iter()
        .any(|folder| file.starts_with(folder));
        let text = fs::read_to_string(src.join(&file)).unwrap();
        for (line, code) in code_lines(&text) {
            let mut named: Vec<String> = Vec::new();
            let holds_the_context = file.starts_with("fsdp/") || file == "init/stage3.rs";
            if !holds_the_context && code.contains("FsdpContext") {
                named.push("`FsdpContext` (stage 3's context: ask `plan.params()`)".into());
            }
            for variant in variants {
                if runs_the_step && code.contains(&format!("Stage::{variant}")) {
                    named.push(format!("`Stage::{variant}`"));
                }
            }
            branches.extend(named.into_iter().map(|what| format!("{file}:{line}: {what}")));
        }
    }
    assert!(
        branches.is_empty(),
        "stage branches outside step/stage_plan.rs (add a method to StagePlan and ask it):\n{}",
        branches.join("\n")
    );
}

/// Every Rust snippet of README.md, docs/ and examples/README.md is a doctest (tests/docs.rs
/// includes each of these files): none is marked `ignore`, so none can rot; a snippet that
/// cannot run here in seconds is `no_run` (compiled) and the text just before it says why.
#[test]
fn every_rust_snippet_of_the_docs_is_compiled() {
    let docs_rs = fs::read_to_string(root().join("tests/docs.rs")).unwrap();
    let mut files = vec![root().join("README.md"), root().join("examples/README.md")];
    for entry in fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    for file in files {
        let text = fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(root()).unwrap().to_string_lossy().into_owned();
        let has_rust = text.lines().any(|l| l.trim_start().starts_with("```rust"));
        if has_rust {
            assert!(
                docs_rs.contains(&format!("include_str!(\"../{name}\")")),
                "{name} has Rust snippets but tests/docs.rs does not include it"
            );
        }
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            let fence = line.trim_start();
            assert!(
                !(fence.starts_with("```rust") && fence.contains("ignore")),
                "{name}:{}: a Rust snippet marked `ignore` is never compiled; make it a doctest (hidden `# ` \
                 lines for its setup, `no_run` if it cannot run here)",
                n + 1
            );
            if fence.starts_with("```rust") && fence.contains("no_run") {
                let before = lines[n.saturating_sub(4)..n].join(" ");
                assert!(
                    before.contains("not run"),
                    "{name}:{}: a `no_run` snippet says just before it why it is compiled but not run",
                    n + 1
                );
            }
        }
    }
}
