//! How `config.json` reads into a [`ShardConfig`]: the tree written since 2026-12-07, and the
//! flat form written before it (`reshard_after_forward`, `units`, `nvme_offload`,
//! `offload_params`, `nvme_offload_params`, `frozen_entries`, `saves_in_flight`, `replicas`,
//! `mesh_layout` at the top). A field left out takes its default, as
//! [`ShardConfig::new`](crate::ShardConfig::new) sets it (`From<SavedShardConfig>` in
//! `config/mod.rs`, which owns the defaults).

use serde::Deserialize;

use burn_shard_comm::MeshLayout;

use crate::config::parts::{CheckpointConfig, MeshConfig, Stage3Config};
use crate::config::placement::{Home, Placement};
use crate::optim::loss_scale::LossScaler;
use crate::run::FrozenEntries;
use crate::stage::Stage;
use crate::swap::config::NvmeOffload;

/// Every field either form may hold (`None`: left out).
#[derive(Deserialize)]
pub(super) struct SavedShardConfig {
    pub(super) stage: Stage,
    pub(super) bucket_numel: Option<usize>,
    pub(super) overlap_comm: Option<bool>,
    #[serde(default, deserialize_with = "norm::deserialize")]
    pub(super) max_grad_norm: Option<f32>,
    #[serde(default)]
    pub(super) loss_scaler: Option<LossScaler>,
    pub(super) placement: Option<Placement>,
    pub(super) stage3: Option<Stage3Config>,
    pub(super) mesh: Option<MeshConfig>,
    pub(super) checkpoint: Option<CheckpointConfig>,
    #[serde(flatten)]
    pub(super) flat: FlatFields,
}

/// The fields of the flat form that the tree nests.
#[derive(Deserialize)]
pub(super) struct FlatFields {
    reshard_after_forward: Option<bool>,
    units: Option<Vec<String>>,
    nvme_offload: Option<NvmeOffload>,
    #[serde(default)]
    offload_params: bool,
    nvme_offload_params: Option<PathOrNvme>,
    frozen_entries: Option<FrozenEntries>,
    saves_in_flight: Option<usize>,
    replicas: Option<usize>,
    mesh_layout: Option<MeshLayout>,
}

/// `nvme_offload_params` of the flat form: an [`NvmeOffload`], or a directory alone (written
/// before the I/O settings existed).
#[derive(Deserialize)]
#[serde(untagged)]
enum PathOrNvme {
    Path(std::path::PathBuf),
    Full(NvmeOffload),
}

impl FlatFields {
    /// Stage 3's part as the flat fields said, each left out taken from `default`.
    pub(super) fn stage3(&self, default: Stage3Config) -> Stage3Config {
        Stage3Config {
            reshard_after_forward: self.reshard_after_forward.unwrap_or(default.reshard_after_forward),
            units: self.units.clone().unwrap_or(default.units),
        }
    }

    /// The mesh as the flat fields said, each left out taken from `default`.
    pub(super) fn mesh(&self, default: MeshConfig) -> MeshConfig {
        MeshConfig {
            replicas: self.replicas.unwrap_or(default.replicas),
            layout: self.mesh_layout.unwrap_or(default.layout),
        }
    }

    /// The checkpoint part as the flat fields said, each left out taken from `default`.
    pub(super) fn checkpoint(&self, default: CheckpointConfig) -> CheckpointConfig {
        CheckpointConfig {
            frozen_entries: self.frozen_entries.unwrap_or(default.frozen_entries),
            saves_in_flight: self.saves_in_flight.unwrap_or(default.saves_in_flight),
        }
    }

    /// The placement the flat fields said. `offload_params` alone (shards in host memory)
    /// was accepted only on an accelerator with the optimizer wrapped in `Offload`, which kept
    /// its state in host memory: it says that state's home too. With `nvme_offload_params`
    /// (shards on disk, also accepted on `Flex` with a plain optimizer) the file does not say
    /// whether the optimizer was wrapped: the state stays where `nvme_offload` says (on the
    /// device without it), and an accelerator run that had the wrapper adds
    /// `with_optimizer_state_on(Home::Host)` (`init` refuses it otherwise, naming that).
    pub(super) fn placement(&self) -> Placement {
        let params = match (&self.nvme_offload_params, self.offload_params) {
            (Some(PathOrNvme::Path(path)), _) => Home::Disk(NvmeOffload::new(path)),
            (Some(PathOrNvme::Full(nvme)), _) => Home::Disk(nvme.clone()),
            (None, true) => Home::Host,
            (None, false) => Home::Device,
        };
        let optimizer_state = match (&self.nvme_offload, &params) {
            (Some(nvme), _) => Home::Disk(nvme.clone()),
            (None, Home::Host) => Home::Host,
            (None, _) => Home::Device,
        };
        Placement {
            optimizer_state,
            params,
        }
    }
}

/// `max_grad_norm`: a number, `null` (no clipping) or `"inf"` (measure without clipping:
/// serde_json would write `f32::INFINITY` as `null`, which reads back as no clipping).
pub(super) mod norm {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Norm {
        Number(f32),
        Text(String),
    }

    pub(crate) fn serialize<S: Serializer>(value: &Option<f32>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) if v.is_infinite() && *v > 0.0 => Norm::Text("inf".into()).serialize(s),
            Some(v) => Norm::Number(*v).serialize(s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
        match Option::<Norm>::deserialize(d)? {
            None => Ok(None),
            Some(Norm::Number(v)) => Ok(Some(v)),
            Some(Norm::Text(t)) if t == "inf" => Ok(Some(f32::INFINITY)),
            Some(Norm::Text(t)) => Err(serde::de::Error::custom(format!(
                "max_grad_norm must be a positive number, null or \"inf\", got \"{t}\""
            ))),
        }
    }
}
