//! A small nanoGPT-style decoder: token + position embeddings, pre-norm blocks of causal
//! multi-head self-attention and a GELU MLP, a final layer norm and a linear head.

use burn::nn::attention::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask};
use burn::nn::{Embedding, EmbeddingConfig, Gelu, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::prelude::*;
use rand::Rng;

/// Sizes of the model.
#[derive(Clone, Copy, Debug)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context length (tokens).
    pub block_size: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Attention heads per block (`n_embd` must divide by it).
    pub n_head: usize,
    /// Number of transformer blocks.
    pub n_layer: usize,
}

/// One pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    ln1: LayerNorm,
    attn: MultiHeadAttention,
    ln2: LayerNorm,
    fc: Linear,
    act: Gelu,
    proj: Linear,
}

impl Block {
    fn new(c: &GptConfig, device: &Device) -> Self {
        Self {
            ln1: LayerNormConfig::new(c.n_embd).init(device),
            attn: MultiHeadAttentionConfig::new(c.n_embd, c.n_head)
                .with_dropout(0.0)
                .init(device),
            ln2: LayerNormConfig::new(c.n_embd).init(device),
            fc: LinearConfig::new(c.n_embd, 4 * c.n_embd).init(device),
            act: Gelu::new(),
            proj: LinearConfig::new(4 * c.n_embd, c.n_embd).init(device),
        }
    }

    /// `x`: `[batch, seq, n_embd]`, `mask`: `[batch, seq, seq]` (true = masked).
    fn forward(&self, x: Tensor<3>, mask: Tensor<3, Bool>) -> Tensor<3> {
        let a = self
            .attn
            .forward(MhaInput::self_attn(self.ln1.forward(x.clone())).mask_attn(mask))
            .context;
        let x = x + a;
        let m = self
            .proj
            .forward(self.act.forward(self.fc.forward(self.ln2.forward(x.clone()))));
        x + m
    }
}

/// The blocks' matrices (attention projections, MLP weights) by module path: Muon's group in
/// the Muon recipes; embeddings, LayerNorms, biases and the head stay with AdamW.
pub fn hidden_matrices() -> burn::module::ParamGroup {
    burn::module::ParamGroup::from_regex(r"^blocks\.[0-9]+\.(attn\.(query|key|value|output)|fc|proj)\.weight$")
        .expect("a valid regex")
}

/// The decoder.
#[derive(Module, Debug)]
pub struct Gpt {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    head: Linear,
}

impl Gpt {
    /// A freshly initialised model (Burn's default initialisers; seed the device for determinism).
    pub fn new(c: &GptConfig, device: &Device) -> Self {
        Self {
            tok: EmbeddingConfig::new(c.vocab_size, c.n_embd).init(device),
            pos: EmbeddingConfig::new(c.block_size, c.n_embd).init(device),
            blocks: (0..c.n_layer).map(|_| Block::new(c, device)).collect(),
            ln_f: LayerNormConfig::new(c.n_embd).init(device),
            head: LinearConfig::new(c.n_embd, c.vocab_size).init(device),
        }
    }

    /// `idx`: `[batch, seq]` token ids (seq <= block_size) -> logits `[batch, seq, vocab]`.
    pub fn forward(&self, idx: Tensor<2, Int>) -> Tensor<3> {
        let [b, t] = idx.dims();
        let device = idx.device();
        let pos = Tensor::<1, Int>::arange(0..t as i64, &device).reshape([1, t]);
        let mut x = self.tok.forward(idx) + self.pos.forward(pos);
        let mask = generate_autoregressive_mask(b, t, &device);
        for block in &self.blocks {
            // Each block is a unit for stage 3 (FSDP): its gradients are reduce-scattered right
            // after its backward. Without sharding this only runs the closure.
            x = burn_shard::fsdp::unit(&x, || block.forward(x.clone(), mask.clone()));
        }
        // The layers after the last block are a unit too, so their gradients are reduced right
        // after their own backward instead of at the end of the backward pass (the hooks of
        // parameters used outside every unit run last).
        burn_shard::fsdp::unit(&x, || self.head.forward(self.ln_f.forward(x.clone())))
    }

    /// Mean cross-entropy (nats per token) of predicting `targets` (`[batch, seq]`).
    pub fn loss(&self, idx: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        crate::training::next_token_loss(self.forward(idx), targets)
    }

    /// Samples `n` tokens after `prompt` with softmax temperature `temperature`.
    pub fn generate(
        &self,
        prompt: &[u16],
        n: usize,
        block_size: usize,
        temperature: f32,
        rng: &mut impl Rng,
        device: &Device,
    ) -> Vec<u16> {
        let mut ids: Vec<u16> = prompt.to_vec();
        for _ in 0..n {
            let ctx: Vec<i64> = ids[ids.len().saturating_sub(block_size)..]
                .iter()
                .map(|&i| i as i64)
                .collect();
            let t = ctx.len();
            let logits = self.forward(Tensor::from_data(TensorData::new(ctx, [1, t]), device));
            let v = logits.dims()[2];
            let last = logits.slice([0..1, t - 1..t, 0..v]).reshape([v]);
            let next = crate::training::sample_index(last, temperature, rng);
            ids.push(next as u16);
        }
        ids[prompt.len()..].to_vec()
    }
}
