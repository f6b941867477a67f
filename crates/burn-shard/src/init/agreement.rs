//! What every rank checks against the others before `init` syncs a value: the same
//! [`ShardConfig`] (one hash of its fields), then the same layouts, step options and pretrained
//! plan (one fingerprint), so that no rank enters a collective the others do not.

use burn::tensor::Device;
use burn_shard_comm::Collective;
use sha2::{Digest, Sha256};

use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::model::layout::{FlatLayout, check_same_layout, first_differing};
use crate::model::pretrained::plan::PretrainedPlan;
use crate::step::agreement::flag_device;
use crate::step::options::StepOptions;

/// The fields of a [`ShardConfig`] that may differ between ranks: where each node keeps its
/// NVMe files and how many threads write them. Whether NVMe offload is on changes the
/// collectives (the ranks agree on each disk outcome), so only its settings are left out.
const NODE_LOCAL: [&str; 2] = ["nvme_offload", "nvme_offload_params"];

/// One hash of every field of `config` but the node-local ones: the first 8 bytes of the
/// SHA-256 of its JSON (serde's, the form `config.json` holds), with each [`NODE_LOCAL`] field
/// replaced by whether it is set. A field added to `ShardConfig` is covered without a change
/// here.
pub(crate) fn config_hash(config: &ShardConfig) -> u64 {
    let mut value = serde_json::to_value(config).expect("a ShardConfig is plain data and serializes");
    for field in NODE_LOCAL {
        if let Some(v) = value.get_mut(field) {
            *v = serde_json::Value::Bool(!v.is_null());
        }
    }
    let digest = Sha256::digest(value.to_string().as_bytes());
    u64::from_le_bytes(digest[..8].try_into().expect("SHA-256 has 32 bytes"))
}

/// Refuses, on every rank, a world whose ranks passed different configs
/// ([`ShardError::ConfigMismatch`]): the first collective of `init`, over the whole world
/// before the mesh is split (a rank whose config has other replicas would split alone). One
/// all-gather of 8 bytes per rank, on the collective's flag device.
///
/// # Errors
/// That one; [`ShardError::Comm`].
pub(super) fn check_same_config(world: &dyn Collective, config: &ShardConfig) -> Result<(), ShardError> {
    match first_differing(world, config_hash(config), &flag_device(world))? {
        Some((peer, _)) => Err(ShardError::ConfigMismatch {
            rank: world.rank(),
            peer,
        }),
        None => Ok(()),
    }
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
    pretrained: Option<&PretrainedPlan>,
    device: &Device,
) -> Result<(), ShardError> {
    let mut hasher = Sha256::new();
    for part in [
        layouts[0].fingerprint(),
        layouts[1].fingerprint(),
        options.fingerprint(),
        pretrained.map_or(0, PretrainedPlan::fingerprint),
    ] {
        hasher.update(part.to_le_bytes());
    }
    let digest = hasher.finalize();
    let fingerprint = u64::from_le_bytes(digest[..8].try_into().expect("SHA-256 has 32 bytes"));
    check_same_layout(world, fingerprint, device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::Stage;
    use crate::swap::config::NvmeOffload;

    /// Where a node keeps its NVMe files and how many threads write them leaves the hash as it
    /// is; whether NVMe offload is on, and any other field, changes it.
    #[test]
    fn the_config_hash_ignores_node_local_settings_alone() {
        let base = ShardConfig::new(Stage::Three);
        let on_disk = |dir: &str, threads: usize| {
            base.clone()
                .with_nvme_offload(NvmeOffload::new(format!("{dir}/state")).with_io_threads(threads))
                .with_nvme_offload_params(NvmeOffload::new(format!("{dir}/params")).with_max_in_flight(threads))
        };
        assert_eq!(config_hash(&on_disk("/a", 1)), config_hash(&on_disk("/b", 3)));
        assert_ne!(
            config_hash(&on_disk("/a", 1)),
            config_hash(&base),
            "NVMe offload on or off"
        );
        assert_ne!(config_hash(&base), config_hash(&base.clone().with_bucket_numel(7)));
        assert_ne!(config_hash(&base), config_hash(&ShardConfig::new(Stage::Two)));
        assert_eq!(config_hash(&base), config_hash(&base.clone()), "deterministic");
    }
}
