//! One slot's optimizer state and `f32` master as bytes, and back.
//!
//! The state goes through Burn's `RecordState` (the same flattening checkpoints use), so the
//! state of any Burn optimizer swaps; its tensors' bytes are concatenated, the names, dtypes,
//! shapes and scalars stay in memory ([`SlotLayout`]), with a CRC-32 of each tensor's bytes
//! that every read checks (per tensor, so a checkpoint can read one tensor of a slot alone).

use burn::optim::{RecordState, StateSink, StateSource};
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};
use burn_pack::Scalar;

use crate::swap::blocks::checksum;

/// A slot's optimizer state and `f32` master, each `None` when it has none.
pub(crate) type StateAndMaster<S> = (Option<S>, Option<Tensor<1>>);

/// One tensor within a slot's bytes.
#[derive(Clone, Debug)]
pub(crate) struct Field {
    /// The state's name for it (`StateSink`'s), empty for the master.
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
    /// Where its bytes start within the slot's.
    pub(crate) at: usize,
    pub(crate) bytes: usize,
    /// CRC-32 (IEEE) of its bytes.
    pub(crate) crc: u32,
}

impl Field {
    /// Whether `bytes` (this field's, read back) are the ones written (length and CRC-32).
    pub(crate) fn matches(&self, bytes: &[u8]) -> bool {
        bytes.len() == self.bytes && checksum(bytes) == self.crc
    }
}

/// What a slot's bytes hold, kept in memory while the bytes are on disk.
#[derive(Clone, Debug)]
pub(crate) struct SlotLayout {
    /// The state's tensors in the order written (`None`: the slot has no state yet).
    pub(crate) state: Option<Vec<Field>>,
    /// The state's scalars (`StateSink`'s), kept in memory only.
    pub(crate) scalars: Vec<(String, Scalar)>,
    /// The master, written after the state's tensors.
    pub(crate) master: Option<Field>,
    /// Bytes written (state tensors, then master).
    pub(crate) len: usize,
}

impl SlotLayout {
    /// Whether the bytes read back are the ones written (length and each tensor's CRC-32).
    pub(crate) fn matches(&self, bytes: &[u8]) -> bool {
        bytes.len() == self.len
            && self
                .state
                .iter()
                .flatten()
                .chain(&self.master)
                .all(|f| f.matches(&bytes[f.at..f.at + f.bytes]))
    }
}

/// The bytes of `state` and `master`, and their layout.
pub(crate) fn encode<S: RecordState>(state: Option<&S>, master: Option<&Tensor<1>>) -> (Vec<u8>, SlotLayout) {
    let mut bytes = Vec::new();
    let mut push = |name: String, data: TensorData| {
        let at = bytes.len();
        bytes.extend_from_slice(data.as_bytes());
        Field {
            name,
            dtype: data.dtype(),
            shape: data.shape().clone(),
            at,
            bytes: data.as_bytes().len(),
            crc: checksum(data.as_bytes()),
        }
    };
    let (state, scalars) = match state {
        Some(state) => {
            let mut sink = StateSink::default();
            state.state_flatten("", &mut sink);
            let fields = sink.tensors.into_iter().map(|(name, data)| push(name, data)).collect();
            (Some(fields), sink.scalars)
        }
        None => (None, Vec::new()),
    };
    let master = master.map(|m| push(String::new(), m.clone().into_data()));
    let layout = SlotLayout {
        state,
        scalars,
        master,
        len: bytes.len(),
    };
    (bytes, layout)
}

/// The state and master `encode` made `bytes` from, as tensors on `device`; `None` when Burn
/// cannot rebuild the state from its leaves (not expected: they were flattened from one).
pub(crate) fn decode<S: RecordState>(
    bytes: Vec<u8>,
    layout: &SlotLayout,
    device: &Device,
) -> Option<StateAndMaster<S>> {
    let take = |field: &Field| {
        TensorData::from_bytes_vec(
            bytes[field.at..field.at + field.bytes].to_vec(),
            field.shape.clone(),
            field.dtype,
        )
    };
    let state = match &layout.state {
        Some(fields) => {
            let mut source = StateSource::new(layout.scalars.iter().cloned().collect());
            for field in fields {
                source.insert_tensor(field.name.clone(), take(field));
            }
            Some(S::state_unflatten("", &mut source, device)?)
        }
        None => None,
    };
    let master = layout
        .master
        .as_ref()
        .map(|field| Tensor::from_data(take(field), (device, field.dtype)));
    Some((state, master))
}
