//! Per-rank state shared by every stage-3 op of one model.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use burn::backend::Flex;
use burn::backend::autodiff::NodeId;
use burn::tensor::Tensor;
use burn_shard_comm::{Collective, CommError};

use crate::overlap::collectives::all_gather_full;
use crate::overlap::gather_schedule::Schedule;
use crate::overlap::spec::GatherSpec;
use crate::overlap::unit_reducer::{Reduced, Reducer};

/// Shared by the sharded parameters of one model on one rank. Cheap to clone.
#[derive(Clone)]
pub(crate) struct FsdpContext(Arc<Inner>);

struct Inner {
    comm: Arc<dyn Collective>,
    reshard_after_forward: bool,
    first_error: Mutex<Option<CommError>>,
    transient: Mutex<TransientProbes>,
    schedule: Mutex<Schedule>,
    reducer: Mutex<Reducer>,
}

impl fmt::Debug for FsdpContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FsdpContext")
            .field("rank", &self.0.comm.rank())
            .field("world_size", &self.0.comm.world_size())
            .field("reshard_after_forward", &self.0.reshard_after_forward)
            .finish()
    }
}

impl FsdpContext {
    pub(crate) fn new(comm: Arc<dyn Collective>, reshard_after_forward: bool) -> Self {
        Self(Arc::new(Inner {
            comm,
            reshard_after_forward,
            first_error: Mutex::new(None),
            transient: Mutex::new(TransientProbes::default()),
            schedule: Mutex::new(Schedule::default()),
            reducer: Mutex::new(Reducer::default()),
        }))
    }

    /// The full `[numel]` parameter of `spec`: taken from its unit's grouped all-gather when the
    /// schedule fetched it, else all-gathered alone (see [`crate::overlap::gather_schedule`]).
    pub(crate) fn gather(&self, spec: &GatherSpec) -> Tensor<1> {
        let mut schedule = self.0.schedule.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(full) = schedule.take(self, spec) {
            return full;
        }
        drop(schedule);
        let full = all_gather_full(self, spec.shard.clone(), spec.numel, spec.tag);
        self.watch_tensor(&full, spec.numel * full.dtype().size());
        full
    }

    /// Takes the complete full gradient (`[numel]`) of `spec`'s parameter, whose autodiff leaf
    /// is `node`, for its unit's grouped reduce-scatter; returns the shards ready to register
    /// now (see [`crate::overlap::unit_reducer`]).
    pub(crate) fn reduce(&self, spec: &GatherSpec, node: NodeId, grad: Tensor<1>) -> Vec<Reduced> {
        let mut reducer = self.0.reducer.lock().unwrap_or_else(|p| p.into_inner());
        reducer.add(self, spec, node, grad)
    }

    /// The shards of the last backward still in flight or pending, waited for: the optimizer
    /// adds them to the gradients it was given.
    pub(crate) fn finish_reduce(&self) -> Vec<Reduced> {
        self.0.reducer.lock().unwrap_or_else(|p| p.into_inner()).finish(self)
    }

    /// Records that `spec`'s shard is the parameter's current one (at sharding, and each time
    /// the optimizer or a checkpoint load replaces it), for the grouped gathers.
    pub(crate) fn register(&self, spec: &GatherSpec) {
        self.0.schedule.lock().unwrap_or_else(|p| p.into_inner()).register(spec);
    }

    /// Called before the optimizer replaces the shards: nothing gathered so far is used again.
    pub(crate) fn end_pass(&self) {
        self.0.schedule.lock().unwrap_or_else(|p| p.into_inner()).end_pass();
    }

    pub(crate) fn comm(&self) -> &dyn Collective {
        self.0.comm.as_ref()
    }

    /// Whether gathered parameters are freed after forward and re-gathered in backward
    /// (FSDP's `reshard_after_forward=True`, the default) or kept until backward.
    pub(crate) fn reshard_after_forward(&self) -> bool {
        self.0.reshard_after_forward
    }

    /// Ops cannot return errors through Burn's autodiff: they record the first one here and
    /// [`ShardedOptimizer::step`](crate::ShardedOptimizer::step) returns it.
    pub(crate) fn record_error(&self, err: CommError) {
        let mut slot = self.0.first_error.lock().unwrap_or_else(|p| p.into_inner());
        tracing::error!(rank = self.0.comm.rank(), "stage-3 collective failed: {err}");
        slot.get_or_insert(err);
    }

    pub(crate) fn take_error(&self) -> Option<CommError> {
        self.0.first_error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Watches a transient buffer (a gathered parameter or a full gradient) of `bytes` bytes,
    /// alive as long as `alive` can be upgraded, and updates the peak.
    pub(crate) fn watch_transient<T: Send + Sync + 'static>(&self, alive: Weak<T>, bytes: usize) {
        let mut t = self.0.transient.lock().unwrap_or_else(|p| p.into_inner());
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
        self.0.transient.lock().unwrap_or_else(|p| p.into_inner()).peak
    }

    pub(crate) fn reset_transient_peak(&self) {
        let mut t = self.0.transient.lock().unwrap_or_else(|p| p.into_inner());
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
