//! The placement policy ([`Placement`]) turned into where this rank's optimizer state and
//! stage-3 shards live, with the combinations refused: the one place that reads
//! `config.placement`.

use burn::tensor::Device;

use crate::config::ShardConfig;
use crate::config::placement::{Home, Placement};
use crate::error::ShardError;
use crate::fsdp::home::ParamHome;
use crate::optim::state_home::StateHome;
use crate::stage::Stage;
use crate::swap::shard_store::ShardStore;
use crate::swap::swapper::Swapper;

/// Where this rank's model state lives, from [`ShardConfig::placement`].
pub(super) struct Homes {
    /// Where the optimizer state lives in memory and the update runs.
    pub(super) state: StateHome,
    /// The optimizer state's swap file between steps ([`Home::Disk`]).
    pub(super) swap: Option<Swapper>,
    /// Where stage-3 shards live when not on the compute device.
    pub(super) params: Option<ParamHome>,
}

/// Where the optimizer state and the stage-3 shards of a model on `device` live, or the reason
/// the combination moves nothing or cannot step (see [`Placement`]). Files are created here:
/// a rank whose directory is unusable fails before any collective that moves values (init's
/// error path aborts the world).
///
/// # Errors
/// [`ShardError::InvalidConfig`] naming the fix; [`ShardError::Nvme`] for an unusable directory.
pub(super) fn homes(config: &ShardConfig, device: &Device, rank: usize) -> Result<Homes, ShardError> {
    let Placement {
        optimizer_state,
        params,
    } = &config.placement;
    let host = StateHome::host_device();
    let on_host = *device == host;
    let refuse = |what: &str, why: String| Err(ShardError::InvalidConfig(format!("placement.{what}: {why}")));
    // The parameters first: their refusal of a host model names the fix for the combination.
    if !params.is_device() {
        if on_host && *params == Home::Host {
            return refuse(
                "params",
                "the model's parameters already live in host memory (Burn's Flex CPU device), so nothing would \
                 move; keep the shards and the optimizer state on disk to save memory there: \
                 with_params_on(Home::Disk(dir.into())).with_optimizer_state_on(Home::Disk(dir.into()))"
                    .into(),
            );
        }
        if config.stage != Stage::Three {
            return refuse(
                "params",
                format!(
                    "parameter offload keeps stage-3 shards in host memory or on disk, and at stage {} every rank \
                     holds whole parameters; use stage 3 (ShardConfig::new(Stage::Three)), or move the optimizer \
                     state alone with with_optimizer_state_on(Home::Host) or (Home::Disk(..))",
                    config.stage.number()
                ),
            );
        }
        if !on_host && optimizer_state.is_device() {
            return refuse(
                "params",
                "the shards would live in host memory while the optimizer state stays on the device, and a step \
                 updates a shard where its state is; add with_optimizer_state_on(Home::Host) (or Home::Disk) so \
                 both live off the device"
                    .into(),
            );
        }
    }
    if on_host && *optimizer_state == Home::Host {
        return refuse(
            "optimizer_state",
            "Home::Host moves the optimizer state and master weights to host memory (Burn's Flex CPU device), but \
             the model's parameters already live there, so nothing would move; keep the default (Home::Device), \
             or use Home::Disk(dir.into()) to keep the state on disk between steps, or build the model on an \
             accelerator device (CUDA, wgpu) to offload its optimizer"
                .into(),
        );
    }
    // Off the device, the update runs in host memory (ZeRO-Offload's CPU Adam, which
    // DeepSpeed's NVMe offload of the state steps with too); on `Flex` that is the device.
    let state = match optimizer_state {
        Home::Device => StateHome::WithParams,
        Home::Host | Home::Disk(_) if on_host => StateHome::WithParams,
        Home::Host | Home::Disk(_) => StateHome::Host,
    };
    let swap = optimizer_state
        .disk()
        .map(|nvme| Swapper::new(nvme, rank, state.device(device)))
        .transpose()?;
    let params = match params {
        Home::Device => None,
        // On Flex the shards are read into host memory, where the model computes.
        Home::Host | Home::Disk(_) => Some(ParamHome {
            host: host.clone(),
            compute: device.clone(),
            store: params
                .disk()
                .map(|nvme| ShardStore::create(nvme, rank, host.clone()))
                .transpose()?,
        }),
    };
    Ok(Homes { state, swap, params })
}
