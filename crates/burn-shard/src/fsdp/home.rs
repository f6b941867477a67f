//! [`ShardHome`]: where one rank's stage-3 shards live and how they move between there and the
//! device they are gathered on (FSDP2's `FSDPParam` placement, ZeRO-Infinity's parameter
//! offload): on the compute device, in host memory (`Home::Host` in [`crate::ShardConfig::placement`]), or
//! in the rank's shard file (`Home::Disk` in [`crate::ShardConfig::placement`]). The one place that
//! decides where shards live: the device a shard is gathered on, how a stored shard's read is
//! waited for, and where a shard replaced on the device goes home (reading one stored shard is
//! `Shard::read`, wherever it is called).

use std::sync::Arc;

use burn::tensor::{Device, Tensor};

use crate::error::ShardError;
use crate::fsdp::shard::Shard;
use crate::swap::shard_store::{ShardRead, ShardStore};

/// Parameter offload (`Home::Host` in [`crate::ShardConfig::placement`]): this rank's shards live in host
/// memory and are copied to the compute device when they are gathered; with
/// `Home::Disk` in [`crate::ShardConfig::placement`] they live on disk and are read into host memory
/// first (`host` and `compute` are then the same device for a model on Burn's `Flex`).
#[derive(Clone, Debug)]
pub(crate) struct ParamHome {
    /// Where the shards live (Burn's `Flex` CPU device).
    pub(crate) host: Device,
    /// Where they are gathered, and where the model computes (plain, without autodiff).
    pub(crate) compute: Device,
    /// The rank's file of shards, with NVMe parameter offload.
    pub(crate) store: Option<Arc<ShardStore>>,
}

/// Where this rank's shards live: with the parameters on the compute device (`None`), or
/// offloaded ([`ParamHome`]).
#[derive(Clone, Debug)]
pub(crate) struct ShardHome(Option<ParamHome>);

impl ShardHome {
    /// Shards where the model computes without `param_home`, offloaded to it with it.
    pub(crate) fn new(param_home: Option<ParamHome>) -> Self {
        Self(param_home)
    }

    /// The device a shard of a parameter on `compute` lives on: the host with parameter
    /// offload, `compute` itself otherwise.
    pub(crate) fn shard_device(&self, compute: &Device) -> Device {
        match &self.0 {
            Some(home) => home.host.clone(),
            None => compute.clone(),
        }
    }

    /// The device the model computes on when the shards live elsewhere (parameter offload).
    pub(crate) fn offloaded_compute(&self) -> Option<&Device> {
        self.0.as_ref().map(|home| &home.compute)
    }

    /// `shard` (`[chunk]`, or a concatenation of shards) on the device it is gathered on:
    /// copied from the host with parameter offload (one copy per gather, issued with the
    /// gather, so a prefetched unit's copy runs ahead of the unit too), as is otherwise.
    pub(crate) fn to_compute(&self, shard: Tensor<1>) -> Tensor<1> {
        match &self.0 {
            Some(home) if shard.device() != home.compute => shard.to_device(&home.compute),
            _ => shard,
        }
    }

    /// `shard` where shards live: a shard the optimizer or a checkpoint load put on the compute
    /// device goes back to the host with parameter offload, and its write to the rank's shard
    /// file is queued with NVMe parameter offload (see [`ShardStore::put`]: the write runs
    /// behind the caller, and a failed one keeps the values in memory, so none is lost, and is
    /// returned by [`ShardHome::flush`]).
    pub(crate) fn to_home(&self, shard: Tensor<1>) -> Shard {
        let shard = self.to_host(shard);
        match self.store() {
            Some(store) => Shard::Stored(Arc::new(store.put(&shard, "parameter"))),
            None => Shard::Held(shard),
        }
    }

    /// Waits for the shard writes [`ShardHome::to_home`] and backward queued (nothing without
    /// NVMe parameter offload).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] as [`ShardStore::flush`] says.
    pub(crate) fn flush(&self) -> Result<(), ShardError> {
        self.store().map_or(Ok(()), |store| store.flush())
    }

    /// `shard` in host memory with parameter offload, as is otherwise.
    fn to_host(&self, shard: Tensor<1>) -> Tensor<1> {
        match &self.0 {
            Some(home) if shard.device() != home.host => shard.to_device(&home.host),
            _ => shard,
        }
    }

    /// The values of `shard` (`[chunk]`) from `read`, its read started ahead (or now); zeros
    /// when the read failed, after `failed` was given the error (the stage-3 ops record it:
    /// they cannot return one through Burn's autodiff, and the step returns it).
    pub(crate) fn wait_read(&self, read: ShardRead, shard: &Shard, failed: impl FnOnce(ShardError)) -> Tensor<1> {
        read.wait().unwrap_or_else(|e| {
            failed(e);
            Tensor::zeros([shard.numel()], (&shard.device(), shard.dtype()))
        })
    }

    /// The rank's file of parameter shards, with NVMe parameter offload.
    pub(crate) fn store(&self) -> Option<&Arc<ShardStore>> {
        self.0.as_ref()?.store.as_ref()
    }
}
