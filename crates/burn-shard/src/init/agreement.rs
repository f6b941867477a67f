//! What every rank checks against the others before `init` syncs a value: the same
//! [`ShardConfig`] (one hash of its fields), then the same layouts, step options and pretrained
//! plan (one fingerprint), so that no rank enters a collective the others do not.

use burn::tensor::Device;
use burn_shard_comm::Collective;
use sha2::{Digest, Sha256};

use crate::config::ShardConfig;
use crate::config::placement::Home;
use crate::error::ShardError;
use crate::model::layout::{FlatLayout, all_gather_u64s, check_same_layout};
use crate::model::pretrained::plan::PretrainedPlan;
use crate::step::agreement::flag_device;
use crate::step::options::StepOptions;
use crate::swap::config::NvmeOffload;

/// The nested parts of [`ShardConfig`] whose fields are hashed one by one (their field sets
/// are fixed, so every rank hashes as many); any other field is hashed whole.
const PARTS: [&str; 4] = ["placement", "stage3", "mesh", "checkpoint"];

/// The hash of each field of `config`, by path (`stage`, `stage3.units`, ...), in path order:
/// the first 8 bytes of the SHA-256 of the field's JSON (serde's, the form `config.json`
/// holds). A [`Home::Disk`] counts as on disk only: where each node keeps its files and how
/// many threads write them may differ between ranks, while whether a state lives on disk
/// changes the collectives (the ranks agree on each disk outcome). A field added to
/// `ShardConfig` is covered without a change here.
pub(crate) fn field_hashes(config: &ShardConfig) -> Vec<(String, u64)> {
    let mut plain = config.clone();
    // Replaced before serializing: a directory need not be UTF-8, which JSON cannot hold.
    for home in [&mut plain.placement.optimizer_state, &mut plain.placement.params] {
        if let Home::Disk(nvme) = home {
            *nvme = NvmeOffload::new("");
        }
    }
    let serde_json::Value::Object(fields) =
        serde_json::to_value(&plain).expect("without its directories a ShardConfig is numbers, strings and booleans")
    else {
        unreachable!("a struct serializes as a JSON object")
    };
    let mut leaves = Vec::new();
    for (name, value) in fields {
        match value {
            serde_json::Value::Object(part) if PARTS.contains(&name.as_str()) => {
                leaves.extend(part.into_iter().map(|(leaf, value)| (format!("{name}.{leaf}"), value)));
            }
            value => leaves.push((name, value)),
        }
    }
    let mut hashes: Vec<(String, u64)> = leaves
        .into_iter()
        .map(|(path, value)| (path, sha256_u64(value.to_string().as_bytes())))
        .collect();
    hashes.sort();
    hashes
}

/// The first 8 bytes of the SHA-256 of `bytes`, little-endian.
fn sha256_u64(bytes: &[u8]) -> u64 {
    let digest = Sha256::digest(bytes);
    u64::from_le_bytes(digest[..8].try_into().expect("SHA-256 has 32 bytes"))
}

/// Refuses, on every rank, a world whose ranks passed different configs
/// ([`ShardError::ConfigMismatch`], naming the fields that differ): the first collective of
/// `init`, over the whole world before the mesh is split (a rank whose config has other
/// replicas would split alone). One all-gather of 8 bytes per field and rank, on the
/// collective's flag device.
///
/// # Errors
/// That one; [`ShardError::Comm`].
pub(super) fn check_same_config(world: &dyn Collective, config: &ShardConfig) -> Result<(), ShardError> {
    let ours = field_hashes(config);
    let values: Vec<u64> = ours.iter().map(|(_, hash)| *hash).collect();
    let all = all_gather_u64s(world, &values, &flag_device(world))?;
    for (peer, theirs) in all.iter().enumerate() {
        let fields: Vec<String> = ours
            .iter()
            .zip(theirs)
            .filter(|((_, mine), theirs)| mine != *theirs)
            .map(|((name, _), _)| name.clone())
            .collect();
        if !fields.is_empty() {
            return Err(ShardError::ConfigMismatch {
                rank: world.rank(),
                peer,
                fields,
            });
        }
    }
    Ok(())
}

/// Refuses, on every rank, a world whose ranks built different layouts, step options or
/// pretrained plans ([`ShardError::LayoutMismatch`]), which the config alone does not say: the
/// models (`layouts`: the trainable parameters over the shard group, then every float entry),
/// what the optimizer adds to the step (clipping), and which entries come from a pretrained
/// file (read there, not broadcast). One all-gather of 8 bytes per rank over `world`.
///
/// # Errors
/// That one; [`ShardError::Comm`].
pub(super) fn check_same_models(
    world: &dyn Collective,
    layouts: [&FlatLayout; 2],
    options: &StepOptions,
    optimizers: u64,
    pretrained: Option<&PretrainedPlan>,
    device: &Device,
) -> Result<(), ShardError> {
    let parts = [
        layouts[0].fingerprint(),
        layouts[1].fingerprint(),
        options.fingerprint(),
        optimizers,
        pretrained.map_or(0, PretrainedPlan::fingerprint),
    ];
    let fingerprint = sha256_u64(&parts.map(u64::to_le_bytes).concat());
    check_same_layout(world, fingerprint, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::Stage;

    /// Where a node keeps its NVMe files and how many threads write them leaves the hashes as
    /// they are; whether a state lives on disk, and any other field, changes its own hash alone,
    /// named by its path in the tree.
    #[test]
    fn field_hashes_ignore_node_local_settings_alone() {
        let base = ShardConfig::new(Stage::Three);
        let on_disk = |dir: &str, threads: usize| {
            base.clone()
                .with_optimizer_state_on(Home::Disk(
                    NvmeOffload::new(format!("{dir}/state")).with_io_threads(threads),
                ))
                .with_params_on(Home::Disk(
                    NvmeOffload::new(format!("{dir}/params")).with_max_in_flight(threads),
                ))
        };
        assert_eq!(field_hashes(&on_disk("/a", 1)), field_hashes(&on_disk("/b", 3)));
        let differing = |a: &ShardConfig, b: &ShardConfig| -> Vec<String> {
            field_hashes(a)
                .into_iter()
                .zip(field_hashes(b))
                .filter(|(x, y)| x.1 != y.1)
                .map(|(x, _)| x.0)
                .collect()
        };
        assert_eq!(
            differing(&on_disk("/a", 1), &base),
            ["placement.optimizer_state", "placement.params"]
        );
        assert_eq!(
            differing(&base.clone().with_optimizer_state_on(Home::Host), &on_disk("/a", 1)),
            ["placement.optimizer_state", "placement.params"]
        );
        assert_eq!(differing(&base, &base.clone().with_bucket_numel(7)), ["bucket_numel"]);
        assert_eq!(
            differing(&base, &base.clone().with_units(["layers.*"])),
            ["stage3.units"]
        );
        assert_eq!(differing(&base, &base.clone().with_replicas(2)), ["mesh.replicas"]);
        assert_eq!(differing(&base, &ShardConfig::new(Stage::Two)), ["stage"]);
        assert_eq!(field_hashes(&base), field_hashes(&base.clone()), "deterministic");
        let with_scaler = base
            .clone()
            .with_loss_scaler(crate::optim::loss_scale::LossScaler::dynamic());
        assert_eq!(
            field_hashes(&with_scaler).len(),
            field_hashes(&base).len(),
            "as many hashes whatever the values: every rank all-gathers as many"
        );
    }
}
