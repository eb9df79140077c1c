//! The CPU stage between QKV and O: RoPE, the KV cache, and causal (optionally sliding-window)
//! grouped-query attention. It is the only stage that depends on a chunk's position, which is
//! why it stays on the CPU while the position-free linears run as shared static graphs.

use candle_core::{Device, Tensor};
use candle_npu::Result;

use crate::spec::{Config, FamilySpec, LayerSpec, RopeLayout};

/// The rows a layer runs on: positions `start..start + m`, of which the first `n_valid` are
/// tokens (the rest pad a chunk to its graph's length), with RoPE tables for each base in use.
pub struct Rows {
    pub start: usize,
    pub m: usize,
    pub n_valid: usize,
    /// (base, cos, sin), each table `[m, rope_dims / 2]`.
    rope: Vec<(f32, Tensor, Tensor)>,
}

impl Rows {
    pub fn new(spec: &FamilySpec, start: usize, m: usize, n_valid: usize) -> Result<Self> {
        let mut rope: Vec<(f32, Tensor, Tensor)> = vec![];
        for l in &spec.layers {
            if !rope.iter().any(|(b, _, _)| *b == l.rope_base) {
                let (cos, sin) = rope_tables(spec.rope_dims, l.rope_base, start, m)?;
                rope.push((l.rope_base, cos, sin));
            }
        }
        Ok(Rows { start, m, n_valid, rope })
    }

    fn tables(&self, base: f32) -> (&Tensor, &Tensor) {
        let (_, c, s) = self.rope.iter().find(|(b, _, _)| *b == base).expect("a table for every layer's base (Rows::new)");
        (c, s)
    }
}

/// Per-head RMSNorm weights of Q and K (Gemma 3).
pub struct QkNorm {
    pub q: Tensor,
    pub k: Tensor,
}

/// RoPE on `q`/`k` (`[m, heads * head_dim]`), append the first `n_valid` rows of k, v to the
/// `cache`, and attend causally (within the layer's window) from the rows' positions.
/// Returns `[m, n_head * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attend(c: &Config, spec: &FamilySpec, layer: &LayerSpec, qk_norm: Option<&QkNorm>, cache: &mut Option<(Tensor, Tensor)>, q: &Tensor, k: &Tensor, v: &Tensor, rows: &Rows) -> Result<Tensor> {
    let (nh, nkv, hd, m) = (c.n_head, c.n_kv_head, c.head_dim, rows.m);
    let heads = |t: &Tensor, n: usize| -> Result<Tensor> { Ok(t.reshape((m, n, hd))?) };
    let (mut q, mut k) = (heads(q, nh)?, heads(k, nkv)?);
    if let Some(n) = qk_norm {
        q = candle_nn::ops::rms_norm(&q.contiguous()?, &n.q, c.rms_eps as f32)?;
        k = candle_nn::ops::rms_norm(&k.contiguous()?, &n.k, c.rms_eps as f32)?;
    }
    // [1, heads, m, hd] for candle's RoPE kernels.
    let to_bhtd = |t: Tensor| -> Result<Tensor> { Ok(t.transpose(0, 1)?.contiguous()?.unsqueeze(0)?) };
    let (cos, sin) = rows.tables(layer.rope_base);
    let q = rope(spec, &to_bhtd(q)?, cos, sin)?.squeeze(0)?;
    let k = rope(spec, &to_bhtd(k)?, cos, sin)?.squeeze(0)?;
    let v = to_bhtd(heads(v, nkv)?)?.squeeze(0)?;
    let (k, v) = (k.narrow(1, 0, rows.n_valid)?, v.narrow(1, 0, rows.n_valid)?);
    let (k, v) = match cache.take() {
        Some((kc, vc)) => (Tensor::cat(&[&kc, &k], 1)?, Tensor::cat(&[&vc, &v], 1)?),
        None => (k, v),
    };
    *cache = Some((k.clone(), v.clone()));
    let t = k.dim(1)?;
    // Grouped-query attention without copying K/V: fold each KV head's query heads into rows.
    let groups = nh / nkv;
    let qg = q.reshape((nkv, groups * m, hd))?;
    let scores = (qg.matmul(&k.t()?)? * spec.attn_scale)?;
    let mask: Vec<f32> = (0..groups * m)
        .flat_map(|r| {
            let pos = rows.start + r % m;
            (0..t).map(move |j| if j <= pos && layer.window.is_none_or(|w| pos - j < w) { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (groups * m, t), &Device::Cpu)?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let y = p.matmul(&v)?; // [nkv, groups*m, hd]
    Ok(y.reshape((nh, m, hd))?.transpose(0, 1)?.reshape((m, nh * hd))?)
}

/// RoPE over the first `spec.rope_dims` of each head of `x` (`[1, heads, m, hd]`).
fn rope(spec: &FamilySpec, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let hd = x.dim(3)?;
    let apply = |x: &Tensor| -> Result<Tensor> {
        Ok(match spec.rope {
            RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin)?,
            RopeLayout::Neox => candle_nn::rotary_emb::rope(x, cos, sin)?,
        })
    };
    if spec.rope_dims == hd {
        return apply(x);
    }
    let r = spec.rope_dims;
    let rotated = apply(&x.narrow(3, 0, r)?.contiguous()?)?;
    Ok(Tensor::cat(&[&rotated, &x.narrow(3, r, hd - r)?], 3)?)
}

/// cos/sin of RoPE for positions `start..start+n`, `[n, dims/2]`, computed as candle's models
/// do (f32 inverse frequencies, f32 products).
fn rope_tables(dims: usize, base: f32, start: usize, n: usize) -> Result<(Tensor, Tensor)> {
    let half = dims / 2;
    let inv: Vec<f32> = (0..dims).step_by(2).map(|i| 1f32 / base.powf(i as f32 / dims as f32)).collect();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in start..start + n {
        for &f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    let dev = &Device::Cpu;
    Ok((Tensor::from_vec(cos, (n, half), dev)?, Tensor::from_vec(sin, (n, half), dev)?))
}
