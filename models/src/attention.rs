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
    /// Tokens the KV cache will hold after this pass (its allocation).
    pub reserve: usize,
    /// (base, cos, sin), each table `[m, rope_dims / 2]`.
    rope: Vec<(f32, Tensor, Tensor)>,
}

impl Rows {
    pub fn new(spec: &FamilySpec, start: usize, m: usize, n_valid: usize, reserve: usize) -> Result<Self> {
        let mut rope: Vec<(f32, Tensor, Tensor)> = vec![];
        for l in &spec.layers {
            if !rope.iter().any(|(b, _, _)| *b == l.rope_base) {
                let (cos, sin) = rope_tables(spec.rope_dims, l.rope_base, start, m)?;
                rope.push((l.rope_base, cos, sin));
            }
        }
        Ok(Rows { start, m, n_valid, reserve, rope })
    }

    fn tables(&self, base: f32) -> (&Tensor, &Tensor) {
        let (_, c, s) = self.rope.iter().find(|(b, _, _)| *b == base).expect("a table for every layer's base (Rows::new)");
        (c, s)
    }
}

/// One layer's keys and values, `[kv_heads, capacity, head_dim]` each, filled to `len`. Grown
/// in place: appending a chunk by concatenation would copy the whole cache per chunk and leave
/// every earlier size free in the heap (measured on SmolLM2: 60 MiB resident after a 700-token
/// prefill whose cache holds 32 MiB).
#[derive(Default)]
pub struct KvCache {
    kv: Option<(Tensor, Tensor)>,
    len: usize,
}

impl KvCache {
    /// Drop the tokens and the memory.
    pub fn clear(&mut self) {
        *self = KvCache::default();
    }

    fn capacity(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.dim(1).unwrap_or(0))
    }

    /// Append `k`, `v` (`[kv_heads, n, head_dim]`); room for `reserve` tokens in all is made
    /// at once when known (a prefill's length), else the capacity grows by `GROW` tokens (not
    /// by a factor: after a long prompt, +50% would be the job's peak; a copy per 256 decoded
    /// tokens costs little).
    fn append(&mut self, k: &Tensor, v: &Tensor, reserve: usize) -> Result<(Tensor, Tensor)> {
        let (heads, n, hd) = k.dims3()?;
        let need = self.len + n;
        if need > self.capacity() {
            const GROW: usize = 256;
            let cap = need.max(reserve).max(self.capacity() + GROW);
            let grow = |old: Option<&Tensor>| -> Result<Tensor> {
                let t = Tensor::zeros((heads, cap, hd), k.dtype(), &Device::Cpu)?;
                if let Some(old) = old.filter(|_| self.len > 0) {
                    t.slice_set(&old.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                }
                Ok(t)
            };
            let (ok, ov) = match &self.kv {
                Some((a, b)) => (Some(a), Some(b)),
                None => (None, None),
            };
            self.kv = Some((grow(ok)?, grow(ov)?));
        }
        let (kc, vc) = self.kv.as_ref().expect("allocated above");
        kc.slice_set(&k.contiguous()?, 1, self.len)?;
        vc.slice_set(&v.contiguous()?, 1, self.len)?;
        self.len = need;
        Ok((kc.narrow(1, 0, need)?, vc.narrow(1, 0, need)?))
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
pub fn attend(c: &Config, spec: &FamilySpec, layer: &LayerSpec, qk_norm: Option<&QkNorm>, cache: &mut KvCache, q: &Tensor, k: &Tensor, v: &Tensor, rows: &Rows) -> Result<Tensor> {
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
    let (k, v) = cache.append(&k.narrow(1, 0, rows.n_valid)?, &v.narrow(1, 0, rows.n_valid)?, rows.reserve)?;
    let t = k.dim(1)?;
    // Grouped-query attention without copying K/V: fold each KV head's query heads into rows,
    // and attend one KV head at a time so the score matrices of only one are alive at once
    // (for SmolLM2 at 700 tokens: 2 MiB instead of 6, three times over: scores, masked, softmax).
    let groups = nh / nkv;
    let qg = q.reshape((nkv, groups * m, hd))?;
    let mask: Vec<f32> = (0..groups * m)
        .flat_map(|r| {
            let pos = rows.start + r % m;
            (0..t).map(move |j| if j <= pos && layer.window.is_none_or(|w| pos - j < w) { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (groups * m, t), &Device::Cpu)?;
    let ys = (0..nkv)
        .map(|h| {
            let scores = (qg.get(h)?.matmul(&k.get(h)?.t()?)? * spec.attn_scale)?;
            let p = candle_nn::ops::softmax_last_dim(&(scores + &mask)?)?;
            Ok(p.matmul(&v.get(h)?)?) // [groups*m, hd]
        })
        .collect::<Result<Vec<_>>>()?;
    let y = Tensor::stack(&ys, 0)?; // [nkv, groups*m, hd]
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
