//! What every stage-3 collective of one rank shares, as a leaf (FSDP2's comm context):
//! communication only, that is the collective, the first error (ops cannot return one through
//! Burn's autodiff) and the probes of transient memory. Where the shards live and how they reach
//! the compute device is [`ShardHome`](crate::fsdp::home::ShardHome)'s. The gather schedule,
//! the unit reducer and the buffer layouts of `collectives` take it;
//! [`super::context::FsdpContext`] owns it with them, so nothing here calls back into its owner.

use std::sync::{Arc, Mutex, Weak};

use burn::backend::Flex;
use burn::tensor::Tensor;
use burn_shard_comm::Collective;

use crate::error::ShardError;

/// The collective of one rank with its first error and transient-memory probes.
pub(crate) struct CommContext {
    comm: Arc<dyn Collective>,
    first_error: Mutex<Option<ShardError>>,
    transient: Mutex<TransientProbes>,
}

impl CommContext {
    /// The context of `comm`'s rank: no error recorded, no transient buffer watched.
    pub(crate) fn new(comm: Arc<dyn Collective>) -> Self {
        Self {
            comm,
            first_error: Mutex::new(None),
            transient: Mutex::new(TransientProbes::default()),
        }
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
