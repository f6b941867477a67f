//! What the optimizer keeps per layout slot between steps, and what checkpoints save of it:
//! Burn's optimizer state of this rank's piece of each parameter, and the `f32` master of a
//! `bf16`/`f16` one.

use burn::optim::LearningRate;
use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::error::ShardError;
use crate::model::flat::tensor_bytes;
use crate::optim::master::{self, MasterWeightStep};
use crate::optim::state_home::StateHome;
use crate::swap::slot_bytes::Field;
use crate::swap::swapper::{IoBytes, SlotReader, Staging, Swapper};

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
    /// Where the states and masters live in memory, and where the update runs.
    home: StateHome,
}

/// Every slot's state and master as a checkpoint load reads them ([`SlotStates::loading`]).
pub(crate) enum LoadedSlots<S> {
    InMemory {
        states: Vec<Option<S>>,
        masters: Vec<Option<Tensor<1>>>,
    },
    /// Written to the swap file, not live yet.
    Staged(Staging),
}

impl<S: burn::optim::RecordState> LoadedSlots<S> {
    /// Slot `index`'s loaded state and master.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when they cannot be written to the swap file.
    pub(crate) fn put(&mut self, index: usize, state: Option<S>, master: Option<Tensor<1>>) -> Result<(), ShardError> {
        match self {
            Self::InMemory { states, masters } => {
                states[index] = state;
                masters[index] = master;
                Ok(())
            }
            Self::Staged(staged) => staged.put(index, state.as_ref(), master.as_ref()),
        }
    }
}

/// One slot's state and master as a checkpoint writes them ([`SlotStates::saved`]).
#[derive(Default)]
pub(crate) struct SavedSlot {
    /// The state's tensors, by `StateSink` name (empty: no state).
    pub(crate) state: Vec<(String, SavedTensor)>,
    /// The state's scalars, by `StateSink` name.
    pub(crate) scalars: Vec<(String, burn_pack::Scalar)>,
    pub(crate) master: Option<SavedTensor>,
}

/// One tensor of a slot: its data, or where it is in the swap file.
pub(crate) enum SavedTensor {
    InMemory(TensorData),
    /// Boxed: a reader with the slot's layout is larger than the data's handle.
    OnDisk(Box<(SlotReader, Field)>),
}

/// Bytes of the optimizer state, by where it is.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StateBytes {
    /// On the parameters' device.
    pub(crate) on_device: usize,
    /// In memory elsewhere (host memory, with the state on the host).
    pub(crate) elsewhere: usize,
    /// In the swap file (NVMe offload).
    pub(crate) on_disk: usize,
}

impl<O: MasterWeightStep> SlotStates<O> {
    /// No state yet for `slots` slots; living at `home`, and on disk between steps when `swap`
    /// is given.
    pub(crate) fn new(slots: usize, swap: Option<Swapper>, home: StateHome) -> Self {
        Self {
            states: vec![None; slots],
            masters: vec![None; slots],
            follow_edits: vec![false; slots],
            swap,
            home,
        }
    }

    /// The device the states and masters of parameters on `param_device` live on (where a
    /// checkpoint load places them).
    pub(crate) fn device(&self, param_device: &Device) -> Device {
        self.home.device(param_device)
    }

    /// Drops slot `index`'s state and master in memory (stage 3: a parameter that changed
    /// between whole and flat keeps neither; with the state on disk `with_group` refuses such
    /// a change).
    pub(crate) fn forget(&mut self, index: usize) {
        self.states[index] = None;
        self.masters[index] = None;
        self.follow_edits[index] = false;
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

    /// Slot `index`'s state and master as a checkpoint writes them: the state's scalars, and
    /// each tensor (named as `StateSink` names it; the master last, unnamed) in memory, or with
    /// NVMe offload where it is on disk, to be read when written (one tensor in memory at a
    /// time, whatever the model's size).
    pub(crate) fn saved(&self, index: usize) -> SavedSlot {
        let Some(swap) = &self.swap else {
            let mut saved = SavedSlot::default();
            if let Some(state) = &self.states[index] {
                let mut sink = burn::optim::StateSink::default();
                burn::optim::RecordState::state_flatten(state, "", &mut sink);
                saved.state = sink
                    .tensors
                    .into_iter()
                    .map(|(n, d)| (n, SavedTensor::InMemory(d)))
                    .collect();
                saved.scalars = sink.scalars;
            }
            saved.master = self.masters[index]
                .clone()
                .map(|m| SavedTensor::InMemory(m.into_data()));
            return saved;
        };
        let Some(reader) = swap.slot_reader(index) else {
            return SavedSlot::default();
        };
        let on_disk = |field: &Field| SavedTensor::OnDisk(Box::new((reader.clone(), field.clone())));
        SavedSlot {
            state: reader
                .layout
                .state
                .iter()
                .flatten()
                .map(|f| (f.name.clone(), on_disk(f)))
                .collect(),
            scalars: reader.layout.scalars.clone(),
            master: reader.layout.master.as_ref().map(on_disk),
        }
    }

    /// Where a checkpoint load puts each slot's state and master until every rank has read
    /// its own ([`SlotStates::replace`] then makes them the live ones): in memory, or with
    /// NVMe offload written to the swap file one slot at a time, past the live state.
    pub(crate) fn loading(&mut self) -> LoadedSlots<O::State<1>> {
        match &mut self.swap {
            Some(swap) => LoadedSlots::Staged(swap.staging()),
            None => LoadedSlots::InMemory {
                states: vec![None; self.states.len()],
                masters: vec![None; self.masters.len()],
            },
        }
    }

    /// Makes `loaded` (from [`SlotStates::loading`], every slot read) the slots' state and
    /// masters.
    pub(crate) fn replace(&mut self, loaded: LoadedSlots<O::State<1>>) {
        match (loaded, &mut self.swap) {
            (LoadedSlots::Staged(staged), Some(swap)) => swap.commit(staged),
            (LoadedSlots::InMemory { states, masters }, _) => {
                self.states = states;
                self.masters = masters;
            }
            (LoadedSlots::Staged(_), None) => unreachable!("staged by this swapper"),
        }
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
    /// gets the master rounded. The update runs where the state lives ([`StateHome`]); with NVMe
    /// offload the state and master are read first and written back behind.
    ///
    /// With `shape`, the piece is the whole parameter, stepped with that shape
    /// ([`MasterWeightStep::step_whole`]).
    pub(crate) fn step(
        &mut self,
        index: usize,
        optim: &O,
        lr: LearningRate,
        shape: Option<&[usize]>,
        param: Tensor<1>,
        grad: Tensor<1>,
    ) -> Tensor<1> {
        if !self.swap_in(index, optim, shape.map_or(1, |shape| optim.state_rank(shape))) {
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
            let (master, param, state) = self.home.step_with_master(optim, lr, shape, master, param, grad, state);
            self.masters[index] = Some(master);
            (param, state)
        } else {
            self.home.step(optim, lr, shape, param, grad, state)
        };
        self.states[index] = state;
        self.swap_out(index);
        param
    }

    /// NVMe offload: brings slot `index`'s state and master into memory, the state rebuilt by
    /// `optim` for tensors of rank `rank` (1 for a flat piece); `false` when they could not be
    /// read (the error is kept for [`SlotStates::end_step`]). `true` without it.
    fn swap_in(&mut self, index: usize, optim: &O, rank: usize) -> bool {
        let Some(swap) = &mut self.swap else {
            return true;
        };
        match swap.take(index, |source, device| optim.rebuild_state(rank, source, device)) {
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
            // Asked where the state lives: an optimizer that cannot see a tensor's device counts
            // everything there.
            let Some(device) = device else { break };
            let (home, away) = O::state_bytes(state, &self.home.device(device));
            match self.home {
                StateHome::WithParams => (on_device, elsewhere) = (on_device + home, elsewhere + away),
                StateHome::Host => (on_device, elsewhere) = (on_device + away, elsewhere + home),
            }
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
