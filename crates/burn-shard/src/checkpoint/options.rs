//! What a save writes besides the model and the optimizer ([`SaveOptions`]), and what a load
//! hands back ([`Restored`]).

use burn::lr_scheduler::LrSchedulerRecord;

/// How [`ShardedOptimizer::save_checkpoint`](crate::ShardedOptimizer::save_checkpoint) saves:
/// what it writes besides the model and the optimizer, and whether it returns before the files
/// are written.
///
/// A `&serde_json::Value` or a `serde_json::Value` converts into options holding it as the
/// payload, written in the foreground: `optim.save_checkpoint(&model, dir, &payload)`.
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Anything JSON (the step, the data position, the seed), handed back by the load as
    /// [`Restored::payload`]; `null` by default.
    pub payload: serde_json::Value,
    /// A Burn learning-rate scheduler's state (`scheduler.to_record()`, any scheduler),
    /// written by rank 0 as `scheduler.bpk` and covered by the digests; handed back as
    /// [`Restored::scheduler`]. Default `None`.
    pub scheduler: Option<LrSchedulerRecord>,
    /// Return as soon as this rank's part is staged in host memory; a background thread
    /// writes it (see `save_checkpoint`). Default `false`: return once the checkpoint is
    /// complete on disk.
    pub background: bool,
}

impl SaveOptions {
    /// A foreground save with `payload` and no scheduler state.
    pub fn new(payload: serde_json::Value) -> Self {
        Self {
            payload,
            ..Self::default()
        }
    }

    /// Also saves a learning-rate scheduler's state (`scheduler.to_record()`).
    pub fn with_scheduler(mut self, record: LrSchedulerRecord) -> Self {
        self.scheduler = Some(record);
        self
    }

    /// Writes in the background: the save returns once this rank's part is staged.
    pub fn in_background(mut self) -> Self {
        self.background = true;
        self
    }
}

impl From<serde_json::Value> for SaveOptions {
    fn from(payload: serde_json::Value) -> Self {
        Self::new(payload)
    }
}

impl From<&serde_json::Value> for SaveOptions {
    fn from(payload: &serde_json::Value) -> Self {
        Self::new(payload.clone())
    }
}

/// What [`ShardedOptimizer::load_checkpoint`](crate::ShardedOptimizer::load_checkpoint) hands
/// back besides the model: what the save was given.
#[derive(Clone, Debug)]
pub struct Restored {
    /// [`SaveOptions::payload`] as saved.
    pub payload: serde_json::Value,
    /// The scheduler state saved with [`SaveOptions::with_scheduler`]
    /// (`scheduler = scheduler.load_record(record)`); `None` when the checkpoint holds none.
    pub scheduler: Option<LrSchedulerRecord>,
}
