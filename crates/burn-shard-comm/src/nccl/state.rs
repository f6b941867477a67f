//! The communicator's state as `ncclCommGetAsyncError` reports it ([`CommState`]): ready, still
//! in progress (a non-blocking communicator initialising or issuing), or failed with NCCL's
//! error named. Initialisation, every wait of a collective and `Drop` poll it.

use cudarc::nccl::sys as ncclsys;
use cudarc::nccl::sys::ncclResult_t;

/// What `ncclCommGetAsyncError` reports.
pub(super) enum CommState {
    /// `ncclSuccess`: everything issued so far is on the stream, no error.
    Ready,
    /// `ncclInProgress`: a non-blocking communicator is still initialising or issuing.
    InProgress,
    /// An asynchronous error, or the query's own error, named.
    Failed(String),
}

/// The communicator's state, from `ncclCommGetAsyncError`.
pub(super) fn async_state(comm: ncclsys::ncclComm_t) -> CommState {
    debug_assert!(!comm.is_null(), "ncclCommGetAsyncError on an aborted communicator");
    // NCCL writes a C `ncclResult_t` (an `int`). It is read as an integer, not as cudarc's
    // `#[repr(u32)]` enum, for which a code that binding does not list would be an invalid value.
    let mut state: u32 = ncclResult_t::ncclSuccess as u32;
    // SAFETY: every caller passes a live communicator (non-null: neither aborted nor destroyed)
    // that only it uses now (it holds the lock, or no `NcclComm` owns the communicator yet);
    // `state` is a valid, aligned out-pointer of the enum's size (4 bytes). NCCL allows this call
    // during initialisation and with work in flight: it is how both are polled.
    let result = unsafe { ncclsys::ncclCommGetAsyncError(comm, (&raw mut state).cast::<ncclResult_t>()) };
    if result != ncclResult_t::ncclSuccess {
        return CommState::Failed(format!("{result:?} from ncclCommGetAsyncError"));
    }
    match state {
        s if s == ncclResult_t::ncclSuccess as u32 => CommState::Ready,
        s if s == ncclResult_t::ncclInProgress as u32 => CommState::InProgress,
        code => CommState::Failed(nccl_code_name(code)),
    }
}

/// The name nccl.h gives an `ncclResult_t` code (stable across NCCL 2.x).
fn nccl_code_name(code: u32) -> String {
    const NAMES: [&str; 9] = [
        "ncclSuccess",
        "ncclUnhandledCudaError",
        "ncclSystemError",
        "ncclInternalError",
        "ncclInvalidArgument",
        "ncclInvalidUsage",
        "ncclRemoteError",
        "ncclInProgress",
        "ncclTimeout",
    ];
    match NAMES.get(code as usize) {
        Some(name) => (*name).to_string(),
        None => format!("NCCL error code {code}"),
    }
}
