//! Where stage-3 shards live with parameter offload ([`ShardConfig::with_offload_params`],
//! [`ShardConfig::with_nvme_offload_params`]), and the combinations refused.

use burn::tensor::Device;

use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::optim::master::MasterWeightStep;
use crate::optim::offload::Offloaded;
use crate::placement::home::ParamHome;
use crate::stage::Stage;
use crate::swap::shard_store::ShardStore;

/// With [`ShardConfig::offload_params`]: where the shards live and where they compute, or
/// the reason the combination moves nothing or cannot step (see
/// [`ShardConfig::with_offload_params`]).
pub(super) fn param_home<O: MasterWeightStep>(
    config: &ShardConfig,
    device: &Device,
    rank: usize,
) -> Result<Option<ParamHome>, ShardError> {
    let nvme = config.nvme_offload_params.as_ref();
    if !config.offload_params && nvme.is_none() {
        return Ok(None);
    }
    let host = Offloaded::<()>::host_device();
    let refuse = |why: &str| Err(ShardError::InvalidConfig(format!("offload_params: {why}")));
    if *device == host && nvme.is_none() {
        return refuse(
            "the model's parameters already live in host memory (Burn's Flex CPU device), so nothing would \
             move; drop with_offload_params(true), and keep the shards and the optimizer state on disk with \
             with_nvme_offload_params(dir) and with_nvme_offload(NvmeOffload::new(dir)) to save memory there",
        );
    }
    if config.stage != Stage::Three {
        return refuse(&format!(
            "parameter offload keeps stage-3 shards in host memory or on disk, and at stage {} every rank holds \
             whole parameters; use stage 3 (ShardConfig::new(Stage::Three)), or Offload(..) or \
             with_nvme_offload(..) alone to move the optimizer state",
            config.stage.number()
        ));
    }
    if O::state_device(device) != host {
        return refuse(
            "the shards would live in host memory while the optimizer state stays on the device, and a step \
             updates a shard where its state is; wrap the optimizer in Offload (Offload(AdamWConfig::new())) \
             so both live in host memory",
        );
    }
    // On Flex the shards are read into host memory, where the model computes.
    let store = nvme
        .map(|nvme| ShardStore::create(nvme, rank, host.clone()))
        .transpose()?;
    Ok(Some(ParamHome {
        host,
        compute: device.clone(),
        store,
    }))
}
