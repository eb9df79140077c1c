//! The CPU stage between QKV and O: RoPE, the KV cache, and causal (optionally sliding-window)
//! grouped-query attention. It is the only stage that depends on a chunk's position, which is
//! why it stays on the CPU while the position-free linears run as shared static graphs.

use candle_core::{Device, Tensor};
use half::f16;
use std::ops::Range;
use std::sync::Mutex;

use candle_npu::kernels::attention::{self as kernel, HeadKv, KvRows, Partial, Scratch, Q8_BLOCK};
use candle_npu::kernels::claim;
use candle_npu::kernels::rows::{rows_per_task, with_f32};
use candle_npu::{Error, Result};
use rayon::prelude::*;

use crate::spec::{Config, FamilySpec, LayerSpec, RopeLayout};

/// The rows a layer runs on: positions `start..start + m`, of which the first `n_valid` are
/// tokens (the rest pad a chunk to its graph's length), with RoPE tables for each base in use.
pub struct Rows {
    /// Position of the first row: the tokens the cache held before the pass plus the chunk's
    /// offset in the prompt.
    pub start: usize,
    /// Rows in the pass: a chunk's graph length (padding included), or the token count on the CPU.
    pub m: usize,
    /// Rows that are tokens, the only ones appended to the KV cache (`n_valid <= m`).
    pub n_valid: usize,
    /// Tokens the KV cache will hold after this pass (its allocation).
    pub reserve: usize,
    /// (base, cos, sin), each table `[m, rope_dims / 2]`.
    rope: Vec<(f32, Vec<f32>, Vec<f32>)>,
    /// A decode step ([`Rows::decode_step`]).
    decode: bool,
}

impl Rows {
    /// The rows `start..start + m` (the first `n_valid` of them tokens) with the RoPE tables of
    /// each distinct base among `spec`'s layers (Gemma 3 has two), computed once per pass.
    pub fn new(spec: &FamilySpec, start: usize, m: usize, n_valid: usize, reserve: usize) -> Result<Self> {
        let mut rope: Vec<(f32, Vec<f32>, Vec<f32>)> = vec![];
        for l in &spec.layers {
            if !rope.iter().any(|(b, _, _)| *b == l.rope_base) {
                let (cos, sin) = rope_tables(spec.rope_dims, l.rope_base, start, m);
                rope.push((l.rope_base, cos, sin));
            }
        }
        Ok(Rows { start, m, n_valid, reserve, rope, decode: false })
    }

    /// Marks one row on the CPU path (decode weights) as a decode step: its attention takes the
    /// one-position kernel ([`kernel::attend_tile_one`]), which agrees with the prefill's to
    /// rounding only; a decode row's linears differ from a prefill row's anyway, so no two are
    /// compared bit for bit.
    pub fn decode_step(mut self) -> Self {
        self.decode = self.m == 1;
        self
    }

    /// Marks every row as a decode step of its own (a speculative verifier's rows): each row's
    /// attention is what [`Rows::decode_step`] gives that row decoded alone, bit for bit, so
    /// verifying k tokens in one pass computes the logits k decode steps would.
    pub fn decode_rows(mut self) -> Self {
        self.decode = true;
        self
    }

    fn tables(&self, base: f32) -> (&[f32], &[f32]) {
        let (_, c, s) = self.rope.iter().find(|(b, _, _)| *b == base).expect("a table for every layer's base (Rows::new)");
        (c, s)
    }
}

/// How a [`KvCache`] holds its keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvType {
    /// f32, as computed: the reference (candle-transformers' own caches are f32), which the
    /// tests that compare with candle at tight tolerances ask for.
    F32,
    /// f16 (llama.cpp's default, and this crate's): half the memory; attention widens each tile
    /// to f32, so only the values held are rounded (2^-11 relative), never a sum
    /// (`docs/memory.md`: perplexity and the chat eval the same as with f32).
    #[default]
    F16,
    /// llama.cpp's `q8_0` (its `--cache-type-k q8_0`): i8 values in blocks of 32 with an f16
    /// scale each, 1.0625 bytes a value (a head size that is a multiple of 32); attention
    /// widens each tile to f32 as for f16 (`docs/memory.md` has its perplexity).
    Q8,
}

impl KvType {
    /// Bytes that `values` values take (a q8 cache's in whole blocks).
    pub fn bytes(self, values: usize) -> usize {
        match self {
            KvType::F32 => 4 * values,
            KvType::F16 => 2 * values,
            KvType::Q8 => values + 2 * values.div_ceil(Q8_BLOCK),
        }
    }

    /// The type a saved state holds a cache of this type in: its own, but q8 as f32 (its values
    /// exactly; restored into q8 they quantize to the same blocks).
    pub fn saved(self) -> KvType {
        match self {
            KvType::Q8 => KvType::F32,
            t => t,
        }
    }

    /// An error unless a cache of this type can hold heads of `head_dim` values (q8 blocks do
    /// not straddle tokens).
    pub fn check_head_dim(self, head_dim: usize) -> Result<()> {
        match self == KvType::Q8 && !head_dim.is_multiple_of(Q8_BLOCK) {
            true => Err(Error::Input(format!("a q8 KV cache holds heads of a multiple of {Q8_BLOCK} values: this model's have {head_dim} (use f16)"))),
            false => Ok(()),
        }
    }
}

/// Keys or values of every head, `[kv_heads, capacity, head_dim]`, in the cache's [`KvType`].
#[derive(Clone)]
enum Store {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// Values and a scale per [`Q8_BLOCK`] of them.
    Q8(Vec<i8>, Vec<f16>),
}

impl Default for Store {
    fn default() -> Self {
        Store::empty(KvType::default())
    }
}

impl Store {
    fn empty(t: KvType) -> Self {
        match t {
            KvType::F32 => Store::F32(Vec::new()),
            KvType::F16 => Store::F16(Vec::new()),
            KvType::Q8 => Store::Q8(Vec::new(), Vec::new()),
        }
    }

    fn kind(&self) -> KvType {
        match self {
            Store::F32(_) => KvType::F32,
            Store::F16(_) => KvType::F16,
            Store::Q8(..) => KvType::Q8,
        }
    }

    /// A store of `values` zeros of the same type, or the allocation's error.
    fn zeros(&self, values: usize) -> std::result::Result<Self, std::collections::TryReserveError> {
        fn z<T: Clone>(values: usize, zero: T) -> std::result::Result<Vec<T>, std::collections::TryReserveError> {
            let mut t = Vec::new();
            t.try_reserve_exact(values)?;
            t.resize(values, zero);
            Ok(t)
        }
        Ok(match self {
            Store::F32(_) => Store::F32(z(values, 0f32)?),
            Store::F16(_) => Store::F16(z(values, f16::ZERO)?),
            Store::Q8(..) => Store::Q8(z(values, 0i8)?, z(values.div_ceil(Q8_BLOCK), f16::ZERO)?),
        })
    }

    /// Values `at..at + len` of `src` (same type) copied to `at2..`.
    fn copy_from(&mut self, at2: usize, src: &Store, at: usize, len: usize) {
        match (self, src) {
            (Store::F32(d), Store::F32(s)) => d[at2..][..len].copy_from_slice(&s[at..][..len]),
            (Store::F16(d), Store::F16(s)) => d[at2..][..len].copy_from_slice(&s[at..][..len]),
            (Store::Q8(dq, dd), Store::Q8(sq, sd)) => {
                // Whole blocks: every offset and length is a multiple of the head size.
                dq[at2..][..len].copy_from_slice(&sq[at..][..len]);
                dd[at2 / Q8_BLOCK..][..len / Q8_BLOCK].copy_from_slice(&sd[at / Q8_BLOCK..][..len / Q8_BLOCK]);
            }
            _ => unreachable!("one cache's stores have one type"),
        }
    }

    /// `x` written at `at` (rounded to f16 in an f16 store, quantized in blocks in a q8 one).
    fn write(&mut self, at: usize, x: &[f32]) {
        use half::slice::HalfFloatSliceExt;
        match self {
            Store::F32(d) => d[at..][..x.len()].copy_from_slice(x),
            Store::F16(d) => d[at..][..x.len()].convert_from_f32_slice(x),
            Store::Q8(q, d) => kernel::quantize_q8(x, &mut q[at..][..x.len()], &mut d[at / Q8_BLOCK..][..x.len() / Q8_BLOCK]),
        }
    }

    /// Values `r` as f32, appended to `out`.
    fn read(&self, r: Range<usize>, out: &mut Vec<f32>) {
        let at = out.len();
        out.resize(at + r.len(), 0.0);
        self.read_into(r, &mut out[at..]);
    }

    /// Values `r` into `out` (as long), as f32.
    fn read_into(&self, r: Range<usize>, out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        match self {
            Store::F32(d) => out.copy_from_slice(&d[r]),
            Store::F16(d) => d[r].convert_to_f32_slice(out),
            Store::Q8(..) => {
                let mut buf = vec![];
                out.copy_from_slice(self.rows(r).as_f32(&mut buf));
            }
        }
    }

    fn rows(&self, r: Range<usize>) -> KvRows<'_> {
        match self {
            Store::F32(d) => KvRows::F32(&d[r]),
            Store::F16(d) => KvRows::F16(&d[r]),
            Store::Q8(q, d) => KvRows::Q8 { q: &q[r.clone()], d: &d[r.start / Q8_BLOCK..r.end.div_ceil(Q8_BLOCK)] },
        }
    }
}

/// One layer's keys and values, `[kv_heads, capacity, head_dim]` each (a head's keys are one
/// contiguous matrix for the score GEMM), filled to `len`, as f32 or f16 ([`KvType`]). Grown in
/// place: appending a chunk by concatenation would copy the whole cache per chunk and leave every
/// earlier size free in the heap (measured on SmolLM2: 60 MiB resident after a 700-token prefill
/// whose cache holds 32 MiB).
#[derive(Default, Clone)]
pub struct KvCache {
    k: Store,
    v: Store,
    heads: usize,
    head_dim: usize,
    cap: usize,
    len: usize,
}

impl KvCache {
    /// Tokens the capacity grows by when it must grow and no reservation says more.
    pub const GROW: usize = 256;

    /// An empty cache holding its values as `t`.
    pub fn new(t: KvType) -> Self {
        KvCache { k: Store::empty(t), v: Store::empty(t), ..Default::default() }
    }

    /// How the values are held.
    pub fn kind(&self) -> KvType {
        self.k.kind()
    }

    /// The cache with its values held as `t` (converted: f32 to f16 rounds them).
    pub fn into_type(self, t: KvType) -> Self {
        if self.kind() == t {
            return self;
        }
        let mut out = KvCache::new(t);
        if self.len > 0 {
            let (k, v) = self.head_major();
            // Room for exactly the tokens held; the next append grows it as usual.
            out.append_heads(&k, &v, self.len, self.heads, self.head_dim).expect("a cache of the tokens already held fits again");
        }
        out
    }

    /// Drop the tokens and the memory (the type stays).
    pub fn clear(&mut self) {
        *self = KvCache::new(self.kind());
    }

    /// Keep the first `n` tokens (fewer are kept as they are).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No tokens held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the values take (capacity included).
    pub fn bytes(&self) -> usize {
        2 * self.kind().bytes(self.heads * self.cap * self.head_dim)
    }

    /// Append `n` tokens of `k`, `v` (`[n, kv_heads, head_dim]`); room for `reserve` tokens in
    /// all is made at once when known (a prefill's length), else the capacity grows by `GROW`
    /// tokens (not by a factor: after a long prompt, +50% would be the job's peak; a copy per 256
    /// decoded tokens costs little).
    ///
    /// A cache that does not fit in memory is [`Error::OutOfMemory`] saying how many tokens it
    /// was for (the longest prompts and conversations are where memory runs out).
    pub(crate) fn append(&mut self, k: &[f32], v: &[f32], n: usize, heads: usize, head_dim: usize, reserve: usize) -> Result<()> {
        let need = self.len + n;
        if need > self.cap || (heads, head_dim) != (self.heads, self.head_dim) {
            let cap = need.max(reserve).max(self.cap + Self::GROW);
            let (len, old_cap) = (self.len, self.cap);
            let values = heads.checked_mul(cap).and_then(|x| x.checked_mul(head_dim));
            // Keys and values: two stores of `values`.
            let kind = self.kind();
            let oom = || Error::OutOfMemory {
                what: format!("a layer's KV cache of {cap} tokens ({heads} KV heads of {head_dim})"),
                bytes: values.and_then(|n| n.checked_mul(2)).map_or(u64::MAX, |n| kind.bytes(n) as u64),
            };
            let values = values.ok_or_else(oom)?;
            let grow = |old: &Store| -> Result<Store> {
                let mut t = old.zeros(values).map_err(|_| oom())?;
                for h in 0..heads.min(self.heads) {
                    t.copy_from(h * cap * head_dim, old, h * old_cap * head_dim, len * head_dim);
                }
                Ok(t)
            };
            (self.k, self.v) = (grow(&self.k)?, grow(&self.v)?);
            (self.heads, self.head_dim, self.cap) = (heads, head_dim, cap);
        }
        for (dst, src) in [(&mut self.k, k), (&mut self.v, v)] {
            for (t, row) in src.chunks_exact(heads * head_dim).take(n).enumerate() {
                for (h, x) in row.chunks_exact(head_dim).enumerate() {
                    dst.write((h * self.cap + self.len + t) * head_dim, x);
                }
            }
        }
        self.len = need;
        Ok(())
    }

    /// Append `n` tokens of `heads` heads of `hd` given head-major (`[heads, n, hd]` keys, then
    /// values), as [`Self::into_type`] and [`Self::from_values`] have them.
    fn append_heads(&mut self, k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize) -> Result<()> {
        let token_major = |x: &[f32]| -> Vec<f32> { (0..n).flat_map(|t| (0..heads).flat_map(move |h| x[(h * n + t) * hd..][..hd].iter().copied())).collect() };
        self.append(&token_major(k), &token_major(v), n, heads, hd, n)
    }

    /// Every head's keys, then every head's values, as f32 (`[heads, len, head_dim]` each).
    fn head_major(&self) -> (Vec<f32>, Vec<f32>) {
        let mut out = (Vec::new(), Vec::new());
        for (src, dst) in [(&self.k, &mut out.0), (&self.v, &mut out.1)] {
            for h in 0..self.heads {
                src.read(h * self.cap * self.head_dim..(h * self.cap + self.len) * self.head_dim, dst);
            }
        }
        out
    }

    /// (heads, head_dim) of the tokens held.
    pub fn shape(&self) -> (usize, usize) {
        (self.heads, self.head_dim)
    }

    /// Every head's keys, then every head's values, `len` tokens each, as little-endian values
    /// of type `t.saved()` (the saved form of a prompt's KV, see `crate::session`): an f16 cache saved as
    /// f16 (half the file) or widened to f32, exactly; an f32 one as f32, or rounded to f16.
    pub fn write_to(&self, out: &mut impl std::io::Write, t: KvType) -> std::io::Result<()> {
        let (k, v) = self.head_major();
        for data in [k, v] {
            let bytes: Vec<u8> = match t.saved() {
                KvType::F32 | KvType::Q8 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                KvType::F16 => data.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect(),
            };
            out.write_all(&bytes)?;
        }
        Ok(())
    }

    /// The values of [`KvCache::write_to`]'s bytes of type `t.saved()`, widened to f32.
    pub fn values_of(bytes: &[u8], t: KvType) -> Vec<f32> {
        match t.saved() {
            KvType::F32 | KvType::Q8 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            KvType::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        }
    }

    /// A cache of `len` tokens from [`KvCache::write_to`]'s values ([`KvCache::values_of`]),
    /// held as `t`; `None` unless they are exactly `2 * heads * len * head_dim` values.
    pub fn from_values(values: &[f32], heads: usize, head_dim: usize, len: usize, t: KvType) -> Option<Self> {
        let half = heads.checked_mul(len)?.checked_mul(head_dim)?;
        if values.len() != half.checked_mul(2)? {
            return None;
        }
        let (k, v) = values.split_at(half);
        let mut c = KvCache::new(t);
        if len == 0 {
            (c.heads, c.head_dim) = (heads, head_dim);
            return Some(c);
        }
        c.append_heads(k, v, len, heads, head_dim).ok()?;
        Some(c)
    }

    /// Keys and values as a graph's cache inputs: `[heads, cap, head_dim]` each, the tokens held
    /// first in every head and zeros after them (`cap >= len`; a cache that has held nothing is
    /// taken as `heads` heads of `head_dim`).
    pub(crate) fn padded(&self, cap: usize, heads: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
        let mut out = (vec![0f32; heads * cap * head_dim], vec![0f32; heads * cap * head_dim]);
        let n = self.len.min(cap) * head_dim;
        for (dst, src) in [(&mut out.0, &self.k), (&mut out.1, &self.v)] {
            for h in 0..self.heads.min(heads) {
                let at = h * self.cap * self.head_dim;
                src.read_into(at..at + n, &mut dst[h * cap * head_dim..][..n]);
            }
        }
        out
    }

    /// The tokens of head `h`: `[len, head_dim]` keys and values.
    fn head_kv(&self, h: usize) -> HeadKv<'_> {
        let range = h * self.cap * self.head_dim..(h * self.cap + self.len) * self.head_dim;
        HeadKv { keys: self.k.rows(range.clone()), values: self.v.rows(range), first: 0, head_dim: self.head_dim }
    }
}

/// Per-head RMSNorm weights of Q and K (Gemma 3).
pub struct QkNorm {
    /// The query norm's weight, `[head_dim]`, applied to every query head.
    pub q: Tensor,
    /// The key norm's weight, `[head_dim]`, applied to every KV head.
    pub k: Tensor,
}

/// RoPE on `q`/`k` (`[m, heads * head_dim]`), append the first `n_valid` rows of k, v to the
/// `cache`, and attend causally (within the layer's window) from the rows' positions.
/// Returns `[m, n_head * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    c: &Config,
    spec: &FamilySpec,
    layer: &LayerSpec,
    qk_norm: Option<&QkNorm>,
    cache: &mut KvCache,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rows: &Rows,
) -> Result<Tensor> {
    let (nh, nkv, hd, m) = (c.n_head, c.n_kv_head, c.head_dim, rows.m);
    let (mut q, mut k) = (q.reshape((m, nh, hd))?, k.reshape((m, nkv, hd))?);
    if let Some(n) = qk_norm {
        q = candle_nn::ops::rms_norm(&q.contiguous()?, &n.q, c.rms_eps as f32)?;
        k = candle_nn::ops::rms_norm(&k.contiguous()?, &n.k, c.rms_eps as f32)?;
    }
    let (cos, sin) = rows.tables(layer.rope_base);
    let (q, k) = (with_f32(&q, |q| roped(spec, q, nh, hd, cos, sin))?, with_f32(&k, |k| roped(spec, k, nkv, hd, cos, sin))?);
    // V is appended from the stage's output as it is (no copy of its own).
    with_f32(v, |v| cache.append(&k, v, rows.n_valid, nkv, hd, rows.reserve))??;
    let out = causal(&q, cache, rows, nh, layer.window, spec.attn_scale as f32);
    Ok(Tensor::from_vec(out, (m, nh * hd), &Device::Cpu)?)
}

/// Query rows per attention block: a chunk of 256 rows makes 4 blocks per KV head (the cores stay
/// busy, and a block's key range ends at its own last row).
const ROW_BLOCK: usize = 64;

/// Block-causal grouped-query attention of the rows' queries (`q`: `[m, n_head, head_dim]`, after
/// RoPE) over the cache, by the engine's tiled kernel ([`candle_npu::kernels::attention`]).
/// Each task is one KV head and one block of query rows, with the query heads that share the KV
/// head stacked as rows (no K/V copies); its keys end at the block's last position and start at
/// its first row's window, so nothing above the diagonal block is computed and no mask is built.
/// A decode step, and a pass of rows too few for such tasks to keep the cores busy (a short
/// turn), spread their tiles of keys over the cores instead, merged in order afterwards
/// (flash-decoding); a decode step takes the one-position kernel. Returns `[m, n_head * head_dim]`.
fn causal(q: &[f32], cache: &KvCache, rows: &Rows, nh: usize, window: Option<usize>, scale: f32) -> Vec<f32> {
    let hd = cache.head_dim;
    let mut out = vec![0f32; rows.m * nh * hd];
    // Only the rows that are tokens attend: a padding row's output is never used (each row's
    // values depend on its own inputs only, through static quantization), so it stays zero. A
    // verification pass of a few rows in a padded 32-row chunk pays for its own rows only.
    let m = rows.n_valid;
    if cache.len == 0 || m == 0 {
        return out;
    }
    let (q, out_valid) = (&q[..m * nh * hd], &mut out[..m * nh * hd]);
    causal_rows(q, cache, rows, m, nh, window, scale, out_valid);
    out
}

/// [`causal`] of the first `m` rows into `out` (`[m, n_head * head_dim]`).
#[allow(clippy::too_many_arguments)]
fn causal_rows(q: &[f32], cache: &KvCache, rows: &Rows, m: usize, nh: usize, window: Option<usize>, scale: f32, out: &mut [f32]) {
    let (nkv, hd, t) = (cache.heads, cache.head_dim, cache.len);
    // Keys visible from row `r`.
    let pos = |r: usize| (rows.start + r).min(t - 1);
    let span = |r: usize| window.map_or(0, |w| (pos(r) + 1).saturating_sub(w))..pos(r) + 1;
    let blocks = m.div_ceil(ROW_BLOCK);
    if rows.decode {
        // Each row as its own decode step: its span, its tiles, the one-position kernel.
        let w = nh * cache.head_dim;
        for (r, out) in out.chunks_exact_mut(w).enumerate() {
            split_keys(&q[r * w..(r + 1) * w], cache, 1, nh, &|_| span(r), scale, true, out);
        }
        return;
    }
    if nkv * blocks < 2 * rayon::current_num_threads() {
        split_keys(q, cache, m, nh, &span, scale, false, out);
        return;
    }
    let groups = nh / nkv;
    // Rows s0..s1 of KV head h (a `Part`).
    let part = |h: usize, s0: usize, s1: usize, scratch: &mut Scratch| {
        let rb = s1 - s0;
        let qs = stacked(q, h, s0..s1, nh, groups, hd);
        let mut acc = Partial::default();
        acc.reset(groups * rb, hd);
        kernel::attend(&qs, cache.head_kv(h), &|i| span(s0 + i % rb), scale, &mut acc, scratch);
        let mut o = vec![0f32; groups * rb * hd];
        acc.normalized_into(&mut o);
        Part { s0, o }
    };
    // A block whose keys are mostly its own diagonal (a prompt's first few blocks) runs as two
    // halves, the first ending its keys at its own last row: half of the diagonal's masked
    // corner is not computed (10% of the attention GEMMs at 256 tokens).
    let block = |task: usize, scratch: &mut Scratch| {
        let (h, b) = (task / blocks, task % blocks);
        let (r0, r1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(m));
        let rb = r1 - r0;
        match rb >= ROW_BLOCK / 2 && span(r1 - 1).end - span(r0).start <= 4 * ROW_BLOCK {
            true => vec![part(h, r0, r0 + rb / 2, scratch), part(h, r0 + rb / 2, r1, scratch)],
            false => vec![part(h, r0, r1, scratch)],
        }
    };
    // A block's work grows with its keys: a task is block b and block blocks - 1 - b of one KV
    // head, so the tasks are of one size and the threads end together (one block a task left a
    // thread waiting for the last long one: +1.3% prefill at 256 tokens, +1.1% at 1024).
    let pairs = blocks.div_ceil(2);
    let done: Vec<(usize, Vec<Part>)> = (0..nkv * pairs)
        .into_par_iter()
        .flat_map_iter(|t| {
            let (h, b) = (t / pairs, t % pairs);
            let other = (blocks - 1 - b != b).then_some(blocks - 1 - b);
            let mut scratch = Scratch::default();
            [Some(b), other].into_iter().flatten().map(|b| (h * blocks + b, block(h * blocks + b, &mut scratch))).collect::<Vec<_>>()
        })
        .collect();
    let mut tasks: Vec<Vec<Part>> = (0..nkv * blocks).map(|_| vec![]).collect();
    for (i, o) in done {
        tasks[i] = o;
    }
    // Each block of rows gathers its blocks' outputs (block `h * blocks + b` for KV head h).
    out.par_chunks_mut(ROW_BLOCK * nh * hd).enumerate().for_each(|(b, out)| {
        for h in 0..nkv {
            for Part { s0, o } in &tasks[h * blocks + b] {
                unstack(o, h, s0 - b * ROW_BLOCK, nh, groups, hd, out);
            }
        }
    });
}

/// Attention of the pass's `m` rows (few: a decode step, a short turn) with every KV head's tiles
/// of keys as the tasks, claimed by the caller and the helper team ([`claim`]: no one waits for a
/// helper that has not started), then merged per head in position order. `one`: the rows are one
/// position's, on the one-position kernel ([`Rows::decode_step`]).
#[allow(clippy::too_many_arguments)]
fn split_keys(q: &[f32], cache: &KvCache, m: usize, nh: usize, span: &(dyn Fn(usize) -> Range<usize> + Sync), scale: f32, one: bool, out: &mut [f32]) {
    let (nkv, hd) = (cache.heads, cache.head_dim);
    let groups = nh / nkv;
    let tiles: Vec<usize> = kernel::tile_starts((0..m).map(span), 0..cache.len).collect();
    let stacks: Vec<Vec<f32>> = (0..nkv).map(|h| stacked(q, h, 0..m, nh, groups, hd)).collect();
    // Stacked row i is query head i / m's row i % m.
    let span_of = |i: usize| span(i % m);
    let partials: Vec<Mutex<Partial>> = (0..nkv * tiles.len()).map(|_| Mutex::default()).collect();
    // Tiles of a few microseconds each; a short cache stays on the caller.
    let helpers = if cache.len * hd * nkv >= 1 << 15 { rayon::current_num_threads().saturating_sub(1) } else { 0 };
    claim::for_each_chunk(partials.len(), 1, helpers, &|range| {
        let mut scores = vec![];
        for i in range {
            let (h, tile) = (i / tiles.len(), tiles[i % tiles.len()]);
            let mut p = partials[i].lock().unwrap_or_else(|e| e.into_inner());
            p.reset(groups * m, hd);
            match one {
                true => kernel::attend_tile_one(&stacks[h], cache.head_kv(h), span(0), scale, tile, &mut p, &mut scores),
                false => kernel::attend_tile(&stacks[h], cache.head_kv(h), &span_of, scale, tile, &mut p, &mut scores),
            }
        }
    });
    let mut acc = Partial::default();
    let mut o = vec![0f32; groups * m * hd];
    for h in 0..nkv {
        acc.reset(groups * m, hd);
        for p in &partials[h * tiles.len()..(h + 1) * tiles.len()] {
            acc.merge(&p.lock().unwrap_or_else(|e| e.into_inner()));
        }
        acc.normalized_into(&mut o);
        unstack(&o, h, 0, nh, groups, hd, out);
    }
}

/// The queries of KV head `h`'s query heads for `rows`, stacked: query head g's row `r` at row
/// `g * rows.len() + (r - rows.start)`, `[groups * rows.len(), head_dim]`.
fn stacked(q: &[f32], h: usize, rows: Range<usize>, nh: usize, groups: usize, hd: usize) -> Vec<f32> {
    let mut qs = Vec::with_capacity(groups * rows.len() * hd);
    for g in 0..groups {
        for r in rows.clone() {
            qs.extend_from_slice(&q[(r * nh + h * groups + g) * hd..][..hd]);
        }
    }
    qs
}

/// [`stacked`]'s inverse for outputs: `o`'s rows (`[groups * n, head_dim]`) to the rows `at..at +
/// n` of `out` (`[_, n_head * head_dim]`), in KV head `h`'s query heads.
fn unstack(o: &[f32], h: usize, at: usize, nh: usize, groups: usize, hd: usize, out: &mut [f32]) {
    let n = o.len() / (groups * hd);
    for g in 0..groups {
        for i in 0..n {
            out[((at + i) * nh + h * groups + g) * hd..][..hd].copy_from_slice(&o[(g * n + i) * hd..][..hd]);
        }
    }
}

/// The attention output of query rows from `s0` of one KV head's query heads: `[groups * rows,
/// head_dim]`, query head g's row s0 + i at row g * rows + i.
struct Part {
    s0: usize,
    o: Vec<f32>,
}

/// `x` with RoPE over the first `spec.rope_dims` of each head (`x`: `[m, heads, hd]`), row
/// `r` at the table's row `r`: pairs `(2i, 2i + 1)` (interleaved) or `(i, i + dims / 2)` (NeoX),
/// rotated by the angle of frequency `i`, as candle's `rope_i` / `rope` kernels do.
fn roped(spec: &FamilySpec, x: &[f32], heads: usize, hd: usize, cos: &[f32], sin: &[f32]) -> Vec<f32> {
    let (half, width) = (spec.rope_dims / 2, heads * hd);
    let block = rows_per_task(x.len() / width, width);
    // Copied and rotated block by block, over the pool (the copy is a pass over the rows too).
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(block * width).zip(x.par_chunks(block * width)).enumerate().for_each(|(b, (rows, src))| {
        rows.copy_from_slice(src);
        for (i, row) in rows.chunks_exact_mut(width).enumerate() {
            let r = b * block + i;
            let (cos, sin) = (&cos[r * half..][..half], &sin[r * half..][..half]);
            for head in row.chunks_exact_mut(hd) {
                let turn = |x0: f32, x1: f32, c: f32, s: f32| (x0 * c - x1 * s, x0 * s + x1 * c);
                match spec.rope {
                    RopeLayout::Interleaved => {
                        for ((p, &c), &s) in head[..2 * half].chunks_exact_mut(2).zip(cos).zip(sin) {
                            (p[0], p[1]) = turn(p[0], p[1], c, s);
                        }
                    }
                    RopeLayout::Neox => {
                        let (a, b) = head[..2 * half].split_at_mut(half);
                        for (((x0, x1), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
                            (*x0, *x1) = turn(*x0, *x1, c, s);
                        }
                    }
                }
            }
        }
    });
    out
}

/// cos/sin of RoPE for positions `start..start+n`, `[n, dims/2]`, computed as candle's models
/// do (f32 inverse frequencies, f32 products).
pub(crate) fn rope_tables(dims: usize, base: f32, start: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let inv: Vec<f32> = (0..dims).step_by(2).map(|i| 1f32 / base.powf(i as f32 / dims as f32)).collect();
    let mut cos = Vec::with_capacity(n * inv.len());
    let mut sin = Vec::with_capacity(n * inv.len());
    for p in start..start + n {
        for &f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f16 cache holds each value rounded to f16, through growth, conversion, the graph's
    /// padded inputs and the saved bytes, in half the bytes.
    #[test]
    fn an_f16_cache_holds_the_rounded_values() {
        let (heads, hd) = (3, 8);
        let vals = |n: usize, s: f32| (0..n * heads * hd).map(|i| ((i as f32 + s) * 0.731).sin() * 3.0).collect::<Vec<f32>>();
        let (mut c32, mut c16) = (KvCache::new(KvType::F32), KvCache::new(KvType::F16));
        // Two appends, the second past the first's reservation: the cache grows.
        for (n, s, reserve) in [(5, 0.0, 5), (300, 1.0, 0)] {
            let (k, v) = (vals(n, s), vals(n, s + 0.5));
            c32.append(&k, &v, n, heads, hd, reserve).unwrap();
            c16.append(&k, &v, n, heads, hd, reserve).unwrap();
        }
        let round = |v: Vec<f32>| v.into_iter().map(|x| f16::from_f32(x).to_f32()).collect::<Vec<f32>>();
        let (k32, v32) = c32.head_major();
        assert_eq!(c16.head_major(), (round(k32.clone()), round(v32.clone())));
        assert_eq!(c32.clone().into_type(KvType::F16).head_major(), c16.head_major(), "converted as appended");
        assert_eq!(c16.bytes() * 2, c32.bytes());
        let (p32, p16) = (c32.padded(512, heads, hd), c16.padded(512, heads, hd));
        assert_eq!((round(p32.0), round(p32.1)), p16);
        // Saved as f16 (half the bytes) or widened to f32, and read back, exactly.
        let (mut b16, mut b32) = (vec![], vec![]);
        c16.write_to(&mut b16, KvType::F16).unwrap();
        c16.write_to(&mut b32, KvType::F32).unwrap();
        assert_eq!(b16.len() * 2, b32.len());
        assert_eq!(KvCache::values_of(&b16, KvType::F16), KvCache::values_of(&b32, KvType::F32));
        let back = KvCache::from_values(&KvCache::values_of(&b16, KvType::F16), heads, hd, 305, KvType::F16).unwrap();
        assert_eq!((back.kind(), back.len(), back.head_major()), (KvType::F16, 305, c16.head_major()));
        assert!(KvCache::from_values(&KvCache::values_of(&b16, KvType::F16), heads, hd, 304, KvType::F16).is_none(), "a wrong length");
        let mut cleared = back;
        cleared.clear();
        assert_eq!((cleared.kind(), cleared.len()), (KvType::F16, 0), "clearing keeps the type");
    }

    /// A q8 cache holds each token's heads as q8 blocks (those `quantize_q8` gives), through
    /// growth, conversion and the graph's padded inputs, in about a quarter of f32's bytes; its
    /// saved form is f32, exactly, and restores to the same blocks.
    #[test]
    fn a_q8_cache_holds_blocks_of_its_values() {
        let (heads, hd) = (2, 64);
        let vals = |n: usize, s: f32| (0..n * heads * hd).map(|i| ((i as f32 + s) * 0.377).sin() * 2.5).collect::<Vec<f32>>();
        let (mut c32, mut c8) = (KvCache::new(KvType::F32), KvCache::new(KvType::Q8));
        for (n, s, reserve) in [(3, 0.0, 3), (260, 1.0, 0)] {
            let (k, v) = (vals(n, s), vals(n, s + 0.5));
            c32.append(&k, &v, n, heads, hd, reserve).unwrap();
            c8.append(&k, &v, n, heads, hd, reserve).unwrap();
        }
        let blocks = |v: Vec<f32>| {
            let (mut q, mut d) = (vec![0i8; v.len()], vec![f16::ZERO; v.len() / Q8_BLOCK]);
            kernel::quantize_q8(&v, &mut q, &mut d);
            q.iter().enumerate().map(|(i, &x)| x as f32 * d[i / Q8_BLOCK].to_f32()).collect::<Vec<f32>>()
        };
        let (k32, v32) = c32.head_major();
        let held = c8.head_major();
        assert_eq!(held, (blocks(k32.clone()), blocks(v32.clone())));
        // Within half a step (the block's largest value over 127, at most 2.5 / 127 here), plus
        // the f16 scale's rounding times up to 127 steps (2^-11 relative: 0.062 of a step).
        let step = 2.5 / 127.0;
        assert!(held.0.iter().zip(&k32).all(|(a, b)| (a - b).abs() <= step * (0.5 + 127.0 / 2048.0)));
        assert_eq!(c32.clone().into_type(KvType::Q8).head_major(), held, "converted as appended");
        assert_eq!(c8.bytes(), KvType::Q8.bytes(2 * heads * c8.cap * hd));
        assert!(c8.bytes() * 3 < c32.bytes(), "{} bytes against f32's {}", c8.bytes(), c32.bytes());
        let (p32, p8) = (c32.padded(300, heads, hd), c8.padded(300, heads, hd));
        assert_eq!((blocks(p32.0), blocks(p32.1)), p8);
        let mut bytes = vec![];
        c8.write_to(&mut bytes, KvType::Q8).unwrap();
        assert_eq!(bytes.len(), 2 * heads * 263 * hd * 4, "saved as f32");
        let back = KvCache::from_values(&KvCache::values_of(&bytes, KvType::Q8), heads, hd, 263, KvType::Q8).unwrap();
        assert_eq!((back.kind(), back.head_major()), (KvType::Q8, held));
        assert!(KvType::Q8.check_head_dim(96).is_ok() && KvType::Q8.check_head_dim(80).is_err() && KvType::F16.check_head_dim(80).is_ok());
    }

    /// A KV cache that cannot be allocated is an error saying what it was for, where Rust's
    /// allocation failure handler would abort the process with "memory allocation failed".
    #[test]
    fn a_kv_cache_beyond_memory_is_an_error() {
        let mut cache = KvCache::default();
        let n = KvCache::GROW;
        let (k, v) = (vec![1f32; n * 2 * 4], vec![2f32; n * 2 * 4]);
        cache.append(&k, &v, 1, 2, 4, 1).unwrap();
        // Past its capacity, reserving 2^40 tokens of 2 heads of 4: 2^45 values, 256 TiB.
        let e = cache.append(&k, &v, n, 2, 4, 1 << 40).unwrap_err().to_string();
        assert!(e.contains("out of memory") && e.contains("KV cache of 1099511627776 tokens"), "{e}");
        // A size that overflows too; the cache is left as it was, and grows when it can.
        assert!(cache.append(&k, &v, n, 2, 4, usize::MAX / 2).unwrap_err().to_string().contains("out of memory"));
        assert_eq!(cache.len(), 1);
        cache.append(&k, &v, n, 2, 4, n + 1).unwrap();
        assert_eq!(cache.len(), n + 1);
    }

    /// `causal` against attention written from its definition (f64, one row and head at a time),
    /// over row blocks, GQA groups, a pre-filled cache, padding rows and sliding windows.
    #[test]
    fn block_causal_attention_matches_the_definition() {
        // xorshift: values in [-2, 2).
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let (nh, nkv, hd, scale) = (6, 2, 8, 0.35f32);
        // (tokens already cached, rows, valid rows, window)
        for (start, m, n_valid, window) in [(0, 70, 70, None), (0, 150, 150, Some(5)), (40, 30, 25, Some(17)), (130, 1, 1, None)] {
            // f32: the definition's values (an f16 cache rounds them, 2^-11).
            let mut cache = KvCache::new(KvType::F32);
            let mut random = |n: usize| -> Vec<f32> {
                (0..n)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
                    })
                    .collect()
            };
            let (k0, v0) = (random(start * nkv * hd), random(start * nkv * hd));
            cache.append(&k0, &v0, start, nkv, hd, start + n_valid).unwrap();
            let (k1, v1, q) = (random(m * nkv * hd), random(m * nkv * hd), random(m * nh * hd));
            cache.append(&k1, &v1, n_valid, nkv, hd, start + n_valid).unwrap();
            // A one-row pass also as a decode step (the one-position kernel).
            let rows = Rows { start, m, n_valid, reserve: start + n_valid, rope: vec![], decode: false };
            let runs = [Some(rows), (m == 1).then(|| Rows { start, m, n_valid, reserve: start + n_valid, rope: vec![], decode: true })];
            for rows in runs.into_iter().flatten() {
                let got = causal(&q, &cache, &rows, nh, window, scale);
                let (keys, values): (Vec<f32>, Vec<f32>) = (k0.iter().chain(&k1).copied().collect(), v0.iter().chain(&v1).copied().collect());
                for r in 0..n_valid {
                    let pos = start + r;
                    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    for h in 0..nh {
                        let kh = h / (nh / nkv);
                        let qv = &q[(r * nh + h) * hd..][..hd];
                        let s: Vec<f64> =
                            (lo..=pos).map(|j| scale as f64 * (0..hd).map(|d| qv[d] as f64 * keys[(j * nkv + kh) * hd + d] as f64).sum::<f64>()).collect();
                        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = s.iter().map(|v| (v - max).exp()).sum();
                        for d in 0..hd {
                            let want: f64 = (lo..=pos).zip(&s).map(|(j, v)| (v - max).exp() / z * values[(j * nkv + kh) * hd + d] as f64).sum();
                            let g = got[(r * nh + h) * hd + d] as f64;
                            assert!((g - want).abs() < 1e-5, "start {start} row {r} head {h} dim {d} decode {}: {g} vs {want}", rows.decode);
                        }
                    }
                }
            }
        }
    }
}
