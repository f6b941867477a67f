//! One slot's optimizer state and `f32` master as bytes, and back.
//!
//! The state goes through Burn's `RecordState` (the same flattening checkpoints use), so the
//! state of any Burn optimizer swaps; its tensors' bytes are concatenated, the names, dtypes,
//! shapes and scalars stay in memory ([`SlotLayout`]), with a CRC-32 of the bytes that every
//! read checks.

use burn::optim::{RecordState, StateSink, StateSource};
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};
use burn_pack::Scalar;

/// A slot's optimizer state and `f32` master, each `None` when it has none.
pub(crate) type StateAndMaster<S> = (Option<S>, Option<Tensor<1>>);

/// One tensor within a slot's bytes.
#[derive(Clone, Debug)]
struct Field {
    name: String,
    dtype: DType,
    shape: Shape,
    bytes: usize,
}

/// What a slot's bytes hold, kept in memory while the bytes are on disk.
#[derive(Clone, Debug)]
pub(crate) struct SlotLayout {
    /// The state's tensors in the order written (`None`: the slot has no state yet).
    state: Option<Vec<Field>>,
    scalars: Vec<(String, Scalar)>,
    /// The master, written after the state's tensors.
    master: Option<Field>,
    /// Bytes written (state tensors, then master).
    pub(crate) len: usize,
    /// CRC-32 (IEEE) of the bytes written.
    crc: u32,
}

impl SlotLayout {
    /// Whether the bytes read back are the ones written (length and CRC-32).
    pub(crate) fn matches(&self, bytes: &[u8]) -> bool {
        bytes.len() == self.len && crc32fast::hash(bytes) == self.crc
    }
}

/// The bytes of `state` and `master`, and their layout.
pub(crate) fn encode<S: RecordState>(state: Option<&S>, master: Option<&Tensor<1>>) -> (Vec<u8>, SlotLayout) {
    let mut bytes = Vec::new();
    let mut push = |name: String, data: TensorData| {
        bytes.extend_from_slice(data.as_bytes());
        Field {
            name,
            dtype: data.dtype(),
            shape: data.shape().clone(),
            bytes: data.as_bytes().len(),
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
        crc: crc32fast::hash(&bytes),
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
    let mut at = 0;
    let mut take = |field: &Field| {
        let data = TensorData::from_bytes_vec(bytes[at..at + field.bytes].to_vec(), field.shape.clone(), field.dtype);
        at += field.bytes;
        data
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
