//! A character-level corpus: vocabulary, encoding, a train/validation split and batch sampling.

use burn::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A text encoded as character ids, split 90/10 into train and validation.
pub struct CharCorpus {
    /// The distinct characters, sorted; id = index.
    pub vocab: Vec<char>,
    /// Training ids (first 90 % of the text).
    pub train: Vec<u16>,
    /// Validation ids (last 10 %).
    pub val: Vec<u16>,
}

impl CharCorpus {
    /// Builds the vocabulary of `text` and splits it 90/10 (nanoGPT's split).
    pub fn new(text: &str) -> Self {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let ids: Vec<u16> = text
            .chars()
            .map(|c| vocab.binary_search(&c).expect("char in vocab") as u16)
            .collect();
        let split = ids.len() * 9 / 10;
        Self {
            vocab,
            val: ids[split..].to_vec(),
            train: ids[..split].to_vec(),
        }
    }

    /// Number of distinct characters.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// Decodes ids into text.
    pub fn decode(&self, ids: &[u16]) -> String {
        ids.iter().map(|&i| self.vocab[i as usize]).collect()
    }

    /// Encodes text; characters outside the vocabulary are skipped.
    pub fn encode(&self, text: &str) -> Vec<u16> {
        text.chars()
            .filter_map(|c| self.vocab.binary_search(&c).ok().map(|i| i as u16))
            .collect()
    }
}

/// A batch of `batch` random windows of `block` characters from `ids`: inputs and next-char
/// targets, both `[batch, block]` Int tensors.
pub fn sample_batch(
    ids: &[u16],
    batch: usize,
    block: usize,
    rng: &mut impl Rng,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let starts: Vec<usize> = (0..batch).map(|_| rng.random_range(0..ids.len() - block - 1)).collect();
    windows(ids, &starts, block, device)
}

/// Rank `rank`'s `local` windows of global batch `index`. The global batch is `local *
/// world_size` random windows of `block` ids drawn from a generator seeded by (`seed`,
/// `index`); rank `r` takes windows `[r * local, (r + 1) * local)`. It is the same batch at
/// every world size, so `W` ranks train as one device on the whole batch does, and a
/// checkpoint resumes on the same data at any world size.
pub fn global_batch_slice(
    ids: &[u16],
    (seed, index): (u64, u64),
    (rank, world_size, local): (usize, usize, usize),
    block: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let mut rng = StdRng::seed_from_u64(seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let starts: Vec<usize> = (0..local * world_size)
        .map(|_| rng.random_range(0..ids.len() - block - 1))
        .collect();
    windows(ids, &starts[rank * local..(rank + 1) * local], block, device)
}

/// Inputs `ids[s..s + block]` and targets `ids[s + 1..s + block + 1]` for each start `s`:
/// `[starts.len(), block]` Int tensors.
fn windows(ids: &[u16], starts: &[usize], block: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let mut x = Vec::with_capacity(starts.len() * block);
    let mut y = Vec::with_capacity(starts.len() * block);
    for &start in starts {
        x.extend(ids[start..start + block].iter().map(|&i| i as i64));
        y.extend(ids[start + 1..start + block + 1].iter().map(|&i| i as i64));
    }
    (
        Tensor::from_data(TensorData::new(x, [starts.len(), block]), device),
        Tensor::from_data(TensorData::new(y, [starts.len(), block]), device),
    )
}
