//! `ShardConfig` as a Burn `Config`: nested in a user's `#[derive(Config)]` training config,
//! saved to `config.json` and loaded back unchanged, for every stage and every kind of
//! `max_grad_norm` (none, a number, `f32::INFINITY`); fields left out take their defaults; bad
//! values are errors naming the field.

use burn::config::Config;
use burn_shard::{LossScaler, NvmeOffload, ShardConfig, Stage};

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
                .with_loss_scaler(LossScaler::dynamic());
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

/// `nvme_offload_params` round-trips with its I/O settings, and a directory alone (as configs
/// saved before those settings existed hold it) reads as `NvmeOffload::new(dir)`.
#[test]
fn nvme_offload_params_reads_its_settings_or_a_directory_alone() {
    let nvme = NvmeOffload::new("/nvme/swap").with_io_threads(3).with_max_in_flight(7);
    let config = ShardConfig::new(Stage::Three).with_nvme_offload_params(nvme.clone());
    let json = serde_json::to_string(&config).unwrap();
    let loaded: ShardConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(loaded.nvme_offload_params, Some(nvme));
    let old: ShardConfig = serde_json::from_str("{\"stage\": 3, \"nvme_offload_params\": \"/nvme/swap\"}").unwrap();
    assert_eq!(old.nvme_offload_params, Some(NvmeOffload::new("/nvme/swap")));
    let none: ShardConfig = serde_json::from_str("{\"stage\": 3, \"nvme_offload_params\": null}").unwrap();
    assert_eq!(none.nvme_offload_params, None);
}

/// The mesh of hybrid sharding round-trips, with its layout as a word.
#[test]
fn the_mesh_round_trips_with_its_layout_named() {
    let config = ShardConfig::new(Stage::Three)
        .with_replicas(4)
        .with_mesh_layout(burn_shard::MeshLayout::Interleaved);
    let json = serde_json::to_value(&config).unwrap();
    assert_eq!(
        (&json["replicas"], &json["mesh_layout"]),
        (&serde_json::json!(4), &serde_json::json!("interleaved"))
    );
    let loaded: ShardConfig = serde_json::from_value(json).unwrap();
    assert_eq!(loaded, config);
    let flat: ShardConfig = serde_json::from_str("{\"stage\": 2}").unwrap();
    assert_eq!(
        (flat.replicas, flat.mesh_layout),
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
