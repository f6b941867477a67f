//! Creating the raw communicator ([`init_comm`]): non-blocking through `ncclCommInitRankConfig`
//! and polled until every rank has joined or the timeout passes (then aborted), or, with an NCCL
//! older than 2.14, blocking through `ncclCommInitRank`, without a timeout.

use std::ffi::{c_int, c_uint};
use std::ptr;
use std::time::{Duration, Instant};

use cudarc::nccl::sys::ncclResult_t;
use cudarc::nccl::{result as nccl, sys as ncclsys};

use super::config::{NCCL_2_14, NcclConfigV21400, version_string};
use super::id::NcclId;
use super::library::nccl_has_symbol;
use super::state::{CommState, async_state};
use crate::CommError;

/// How often the initialisation polls `ncclCommGetAsyncError`.
const INIT_POLL: Duration = Duration::from_millis(1);

/// Creates the communicator: non-blocking with a timeout when the NCCL loaded supports it,
/// blocking otherwise. Returns it and whether it was created non-blocking.
pub(super) fn init_comm(
    id: &NcclId,
    rank: usize,
    world_size: usize,
    device_index: usize,
    timeout: Duration,
) -> Result<(ncclsys::ncclComm_t, bool), CommError> {
    let (nranks, my_rank) = match (c_int::try_from(world_size), c_int::try_from(rank)) {
        (Ok(nranks), Ok(my_rank)) => (nranks, my_rank),
        _ => return Err(CommError::InvalidWorldSize(world_size)),
    };
    let who = format!("rank {rank} of {world_size} on CUDA device {device_index}");
    // ncclCommAbort and ncclCommGetAsyncError (every collective uses them) exist since NCCL 2.4,
    // ncclGetVersion since 2.3: probe before calling, cudarc's loader panics on a missing symbol.
    if !nccl_has_symbol(c"ncclCommAbort") || !nccl_has_symbol(c"ncclCommGetAsyncError") {
        return Err(CommError::Unavailable(
            "the loaded libnccl lacks ncclCommAbort/ncclCommGetAsyncError (NCCL < 2.4): install NCCL 2.14 or newer"
                .into(),
        ));
    }
    let version =
        nccl::get_nccl_version().map_err(|e| CommError::Backend(format!("ncclGetVersion returned {:?}", e.0)))?;
    let version = c_uint::try_from(version).unwrap_or(0);
    let mut comm: ncclsys::ncclComm_t = ptr::null_mut();
    if version < NCCL_2_14 || !nccl_has_symbol(c"ncclCommInitRankConfig") {
        tracing::warn!(
            "NCCL {} predates non-blocking communicators (2.14): joining the communicator as {who} blocks \
             until every rank has joined, without a timeout",
            version_string(version)
        );
        // SAFETY: `comm` is a valid out-pointer for the call; the id is passed by value; the
        // caller made device `device_index`'s primary context current, the device NCCL takes.
        let result = unsafe { ncclsys::ncclCommInitRank(&mut comm, nranks, id.raw(), my_rank) };
        if result != ncclResult_t::ncclSuccess || comm.is_null() {
            return Err(CommError::Backend(format!(
                "ncclCommInitRank ({who}) returned {result:?} (set NCCL_DEBUG=WARN for NCCL's reason)"
            )));
        }
        return Ok((comm, false));
    }
    // NCCL copies the config during the call (`parseCommConfig`, before the initialisation
    // continues in the background); it lives until this function returns in any case.
    let mut config = NcclConfigV21400::non_blocking();
    // SAFETY: `comm` is a valid out-pointer; `config` is a live, fully initialised
    // `ncclConfig_v21400` (see `NcclConfigV21400`), passed as the `ncclConfig_t*` NCCL ≥ 2.14
    // accepts for it (the version check above; the symbol exists, so cudarc's loader does not
    // panic); the caller made the device current.
    let result = unsafe {
        ncclsys::ncclCommInitRankConfig(
            &mut comm,
            nranks,
            id.raw(),
            my_rank,
            (&raw mut config).cast::<ncclsys::ncclConfig_t>(),
        )
    };
    let abort = |comm: ncclsys::ncclComm_t| {
        if !comm.is_null() {
            // SAFETY: a non-null `comm` is the communicator this call created (NCCL nulls it
            // when creation fails outright), not yet aborted or destroyed, and used by this
            // thread only: no `NcclComm` holds it yet.
            let _ = unsafe { nccl::comm_abort(comm) };
        }
    };
    if !matches!(result, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) || comm.is_null() {
        abort(comm);
        return Err(CommError::Backend(format!(
            "ncclCommInitRankConfig ({who}) returned {result:?} (set NCCL_DEBUG=WARN for NCCL's reason)"
        )));
    }
    wait_until_ready(comm, &who, rank, world_size, timeout, "joining the communicator")?;
    Ok((comm, true))
}

/// Polls a communicator being created non-blocking (`ncclCommInitRankConfig`, `ncclCommSplit`)
/// until it is ready; aborts it and fails on an error or after `timeout`. `who` names the rank
/// and device in the messages, `doing` what was being done ("joining the communicator").
///
/// # Errors
/// [`CommError::Backend`] when NCCL reports an error, [`CommError::NcclTimeout`] after
/// `timeout`; the communicator is aborted in both cases.
pub(super) fn wait_until_ready(
    comm: ncclsys::ncclComm_t,
    who: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    doing: &str,
) -> Result<(), CommError> {
    let abort = |comm: ncclsys::ncclComm_t| {
        // SAFETY: `comm` is the non-null communicator the caller just created, not yet aborted
        // or destroyed, and used by this thread only: no `NcclComm` holds it yet.
        let _ = unsafe { nccl::comm_abort(comm) };
    };
    // Non-blocking: the communicator is ready when its state leaves ncclInProgress (NCCL user
    // guide, "Creating a communication with options" and "Fault Tolerance").
    let start = Instant::now();
    loop {
        match async_state(comm) {
            CommState::Ready => break,
            CommState::InProgress => {}
            CommState::Failed(what) => {
                abort(comm);
                return Err(CommError::Backend(format!(
                    "{doing} as {who} failed with {what}: check that every rank uses the same NCCL id and reaches \
                     the others over the network (set NCCL_DEBUG=WARN for NCCL's reason)"
                )));
            }
        }
        let waited = start.elapsed();
        if waited > timeout {
            abort(comm);
            return Err(CommError::NcclTimeout {
                rank,
                op: format!(
                    "initialisation ({doing} as {who}: check that all {world_size} ranks started and joined \
                     with the same NCCL id, and that every node reaches the others over the network, e.g. \
                     NCCL_SOCKET_IFNAME; the timeout is the one given to NcclComm::new_with_init_timeout or \
                     NcclComm::from_rendezvous_env, or the parent's for a sub-group)"
                ),
                waited,
            });
        }
        std::thread::sleep(INIT_POLL);
    }
    Ok(())
}
