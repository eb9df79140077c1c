//! The memory bound of issues 9 and 35: SmolLM2's main job (W8A8 NPU prefill of a long prompt
//! on the host executor, CPU decode) peaks at no more than 370 MiB resident (llama.cpp runs the same
//! Q4_1 file in 179 MiB natively, 223 MiB requantized to Q8_0: `docs/memory.md`). Its own
//! test binary: peak RSS is per process, and cargo runs test binaries one at a time.

mod common;

use candle_npu::NpuDevice;
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{memory, CalibrationSet, DecodeWeights, Precision};
use common::*;

/// Was 400 (measured 394, 2026-11-23). Raised for out-of-order prefill with an NPU queue of its
/// own (4 chunks in flight, whose activations coexist: 396-416 MiB over 4 runs); the host
/// executor's default now runs the chunks in order, and the KV cache reserves its decode
/// headroom with the prompt (no copy at the first decode step): measured 410 MiB, 2026-11-25.
/// The bound still fails on a regression of ~20 MiB above that.
// Measured 344 MiB on 2026-11-26 with decode reading the GGUF's own blocks and the host
// executor's packed copy the only INT8 one (410 before, with a Q8_0 decode copy beside it, when
// the bound was 430): the bound keeps a margin of 7% for allocator and page-cache variation.
const BOUND_MIB: u64 = 370;

#[test]
fn smollm2_main_job_peaks_under_370_mib() {
    let Some((_, start)) = memory::rss() else {
        eprintln!("skipped: /proc/self/status is not available on this OS");
        return;
    };
    // As the examples do at start (see the function for why and what it saves).
    memory::limit_malloc_arenas(1);
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::default());
    eprintln!("loaded: {}", memory::describe());
    // The profile as the example gets it: loaded, or calibrated and saved on first use.
    p.ensure_profile(None, CalibrationSet::default(), |_, _| {}).unwrap();
    // A 700-token prompt (the default plan: 2 chunks of 256, 5 of 32, a 28-row margin; FIFO,
    // 4 chunks in flight) from a plain text file: the Wikipedia loader
    // would parse 6.5 MB of JSON, which is the test's cost, not the job's.
    let text: String = candle_npu_models::assets::moby_dick().unwrap().chars().skip(20_000).take(4_000).collect();
    let prompt: Vec<u32> = p.encode(&text, false).unwrap().into_iter().take(700).collect();
    assert_eq!(prompt.len(), 700);
    eprintln!("profile: {}", memory::describe());
    p.model.prepare_chunked(256).unwrap();
    eprintln!("graphs: {}", memory::describe());
    let mut t = argmax(&p.model.prefill(&prompt, &PrefillOptions::chunked(256)).unwrap()).unwrap();
    eprintln!("prefill: {}", memory::describe());
    for _ in 0..16 {
        t = argmax(&p.model.decode(t).unwrap()).unwrap();
    }
    let (_, peak) = memory::rss().unwrap();
    let mib = |b: u64| b / (1 << 20);
    eprintln!("peak resident {} MiB (at test start {} MiB); {}", mib(peak), mib(start), memory::describe());
    assert!(mib(peak) <= BOUND_MIB, "peak resident {} MiB > {BOUND_MIB} MiB", mib(peak));
}
