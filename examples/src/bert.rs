//! A BERT encoder (all-MiniLM-L6-v2's architecture) built from stock `burn::nn` layers, its
//! pretrained weights read from Hugging Face safetensors with `burn-store`, and a sentence
//! classifier on top (mean pooling and a linear head).
//!
//! BERT's encoder layer is Burn's post-norm `TransformerEncoderLayer` (`norm_first = false`):
//! `x = LN1(x + MHA(x)); x = LN2(x + W2·gelu(W1·x))` with erf GELU, so the port reuses it and
//! only the names differ from Hugging Face's (mapped in [`Bert::load_safetensors`]). The two
//! agree exactly in evaluation; in training Burn's feed-forward also applies dropout after the
//! GELU, where BERT does not.

use std::path::Path;

use burn::module::Param;
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn_shard::Pretrained;
use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

/// The sizes of a BERT model, as in Hugging Face's `config.json` (`BertConfig`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BertConfig {
    /// Tokens in the vocabulary (30,522 for uncased BERT).
    pub vocab_size: usize,
    /// Width of every hidden state (384 for MiniLM-L6).
    pub hidden_size: usize,
    /// Encoder layers (6).
    pub num_hidden_layers: usize,
    /// Attention heads per layer (12); `hidden_size` divides by it.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer (1,536).
    pub intermediate_size: usize,
    /// Longest input, in tokens (512).
    pub max_position_embeddings: usize,
    /// Segment types (2); this port feeds segment 0 only.
    pub type_vocab_size: usize,
    /// Layer-norm epsilon (1e-12).
    pub layer_norm_eps: f64,
    /// Must be `"gelu"` (erf GELU, Burn's `Gelu::new()`).
    pub hidden_act: String,
}

impl BertConfig {
    /// Reads and checks a Hugging Face `config.json`.
    ///
    /// # Errors
    /// The file is unreadable or not a BERT config, or names an activation other than `gelu`.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let config: Self =
            serde_json::from_str(&text).map_err(|e| format!("{} is not a BERT config.json: {e}", path.display()))?;
        if config.hidden_act != "gelu" {
            return Err(format!(
                "{}: hidden_act is {:?}; this port implements \"gelu\" only",
                path.display(),
                config.hidden_act
            ));
        }
        if config.num_attention_heads == 0 || !config.hidden_size.is_multiple_of(config.num_attention_heads) {
            return Err(format!(
                "{}: hidden_size {} does not divide into {} heads",
                path.display(),
                config.hidden_size,
                config.num_attention_heads
            ));
        }
        Ok(config)
    }

    /// A randomly initialised encoder of these sizes; `dropout` is BERT's hidden and attention
    /// dropout (0.1 in pretraining and usual in fine-tuning).
    pub fn init(&self, dropout: f64, device: &Device) -> Bert {
        let h = self.hidden_size;
        Bert {
            embeddings: BertEmbeddings {
                word_embeddings: EmbeddingConfig::new(self.vocab_size, h).init(device),
                position_embeddings: EmbeddingConfig::new(self.max_position_embeddings, h).init(device),
                token_type_embeddings: EmbeddingConfig::new(self.type_vocab_size, h).init(device),
                layer_norm: LayerNormConfig::new(h).with_epsilon(self.layer_norm_eps).init(device),
                dropout: DropoutConfig::new(dropout).init(),
            },
            encoder: TransformerEncoderConfig::new(
                h,
                self.intermediate_size,
                self.num_attention_heads,
                self.num_hidden_layers,
            )
            .with_dropout(dropout)
            .with_norm_first(false)
            .with_layer_norm_eps(self.layer_norm_eps)
            .init(device),
        }
    }
}

/// Token, position and segment embeddings, summed and normalised.
#[derive(Module, Debug)]
pub struct BertEmbeddings {
    /// `[vocab_size, hidden]`.
    pub word_embeddings: Embedding,
    /// `[max_position_embeddings, hidden]`.
    pub position_embeddings: Embedding,
    /// `[type_vocab_size, hidden]`.
    pub token_type_embeddings: Embedding,
    /// Hugging Face's `LayerNorm`.
    pub layer_norm: LayerNorm,
    /// Hidden dropout.
    pub dropout: Dropout,
}

/// The BERT encoder without its pooler (mean pooling replaces it).
#[derive(Module, Debug)]
pub struct Bert {
    /// Input embeddings.
    pub embeddings: BertEmbeddings,
    /// Burn's post-norm transformer encoder.
    pub encoder: TransformerEncoder,
}

/// Hugging Face BERT tensor names -> this module's paths (regex, replacement), applied in order.
/// Linear weights are transposed (`[out, in]` -> Burn's `[in, out]`) and LayerNorm's
/// `weight`/`bias` become `gamma`/`beta` by burn-store's `PyTorchToBurnAdapter`.
const HF_NAMES: [(&str, &str); 7] = [
    (r"^embeddings\.LayerNorm\.", "embeddings.layer_norm."),
    (
        r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.",
        "encoder.layers.$1.mha.$2.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.",
        "encoder.layers.$1.mha.output.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.",
        "encoder.layers.$1.norm_1.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.intermediate\.dense\.",
        "encoder.layers.$1.pwff.linear_inner.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.output\.dense\.",
        "encoder.layers.$1.pwff.linear_outer.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.",
        "encoder.layers.$1.norm_2.",
    ),
];

/// What to do when the weights are not where they should be.
fn missing_weights(path: &Path) -> String {
    format!(
        "{} does not exist: run `cargo xtask fetch-minilm` to download all-MiniLM-L6-v2 (90.9 MB) there, or pass --model-dir",
        path.display()
    )
}

/// `name` with the regex metacharacters it can hold (dots) escaped.
fn regex_escape(name: &str) -> String {
    name.replace('.', "\\.")
}

/// Tensors of a Hugging Face `BertModel` file this port does not use.
const HF_UNUSED: [&str; 3] = ["embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"];

impl Bert {
    /// Loads Hugging Face `BertModel` weights (names without a `bert.` prefix, as in
    /// all-MiniLM-L6-v2's `model.safetensors`) into this encoder.
    ///
    /// # Errors
    /// The file is missing or not safetensors; a tensor of the model is missing from the file
    /// or has another shape (both named); or the file holds tensors the model has no place
    /// for (another architecture or size than `config.json` says).
    pub fn load_safetensors(mut self, path: &Path) -> Result<Self, String> {
        if !path.is_file() {
            return Err(missing_weights(path));
        }
        let mut store = SafetensorsStore::from_file(path).with_from_adapter(PyTorchToBurnAdapter);
        for (from, to) in HF_NAMES {
            store = store.with_key_remapping(from, to);
        }
        let result = self
            .load_from(&mut store)
            .map_err(|e| {
                format!(
                    "{} does not fit the model of its config.json: {e}\n(for all-MiniLM-L6-v2, delete the folder and run `cargo xtask fetch-minilm`)",
                    path.display()
                )
            })?;
        let extra: Vec<&String> = result
            .unused
            .iter()
            .filter(|name| !HF_UNUSED.contains(&name.as_str()))
            .collect();
        if !extra.is_empty() {
            return Err(format!(
                "{} holds tensors this BERT has no place for: {extra:?}; is its config.json the one that came with it?",
                path.display()
            ));
        }
        Ok(self)
    }

    /// `ids`: `[batch, seq]` token ids; `pad`: `[batch, seq]`, true at padding. Returns the
    /// last hidden states `[batch, seq, hidden]`. Each encoder layer is an FSDP unit.
    pub fn forward(&self, ids: Tensor<2, Int>, pad: Tensor<2, Bool>) -> Tensor<3> {
        let [b, t] = ids.dims();
        let device = ids.device();
        let positions = Tensor::<1, Int>::arange(0..t as i64, &device).reshape([1, t]);
        let segments = Tensor::<2, Int>::zeros([1, t], &device);
        let e = &self.embeddings;
        let x = e.word_embeddings.forward(ids)
            + e.position_embeddings.forward(positions)
            + e.token_type_embeddings.forward(segments);
        let mut x = e.dropout.forward(e.layer_norm.forward(x));
        debug_assert_eq!(x.dims()[0], b);
        for layer in &self.encoder.layers {
            // A unit for stage 3 (FSDP): its gradients are reduce-scattered right after its
            // backward; without sharding this only runs the closure.
            x = burn_shard::fsdp::unit(&x, || layer.forward(x.clone(), Some(pad.clone()), None));
        }
        x
    }

    /// Mean of the hidden states over the non-padding tokens (sentence-transformers' pooling):
    /// `[batch, hidden]`.
    pub fn mean_pooled(&self, ids: Tensor<2, Int>, pad: Tensor<2, Bool>) -> Tensor<2> {
        let keep = pad.clone().bool_not().float().unsqueeze_dim::<3>(2); // [b, t, 1]
        let hidden = self.forward(ids, pad);
        let summed = (hidden * keep.clone()).sum_dim(1).squeeze_dim::<2>(1);
        let count = keep.sum_dim(1).squeeze_dim::<2>(1).clamp_min(1e-9);
        summed / count
    }
}

/// A sentence classifier: BERT, mean pooling, dropout and a linear head.
#[derive(Module, Debug)]
pub struct SentenceClassifier {
    /// The (pretrained) encoder.
    pub bert: Bert,
    /// Dropout before the head.
    pub dropout: Dropout,
    /// `[hidden, classes]`.
    pub head: Linear,
}

impl SentenceClassifier {
    /// Puts a head with `classes` outputs on `bert`: weights uniform in ±1/√hidden (the bound
    /// of Burn's `Linear` default), bias zero, drawn from a generator seeded with `seed`, so the
    /// head is the same whatever else draws from Burn's process-wide generator meanwhile.
    pub fn new(bert: Bert, classes: usize, dropout: f64, seed: u64, device: &Device) -> Self {
        // `lazy_shape`: reading the shape through the value would build the embedding table.
        let hidden = bert.embeddings.word_embeddings.weight.lazy_shape().dims::<2>()[1];
        let bound = 1.0 / (hidden as f32).sqrt();
        let mut rng = StdRng::seed_from_u64(seed);
        let weights: Vec<f32> = (0..hidden * classes).map(|_| rng.random_range(-bound..bound)).collect();
        let mut head = LinearConfig::new(hidden, classes).init(device);
        head.weight = Param::from_tensor(Tensor::from_data(TensorData::new(weights, [hidden, classes]), device));
        head.bias = Some(Param::from_tensor(Tensor::zeros([classes], device)));
        Self {
            bert,
            dropout: DropoutConfig::new(dropout).init(),
            head,
        }
    }

    /// Hugging Face `BertModel` weights (as in all-MiniLM-L6-v2's `model.safetensors`) for a
    /// classifier, as `ShardConfig::init_pretrained` takes them: no rank builds the whole
    /// encoder first (at stage 3 a rank keeps its shards; the `Linear` weights, which the
    /// adapter transposes, are read whole, one at a time). The same names, transposes and
    /// checks as [`Bert::load_safetensors`]; the head is not in the file and keeps the values
    /// [`SentenceClassifier::new`] gave it; the file's pooler is skipped.
    ///
    /// # Errors
    /// The file is missing (the message says how to fetch it) or not safetensors. Whether it
    /// fits the model is checked by `init_pretrained` (every tensor's name and shape).
    pub fn pretrained(path: &Path) -> Result<Pretrained, String> {
        if !path.is_file() {
            return Err(missing_weights(path));
        }
        // Hugging Face's names onto the encoder's paths, then under the classifier's `bert`.
        let pretrained = HF_NAMES
            .into_iter()
            .chain([("^", "bert.")])
            .fold(Pretrained::safetensors(path), |p, (from, to)| {
                p.with_key_remapping(from, to)
            });
        let unused = HF_UNUSED.map(|name| format!("^bert\\.{}$", regex_escape(name)));
        let pretrained = pretrained
            .with_from_adapter(PyTorchToBurnAdapter)
            .allow_missing(["^head\\."])
            .ignore_unused(unused);
        match pretrained.problem() {
            Some(e) => Err(e.to_string()),
            None => Ok(pretrained),
        }
    }

    /// Class logits `[batch, classes]` for `ids`/`pad` as in [`Bert::forward`].
    pub fn forward(&self, ids: Tensor<2, Int>, pad: Tensor<2, Bool>) -> Tensor<2> {
        self.head.forward(self.dropout.forward(self.bert.mean_pooled(ids, pad)))
    }
}
