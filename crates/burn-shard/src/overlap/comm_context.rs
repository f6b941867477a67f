//! What every stage-3 collective of one rank shares, as a leaf (FSDP2's comm context): the
//! collective, the first error (ops cannot return one through Burn's autodiff) and the probes of
//! transient memory. The gather schedule, the unit reducer and the buffer layouts of
//! `collectives` take it; [`super::context::FsdpContext`] owns it with them, so nothing here
//! calls back into its owner.

use std::sync::{Arc, Mutex, Weak};

use burn::backend::Flex;
use burn::tensor::{Device, Tensor};
use burn_shard_comm::Collective;

use crate::error::ShardError;
use crate::swap::shard_store::{Shard, ShardRead, ShardStore};

/// The collective of one rank with its first error and transient-memory probes.
pub(crate) struct CommContext {
    comm: Arc<dyn Collective>,
    first_error: Mutex<Option<ShardError>>,
    transient: Mutex<TransientProbes>,
    /// Where the shards live when that is not where they are gathered.
    param_home: Option<ParamHome>,
}

/// Parameter offload ([`crate::ShardConfig::offload_params`]): this rank's shards live in host
/// memory and are copied to the compute device when they are gathered; with
/// [`crate::ShardConfig::nvme_offload_params`] they live on disk and are read into host memory
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

impl CommContext {
    /// The context of `comm`'s rank: no error recorded, no transient buffer watched; shards
    /// in host memory when `param_home` is given.
    pub(crate) fn new(comm: Arc<dyn Collective>, param_home: Option<ParamHome>) -> Self {
        Self {
            comm,
            first_error: Mutex::new(None),
            transient: Mutex::new(TransientProbes::default()),
            param_home,
        }
    }

    /// The device a shard of a parameter on `compute` lives on: the host with parameter
    /// offload, `compute` itself otherwise.
    pub(crate) fn shard_device(&self, compute: &Device) -> Device {
        match &self.param_home {
            Some(home) => home.host.clone(),
            None => compute.clone(),
        }
    }

    /// The device the model computes on when the shards live elsewhere (parameter offload).
    pub(crate) fn offloaded_compute(&self) -> Option<&Device> {
        self.param_home.as_ref().map(|home| &home.compute)
    }

    /// `shard` (or a concatenation of shards) on the device it is gathered on: copied from the
    /// host with parameter offload (one copy per gather, issued with the gather, so a
    /// prefetched unit's copy runs ahead of the unit too), as is otherwise.
    pub(crate) fn to_compute(&self, shard: Tensor<1>) -> Tensor<1> {
        match &self.param_home {
            Some(home) if shard.device() != home.compute => shard.to_device(&home.compute),
            _ => shard,
        }
    }

    /// `shard` where shards live: a shard the optimizer or a checkpoint load put on the compute
    /// device goes back to the host with parameter offload, and its write to the rank's shard
    /// file is queued with NVMe parameter offload (see [`ShardStore::put`]: the write runs
    /// behind the caller, and a failed one keeps the values in memory, so none is lost, and is
    /// returned by [`CommContext::flush_home`]).
    pub(crate) fn to_home(&self, shard: Tensor<1>) -> Shard {
        let shard = self.to_host(shard);
        match self.shard_store() {
            Some(store) => Shard::Stored(Arc::new(store.put(&shard, "parameter"))),
            None => Shard::Held(shard),
        }
    }

    /// Waits for the shard writes [`CommContext::to_home`] and backward queued (nothing
    /// without NVMe parameter offload).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] as [`ShardStore::flush`] says.
    pub(crate) fn flush_home(&self) -> Result<(), ShardError> {
        self.shard_store().map_or(Ok(()), |store| store.flush())
    }

    /// `shard` in host memory with parameter offload, as is otherwise.
    fn to_host(&self, shard: Tensor<1>) -> Tensor<1> {
        match &self.param_home {
            Some(home) if shard.device() != home.host => shard.to_device(&home.host),
            _ => shard,
        }
    }

    /// The values of `shard` (read from disk when stored); a failed read is recorded (the step
    /// returns it) and gives zeros, as a failed collective does.
    pub(crate) fn read(&self, shard: &Shard) -> Tensor<1> {
        self.wait_read(shard.start_read(), shard)
    }

    /// As [`CommContext::read`], from `read`, the read of `shard` started ahead.
    pub(crate) fn wait_read(&self, read: ShardRead, shard: &Shard) -> Tensor<1> {
        read.wait().unwrap_or_else(|e| {
            self.record_error(e);
            Tensor::zeros([shard.numel()], (&shard.device(), shard.dtype()))
        })
    }

    /// The rank's file of parameter shards, with NVMe parameter offload.
    pub(crate) fn shard_store(&self) -> Option<&Arc<ShardStore>> {
        self.param_home.as_ref()?.store.as_ref()
    }

    /// The rank's collective.
    pub(crate) fn comm(&self) -> &dyn Collective {
        self.comm.as_ref()
    }

    /// Ops cannot return errors through Burn's autodiff: they record the first one (a failed
    /// collective, or a shard file that could not be read or written) here and
    /// [`ShardedOptimizer::step`](crate::ShardedOptimizer::step) returns it.
    pub(crate) fn record_error(&self, err: impl Into<ShardError>) {
        let err = err.into();
        let mut slot = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        tracing::error!(rank = self.comm.rank(), "stage-3 gather or reduction failed: {err}");
        slot.get_or_insert(err);
    }

    /// The first error an op recorded since the last call, taken (the step returns it).
    pub(crate) fn take_error(&self) -> Option<ShardError> {
        self.first_error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Watches a transient buffer (a gathered parameter or a full gradient) of `bytes` bytes,
    /// alive as long as `alive` can be upgraded, and updates the peak.
    pub(crate) fn watch_transient<T: Send + Sync + 'static>(&self, alive: Weak<T>, bytes: usize) {
        let mut t = self.transient.lock().unwrap_or_else(|p| p.into_inner());
        t.watch(Box::new(move || alive.strong_count() > 0), bytes);
    }

    /// Watches a gathered tensor of `bytes` bytes when it lives on the host (`Flex`); device
    /// memory is its allocator's to report.
    pub(crate) fn watch_tensor(&self, tensor: &Tensor<1>, bytes: usize) {
        if let Ok(host) = tensor.clone().try_into_primitive::<Flex>() {
            self.watch_transient(Arc::downgrade(&host.data_arc()), bytes);
        }
    }

    /// Watches `bytes` bytes in flight on the host (when `sample`, a tensor on the same device,
    /// lives on `Flex`), for as long as the returned handle is kept.
    pub(crate) fn watch_in_flight(&self, sample: &Tensor<1>, bytes: usize) -> Option<Arc<()>> {
        sample.clone().try_into_primitive::<Flex>().ok()?;
        let handle = Arc::new(());
        self.watch_transient(Arc::downgrade(&handle), bytes);
        Some(handle)
    }

    /// Peak bytes of watched transient buffers alive at once since the last reset.
    pub(crate) fn transient_peak(&self) -> usize {
        self.transient.lock().unwrap_or_else(|p| p.into_inner()).peak
    }

    /// Starts a new peak from the transient buffers alive now (at each step).
    pub(crate) fn reset_transient_peak(&self) {
        let mut t = self.transient.lock().unwrap_or_else(|p| p.into_inner());
        t.prune();
        t.peak = t.live();
    }
}

/// Liveness probes of transient buffers, sampled whenever a new one appears (after each
/// all-gather and at each reduce-scatter), which is when the transient set is largest.
#[derive(Default)]
struct TransientProbes {
    probes: Vec<(Box<dyn Fn() -> bool + Send>, usize)>,
    peak: usize,
}

impl TransientProbes {
    fn prune(&mut self) {
        self.probes.retain(|(alive, _)| alive());
    }

    fn live(&self) -> usize {
        self.probes.iter().map(|(_, b)| b).sum()
    }

    fn watch(&mut self, alive: Box<dyn Fn() -> bool + Send>, bytes: usize) {
        self.prune();
        self.probes.push((alive, bytes));
        self.peak = self.peak.max(self.live());
    }
}
