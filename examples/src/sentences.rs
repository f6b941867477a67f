//! Labelled sentences (SST-2, TREC) tokenized with the `tokenizers` crate, and padded batches.

use std::path::{Path, PathBuf};

use burn::prelude::*;
use tokenizers::{Tokenizer, TruncationParams};

use crate::training::read_data;

/// Which classification data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Task {
    /// Stanford Sentiment Treebank, binary (6,920 training sentences, the 872-sentence GLUE dev set).
    Sst2,
    /// TREC question classification, 6 classes (5,452 training questions, 500 test questions).
    Trec,
}

impl std::fmt::Display for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Task::Sst2 => "SST-2",
            Task::Trec => "TREC",
        })
    }
}

impl Task {
    /// Number of classes.
    pub fn classes(self) -> usize {
        match self {
            Task::Sst2 => 2,
            Task::Trec => 6,
        }
    }

    /// The training and evaluation files under `data_dir` (`examples/data` by default).
    pub fn files(self, data_dir: &Path) -> (PathBuf, PathBuf) {
        match self {
            Task::Sst2 => (
                data_dir.join("sst2/stsa.binary.train"),
                data_dir.join("sst2/stsa.binary.dev"),
            ),
            Task::Trec => (
                data_dir.join("trec/TREC.train.all"),
                data_dir.join("trec/TREC.test.all"),
            ),
        }
    }
}

/// One tokenized sentence.
#[derive(Clone, Debug)]
pub struct Sentence {
    /// Class id, `0..classes`.
    pub label: usize,
    /// WordPiece ids with `[CLS]` and `[SEP]`, at most the tokenizer's truncation length.
    pub ids: Vec<u32>,
}

/// Loads a Hugging Face `tokenizer.json`, without its padding (batches pad to their longest
/// sentence) and truncating to `max_len` tokens (`[CLS]` and `[SEP]` included).
///
/// # Errors
/// The file is missing or not a tokenizer, or `max_len` is below 2.
pub fn load_tokenizer(path: &Path, max_len: usize) -> Result<Tokenizer, String> {
    let mut tokenizer = Tokenizer::from_file(path).map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: max_len,
            ..Default::default()
        }))
        .map_err(|e| format!("--max-len {max_len}: {e}"))?;
    Ok(tokenizer)
}

/// Reads a file of `<label> <sentence>` lines (read as lossy UTF-8: TREC has one stray byte).
///
/// # Errors
/// The file is unreadable, a line has no label or one outside `0..classes` (line number given),
/// or the tokenizer fails.
pub fn read_labelled(path: &Path, classes: usize, tokenizer: &Tokenizer) -> Result<Vec<Sentence>, String> {
    let bytes = read_data(path)?;
    let text = String::from_utf8_lossy(&bytes);
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let (label, sentence) = line.split_once(' ').unwrap_or((line, ""));
        let label: usize = label.parse().ok().filter(|&l| l < classes).ok_or_else(|| {
            format!(
                "{}:{}: expected a label in 0..{classes}, found {label:?}",
                path.display(),
                i + 1
            )
        })?;
        let encoding = tokenizer
            .encode(sentence, true)
            .map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
        out.push(Sentence {
            label,
            ids: encoding.get_ids().to_vec(),
        });
    }
    Ok(out)
}

/// A padded batch: ids `[batch, longest]` (padding id 0), the padding mask `[batch, longest]`
/// (true at padding) and the labels `[batch]`.
pub fn batch(sentences: &[&Sentence], device: &Device) -> (Tensor<2, Int>, Tensor<2, Bool>, Tensor<1, Int>) {
    let longest = sentences.iter().map(|s| s.ids.len()).max().unwrap_or(1).max(1);
    let mut ids = Vec::with_capacity(sentences.len() * longest);
    let mut pad = Vec::with_capacity(sentences.len() * longest);
    for s in sentences {
        for j in 0..longest {
            ids.push(s.ids.get(j).map_or(0, |&id| id as i64));
            pad.push(j >= s.ids.len());
        }
    }
    let b = sentences.len();
    let labels: Vec<i64> = sentences.iter().map(|s| s.label as i64).collect();
    (
        Tensor::from_data(TensorData::new(ids, [b, longest]), device),
        Tensor::from_data(TensorData::new(pad, [b, longest]), device),
        Tensor::from_data(TensorData::new(labels, [b]), device),
    )
}
