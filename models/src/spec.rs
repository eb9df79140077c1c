//! What a model family is, as data: a [`Config`] (sizes, read from the checkpoint the way
//! candle-transformers reads it) and a [`FamilySpec`] (how a layer computes). The engine turns
//! the two into one list of stages per layer; a family file only fills them in and names its
//! checkpoint's tensors.

use candle_core::{DType, Tensor};
use candle_npu::kernels::rows::{gelu_tanh_mul, silu_mul, with_f32};
use candle_npu::Result;

/// Sizes of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Decoder layers.
    pub n_layer: usize,
    /// Width of the residual stream (the embedding length).
    pub hidden: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads: `n_head` is a multiple of it (grouped-query attention; equal without).
    pub n_kv_head: usize,
    /// Size of one head: usually `hidden / n_head`, unless the checkpoint states its own (Gemma 3).
    pub head_dim: usize,
    /// Inner width of the FFN (the gate and up outputs).
    pub ffn: usize,
    /// Vocabulary size: rows of the embedding table, logits per position.
    pub vocab: usize,
    /// RMSNorm epsilon, as the checkpoint gives it (the norms use it as f32).
    pub rms_eps: f64,
    /// Positions the model takes, prompt and generated tokens together; the KV cache never holds
    /// more.
    pub context_len: usize,
}

impl Config {
    /// Why the engine cannot run these sizes, if it cannot (checked as a checkpoint is opened,
    /// before any of its sizes is used): every size positive and within what a decoder of up to
    /// tens of billions of parameters has (a header value beyond that is damage, and would size
    /// allocations), heads in whole KV groups, and an RMSNorm epsilon that is a small positive
    /// number in f32.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let limits = [
            ("layers", self.n_layer, 1 << 10),
            ("hidden size", self.hidden, 1 << 16),
            ("attention heads", self.n_head, 1 << 10),
            ("KV heads", self.n_kv_head, 1 << 10),
            ("head size", self.head_dim, 1 << 12),
            ("FFN size", self.ffn, 1 << 18),
            ("vocabulary", self.vocab, 1 << 22),
            ("context length", self.context_len, 1 << 24),
        ];
        for (what, v, max) in limits {
            if v == 0 || v > max {
                return Err(format!("{what} {v} is not within 1..={max}"));
            }
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(format!("{} attention heads are not a multiple of {} KV heads", self.n_head, self.n_kv_head));
        }
        let eps = self.rms_eps as f32;
        if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
            return Err(format!("RMSNorm epsilon {eps} is not a number in (0, 1)"));
        }
        Ok(())
    }
}

/// The FFN's gate activation: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Llama, Qwen2, Phi-3, Mistral.
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// `act(gate) * up` in one pass over f32 rows (candle's ops take two, with libm's `exp`).
    pub fn gated(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        if gate.dtype() != DType::F32 || up.dtype() != DType::F32 || gate.shape() != up.shape() {
            return Ok((self.apply(gate)? * up)?);
        }
        let y = with_f32(gate, |g| {
            with_f32(up, |u| match self {
                Activation::Silu => silu_mul(g, u),
                Activation::GeluTanh => gelu_tanh_mul(g, u),
            })
        })??;
        Ok(Tensor::from_vec(y, gate.shape(), gate.device())?)
    }

    /// `act(x)` alone, with candle's ops: [`Activation::gated`]'s path for anything but f32 rows
    /// of one shape.
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Activation::Silu => candle_nn::ops::silu(x)?,
            Activation::GeluTanh => x.gelu()?,
        })
    }
}

/// Which dimensions of a head RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i+1)`: the layout of llama.cpp's Llama GGUFs, whose Q/K rows are permuted
    /// from the HF checkpoint.
    Interleaved,
    /// Pairs `(i, i + d/2)` (GPT-NeoX, HF's `rotate_half`): every HF checkpoint, and GGUFs
    /// converted without the permutation (Qwen2, Gemma 3).
    Neox,
}

/// What differs between layers of one model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSpec {
    /// RoPE's frequency base (`theta`) for this layer's positions: per layer because Gemma 3's
    /// sliding layers use another base than its global ones.
    pub rope_base: f32,
    /// Sliding-window attention: a position sees itself and the `window - 1` before it (HF's and
    /// llama.cpp's convention); `None` is global attention.
    pub window: Option<usize>,
}

/// How one family's layer computes, beyond its sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilySpec {
    /// For messages and graph names: "llama", "qwen2", "gemma3", "phi3", "mistral".
    pub family: &'static str,
    /// The FFN's gate activation.
    pub activation: Activation,
    /// Which dimensions of a head RoPE pairs, as the checkpoint's Q/K rows are laid out.
    pub rope: RopeLayout,
    /// Rotated dimensions of each head (all of them unless the checkpoint says otherwise).
    pub rope_dims: usize,
    /// One per layer (`Config::n_layer` of them): RoPE base and attention window.
    pub layers: Vec<LayerSpec>,
    /// RMSNorm of each head's query and key before RoPE (Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention output and of the FFN output before each residual add
    /// (Gemma's "sandwich" norms).
    pub post_norms: bool,
    /// Q, K and V carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Embeddings are multiplied by this before the first layer (Gemma: `sqrt(hidden)`).
    pub embed_scale: Option<f64>,
    /// Attention logits are `q.k * attn_scale` (usually `1/sqrt(head_dim)`).
    pub attn_scale: f64,
    /// The output table is the embedding even where the checkpoint also holds an output matrix
    /// (an HF config's `tie_word_embeddings: true`, as HF and candle-transformers read it).
    /// Otherwise it is the embedding only where there is no output matrix.
    pub tied_output: bool,
}

impl FamilySpec {
    /// The common case: SiLU, global attention with one RoPE base, no extra norms or biases.
    pub fn plain(family: &'static str, cfg: &Config, rope: RopeLayout, rope_base: f32) -> Self {
        FamilySpec {
            family,
            activation: Activation::Silu,
            rope,
            rope_dims: cfg.head_dim,
            layers: vec![LayerSpec { rope_base, window: None }; cfg.n_layer],
            qk_norm: false,
            post_norms: false,
            qkv_bias: false,
            embed_scale: None,
            attn_scale: 1.0 / (cfg.head_dim as f64).sqrt(),
            tied_output: false,
        }
    }
}
