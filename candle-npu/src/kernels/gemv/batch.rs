//! Several input rows against the same weight rows in one call ([`gemv_rows`]): batched
//! decode's conversations, a speculative verifier's rows. Each row has the bits it gets alone.

use std::ops::Range;

#[cfg(target_arch = "aarch64")]
use super::aarch64;
#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{assert_groups, assert_in_range, assert_sums, checked_rows, gemv_on, BlockFormat, GemvPath, Q8Activation, BLOCK_BYTES, Q4_1_BLOCK_BYTES, QK};

/// [`gemv`](super::gemv) of several input rows at once: `outs[i]` for `xs[i]`, each with the bits [`gemv`](super::gemv)
/// gives that row alone. For Q8_0 and Q4_1 the rows share a kernel that reads and unpacks each
/// weight block once for all of them ([`GemvPath::rows_at_once`] at a time), so batched decode
/// (several conversations, a speculative verifier's rows) pays per added row only its own
/// multiply-adds: on i8mm `smmla` takes two input rows by two weight rows; on x86 a block's
/// `|w|` or nibbles and its scales' conversion are shared. The other formats run a call per row.
pub fn gemv_rows(format: BlockFormat, w: &[u8], k: usize, xs: &[&Q8Activation], rows: Range<usize>, outs: &mut [&mut [f32]]) {
    gemv_rows_on(GemvPath::detect(), format, w, k, xs, rows, outs)
}

/// [`gemv_rows`] on `path`; panics if the CPU lacks the path's features.
pub fn gemv_rows_on(path: GemvPath, format: BlockFormat, w: &[u8], k: usize, xs: &[&Q8Activation], rows: Range<usize>, outs: &mut [&mut [f32]]) {
    rows_on(path, format, w, k, xs, rows, outs, true)
}

/// [`gemv_rows_on`], checking the activations' values (block sums, groups, Q8_0's -128) only
/// with `check_values`: `BlockMatrix::product` quantized them itself, and at SmolLM2's K
/// checking them again for every piece of 64 weight rows was 8% of a four-row Q4_1 product.
pub(super) fn rows_on(
    path: GemvPath,
    format: BlockFormat,
    w: &[u8],
    k: usize,
    xs: &[&Q8Activation],
    rows: Range<usize>,
    outs: &mut [&mut [f32]],
    check_values: bool,
) {
    let name = "gemv_rows";
    assert_eq!(xs.len(), outs.len(), "{name}: {} input rows and {} outputs", xs.len(), outs.len());
    let at_once = path.rows_at_once(format);
    if at_once == 1 || xs.is_empty() {
        for (x, out) in xs.iter().zip(outs.iter_mut()) {
            gemv_on(path, format, w, k, x, rows.clone(), out);
        }
        return;
    }
    let block_bytes = if format == BlockFormat::Q8_0 { BLOCK_BYTES } else { Q4_1_BLOCK_BYTES };
    let (k0, n0) = (xs[0].q.len(), outs[0].len());
    for (x, out) in xs.iter().zip(outs.iter()).skip(1) {
        assert_eq!(x.q.len(), k0, "{name}: rows of {k0} and {} values", x.q.len());
        assert_eq!(out.len(), n0, "{name}: outputs of {n0} and {} values", out.len());
    }
    let Some((w, nb)) = checked_rows(name, block_bytes, QK, w, k, xs[0], &rows, outs[0]) else {
        return outs.iter_mut().for_each(|o| o.fill(0.0));
    };
    assert!(path.runs_here(), "{name}: this CPU cannot run {path:?}");
    let sums = path.reads_sums(format);
    for x in xs {
        assert_eq!(x.scales.len(), nb, "{name}: a row has {} scales for {nb} blocks", x.scales.len());
        if sums {
            assert_eq!(x.sums.len(), nb, "{name}: a row has {} block sums for {nb} blocks", x.sums.len());
        }
        assert_groups(name, x, check_values);
        if !check_values {
            continue;
        }
        if sums {
            assert_sums(name, x);
        }
        if format == BlockFormat::Q8_0 {
            assert_in_range(name, path, x);
        }
    }
    let (mut xs, mut outs) = (xs, outs);
    while !xs.is_empty() {
        let r = if xs.len() >= 4 && at_once >= 4 { 4 } else { xs.len().min(2) };
        let (x, rest) = xs.split_at(r);
        let (out, rest_out) = outs.split_at_mut(r);
        // SAFETY: the CPU runs `path` (asserted); `w` is `out[i].len()` whole rows of `nb`
        // blocks for every `i` (`checked_rows`, the lengths asserted equal), every activation
        // has `nb` blocks, their groups and the sums the path reads, for Q8_0 no -128 where the
        // path cannot take it (asserted above).
        unsafe { shared_rows(path, format, w, nb, x, out) };
        (xs, outs) = (rest, rest_out);
    }
}

/// One call of the shared-rows kernel of `path` and `format` (Q8_0 or Q4_1) for 1, 2 or 4 rows
/// (at most [`GemvPath::rows_at_once`]).
///
/// # Safety
/// The CPU runs `path`; `w` is `out[i].len()` whole rows of `nb` blocks of `format` for every
/// `i`; every `x[i]` has `nb` blocks, their groups and the sums the path reads
/// ([`GemvPath::reads_sums`]), for Q8_0 no -128 unless the path takes it.
unsafe fn shared_rows(path: GemvPath, format: BlockFormat, w: &[u8], nb: usize, x: &[&Q8Activation], out: &mut [&mut [f32]]) {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! call {
            ($kernel:ident, $r:literal) => {{
                let x: [&Q8Activation; $r] = std::array::from_fn(|i| x[i]);
                let mut it = out.iter_mut();
                let out: [&mut [f32]; $r] = std::array::from_fn(|_| &mut **it.next().expect("as many outputs as rows"));
                // SAFETY: the caller's contract.
                unsafe { x86::$kernel::<$r>(w, nb, x, out) }
            }};
        }
        macro_rules! rows {
            ($kernel:ident) => {
                match x.len() {
                    1 => call!($kernel, 1),
                    2 => call!($kernel, 2),
                    _ => call!($kernel, 4),
                }
            };
        }
        match (path, format) {
            (GemvPath::Avx512, BlockFormat::Q8_0) => rows!(gemv_q8_0_vnni),
            (GemvPath::Avx512, _) => rows!(gemv_q4_1_vnni),
            (_, BlockFormat::Q8_0) => rows!(gemv_q8_0_avx2),
            _ => rows!(gemv_q4_1_avx2),
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        let _ = path;
        let (first, second) = out.split_at_mut(1);
        let x = [x[0], *x.get(1).unwrap_or(&x[0])];
        let second = second.first_mut().map(|o| &mut **o);
        // SAFETY: the caller's contract; on aarch64 only I8mm shares rows (`rows_at_once`).
        unsafe {
            match format {
                BlockFormat::Q8_0 => aarch64::gemv_q8_0_i8mm(w, nb, x, first[0], second),
                _ => aarch64::gemv_q4_1_i8mm(w, nb, x, first[0], second),
            }
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (path, format, w, nb, x, out);
        unreachable!("no path shares rows here (`rows_at_once`)")
    }
}
