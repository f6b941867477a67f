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

/// The state and master `encode` made `bytes` from, as tensors on `device`, the state rebuilt
/// from its leaves (each with its shape) by `rebuild` (the optimizer's
/// `MasterWeightStep::rebuild_state`); `None` when it cannot (not expected: they were
/// flattened from one).
pub(crate) fn decode<S>(
    bytes: Vec<u8>,
    layout: &SlotLayout,
    device: &Device,
    rebuild: impl FnOnce(&mut StateSource, &Device) -> Option<S>,
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
            Some(rebuild(&mut source, device)?)
        }
        None => None,
    };
    let master = layout
        .master
        .as_ref()
        .map(|field| Tensor::from_data(take(field), (device, field.dtype)));
    Some((state, master))
}

#[cfg(test)]
mod tests {
    use burn::optim::{AdamState, AdaptiveMomentumState};

    use super::*;

    fn tensor(values: &[f32], dtype: DType) -> Tensor<1> {
        Tensor::<1>::from_data(TensorData::new(values.to_vec(), [values.len()]), &Device::flex()).cast(dtype)
    }

    fn bits(t: &Tensor<1>) -> (DType, Vec<u8>) {
        let data = t.clone().into_data();
        (data.dtype(), data.as_bytes().to_vec())
    }

    /// A slot's state (Burn's `AdamState` with AMSGrad's third moment, its step count a scalar)
    /// and a `bf16` parameter's `f32` master come back bit for bit; a flipped byte fails the
    /// CRC of its tensor, and bytes of another length fail the layout.
    #[test]
    fn a_slot_round_trips_through_its_bytes_and_a_flipped_byte_is_caught() {
        let moment = |seed: f32| tensor(&[seed, -0.5 * seed, 1e-30, f32::MAX], DType::F32);
        let state = AdamState {
            momentum: AdaptiveMomentumState {
                time: 7,
                moment_1: moment(0.25),
                moment_2: moment(3.0),
                max_moment_2: Some(moment(4.0)),
            },
        };
        let master = tensor(&[1.0, 2.5, -3.75, 1e-7], DType::F32);
        let (bytes, layout) = encode(Some(&state), Some(&master));
        assert!(layout.matches(&bytes));
        let (back, back_master) = decode(bytes.clone(), &layout, &Device::flex(), |source, device| {
            AdamState::<1>::state_unflatten("", source, device)
        })
        .expect("decodes");
        let back = back.expect("a state");
        assert_eq!(back.momentum.time, 7);
        assert_eq!(bits(&back.momentum.moment_1), bits(&state.momentum.moment_1));
        assert_eq!(bits(&back.momentum.moment_2), bits(&state.momentum.moment_2));
        assert_eq!(
            back.momentum.max_moment_2.as_ref().map(bits),
            state.momentum.max_moment_2.as_ref().map(bits)
        );
        assert_eq!(back_master.as_ref().map(bits), Some(bits(&master)));
        for at in [0, bytes.len() / 2, bytes.len() - 1] {
            let mut flipped = bytes.clone();
            flipped[at] ^= 1;
            assert!(!layout.matches(&flipped), "byte {at} flipped");
        }
        assert!(!layout.matches(&bytes[1..]));
        let (empty, none) = encode::<AdamState<1>>(None, None);
        assert!(empty.is_empty() && none.matches(&empty));
    }
}
