//! Sub-groups ([`NcclComm::split_group`], behind `Collective::split`): `ncclCommSplit` (NCCL
//! 2.18), created non-blocking and polled with the parent's timeout, as `init.rs` creates the
//! parent; with an older NCCL, a new communicator per group from an id its rank 0 creates.

use std::ffi::c_int;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::nccl::sys as ncclsys;
use cudarc::nccl::sys::ncclResult_t;

use super::comm::{NcclComm, Raw};
use super::config::NcclConfigV21400;
use super::id::NcclId;
use super::init::wait_until_ready;
use super::library::nccl_has_symbol;
use super::state::{CommState, async_state};
use crate::CommError;
use crate::split::SplitPlan;
use crate::stats::StatsCounter;

/// What `ncclCommSplit` is given to write into and read, kept for the process's life (see
/// [`NcclComm::split_group`]).
struct SplitCall {
    slot: AtomicPtr<ncclsys::ncclComm>,
    config: NcclConfigV21400,
}

impl NcclComm {
    /// The sub-group of the ranks that pass `color`, numbered by `key` then rank, on this
    /// rank's GPU. Every rank first reaches the split through one all-gather of the colors on
    /// this communicator (so a rank that failed before it aborts the others instead of leaving
    /// them in `ncclCommSplit`); the sub-group is created non-blocking and polled with this
    /// communicator's timeout, and has its own stream, lock and abort state.
    ///
    /// An NCCL without `ncclCommSplit` (before 2.18) gets new communicators instead (see
    /// [`NcclComm::split_by_new_ids`]).
    ///
    /// # Errors
    /// As `crate::split::plan`; [`CommError::Backend`] or [`CommError::NcclTimeout`] when NCCL
    /// fails to create it.
    pub(super) fn split_group(&self, color: usize, key: usize) -> Result<NcclComm, CommError> {
        let plan = crate::split::plan(self, color, key)?;
        if !nccl_has_symbol(c"ncclCommSplit") {
            return self.split_by_new_ids(&plan);
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
        // With a non-blocking parent, ncclCommSplit returns ncclInProgress and NCCL's own thread
        // writes the new communicator into `slot` once the split completes, which may be after
        // this function returned on a timeout: the slot (and the config NCCL was given) are
        // leaked, never freed under it (a few dozen bytes per split, once per mesh).
        let call: &'static mut SplitCall = Box::leak(Box::new(SplitCall {
            slot: AtomicPtr::new(ptr::null_mut()),
            config: NcclConfigV21400::non_blocking(),
        }));
        {
            let mut raw = self.acquire()?;
            // SAFETY: `raw.comm` is live (`acquire` fails on an aborted one) and this thread
            // holds its lock, so no other NCCL call runs on it until the split is complete (the
            // loop below keeps the lock); `call.slot` is a valid, never-freed out-pointer of
            // `ncclComm_t`'s size; `call.config` is a live, never-freed `ncclConfig_v21400`
            // passed as the `ncclConfig_t*` NCCL ≥ 2.14 reads (the symbol exists, so NCCL is
            // ≥ 2.18 and cudarc's loader does not panic); the device was made current above.
            let result = unsafe {
                ncclsys::ncclCommSplit(
                    raw.comm,
                    color_c,
                    key_c,
                    call.slot.as_ptr(),
                    (&raw mut call.config).cast::<ncclsys::ncclConfig_t>(),
                )
            };
            if !matches!(result, ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress) {
                return Err(CommError::Backend(format!(
                    "ncclCommSplit ({who}) returned {result:?} (set NCCL_DEBUG=WARN for NCCL's reason)"
                )));
            }
            // The parent is busy until the split is complete (NCCL's "Fault Tolerance": a
            // non-blocking call's communicator is polled until it leaves ncclInProgress); on a
            // failure or the timeout it is aborted, which stops the split too.
            let start = Instant::now();
            loop {
                match async_state(raw.comm) {
                    CommState::Ready => break,
                    CommState::InProgress => {}
                    CommState::Failed(what) => {
                        self.abort_locked(&mut raw, &format!("ncclCommSplit failed with {what}"));
                        return Err(CommError::Backend(format!(
                            "ncclCommSplit ({who}) failed with {what} (set NCCL_DEBUG=WARN for NCCL's reason)"
                        )));
                    }
                }
                if start.elapsed() > self.timeout {
                    self.abort_locked(&mut raw, "ncclCommSplit timed out");
                    return Err(CommError::NcclTimeout {
                        rank: self.rank,
                        op: format!("ncclCommSplit ({who}): check that every rank of the parent reached the split"),
                        waited: start.elapsed(),
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let newcomm = call.slot.load(Ordering::SeqCst);
        if newcomm.is_null() {
            return Err(CommError::Backend(format!(
                "ncclCommSplit ({who}) completed without a communicator for this rank"
            )));
        }
        wait_until_ready(
            newcomm,
            &who,
            plan.rank,
            plan.members.len(),
            self.timeout,
            "joining the sub-group",
        )?;
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

    /// NCCL before 2.18: each sub-group's rank 0 creates an NCCL id, the ranks all-gather the
    /// ids on this communicator (one byte per element, exact in `f32`, and a flag for a leader
    /// that could not create one), and each rank joins its group's id with
    /// `ncclCommInitRank(Config)` on its GPU, as `NcclComm::new` does.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the leader that could not create the id (on every rank of
    /// its group); the all-gather's and the join's errors.
    fn split_by_new_ids(&self, plan: &SplitPlan) -> Result<NcclComm, CommError> {
        const ID: usize = 128;
        let (mut sent, mut own_error) = (vec![0.0f32; ID + 1], None);
        if plan.rank == 0 {
            match NcclId::new() {
                Ok(id) => sent[..ID]
                    .iter_mut()
                    .zip(id.bytes())
                    .for_each(|(v, b)| *v = f32::from(b)),
                Err(e) => {
                    sent[ID] = 1.0;
                    own_error = Some(e);
                }
            }
        }
        let all = crate::split::all_gather_values(self, sent, "the sub-groups' NCCL ids")?;
        let leader = plan.members[0];
        let chunk = &all[leader * (ID + 1)..(leader + 1) * (ID + 1)];
        if let Some(e) = own_error {
            return Err(e);
        }
        if chunk[ID] != 0.0 {
            return Err(CommError::Backend(format!(
                "rank {leader} could not create the NCCL id of its sub-group (see its error)"
            )));
        }
        let mut bytes = [0u8; ID];
        bytes.iter_mut().zip(chunk).for_each(|(b, v)| *b = *v as u8);
        tracing::info!(
            rank = self.rank,
            "this NCCL has no ncclCommSplit (2.18): joining the sub-group through a new communicator"
        );
        let comm = NcclComm::new_with_init_timeout(
            self.device_index,
            plan.rank,
            plan.members.len(),
            &NcclId::from_bytes(bytes),
            self.timeout,
        )?;
        Ok(comm.with_timeout(self.timeout))
    }
}
