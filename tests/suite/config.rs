//! `ShardConfig` as a Burn `Config`: nested in a user's `#[derive(Config)]` training config,
//! saved to `config.json` and loaded back unchanged, for every stage and every kind of
//! `max_grad_norm` (none, a number, `f32::INFINITY`); fields left out take their defaults; bad
//! values are errors naming the field.

use burn::config::Config;
use burn_shard::{Home, LossScaler, NvmeOffload, ShardConfig, Stage};

use crate::common::scratch;

/// A training config as a Burn user writes one, with the sharding nested in it.
#[derive(Config, Debug)]
pub struct TrainingConfig {
    pub shard: ShardConfig,
    #[config(default = 1e-3)]
    pub lr: f64,
}

#[test]
fn shard_config_nested_in_a_burn_config_round_trips_through_config_json() {
    let dir = scratch("config", "round-trip");
    let stages = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];
    for (i, stage) in stages.into_iter().enumerate() {
        for norm in [None, Some(1.5f32), Some(f32::INFINITY)] {
            let mut shard = ShardConfig::new(stage)
                .with_bucket_numel(1000 + i)
                .with_reshard_after_forward(i % 2 == 0)
                .with_overlap_comm(i % 2 == 1)
                .with_loss_scaler(LossScaler::dynamic())
                .with_optimizer_state_on([Home::Device, Home::Host][i % 2].clone())
                .with_params_on(Home::Disk(
                    NvmeOffload::new(format!("/nvme/{i}")).with_io_threads(i + 1),
                ));
            shard.max_grad_norm = norm;
            let config = TrainingConfig::new(shard.clone()).with_lr(0.5);
            let file = dir.join(format!("stage{stage}-{norm:?}.json"));
            config.save(&file).unwrap();
            let loaded = TrainingConfig::load(&file).unwrap();
            assert_eq!(loaded.shard, shard, "stage {stage}, max_grad_norm {norm:?}");
            assert_eq!(loaded.lr, 0.5);
            let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            assert_eq!(
                json["shard"]["stage"],
                serde_json::json!(stage.number()),
                "a stage is its number"
            );
            if norm == Some(f32::INFINITY) {
                assert_eq!(json["shard"]["max_grad_norm"], serde_json::json!("inf"));
            }
        }
    }
}

/// A `config.json` written before the config was a tree (2026-12-07: every field at the top,
/// three spellings of offload) loads as the tree that says the same: each field where it moved,
/// `offload_params` alone as the shards and the state in host memory (it needed `Offload`
/// then), `nvme_offload_params` with its I/O settings or as a directory alone (the form before
/// those existed), the state's home then only what `nvme_offload` says (the file cannot say
/// whether the optimizer was wrapped: `Flex` ran shards on disk with a plain one).
#[test]
fn configs_saved_before_the_tree_still_load() {
    use burn_shard::{FrozenEntries, MeshLayout};
    let old = serde_json::json!({
        "stage": 3, "bucket_numel": 4096, "reshard_after_forward": false, "max_grad_norm": "inf",
        "loss_scaler": null, "overlap_comm": false, "units": ["layers.*", "head"],
        "nvme_offload": {"path": "/nvme/state", "io_threads": 3, "max_in_flight": 5},
        "offload_params": false,
        "nvme_offload_params": {"path": "/nvme/params", "io_threads": 1, "max_in_flight": 7},
        "frozen_entries": "Fingerprinted", "saves_in_flight": 2, "replicas": 2, "mesh_layout": "interleaved"
    });
    let loaded: ShardConfig = serde_json::from_value(old).unwrap();
    let tree = ShardConfig::new(Stage::Three)
        .with_bucket_numel(4096)
        .with_reshard_after_forward(false)
        .with_max_grad_norm(f32::INFINITY)
        .with_overlap_comm(false)
        .with_units(["layers.*", "head"])
        .with_optimizer_state_on(Home::Disk(
            NvmeOffload::new("/nvme/state").with_io_threads(3).with_max_in_flight(5),
        ))
        .with_params_on(Home::Disk(
            NvmeOffload::new("/nvme/params")
                .with_io_threads(1)
                .with_max_in_flight(7),
        ))
        .with_frozen_entries(FrozenEntries::Fingerprinted)
        .with_saves_in_flight(2)
        .with_replicas(2)
        .with_mesh_layout(MeshLayout::Interleaved);
    assert_eq!(loaded, tree);
    // And written back as the tree, which reads as itself.
    let again: ShardConfig = serde_json::from_value(serde_json::to_value(&loaded).unwrap()).unwrap();
    assert_eq!(again, tree);

    let host: ShardConfig = serde_json::from_str("{\"stage\": 3, \"offload_params\": true}").unwrap();
    assert_eq!(
        host,
        ShardConfig::new(Stage::Three)
            .with_optimizer_state_on(Home::Host)
            .with_params_on(Home::Host)
    );
    let path: ShardConfig = serde_json::from_str("{\"stage\": 3, \"nvme_offload_params\": \"/nvme/swap\"}").unwrap();
    assert_eq!(
        path,
        ShardConfig::new(Stage::Three).with_params_on(Home::Disk(NvmeOffload::new("/nvme/swap")))
    );
    let both: ShardConfig =
        serde_json::from_str("{\"stage\": 3, \"offload_params\": true, \"nvme_offload_params\": \"/nvme/swap\"}")
            .unwrap();
    assert_eq!(
        both,
        ShardConfig::new(Stage::Three).with_params_on(Home::Disk(NvmeOffload::new("/nvme/swap")))
    );
    let none: ShardConfig = serde_json::from_str("{\"stage\": 3, \"nvme_offload_params\": null}").unwrap();
    assert_eq!(none, ShardConfig::new(Stage::Three));
}

/// The mesh of hybrid sharding round-trips, with its layout as a word.
#[test]
fn the_mesh_round_trips_with_its_layout_named() {
    let config = ShardConfig::new(Stage::Three)
        .with_replicas(4)
        .with_mesh_layout(burn_shard::MeshLayout::Interleaved);
    let json = serde_json::to_value(&config).unwrap();
    assert_eq!(
        (&json["mesh"]["replicas"], &json["mesh"]["layout"]),
        (&serde_json::json!(4), &serde_json::json!("interleaved"))
    );
    let loaded: ShardConfig = serde_json::from_value(json).unwrap();
    assert_eq!(loaded, config);
    let flat: ShardConfig = serde_json::from_str("{\"stage\": 2}").unwrap();
    assert_eq!(
        (flat.mesh.replicas, flat.mesh.layout),
        (1, burn_shard::MeshLayout::Consecutive)
    );
}

#[test]
fn fields_left_out_take_the_defaults_of_shard_config_new() {
    for stage in 0..=3u8 {
        let loaded: ShardConfig = serde_json::from_str(&format!("{{\"stage\": {stage}}}")).unwrap();
        assert_eq!(loaded, ShardConfig::new(Stage::try_from(stage).unwrap()));
    }
}

#[test]
fn bad_values_are_errors_naming_the_field() {
    let err = serde_json::from_str::<ShardConfig>("{\"stage\": 4}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("stage must be 0, 1, 2 or 3, got 4"), "{err}");
    let err = serde_json::from_str::<ShardConfig>("{\"stage\": 1, \"max_grad_norm\": \"big\"}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("max_grad_norm must be a positive number"), "{err}");
    let err = serde_json::from_str::<ShardConfig>("{\"bucket_numel\": 8}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("stage"), "{err}");
}

/// Ranks whose `ShardConfig`s differ in any field (each field of the config changed on rank 1
/// alone, one at a time) fail `init` together with `ConfigMismatch` naming that field, before any
/// other collective, whatever the field (named by its path in the tree); the NVMe offload
/// directories and I/O settings, which are node-local, may differ. A field added to
/// `ShardConfig` without a case here fails the sweep's coverage check.
#[test]
fn ranks_with_different_configs_fail_init_together_whatever_the_field() {
    use burn::module::Module;
    use burn::optim::AdamWConfig;
    use burn::prelude::Device;
    use burn_shard::comm::{Collective, InProcessGroup, MeshLayout, run_ranks};
    use burn_shard::{FrozenEntries, ShardError};

    use crate::common::TinyMlp;

    let base_config = || ShardConfig::new(Stage::Two);
    let dir = scratch("config", "agreement");
    type Change = (&'static str, Box<dyn Fn(ShardConfig) -> ShardConfig + Sync>);
    let nvme = dir.join("nvme");
    let changes: Vec<Change> = vec![
        ("stage", Box::new(|_| ShardConfig::new(Stage::One))),
        ("bucket_numel", Box::new(|c| c.with_bucket_numel(1000))),
        ("max_grad_norm", Box::new(|c| c.with_max_grad_norm(1.0))),
        ("loss_scaler", Box::new(|c| c.with_loss_scaler(LossScaler::dynamic()))),
        ("overlap_comm", Box::new(|c| c.with_overlap_comm(false))),
        ("placement.optimizer_state", {
            let nvme = nvme.clone();
            Box::new(move |c| c.with_optimizer_state_on(Home::Disk(NvmeOffload::new(&nvme))))
        }),
        ("placement.params", Box::new(|c| c.with_params_on(Home::Host))),
        (
            "stage3.reshard_after_forward",
            Box::new(|c| c.with_reshard_after_forward(false)),
        ),
        ("stage3.units", Box::new(|c| c.with_units(["l1"]))),
        ("mesh.replicas", Box::new(|c| c.with_replicas(2))),
        ("mesh.layout", Box::new(|c| c.with_mesh_layout(MeshLayout::Interleaved))),
        (
            "checkpoint.frozen_entries",
            Box::new(|c| c.with_frozen_entries(FrozenEntries::Fingerprinted)),
        ),
        ("checkpoint.saves_in_flight", Box::new(|c| c.with_saves_in_flight(2))),
    ];
    // Coverage: every leaf of the serialized config (a top-level field, or a field of a nested
    // part; a new part hashed whole shows as its top-level name) is changed by one case.
    let leaves = |c: &ShardConfig| -> Vec<(String, serde_json::Value)> {
        let top = serde_json::to_value(c).unwrap().as_object().unwrap().clone();
        top.into_iter()
            .flat_map(|(name, value)| match value {
                serde_json::Value::Object(part)
                    if ["placement", "stage3", "mesh", "checkpoint"].contains(&name.as_str()) =>
                {
                    part.into_iter()
                        .map(|(leaf, value)| (format!("{name}.{leaf}"), value))
                        .collect::<Vec<_>>()
                }
                value => vec![(name, value)],
            })
            .collect()
    };
    let base_leaves = leaves(&base_config());
    for (key, value) in &base_leaves {
        let covered = changes.iter().any(|(name, change)| {
            name == key
                && leaves(&change(base_config()))
                    .iter()
                    .any(|(k, v)| k == key && v != value)
        });
        assert!(covered, "ShardConfig field `{key}` has no case in this sweep: add one");
    }
    let device = Device::flex().autodiff();
    let model = TinyMlp::new(&device);
    for (name, change) in &changes {
        let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let config = match comm.rank() {
                0 => base_config(),
                _ => change(base_config()),
            };
            config
                .init(model.clone().fork(&Device::flex().autodiff()), AdamWConfig::new(), comm)
                .err()
        })
        .expect("no rank panics");
        for (rank, err) in errors.into_iter().enumerate() {
            let err = err.unwrap_or_else(|| panic!("`{name}` differs, yet rank {rank}'s init succeeded"));
            assert!(
                matches!(&err, ShardError::ConfigMismatch { rank: r, peer, fields }
                    if *r == rank && *peer == 1 - rank && fields == &[name.to_string()]),
                "`{name}` differs: rank {rank}: {err}"
            );
        }
    }
    // Node-local: each rank's own NVMe directories and I/O threads.
    let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let rank = comm.rank();
        let local = dir.join(format!("node-{rank}"));
        for sub in ["state", "params"] {
            std::fs::create_dir_all(local.join(sub)).unwrap();
        }
        let config = ShardConfig::new(Stage::Three)
            .with_optimizer_state_on(Home::Disk(
                NvmeOffload::new(local.join("state")).with_io_threads(1 + rank),
            ))
            .with_params_on(Home::Disk(
                NvmeOffload::new(local.join("params")).with_max_in_flight(2 + rank),
            ));
        config
            .init(model.clone().fork(&Device::flex().autodiff()), AdamWConfig::new(), comm)
            .map(drop)
    })
    .expect("no rank panics");
    for (rank, result) in results.into_iter().enumerate() {
        result.unwrap_or_else(|e| panic!("rank {rank}: node-local NVMe settings must not be refused: {e}"));
    }
}
