//! A Llama decoder built from stock `burn::nn` layers (`Embedding`, `RmsNorm`, `Linear`,
//! `SwiGlu`, `RotaryEncoding`), and a reader of llama2.c checkpoints (karpathy's tinyllamas,
//! such as `stories260K.bin`).
//!
//! The architecture follows llama2.c's `run.c`: pre-norm blocks of grouped-query attention
//! (`n_kv_heads` key/value heads shared by `n_heads / n_kv_heads` query heads each) with RoPE
//! on adjacent pairs `(2i, 2i+1)` (Burn's `RotaryEncoding` pairs them the same way, with
//! θ = 10,000), a SwiGLU feed-forward `w2(silu(w1 x) * w3 x)`, RMSNorm with ε = 1e-5, and a
//! classifier tied to the token embedding.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::{
    Embedding, EmbeddingConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig,
    SwiGlu, SwiGluConfig,
};
use burn::prelude::*;
use burn::tensor::activation::softmax;
use burn::tensor::{Bytes, DType};
use burn_shard::Pretrained;
use burn_store::burn_pack::Tensor as PackTensor;
use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter};
use rand::Rng;

use crate::llama2c_tokenizer::{BOS, EOS};
use crate::training::sample_index;

/// The sizes in a llama2.c checkpoint's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlamaConfig {
    /// Model width (64 for stories260K).
    pub dim: usize,
    /// Feed-forward width (172).
    pub hidden_dim: usize,
    /// Blocks (5).
    pub n_layers: usize,
    /// Query heads (8).
    pub n_heads: usize,
    /// Key/value heads (4); `n_heads` divides by it.
    pub n_kv_heads: usize,
    /// Tokens (512).
    pub vocab_size: usize,
    /// Longest context the model was trained with (512).
    pub seq_len: usize,
}

impl LlamaConfig {
    /// Width of one head.
    pub fn head_size(&self) -> usize {
        self.dim / self.n_heads
    }

    /// The model of these sizes on `device`, its parameters lazy (Burn's initializers, not
    /// run until first read or loaded): build it so and load the weights with
    /// [`Llama::llama2c_pretrained`] and `ShardConfig::init_pretrained`.
    pub fn init(&self, device: &Device) -> Llama {
        let (d, kv, h) = (self.dim, self.n_kv_heads * self.head_size(), self.hidden_dim);
        let linear = |inp: usize, out: usize| LinearConfig::new(inp, out).with_bias(false).init(device);
        let norm = || RmsNormConfig::new(d).with_epsilon(1e-5).init(device);
        let block = |_| LlamaBlock {
            attention_norm: norm(),
            attention: Attention {
                wq: linear(d, d),
                wk: linear(d, kv),
                wv: linear(d, kv),
                wo: linear(d, d),
                n_heads: self.n_heads,
                n_kv_heads: self.n_kv_heads,
            },
            ffn_norm: norm(),
            w13: SwiGluConfig::new(d, h).with_bias(false).init(device),
            w2: linear(h, d),
        };
        Llama {
            tok_embeddings: EmbeddingConfig::new(self.vocab_size, d).init(device),
            layers: (0..self.n_layers).map(block).collect(),
            norm: norm(),
            rope: RotaryEncodingConfig::new(self.seq_len, self.head_size()).init(device),
        }
    }
}

/// Grouped-query self-attention.
#[derive(Module, Debug)]
pub struct Attention {
    /// `[dim, n_heads * head_size]`.
    pub wq: Linear,
    /// `[dim, n_kv_heads * head_size]`.
    pub wk: Linear,
    /// `[dim, n_kv_heads * head_size]`.
    pub wv: Linear,
    /// `[n_heads * head_size, dim]`.
    pub wo: Linear,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
}

impl Attention {
    /// `x`: `[batch, seq, dim]`; `mask`: `[batch, n_heads, seq, seq]`, true where a query may
    /// not look (the future). Returns `[batch, seq, dim]`.
    fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding, mask: Tensor<4, Bool>) -> Tensor<3> {
        let [b, t, dim] = x.dims();
        let hs = dim / self.n_heads;
        let heads = |y: Tensor<3>, n: usize| y.reshape([b, t, n, hs]).swap_dims(1, 2); // [b, n, t, hs]
        let q = rope.forward(heads(self.wq.forward(x.clone()), self.n_heads));
        let k = rope.forward(heads(self.wk.forward(x.clone()), self.n_kv_heads));
        let v = heads(self.wv.forward(x), self.n_kv_heads);
        // Query head h reads key/value head h / (n_heads / n_kv_heads), as in llama2.c.
        let rep = self.n_heads / self.n_kv_heads;
        let share = |y: Tensor<4>| {
            y.unsqueeze_dim::<5>(2)
                .repeat_dim(2, rep)
                .reshape([b, self.n_heads, t, hs])
        };
        let scores = q.matmul(share(k).swap_dims(2, 3)).div_scalar((hs as f32).sqrt());
        let weights = softmax(scores.mask_fill(mask, -1e9), 3);
        let y = weights.matmul(share(v)).swap_dims(1, 2).reshape([b, t, dim]);
        self.wo.forward(y)
    }
}

/// One pre-norm block.
#[derive(Module, Debug)]
pub struct LlamaBlock {
    /// RMSNorm before attention (`rms_att`).
    pub attention_norm: RmsNorm,
    /// Attention.
    pub attention: Attention,
    /// RMSNorm before the feed-forward (`rms_ffn`).
    pub ffn_norm: RmsNorm,
    /// `silu(w1 x) * w3 x`: `linear_inner` = w1, `linear_outer` = w3.
    pub w13: SwiGlu,
    /// `[hidden_dim, dim]`.
    pub w2: Linear,
}

impl LlamaBlock {
    fn forward(&self, x: Tensor<3>, rope: &RotaryEncoding, mask: Tensor<4, Bool>) -> Tensor<3> {
        let h = x.clone() + self.attention.forward(self.attention_norm.forward(x), rope, mask);
        h.clone() + self.w2.forward(self.w13.forward(self.ffn_norm.forward(h)))
    }
}

/// The decoder; its classifier is the token embedding (tied).
#[derive(Module, Debug)]
pub struct Llama {
    /// `[vocab_size, dim]`, also the classifier.
    pub tok_embeddings: Embedding,
    /// The blocks.
    pub layers: Vec<LlamaBlock>,
    /// Final RMSNorm (`rms_final`).
    pub norm: RmsNorm,
    /// Rotary position encoding (constant tables, not parameters).
    pub rope: RotaryEncoding,
}

impl Llama {
    /// Reads a llama2.c checkpoint into a whole model on `device` (see
    /// [`Llama::llama2c_tensors`] for the format and the checks).
    ///
    /// # Errors
    /// Those of [`Llama::llama2c_tensors`].
    pub fn load_llama2c(path: &Path, device: &Device) -> Result<(LlamaConfig, Self), String> {
        let (config, tensors) = Self::llama2c_tensors(path)?;
        let mut model = config.init(device);
        let result = model.apply(tensors, None, Some(Box::new(PyTorchToBurnAdapter)), false);
        if !result.errors.is_empty() || !result.missing.is_empty() || !result.unused.is_empty() {
            return Err(format!("{}: {result:?}", path.display()));
        }
        Ok((config, model))
    }

    /// A llama2.c checkpoint as `ShardConfig::init_pretrained` takes it, for a model built
    /// lazily with [`LlamaConfig::init`]: no rank holds the whole model first (at stage 3 a
    /// rank reads its shards' bytes of the embedding and the norms, and each `Linear` weight
    /// whole, one at a time, since the adapter transposes it).
    ///
    /// # Errors
    /// Those of [`Llama::llama2c_tensors`].
    pub fn llama2c_pretrained(path: &Path) -> Result<(LlamaConfig, Pretrained), String> {
        let (config, tensors) = Self::llama2c_tensors(path)?;
        let pretrained =
            Pretrained::from_tensors(path.display().to_string(), tensors).with_from_adapter(PyTorchToBurnAdapter);
        Ok((config, pretrained))
    }

    /// The tensors of a llama2.c checkpoint, named by this model's module paths, each a window
    /// of the file (nothing but the header and the RoPE table is read here): a header of 7
    /// little-endian `i32` (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size
    /// (negative: an untied classifier follows), seq_len), then `f32` tensors, each kind for
    /// all layers at once, weights stored `[out, in]` (PyTorch's layout: load them with
    /// burn-store's `PyTorchToBurnAdapter`, which transposes `Linear` weights).
    ///
    /// # Errors
    /// The file is unreadable, its header is not a llama2.c one, its length is not what the
    /// header implies, its RoPE table is not `θ = 10,000`'s, or it has an untied classifier
    /// (not supported by this port).
    pub fn llama2c_tensors(path: &Path) -> Result<(LlamaConfig, Vec<PackTensor>), String> {
        let bad = |what: String| format!("{} is not a llama2.c checkpoint: {what}", path.display());
        let unreadable = |e: std::io::Error| format!("{}: {e}", path.display());
        let mut file = File::open(path).map_err(unreadable)?;
        let len = file.metadata().map_err(unreadable)?.len();
        let mut header = [0u8; 28];
        if len < 28 {
            return Err(bad(format!("{len} bytes, shorter than the header")));
        }
        file.read_exact(&mut header).map_err(unreadable)?;
        let header: Vec<i32> = header
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        if header[5] < 0 {
            return Err(format!(
                "{}: an untied classifier (negative vocab_size) is not supported",
                path.display()
            ));
        }
        let dims: Vec<usize> = header
            .iter()
            .map(|&v| usize::try_from(v).ok().filter(|&v| v > 0 && v < 1 << 24))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("header {header:?}")))?;
        let c = LlamaConfig {
            dim: dims[0],
            hidden_dim: dims[1],
            n_layers: dims[2],
            n_heads: dims[3],
            n_kv_heads: dims[4],
            vocab_size: dims[5],
            seq_len: dims[6],
        };
        if !c.dim.is_multiple_of(c.n_heads)
            || !c.n_heads.is_multiple_of(c.n_kv_heads)
            || !c.head_size().is_multiple_of(2)
        {
            return Err(bad(format!("inconsistent sizes {c:?}")));
        }
        let (l, d, kv, h) = (c.n_layers, c.dim, c.n_kv_heads * c.head_size(), c.hidden_dim);
        let rope = c.seq_len * c.head_size() / 2;
        // Each kind, for all layers: its name under `layers.{i}.` (or its own path) and the
        // shape of one layer's part, `[out, in]` for weights. Each header value is below 2^24
        // and at most three multiply: the sizes are computed in u64 and compared with the
        // file's length before any use.
        let kinds: [(&str, Vec<usize>, usize); 13] = [
            ("tok_embeddings.weight", vec![c.vocab_size, d], 1),
            ("attention_norm.gamma", vec![d], l),
            ("attention.wq.weight", vec![d, d], l),
            ("attention.wk.weight", vec![kv, d], l),
            ("attention.wv.weight", vec![kv, d], l),
            ("attention.wo.weight", vec![d, d], l),
            ("ffn_norm.gamma", vec![d], l),
            ("w13.linear_inner.weight", vec![h, d], l),
            ("w2.weight", vec![d, h], l),
            ("w13.linear_outer.weight", vec![h, d], l),
            ("norm.gamma", vec![d], 1),
            ("freq_cis_real", vec![rope], 1),
            ("freq_cis_imag", vec![rope], 1),
        ];
        let bytes_of = |shape: &[usize], n: usize| 4 * n as u64 * shape.iter().map(|&f| f as u64).product::<u64>();
        let expected = 28 + kinds.iter().map(|(_, shape, n)| bytes_of(shape, *n)).sum::<u64>();
        if len != expected {
            return Err(bad(format!("{len} bytes, the header {c:?} implies {expected}")));
        }
        let mut tensors = Vec::new();
        let mut at = 28u64;
        let mut rope_table = Vec::new();
        for (name, shape, n) in kinds {
            let size = bytes_of(&shape, 1);
            for i in 0..n {
                let name = match (name, n) {
                    ("freq_cis_real" | "freq_cis_imag", _) => {
                        let mut table = vec![0u8; size as usize];
                        file.seek(SeekFrom::Start(at)).map_err(unreadable)?;
                        file.read_exact(&mut table).map_err(unreadable)?;
                        rope_table.push(table);
                        None
                    }
                    (_, 1) => Some(name.to_string()),
                    _ => Some(format!("layers.{i}.{name}")),
                };
                if let Some(name) = name {
                    let bytes = Bytes::from_file(path, size, at);
                    tensors.push(PackTensor::new(name, DType::F32, shape.clone(), None, bytes));
                }
                at += size;
            }
        }
        let floats = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect()
        };
        check_rope_table(&c, &floats(&rope_table[0]), &floats(&rope_table[1])).map_err(bad)?;
        Ok((c, tensors))
    }

    /// `idx`: `[batch, seq]` token ids (seq at most the config's `seq_len`) -> logits
    /// `[batch, seq, vocab]`. Each block is an FSDP unit.
    pub fn forward(&self, idx: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = idx.dims();
        let device = idx.device();
        let n_heads = self.layers.first().map_or(1, |l| l.attention.n_heads);
        let mask = generate_autoregressive_mask(1, t, &device)
            .reshape([1, 1, t, t])
            .expand([b, n_heads, t, t]);
        let mut h = self.tok_embeddings.forward(idx);
        for layer in &self.layers {
            // A unit for stage 3 (FSDP); without sharding this only runs the closure.
            h = burn_shard::fsdp::unit(&h, || layer.forward(h.clone(), &self.rope, mask.clone()));
        }
        let h = self.norm.forward(h);
        let [_, _, d] = h.dims();
        // The tied classifier: logits = h · Eᵀ.
        let e = self.tok_embeddings.weight.val(); // [vocab, dim]
        let v = e.dims()[0];
        h.reshape([b * t, d]).matmul(e.transpose()).reshape([b, t, v])
    }

    /// Mean cross-entropy (nats per token) of predicting `targets` (`[batch, seq]`).
    pub fn loss(&self, idx: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        crate::training::next_token_loss(self.forward(idx), targets)
    }

    /// Continues `prompt` by up to `n` tokens: greedy (argmax) when `temperature` is 0, else
    /// sampled from the softmax at that temperature. The context is the last `context`
    /// tokens. Stops before a BOS or EOS token, as llama2.c does (a new story would follow).
    pub fn generate(
        &self,
        prompt: &[u32],
        n: usize,
        context: usize,
        temperature: f32,
        rng: &mut impl Rng,
        device: &Device,
    ) -> Vec<u32> {
        let mut ids = prompt.to_vec();
        for _ in 0..n {
            let window: Vec<i64> = ids[ids.len().saturating_sub(context)..]
                .iter()
                .map(|&i| i64::from(i))
                .collect();
            let t = window.len();
            let logits = self.forward(Tensor::from_data(TensorData::new(window, [1, t]), device));
            let v = logits.dims()[2];
            let next = sample_index(logits.slice([0..1, t - 1..t, 0..v]).reshape([v]), temperature, rng) as u32;
            if next == BOS || next == EOS {
                break;
            }
            ids.push(next);
        }
        ids[prompt.len()..].to_vec()
    }
}

/// The checkpoint's RoPE table must be the one `RotaryEncoding` computes (θ = 10,000):
/// `freq_cis_real[t][i] = cos(t · θ^(-2i / head_size))`, `freq_cis_imag` the sine.
fn check_rope_table(c: &LlamaConfig, real: &[f32], imag: &[f32]) -> Result<(), String> {
    let half = c.head_size() / 2;
    for t in 0..c.seq_len {
        for i in 0..half {
            let angle = t as f64 * 10_000f64.powf(-2.0 * i as f64 / c.head_size() as f64);
            let (want_re, want_im) = (angle.cos(), angle.sin());
            let (re, im) = (f64::from(real[t * half + i]), f64::from(imag[t * half + i]));
            if (re - want_re).abs() > 1e-4 || (im - want_im).abs() > 1e-4 {
                return Err(format!(
                    "its RoPE table at position {t}, pair {i} is ({re}, {im}), not θ = 10,000's ({want_re:.6}, {want_im:.6})"
                ));
            }
        }
    }
    Ok(())
}
