//! What a checkpoint directory holds over time: `list` and `keep_last`, the one rule of what
//! counts as a checkpoint (a `.partial` directory with its marker does not), lineages and
//! rollbacks (abandoned checkpoints set aside), and what failed and crashed saves leave.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_shard::checkpoint::inspect;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::checkpoint::LR;
use crate::common::{params_of, scratch, sharded_step};

/// `list` orders checkpoints by the step that ends their names (not as text) and skips
/// incomplete ones; `keep_last` removes the oldest complete ones only.
#[test]
fn keep_last_removes_the_oldest_complete_checkpoints_only() {
    use burn_shard::checkpoint::{keep_last, list};
    let root = scratch("checkpoint-tests", "keep-last");
    for name in ["step-9", "step-100", "step-10", "step-1000000"] {
        std::fs::create_dir_all(root.join(name)).unwrap();
        std::fs::write(root.join(name).join("COMPLETE"), b"").unwrap();
    }
    std::fs::create_dir_all(root.join("step-5000000.partial")).unwrap();
    // A save killed between its COMPLETE marker and the rename: still not a checkpoint.
    std::fs::create_dir_all(root.join("step-6000000.partial")).unwrap();
    std::fs::write(root.join("step-6000000.partial").join("COMPLETE"), b"").unwrap();
    let names = |dirs: Vec<PathBuf>| -> Vec<String> {
        dirs.iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().to_string())
            .collect()
    };
    assert_eq!(
        names(list(&root).unwrap()),
        ["step-9", "step-10", "step-100", "step-1000000"]
    );
    assert_eq!(names(keep_last(&root, 2).unwrap()), ["step-9", "step-10"]);
    assert_eq!(names(list(&root).unwrap()), ["step-100", "step-1000000"]);
    assert!(
        root.join("step-5000000.partial").exists() && root.join("step-6000000.partial").exists(),
        "an unfinished save is not touched, with or without its COMPLETE marker"
    );
}

/// The input (`step-9`, `step-10`, `step-12.partial` holding `COMPLETE`) through every
/// reader that decides "is this a checkpoint": `list`, `newest`, `keep_last`, and a load of the
/// `.partial` directory named directly (`CheckpointMeta::read`, which every load and
/// `inspect` start with).
#[test]
fn a_partial_directory_with_its_marker_is_no_checkpoint_anywhere() {
    use burn_shard::checkpoint::{CheckpointError, CheckpointMeta, keep_last, list, newest};
    let root = scratch("checkpoint-tests", "partial-with-marker");
    for name in ["step-9", "step-10", "step-12.partial"] {
        std::fs::create_dir_all(root.join(name)).unwrap();
        std::fs::write(root.join(name).join("COMPLETE"), b"").unwrap();
        std::fs::write(root.join(name).join("meta.json"), b"{}").unwrap();
    }
    let names = |dirs: Vec<PathBuf>| -> Vec<String> {
        dirs.iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().to_string())
            .collect()
    };
    assert_eq!(names(list(&root).unwrap()), ["step-9", "step-10"]);
    assert_eq!(names(newest(&root).unwrap().into_iter().collect()), ["step-10"]);
    assert_eq!(names(keep_last(&root, 1).unwrap()), ["step-9"]);
    assert!(
        root.join("step-12.partial").join("COMPLETE").exists(),
        "keep_last left it alone"
    );
    let err = CheckpointMeta::read(&root.join("step-12.partial")).unwrap_err();
    assert!(matches!(err, CheckpointError::Incomplete { .. }), "{err}");
    assert!(err.to_string().contains("DIR.partial"), "{err}");

    // No save writes a checkpoint under a name the rule refuses, on any rank.
    let errors = burn_shard_comm::run_ranks(burn_shard_comm::InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, optim) = burn_shard::ShardConfig::new(burn_shard::Stage::One)
            .init(
                crate::common::TinyMlp::new(&device),
                burn::optim::AdamWConfig::new(),
                comm,
            )
            .unwrap();
        optim
            .save_checkpoint(&model, root.join("step-13.partial"), serde_json::json!({}))
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("cannot end in .partial"), "{e}");
    }
}

/// Global batch of the lineage tests: divides by world sizes 1-4.
const TINY_BATCH: usize = 12;

/// One run of `TinyMlp` at `world_size` and `stage`: loads `resume` when given, then for each
/// `(step, dir)` of `saves` takes one step and saves into `dir` with `{"step", "run": tag}`;
/// with `keep`, rank 0 then calls `keep_last` on the directory (as the examples do). Returns
/// rank 0's parameters at the end.
fn tiny_run(
    world_size: usize,
    stage: Stage,
    resume: Option<&Path>,
    saves: &[(usize, PathBuf)],
    tag: &str,
    keep: Option<usize>,
) -> Vec<f32> {
    use crate::common::{IN, OUT, TinyMlp, batch, mse, rank_rows, rows};
    let base = TinyMlp::new(&Device::flex().autodiff());
    let outcomes = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (lo, hi) = rank_rows(comm.rank(), world_size, TINY_BATCH);
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .expect("init");
        if let Some(dir) = resume {
            model = optim.load_checkpoint(model, dir).expect("resume").0;
        }
        for (step, dir) in saves {
            // Each run its own data (a rollback after a loss spike changes something).
            let (x, y) = batch(
                *step + 1000 * tag.len() + tag.bytes().map(usize::from).sum::<usize>(),
                TINY_BATCH,
            );
            let l = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
            model = sharded_step(&mut optim, model, l, LR).0;
            let payload = serde_json::json!({ "step": step, "run": tag });
            optim.save_checkpoint(&model, dir, &payload).expect("the save succeeds");
            if let (Some(keep), 0) = (keep, optim.comm().rank()) {
                burn_shard::checkpoint::keep_last(dir.parent().unwrap(), keep).expect("keep_last");
            }
        }
        params_of(&model.valid().materialize())
    })
    .expect("no rank panics");
    outcomes.into_iter().next().unwrap()
}

/// Loads `dir` at `world_size` and `stage`: rank 0's parameters and the payload.
fn tiny_load(world_size: usize, stage: Stage, dir: &Path) -> (Vec<f32>, serde_json::Value) {
    use crate::common::TinyMlp;
    let base = TinyMlp::new(&Device::flex().autodiff());
    let outcomes = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .expect("init");
        let (model, restored) = optim.load_checkpoint(model, dir).expect("load");
        (params_of(&model.valid().materialize()), restored.payload)
    })
    .expect("no rank panics");
    outcomes.into_iter().next().unwrap()
}

fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:06}"))
}

fn names_of(dirs: &[PathBuf]) -> Vec<String> {
    dirs.iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Copies the directory tree `from` to `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        match entry.file_type().unwrap().is_dir() {
            true => copy_tree(&entry.path(), &to.join(entry.file_name())),
            false => {
                std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
            }
        }
    }
}

/// The `abandoned-*` folders of `root` and the checkpoints in each.
fn abandoned(root: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut found: Vec<(PathBuf, Vec<String>)> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(burn_shard::checkpoint::ABANDONED_PREFIX)
        })
        .map(|p| {
            let mut inside: Vec<String> = std::fs::read_dir(&p)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            inside.sort();
            (p, inside)
        })
        .collect();
    found.sort();
    found
}

/// Every `*.partial` entry under `root` (recursively).
fn partials_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root).unwrap() {
        let path = entry.unwrap().path();
        if path.to_string_lossy().ends_with(".partial") {
            found.push(path.clone());
        }
        if path.is_dir() {
            found.extend(partials_under(&path));
        }
    }
    found
}

/// Issue #30, 1: a rollback into the same save directory. Run A saved steps 4, 8 and 12; run B
/// resumes from step 4 and saves every 4 steps (8 and 12: A's names) or every 3 (6, 9, 12),
/// with `keep_last(2)` after each save, at every world size 1-4 and stage 0-3 (the save path
/// agrees on the move). B's saves succeed; A's steps 8 and 12 are moved into one
/// `abandoned-<run>/` folder, intact; `list` (what `--resume DIR` takes) and `keep_last` follow
/// B's lineage: B's newest loads with B's values and payload; the metadata names the parent.
#[test]
fn a_rollback_sets_the_abandoned_checkpoints_aside_at_every_world_size_and_stage() {
    use burn_shard::checkpoint::{CheckpointMeta, list};
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let case = format!("world size {world_size}, stage {stage}");
            let first = scratch("checkpoint-tests", &format!("rollback-{world_size}-{stage}"));
            let original = first.join("run-a");
            let saves_a: Vec<(usize, PathBuf)> = [4, 8, 12].map(|s| (s, step_dir(&original, s))).to_vec();
            let a_params = tiny_run(world_size, stage, None, &saves_a, "A", Some(3));
            let run_a = |root: &Path, step: usize| {
                CheckpointMeta::read(&step_dir(root, step))
                    .unwrap()
                    .lineage
                    .unwrap()
                    .run
            };
            let a_id = run_a(&original, 8);
            for (every, b_steps) in [(4, vec![8, 12]), (3, vec![6, 9, 12])] {
                let root = first.join(format!("every-{every}"));
                copy_tree(&original, &root);
                let saves_b: Vec<(usize, PathBuf)> = b_steps.iter().map(|&s| (s, step_dir(&root, s))).collect();
                let b_params = tiny_run(world_size, stage, Some(&step_dir(&root, 4)), &saves_b, "B", Some(2));
                let case = format!("{case}, every {every}");
                // B's lineage only, newest 2 kept.
                let listed = list(&root).unwrap();
                let expected: Vec<String> = b_steps[b_steps.len() - 2..]
                    .iter()
                    .map(|s| format!("step-{s:06}"))
                    .collect();
                assert_eq!(names_of(&listed), expected, "{case}: list");
                for dir in &listed {
                    let lineage = CheckpointMeta::read(dir).unwrap().lineage.unwrap();
                    assert_eq!(lineage.parent.as_deref(), Some("step-000004"), "{case}");
                    assert_ne!(lineage.run, a_id, "{case}: a new run");
                    assert_eq!(lineage.branches.len(), 1, "{case}");
                    assert_eq!(lineage.branches[0].run.as_deref(), Some(a_id.as_str()), "{case}");
                }
                // `--resume DIR` takes B's step 12, with B's values.
                let newest = listed.last().unwrap();
                assert_eq!(newest, &step_dir(&root, 12), "{case}");
                let (loaded, payload) = tiny_load(world_size, stage, newest);
                assert_eq!(payload["run"], "B", "{case}: --resume DIR takes the new run's newest");
                assert_eq!(loaded, b_params, "{case}: its values are B's last");
                assert_ne!(b_params, a_params, "{case}: the runs differ");
                // A's later checkpoints: moved, intact, loadable.
                let aside = abandoned(&root);
                assert_eq!(aside.len(), 1, "{case}: one abandoned folder: {aside:?}");
                assert_eq!(aside[0].1, ["step-000008", "step-000012"], "{case}");
                assert!(inspect(step_dir(&aside[0].0, 12)).unwrap().is_intact(), "{case}");
                assert_eq!(run_a(&aside[0].0, 12), a_id, "{case}");
                let (old, old_payload) = tiny_load(world_size, stage, &step_dir(&aside[0].0, 12));
                assert_eq!(
                    (old, &old_payload["run"]),
                    (a_params.clone(), &serde_json::json!("A")),
                    "{case}"
                );
                assert!(partials_under(&root).is_empty(), "{case}");
            }
        }
    }
}

/// Old checkpoints (no lineage in meta.json) still load, and a rollback among them sets the
/// later ones aside too. A fresh run moves nothing; `list` and `keep_last` then follow the
/// newest checkpoint's lineage and never remove another lineage's.
#[test]
fn checkpoints_without_a_lineage_load_and_roll_back_and_keep_last_keeps_other_lineages() {
    use burn_shard::checkpoint::{keep_last, list};
    let root = scratch("checkpoint-tests", "legacy");
    let saves: Vec<(usize, PathBuf)> = [4, 8, 12].map(|s| (s, step_dir(&root, s))).to_vec();
    tiny_run(2, Stage::Two, None, &saves, "A", None);
    // As written before lineages existed: no `lineage` key (meta.json is not in the digests).
    for (_, dir) in &saves {
        let path = dir.join("meta.json");
        let mut meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        meta.as_object_mut()
            .unwrap()
            .remove("lineage")
            .expect("a lineage was written");
        std::fs::write(&path, serde_json::to_string_pretty(&meta).unwrap()).unwrap();
    }
    assert_eq!(tiny_load(2, Stage::Two, &step_dir(&root, 12)).1["step"], 12);
    assert_eq!(
        names_of(&list(&root).unwrap()),
        ["step-000004", "step-000008", "step-000012"]
    );
    tiny_run(
        2,
        Stage::Two,
        Some(&step_dir(&root, 4)),
        &[(6, step_dir(&root, 6))],
        "B",
        None,
    );
    assert_eq!(names_of(&list(&root).unwrap()), ["step-000004", "step-000006"]);
    assert_eq!(abandoned(&root)[0].1, ["step-000008", "step-000012"]);

    // A fresh run saving into a directory of another run's checkpoints moves nothing; its
    // checkpoint sorts first, so the newest lineage is the other run's: keep_last never
    // removes the fresh run's checkpoint.
    let mixed = scratch("checkpoint-tests", "other-lineage");
    let saves: Vec<(usize, PathBuf)> = [8, 12].map(|s| (s, step_dir(&mixed, s))).to_vec();
    tiny_run(1, Stage::Zero, None, &saves, "A", None);
    tiny_run(1, Stage::Zero, None, &[(2, step_dir(&mixed, 2))], "C", None);
    assert_eq!(names_of(&list(&mixed).unwrap()), ["step-000008", "step-000012"]);
    assert_eq!(names_of(&keep_last(&mixed, 1).unwrap()), ["step-000008"]);
    assert!(
        step_dir(&mixed, 2).join("COMPLETE").exists(),
        "another lineage is never removed"
    );
    assert!(abandoned(&mixed).is_empty());
}

/// Issue #30, 2: a save that fails on one rank (a file where its directory should be, or a
/// model that is not the one `init` returned) fails on every rank and leaves no `*.partial`
/// behind, at every world size and stage; the group then saves there fine.
#[test]
fn a_failed_save_leaves_no_partial_directory_at_any_world_size() {
    use crate::common::TinyMlp;
    let base = TinyMlp::new(&Device::flex().autodiff());
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let root = scratch("checkpoint-tests", &format!("failed-save-{world_size}-{stage}"));
            let blocker = root.join("blocker");
            std::fs::write(&blocker, b"a file where a directory should be").unwrap();
            let target = step_dir(&root, 1);
            let last = world_size - 1;
            let outcomes = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let rank = comm.rank();
                let device = Device::flex().autodiff();
                let (model, optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("init");
                let payload = serde_json::Value::Null;
                // The last rank cannot write its file: its directory is a file.
                let dir = match rank == last {
                    true => blocker.join("step-000001"),
                    false => target.clone(),
                };
                let io = optim
                    .save_checkpoint(&model, &dir, &payload)
                    .expect_err("io")
                    .to_string();
                // Rank 0 (which writes at every stage) saves a model that is not the one init
                // returned.
                let stranger = TinyMlp::new(&device);
                let saved = match rank == 0 {
                    true => optim.save_checkpoint(&stranger, &target, &payload),
                    false => optim.save_checkpoint(&model, &target, &payload),
                };
                let unknown = saved.expect_err("unknown model").to_string();
                let leftovers = partials_under(&root);
                // The group saves fine afterwards.
                optim
                    .save_checkpoint(&model, &target, &payload)
                    .expect("the save succeeds");
                (io, unknown, leftovers)
            })
            .expect("no rank panics");
            for (rank, (io, unknown, leftovers)) in outcomes.into_iter().enumerate() {
                let case = format!("world size {world_size}, stage {stage}, rank {rank}");
                match rank == last {
                    true => assert!(io.contains("blocker"), "{case}: {io}"),
                    false => assert!(io.contains(&format!("rank(s) [{last}] failed")), "{case}: {io}"),
                }
                match rank {
                    0 => assert!(unknown.contains("l1") || unknown.contains("scale"), "{case}: {unknown}"),
                    _ => assert!(unknown.contains("rank(s) [0] failed"), "{case}: {unknown}"),
                }
                assert!(leftovers.is_empty(), "{case}: {leftovers:?}");
            }
            assert!(inspect(&target).unwrap().is_intact());
            assert!(partials_under(&root).is_empty());
        }
    }
}

/// A `*.partial` left by a crashed process (a save's files only) is removed by the next save
/// into its directory; a `*.partial` holding anything else is left alone.
#[test]
fn a_save_removes_what_a_crashed_save_left() {
    let root = scratch("checkpoint-tests", "crashed");
    let crashed = root.join("step-000002.partial");
    std::fs::create_dir_all(&crashed).unwrap();
    for (name, bytes) in [
        ("rank-0.bpk", &b"half a file"[..]),
        ("rank-0.sha256", b"00 11"),
        ("rank-1.bpk.4242-0.tmp", b"half"),
        ("meta.tmp", b"{"),
    ] {
        std::fs::write(crashed.join(name), bytes).unwrap();
    }
    let empty = root.join("step-000003.partial");
    std::fs::create_dir_all(&empty).unwrap();
    let foreign = root.join("notes.partial");
    std::fs::create_dir_all(foreign.join("drafts")).unwrap();
    tiny_run(2, Stage::Three, None, &[(4, step_dir(&root, 4))], "A", None);
    assert!(
        !crashed.exists() && !empty.exists(),
        "the crashed saves' leftovers are removed"
    );
    assert!(
        foreign.join("drafts").exists(),
        "a directory that is not a save's is left alone"
    );
    assert!(inspect(step_dir(&root, 4)).unwrap().is_intact());
}
