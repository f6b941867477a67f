//! Sub-groups ([`NcclComm::split_group`], behind `Collective::split`): `ncclCommSplit` (NCCL
//! 2.18), created non-blocking and polled with the parent's timeout, as `init.rs` creates the
//! parent.

use std::ffi::c_int;
use std::ptr;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::nccl::sys as ncclsys;
use cudarc::nccl::sys::ncclResult_t;

use super::comm::{NcclComm, Raw};
use super::config::NcclConfigV21400;
use super::init::wait_until_ready;
use super::library::nccl_has_symbol;
use crate::CommError;
use crate::stats::StatsCounter;

impl NcclComm {
    /// The sub-group of the ranks that pass `color`, numbered by `key` then rank, on this
    /// rank's GPU. Every rank first reaches the split through one all-gather of the colors on
    /// this communicator (so a rank that failed before it aborts the others instead of leaving
    /// them in `ncclCommSplit`); the sub-group is created non-blocking and polled with this
    /// communicator's timeout, and has its own stream, lock and abort state.
    ///
    /// # Errors
    /// As `crate::split::plan`; [`CommError::Unsupported`] (on every rank, which load the same
    /// NCCL) when the loaded NCCL has no `ncclCommSplit` (before 2.18); [`CommError::Backend`] or
    /// [`CommError::NcclTimeout`] when NCCL fails to create it.
    pub(super) fn split_group(&self, color: usize, key: usize) -> Result<NcclComm, CommError> {
        let plan = crate::split::plan(self, color, key)?;
        if !nccl_has_symbol(c"ncclCommSplit") {
            return Err(CommError::Unsupported(
                "sub-groups of an NCCL communicator need ncclCommSplit (NCCL 2.18 or newer): install a newer NCCL \
                 (pip's nvidia-nccl-cu12 has it)"
                    .into(),
            ));
        }
        let (Ok(color_c), Ok(key_c)) = (c_int::try_from(color), c_int::try_from(key)) else {
            unreachable!("plan keeps colors and keys below 2^24");
        };
        let who = format!(
            "rank {} of a sub-group of {} on CUDA device {}",
            plan.rank,
            plan.members.len(),
            self.device_index
        );
        let ctx =
            CudaContext::new(self.device_index).map_err(|e| CommError::Backend(format!("CUDA context: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| CommError::Backend(format!("CUDA stream: {e:?}")))?;
        // NCCL creates the sub-group on the calling thread's current device.
        ctx.bind_to_thread()
            .map_err(|e| CommError::Backend(format!("CUDA context: {e:?}")))?;
        let mut newcomm: ncclsys::ncclComm_t = ptr::null_mut();
        {
            let raw = self.acquire()?;
            let mut config = NcclConfigV21400::non_blocking();
            // SAFETY: `raw.comm` is live (`acquire` fails on an aborted one) and this thread
            // holds its lock, so no other NCCL call runs on it; `newcomm` is a valid out-pointer;
            // `config` is a live `ncclConfig_v21400` passed as the `ncclConfig_t*` NCCL ≥ 2.14
            // reads (the symbol exists, so NCCL is ≥ 2.18 and cudarc's loader does not panic);
            // the device was made current above.
            let result = unsafe {
                ncclsys::ncclCommSplit(
                    raw.comm,
                    color_c,
                    key_c,
                    &mut newcomm,
                    (&raw mut config).cast::<ncclsys::ncclConfig_t>(),
                )
            };
            if !matches!(result, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) || newcomm.is_null() {
                if !newcomm.is_null() {
                    // SAFETY: the communicator this call created, used by no one else.
                    let _ = unsafe { cudarc::nccl::result::comm_abort(newcomm) };
                }
                return Err(CommError::Backend(format!(
                    "ncclCommSplit ({who}) returned {result:?} (set NCCL_DEBUG=WARN for NCCL's reason)"
                )));
            }
        }
        wait_until_ready(newcomm, &who, plan.rank, plan.members.len(), self.timeout)?;
        Ok(NcclComm {
            raw: Mutex::new(Raw { comm: newcomm, stream }),
            abort_requested: AtomicBool::new(false),
            abort_reason: OnceLock::new(),
            nonblocking: self.nonblocking,
            rank: plan.rank,
            world_size: plan.members.len(),
            device_index: self.device_index,
            device: self.device.clone(),
            timeout: self.timeout,
            stats: StatsCounter::default(),
        })
    }
}
