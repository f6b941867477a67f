//! How a failed rank is reported through burn-train.

use std::fmt;

use burn::data::dataset::DatasetError;
use burn::train::TrainingError;

/// The ranks that failed, each with its message (rank order), or a failure before any rank
/// started (as rank 0).
///
/// burn-train 0.22.1 reports a failed worker as `TrainingError::Workers(Vec<WorkerFailure>)`,
/// but `WorkerFailure` sits in a private module, so no crate outside burn-train can build one.
/// [`RankFailures`] therefore reaches the user as `TrainingError::Dataset`, whose source it is:
/// `LearningResult::error` displays `Dataset error: rank 1 failed: ...`, and
/// [`RankFailures::of`] gives the ranks back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailures(pub Vec<(usize, String)>);

impl RankFailures {
    /// The failed ranks inside a `TrainingError` that [`crate::ShardedStrategy`] reported
    /// (`result.error.as_deref().and_then(RankFailures::of)`); `None` for any other error.
    pub fn of(error: &TrainingError) -> Option<&RankFailures> {
        match error {
            TrainingError::Dataset(e) => std::error::Error::source(e)?.downcast_ref(),
            _ => None,
        }
    }
}

impl fmt::Display for RankFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (rank, message)) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "rank {rank} failed: {message}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RankFailures {}

impl From<RankFailures> for TrainingError {
    fn from(failures: RankFailures) -> Self {
        TrainingError::Dataset(DatasetError::new(failures))
    }
}
