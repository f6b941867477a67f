//! Sub-groups ([`MpiComm::split_group`], behind `Collective::split`): `MPI_Comm_split` of the
//! collectives' communicator; the control communicator stays the job's.

use std::mem::ManuallyDrop;
use std::sync::Mutex;

use ::mpi::topology::Color;
use ::mpi::traits::*;

use super::comm::{MpiComm, State};
use super::process::mpi_calls;
use crate::CommError;
use crate::stats::StatsCounter;

impl MpiComm {
    /// The sub-group of the ranks that pass `color`, numbered by `key` then rank. Every rank
    /// first reaches the split through one polled all-gather of the colors (so a rank that
    /// failed before it aborts the others instead of leaving them in the blocking
    /// `MPI_Comm_split`); the sub-group keeps this rank's timeout, sends and receives its abort
    /// notices on the job's control communicator, and shares this process's abort state: an
    /// abort of any group of the process aborts all of them, and reaches every process.
    ///
    /// # Errors
    /// As `crate::split::plan`; [`CommError::Backend`] if MPI leaves this rank out.
    pub(super) fn split_group(&self, color: usize, key: usize) -> Result<MpiComm, CommError> {
        let plan = crate::split::plan(self, color, key)?;
        let _calls = mpi_calls();
        let state = self.state();
        // Ties of `key` are broken by rank in the parent, as in `plan`.
        let data = state
            .data
            .split_by_color_with_key(Color::with_value(color as i32), key as i32)
            .ok_or_else(|| {
                CommError::Backend(format!("MPI_Comm_split left rank {} out of color {color}", self.rank))
            })?;
        debug_assert_eq!(data.rank() as usize, plan.rank);
        Ok(MpiComm {
            rank: plan.rank,
            world_size: plan.members.len(),
            timeout: self.timeout,
            state: Mutex::new(ManuallyDrop::new(State {
                data,
                control: state.control.clone(),
                seq: 0,
                abandoned: false,
            })),
            abort: self.abort.clone(),
            stats: StatsCounter::default(),
        })
    }
}
