//! Issuing the NCCL calls of one collective ([`NcclComm::issue`]): one call per launch, inside
//! `ncclGroupStart`/`ncclGroupEnd` when there are several, the group always closed, the first
//! error returned for the caller to abort on.

use cudarc::nccl::result as nccl;
use cudarc::nccl::result::{NcclError, NcclStatus};

use super::buffers::Launch;
use super::comm::NcclComm;
use crate::CommError;

impl NcclComm {
    /// Issues one NCCL call per launch, as one group when there are several. Every error is
    /// returned (the caller aborts the communicator: a group's dynamic errors concern all its
    /// operations, and the peers may already wait for the part that was issued).
    pub(super) fn issue(
        &self,
        op: &str,
        launches: &[Launch],
        call: &mut impl FnMut(&Launch) -> Result<NcclStatus, NcclError>,
    ) -> Result<(), CommError> {
        let failed = |what: &str, e: NcclError| {
            CommError::Backend(format!(
                "rank {}: {what} for {op} returned {:?} (set NCCL_DEBUG=WARN for NCCL's reason)",
                self.rank, e.0
            ))
        };
        let grouped = launches.len() > 1;
        if grouped {
            nccl::group_start().map_err(|e| failed("ncclGroupStart", e))?;
        }
        let mut failure = None;
        for launch in launches {
            // `Ok(InProgress)` (non-blocking communicators) is settled by `wait_ready`; inside a
            // group NCCL reports through ncclGroupEnd.
            if let Err(e) = call(launch) {
                failure = Some(failed("the NCCL call", e));
                break;
            }
        }
        if grouped {
            // Always close the group: group state is per thread, and an open group would swallow
            // this thread's next NCCL calls.
            let end = nccl::group_end();
            if let (None, Err(e)) = (&failure, end) {
                failure = Some(failed("ncclGroupEnd", e));
            }
        }
        failure.map_or(Ok(()), Err)
    }
}
