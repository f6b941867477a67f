//! A Llama decoder built from stock `burn::nn` layers (`Embedding`, `RmsNorm`, `Linear`,
//! `SwiGlu`, `RotaryEncoding`), and a reader of llama2.c checkpoints (karpathy's tinyllamas,
//! such as `stories260K.bin`).
//!
//! The architecture follows llama2.c's `run.c`: pre-norm blocks of grouped-query attention
//! (`n_kv_heads` key/value heads shared by `n_heads / n_kv_heads` query heads each) with RoPE
//! on adjacent pairs `(2i, 2i+1)` (Burn's `RotaryEncoding` pairs them the same way, with
//! θ = 10,000), a SwiGLU feed-forward `w2(silu(w1 x) * w3 x)`, RMSNorm with ε = 1e-5, and a
//! classifier tied to the token embedding.

use std::path::Path;

use burn::module::Param;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::{Embedding, Linear, RmsNorm, RmsNormConfig, RotaryEncoding, RotaryEncodingConfig, SwiGlu};
use burn::prelude::*;
use burn::tensor::activation::softmax;
use rand::Rng;

use crate::llama2c_tokenizer::{BOS, EOS};
use crate::training::{read_data, sample_index};

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
    /// Reads a llama2.c checkpoint: a header of 7 little-endian `i32` (dim, hidden_dim,
    /// n_layers, n_heads, n_kv_heads, vocab_size (negative: an untied classifier follows),
    /// seq_len), then `f32` tensors, weights stored `[out, in]`.
    ///
    /// # Errors
    /// The file is unreadable, its header is not a llama2.c one, its length is not what the
    /// header implies, or it has an untied classifier (not supported by this port).
    pub fn load_llama2c(path: &Path, device: &Device) -> Result<(LlamaConfig, Self), String> {
        let bytes = read_data(path)?;
        let bad = |what: String| format!("{} is not a llama2.c checkpoint: {what}", path.display());
        if bytes.len() < 28 {
            return Err(bad(format!("{} bytes, shorter than the header", bytes.len())));
        }
        let header: Vec<i32> = bytes[..28]
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
        let (l, d, kv) = (c.n_layers, c.dim, c.n_kv_heads * c.head_size());
        // Each header value is below 2^24 and at most three multiply: far below u64::MAX, so
        // the sizes are computed in u64 and compared with the file's length before any use.
        let n = |factors: &[usize]| factors.iter().map(|&f| f as u64).product::<u64>();
        let sizes64 = [
            n(&[c.vocab_size, d]),
            n(&[l, d]),
            n(&[l, d, d]),
            n(&[l, kv, d]),
            n(&[l, kv, d]),
            n(&[l, d, d]),
            n(&[l, d]),
            n(&[l, c.hidden_dim, d]),
            n(&[l, d, c.hidden_dim]),
            n(&[l, c.hidden_dim, d]),
            n(&[d]),
            n(&[c.seq_len, c.head_size() / 2]),
            n(&[c.seq_len, c.head_size() / 2]),
        ];
        let expected64 = 28 + 4 * sizes64.iter().sum::<u64>();
        if bytes.len() as u64 != expected64 {
            return Err(bad(format!(
                "{} bytes, the header {c:?} implies {expected64}",
                bytes.len()
            )));
        }
        let sizes = [
            c.vocab_size * d,              // token_embedding
            l * d,                         // rms_att
            l * d * d,                     // wq
            l * kv * d,                    // wk
            l * kv * d,                    // wv
            l * d * d,                     // wo
            l * d,                         // rms_ffn
            l * c.hidden_dim * d,          // w1
            l * d * c.hidden_dim,          // w2
            l * c.hidden_dim * d,          // w3
            d,                             // rms_final
            c.seq_len * c.head_size() / 2, // freq_cis_real (recomputed by RotaryEncoding)
            c.seq_len * c.head_size() / 2, // freq_cis_imag
        ];
        let expected = 28 + 4 * sizes.iter().sum::<usize>();
        if bytes.len() != expected {
            return Err(bad(format!(
                "{} bytes, the header {c:?} implies {expected}",
                bytes.len()
            )));
        }
        let floats: Vec<f32> = bytes[28..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let mut parts = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for n in sizes {
            parts.push(&floats[at..at + n]);
            at += n;
        }
        let [
            emb,
            rms_att,
            wq,
            wk,
            wv,
            wo,
            rms_ffn,
            w1,
            w2,
            w3,
            rms_final,
            freq_real,
            freq_imag,
        ] = parts[..]
        else {
            unreachable!("13 parts")
        };
        check_rope_table(&c, freq_real, freq_imag).map_err(bad)?;
        let block = |i: usize| {
            let layer = |all: &[f32], out: usize, inp: usize| {
                linear(&all[i * out * inp..(i + 1) * out * inp], out, inp, device)
            };
            LlamaBlock {
                attention_norm: rms_norm(&rms_att[i * d..(i + 1) * d], device),
                attention: Attention {
                    wq: layer(wq, d, d),
                    wk: layer(wk, kv, d),
                    wv: layer(wv, kv, d),
                    wo: layer(wo, d, d),
                    n_heads: c.n_heads,
                    n_kv_heads: c.n_kv_heads,
                },
                ffn_norm: rms_norm(&rms_ffn[i * d..(i + 1) * d], device),
                w13: SwiGlu {
                    linear_inner: layer(w1, c.hidden_dim, d),
                    linear_outer: layer(w3, c.hidden_dim, d),
                },
                w2: layer(w2, d, c.hidden_dim),
            }
        };
        let model = Llama {
            tok_embeddings: Embedding {
                weight: Param::from_tensor(Tensor::from_data(
                    TensorData::new(emb.to_vec(), [c.vocab_size, d]),
                    device,
                )),
            },
            layers: (0..l).map(block).collect(),
            norm: rms_norm(rms_final, device),
            rope: RotaryEncodingConfig::new(c.seq_len, c.head_size()).init(device),
        };
        Ok((c, model))
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

/// A bias-free `Linear` from llama2.c's row-major `[out, in]` weight (Burn stores `[in, out]`).
fn linear(rows: &[f32], out: usize, inp: usize, device: &Device) -> Linear {
    let mut transposed = vec![0.0; rows.len()];
    for o in 0..out {
        for i in 0..inp {
            transposed[i * out + o] = rows[o * inp + i];
        }
    }
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(transposed, [inp, out]), device)),
        bias: None,
    }
}

/// llama2.c's RMSNorm (ε = 1e-5) with the given weights.
fn rms_norm(gamma: &[f32], device: &Device) -> RmsNorm {
    let mut norm = RmsNormConfig::new(gamma.len()).with_epsilon(1e-5).init(device);
    norm.gamma = Param::from_tensor(Tensor::from_data(
        TensorData::new(gamma.to_vec(), [gamma.len()]),
        device,
    ));
    norm
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
