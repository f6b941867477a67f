//! What the optimizer keeps per layout slot between steps, and what checkpoints save of it:
//! Burn's optimizer state of this rank's piece of each parameter, and the `f32` master of a
//! `bf16`/`f16` one.

use burn::optim::LearningRate;
use burn::tensor::{DType, Device, Tensor};

use crate::model::flat::tensor_bytes;
use crate::optim::master::{self, MasterWeightStep};

/// Per layout slot: the optimizer's state and the `f32` master of this rank's piece.
pub(crate) struct SlotStates<O: MasterWeightStep> {
    /// Burn's optimizer state of each slot's piece owned by this rank (`None` before the slot's
    /// first gradient, and for slots outside this rank's range).
    pub(crate) states: Vec<Option<O::State<1>>>,
    /// `f32` master copy of each `bf16`/`f16` slot's piece owned by this rank (`None` for `f32`
    /// slots and before the slot's first gradient).
    pub(crate) masters: Vec<Option<Tensor<1>>>,
    /// Per slot: whether its master takes the elements edited since the last step
    /// ([`SlotStates::mark_edited`]) when the slot is next stepped.
    follow_edits: Vec<bool>,
}

impl<O: MasterWeightStep> SlotStates<O> {
    /// No state yet for `slots` slots.
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            states: vec![None; slots],
            masters: vec![None; slots],
            follow_edits: vec![false; slots],
        }
    }

    /// Steps slot `index`'s piece `param` (`[len]`, the bucket's dtype) with `grad` (`[len]`)
    /// and `optim`, updating the slot's state; returns the new piece. A `bf16`/`f16` piece is
    /// stepped through its `f32` master (made from `param` at its first step), and the model
    /// gets the master rounded.
    pub(crate) fn step(
        &mut self,
        index: usize,
        optim: &O,
        lr: LearningRate,
        param: Tensor<1>,
        grad: Tensor<1>,
    ) -> Tensor<1> {
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
        param
    }

    /// Marks every slot's parameter as edited: its master takes the edited elements when the
    /// slot is next stepped (see [`ShardedOptimizer::reset_master_weights`](crate::ShardedOptimizer::reset_master_weights)).
    pub(crate) fn mark_edited(&mut self) {
        self.follow_edits.iter_mut().for_each(|f| *f = true);
    }

    /// Bytes of every state and master as `(on device, elsewhere)`, `device` being the
    /// parameters' device (`None` for a model without tensors, which has no state either).
    pub(crate) fn bytes(&self, device: Option<&Device>) -> (usize, usize) {
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
        (on_device, elsewhere)
    }
}
