//! [`Placement`]: where a rank keeps its optimizer state and its stage-3 parameter shards, the
//! one policy behind ZeRO-Offload and ZeRO-Infinity's CPU and NVMe offload.

use crate::swap::config::NvmeOffload;

/// Where one kind of model state lives between uses (DeepSpeed's `offload_optimizer` /
/// `offload_param` `device: none | cpu | nvme`; PyTorch FSDP2's `CPUOffloadPolicy` is
/// [`Home::Host`] for both).
///
/// Saved in `config.json` as `"Device"`, `"Host"` or `{"Disk": {"path": ..., "io_threads": ...,
/// "max_in_flight": ...}}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Home {
    /// With the model, on its device (the default).
    #[default]
    Device,
    /// In host memory (Burn's `Flex` CPU device), for a model on an accelerator (CUDA, wgpu,
    /// any CubeCL device).
    Host,
    /// In a file per rank on a local disk, read into memory when used (ZeRO-Infinity's NVMe
    /// offload; see [`NvmeOffload`] for the settings and the costs).
    Disk(NvmeOffload),
}

impl Home {
    /// The disk settings of [`Home::Disk`].
    pub fn disk(&self) -> Option<&NvmeOffload> {
        match self {
            Home::Disk(nvme) => Some(nvme),
            _ => None,
        }
    }

    /// Whether this is [`Home::Device`].
    pub fn is_device(&self) -> bool {
        matches!(self, Home::Device)
    }
}

/// Where this rank keeps its optimizer state and its stage-3 parameter shards: the one policy
/// that [`ShardConfig::with_optimizer_state_on`](crate::ShardConfig::with_optimizer_state_on)
/// and [`ShardConfig::with_params_on`](crate::ShardConfig::with_params_on) set.
///
/// | `optimizer_state` | on an accelerator | on Burn's `Flex` CPU device |
/// |---|---|---|
/// | `Device` | state and update on the device | in memory |
/// | `Host` | state, `f32` masters and update in host memory (ZeRO-Offload) | refused: nothing would move |
/// | `Disk` | on disk between steps, stepped in host memory (ZeRO-Infinity) | on disk between steps |
///
/// | `params` (stage 3 only) | on an accelerator | on `Flex` |
/// |---|---|---|
/// | `Device` | shards on the device | in memory |
/// | `Host` | shards in host memory, copied to the device per gather; needs the state off the device | refused: nothing would move |
/// | `Disk` | shards and gradient shards in a file, read through host memory; needs the state off the device | shards and gradient shards in a file |
///
/// Where the state is off the device, the update of a shard runs in host memory, where its
/// state is; parameters in host memory or on disk need that (the step updates a shard where its
/// state lives, which must be where the shard lives). With the fused Adam, results are bitwise
/// those of the same training with everything on the device.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Placement {
    /// The optimizer state and the `f32` master weights of `bf16`/`f16` parameters (default
    /// [`Home::Device`]).
    #[serde(default)]
    pub optimizer_state: Home,
    /// Stage 3: this rank's parameter shards (default [`Home::Device`]).
    #[serde(default)]
    pub params: Home,
}
