//! What every backend's [`Collective::split`] starts with: the ranks exchange their `(color,
//! key)` through the parent group, so each knows the members of its sub-group and its rank
//! there, and every rank has reached the split before any backend call that could block.

use burn::tensor::{Device, Tensor, TensorData};

use crate::{Collective, CommError};

/// Largest color or key carried exactly (as `f32` through the parent's all-gather).
const MAX_LABEL: usize = 1 << 24;

/// One sub-group of a split, as this rank sees it.
pub(crate) struct SplitPlan {
    /// Parent ranks of the sub-group, in sub-group rank order (by key, then parent rank).
    pub(crate) members: Vec<usize>,
    /// This rank's index in `members`.
    pub(crate) rank: usize,
}

/// All-gathers every rank's `(color, key)` over `parent` and returns this rank's sub-group.
///
/// # Errors
/// [`CommError::InvalidMesh`] when `color` or `key` is 2^24 or more (every rank checks its own
/// before the all-gather, and aborts the group so the others fail too); the all-gather's errors.
pub(crate) fn plan(parent: &dyn Collective, color: usize, key: usize) -> Result<SplitPlan, CommError> {
    if color >= MAX_LABEL || key >= MAX_LABEL {
        let err = CommError::InvalidMesh(format!(
            "rank {}: split color {color} and key {key} must be below 2^24",
            parent.rank()
        ));
        parent.abort(&err.to_string());
        return Err(err);
    }
    let all = all_gather_values(parent, vec![color as f32, key as f32], "the ranks' colors")?;
    let labels: Vec<(usize, usize)> = all.chunks(2).map(|p| (p[0] as usize, p[1] as usize)).collect();
    let mut members: Vec<usize> = (0..labels.len()).filter(|&r| labels[r].0 == color).collect();
    members.sort_by_key(|&r| (labels[r].1, r));
    let rank = members
        .iter()
        .position(|&r| r == parent.rank())
        .expect("this rank has its own color");
    Ok(SplitPlan { members, rank })
}

/// Every rank's `values` (the same length on every rank), in rank order: one all-gather of a few
/// host numbers, on the device the group requires (NCCL: its GPU) or `Flex`. `what` names them
/// in the error.
///
/// # Errors
/// The all-gather's; [`CommError::Backend`] when the result cannot be read back.
pub(crate) fn all_gather_values(comm: &dyn Collective, values: Vec<f32>, what: &str) -> Result<Vec<f32>, CommError> {
    let device = comm.required_device().unwrap_or_else(Device::flex);
    let len = values.len();
    let all = comm.all_gather(Tensor::<1>::from_data(TensorData::new(values, [len]), &device))?;
    all.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| CommError::Backend(format!("cannot read {what} back from the all-gather: {e:?}")))
}
