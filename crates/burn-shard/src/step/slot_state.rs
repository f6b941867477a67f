//! What the optimizer keeps per layout slot between steps, and what checkpoints save of it:
//! Burn's optimizer state of this rank's piece of each parameter, and the `f32` master of a
//! `bf16`/`f16` one.

use burn::optim::LearningRate;
use burn::tensor::{DType, Device, Tensor};

use crate::error::ShardError;
use crate::model::flat::tensor_bytes;
use crate::optim::master::{self, MasterWeightStep};
use crate::swap::slot_bytes::StateAndMaster;
use crate::swap::swapper::{IoBytes, Swapper};

/// Per layout slot: the optimizer's state and the `f32` master of this rank's piece, in memory
/// or, with [`NvmeOffload`](crate::NvmeOffload), on disk between steps.
pub(crate) struct SlotStates<O: MasterWeightStep> {
    /// Burn's optimizer state of each slot's piece owned by this rank (`None` before the slot's
    /// first gradient, for slots outside this rank's range, and for every slot between steps
    /// when `swap` keeps them on disk).
    pub(crate) states: Vec<Option<O::State<1>>>,
    /// `f32` master copy of each `bf16`/`f16` slot's piece owned by this rank (`None` for `f32`
    /// slots and before the slot's first gradient).
    pub(crate) masters: Vec<Option<Tensor<1>>>,
    /// Per slot: whether its master takes the elements edited since the last step
    /// ([`SlotStates::mark_edited`]) when the slot is next stepped.
    follow_edits: Vec<bool>,
    /// NVMe offload: where the states and masters are between steps.
    swap: Option<Swapper>,
}

/// Bytes of the optimizer state, by where it is.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StateBytes {
    /// On the parameters' device.
    pub(crate) on_device: usize,
    /// In memory elsewhere (host memory, with `Offload`).
    pub(crate) elsewhere: usize,
    /// In the swap file (NVMe offload).
    pub(crate) on_disk: usize,
}

impl<O: MasterWeightStep> SlotStates<O> {
    /// No state yet for `slots` slots; on disk between steps when `swap` is given.
    pub(crate) fn new(slots: usize, swap: Option<Swapper>) -> Self {
        Self {
            states: vec![None; slots],
            masters: vec![None; slots],
            follow_edits: vec![false; slots],
            swap,
        }
    }

    /// Whether the states live on disk between steps.
    pub(crate) fn swaps(&self) -> bool {
        self.swap.is_some()
    }

    /// Starts a step that will step `order`'s slots in that order (NVMe offload reads them
    /// ahead; nothing to do otherwise).
    pub(crate) fn begin_step(&mut self, order: impl IntoIterator<Item = usize>) {
        if let Some(swap) = &mut self.swap {
            swap.begin(order);
        }
    }

    /// Ends the step: NVMe offload waits for its writes and returns the step's first I/O error.
    ///
    /// # Errors
    /// [`ShardError::Nvme`].
    pub(crate) fn end_step(&mut self) -> Result<(), ShardError> {
        self.swap.as_mut().map_or(Ok(()), Swapper::finish)
    }

    /// Slot `index`'s state and master (clones; read from disk with NVMe offload, between
    /// steps).
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when the swap file cannot be read back.
    pub(crate) fn read(&self, index: usize) -> Result<StateAndMaster<O::State<1>>, ShardError> {
        match &self.swap {
            Some(swap) => swap.peek(index),
            None => Ok((self.states[index].clone(), self.masters[index].clone())),
        }
    }

    /// Replaces every slot's state and master (a loaded checkpoint); with NVMe offload they are
    /// written to disk and dropped from memory.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when they cannot be written.
    pub(crate) fn replace(
        &mut self,
        states: Vec<Option<O::State<1>>>,
        masters: Vec<Option<Tensor<1>>>,
    ) -> Result<(), ShardError> {
        let Some(swap) = &mut self.swap else {
            self.states = states;
            self.masters = masters;
            return Ok(());
        };
        // Not a step: `nvme_io_bytes` keeps reporting the last one.
        let last = swap.last_step_io();
        swap.begin([]);
        for (index, (state, master)) in states.into_iter().zip(masters).enumerate() {
            swap.put(index, state.as_ref(), master.as_ref());
        }
        let written = swap.finish();
        swap.set_last_step_io(last);
        written
    }

    /// The swap files' directory, with NVMe offload.
    pub(crate) fn swap_dir(&self) -> Option<std::path::PathBuf> {
        self.swap
            .as_ref()
            .and_then(|swap| swap.path().parent().map(|dir| dir.to_path_buf()))
    }

    /// Bytes read from and written to the swap file by the last step (zero without NVMe
    /// offload).
    pub(crate) fn last_step_io(&self) -> IoBytes {
        self.swap.as_ref().map(Swapper::last_step_io).unwrap_or_default()
    }

    /// Steps slot `index`'s piece `param` (`[len]`, the bucket's dtype) with `grad` (`[len]`)
    /// and `optim`, updating the slot's state; returns the new piece. A `bf16`/`f16` piece is
    /// stepped through its `f32` master (made from `param` at its first step), and the model
    /// gets the master rounded. With NVMe offload the state and master are read first and
    /// written back behind.
    pub(crate) fn step(
        &mut self,
        index: usize,
        optim: &O,
        lr: LearningRate,
        param: Tensor<1>,
        grad: Tensor<1>,
    ) -> Tensor<1> {
        if !self.swap_in(index) {
            // Recorded: the step ends with the error on every rank; the piece keeps its value.
            return param;
        }
        let state = self.states[index].take();
        // The piece has its bucket's dtype (stages 0-2 refuse a parameter whose dtype changed;
        // stage-3 shards keep theirs), so the dtype decides the master as the bucket's would.
        let (param, state) = if master::needs_master(param.dtype()) {
            let follow = std::mem::take(&mut self.follow_edits[index]);
            let master = match self.masters[index].take() {
                Some(master) if follow => master::follow_edits(master, &param),
                Some(master) => master,
                None => param.clone().cast(DType::F32),
            };
            let (master, param, state) = optim.step_with_master(lr, master, param, grad, state);
            self.masters[index] = Some(master);
            (param, state)
        } else {
            optim.step(lr, param, grad, state)
        };
        self.states[index] = state;
        self.swap_out(index);
        param
    }

    /// NVMe offload: brings slot `index`'s state and master into memory; `false` when they
    /// could not be read (the error is kept for [`SlotStates::end_step`]). `true` without it.
    fn swap_in(&mut self, index: usize) -> bool {
        let Some(swap) = &mut self.swap else {
            return true;
        };
        match swap.take(index) {
            Ok((state, master)) => {
                (self.states[index], self.masters[index]) = (state, master);
                true
            }
            Err(_) => false,
        }
    }

    /// NVMe offload: writes slot `index`'s state and master behind the step and drops them from
    /// memory.
    fn swap_out(&mut self, index: usize) {
        if let Some(swap) = &mut self.swap {
            let (state, master) = (self.states[index].take(), self.masters[index].take());
            swap.put(index, state.as_ref(), master.as_ref());
        }
    }

    /// Marks every slot's parameter as edited: its master takes the edited elements when the
    /// slot is next stepped (see [`ShardedOptimizer::reset_master_weights`](crate::ShardedOptimizer::reset_master_weights)).
    pub(crate) fn mark_edited(&mut self) {
        self.follow_edits.iter_mut().for_each(|f| *f = true);
    }

    /// Bytes of every state and master by where they are, `device` being the parameters'
    /// device (`None` for a model without tensors, which has no state either).
    pub(crate) fn bytes(&self, device: Option<&Device>) -> StateBytes {
        let (mut on_device, mut elsewhere) = (0, 0);
        for state in self.states.iter().flatten() {
            let (here, there) = device.map_or((0, 0), |device| O::state_bytes(state, device));
            on_device += here;
            elsewhere += there;
        }
        for master in self.masters.iter().flatten() {
            match device.is_none_or(|d| master.device() == *d) {
                true => on_device += tensor_bytes(master),
                false => elsewhere += tensor_bytes(master),
            }
        }
        StateBytes {
            on_device,
            elsewhere,
            on_disk: self.swap.as_ref().map_or(0, Swapper::disk_bytes),
        }
    }
}
