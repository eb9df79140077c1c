//! The real QNN HTP library (x86 emulator from onnxruntime-qnn) against the HTP numerics model
//! (`candle_npu::executor::htp_numerics`): four layers' stage graphs of each real model, whole
//! prefills of the three (SmolLM2's also padded), and the README's question on the default plan.
//! The emulator runs ~0.3-1 GMAC/s: a 32-row SmolLM2 chunk costs about 30 s, Qwen2.5-Coder's
//! about 100 s, which is why each model's work here is what its claim needs and no more (this
//! file is a fifth of CI's time). The prepared-graph cache test only prepares (no execution).

mod common;

use candle_npu::executor::htp_numerics::fp16_step;
use candle_npu::{Contexts, DeviceStats, HtpConfig, NpuDevice, Numerics, QuantProfile, Tail};
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{chat_eval, CalibrationSet, DecodeWeights, GenerateOptions, Precision, PrefillPlan, SchedOptions};
use common::*;

/// Every prompt position's logits, flattened `[len * vocab]`, with SmolLM2's default plan or
/// every row on the NPU graphs (`pad`), in chunks of 32.
fn logits(p: &mut candle_npu_models::Pipeline, prompt: &[u32], pad: bool) -> Vec<f32> {
    let tail = if pad { Tail::Pad } else { Tail::Margin };
    p.model.set_sched(SchedOptions { tail, ..Default::default() }).unwrap();
    p.model.prefill(prompt, &PrefillOptions::chunked(32).all_logits()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

fn top1(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks(vocab).map(|r| argmax(&candle_core::Tensor::new(r, &candle_core::Device::Cpu).unwrap()).unwrap()).collect()
}

/// What a whole prefill through the library gave, against the HTP numerics model.
struct PrefillCheck {
    /// Largest |logit difference|, library vs model: in the HTP chunk's rows, in the margin's.
    diff_npu: f32,
    diff_margin: f32,
    /// Top-1 agreement over every position: library vs model, library's margin plan vs padded
    /// (when run).
    agree_model: f64,
    agree_padded: Option<f64>,
}

/// A whole prefill of `n` tokens through the library with the plan of a margin (a 32-row HTP
/// chunk, then the rest as a CPU margin on the host with the HTP's numerics), against the same
/// plan on the HTP numerics model, and (with `padded`) against every row on the HTP. Checks what
/// holds exactly (no fallback, one chunk on the HTP, the margin on the host, the HTP chunk's rows
/// the same in both plans, the model's margin rows its NPU rows bit for bit) and returns the rest.
/// The emulator runs a 32-row chunk in 30 s (SmolLM2) to 100 s (Qwen2.5-Coder): the padded
/// plan's two more chunks are run for one model only.
fn check_prefill(name: &str, load: impl Fn(&NpuDevice) -> candle_npu_models::Pipeline, n: usize, padded: bool) -> PrefillCheck {
    let mut h = load(&NpuDevice::host());
    let profile = h.calibrate(CalibrationSet { sequences: 4, seq_len: 128, importance_sequences: 0, ..Default::default() }, |_, _| {}).unwrap();
    let prompt = heldout_tokens(&h, n);
    let vocab = h.model.config().vocab;
    drop(h);

    let model_dev = NpuDevice::host_with(Numerics::Htp);
    let mut m = load(&model_dev);
    m.model.set_profile(profile.clone()).unwrap();
    let model = logits(&mut m, &prompt, false);
    assert_eq!(model, logits(&mut m, &prompt, true), "{name}: the model's margin rows are its NPU rows, bit for bit");
    drop(m);

    let htp = NpuDevice::hexagon(HtpConfig { cache_dir: None, ..Default::default() }).unwrap();
    let mut x = load(&htp);
    x.model.set_profile(profile).unwrap();
    let got = logits(&mut x, &prompt, false);
    let s = htp.stats();
    let graphs = (x.model.config().n_layer * candle_npu_models::transformer::N_STAGES) as u64;
    // One chunk on the HTP; the margin's stage graphs ran on the host, with the HTP's numerics.
    assert_eq!((s.fallbacks, s.graphs_prepared, s.executions), (0, graphs, graphs), "{name}");
    let margin = htp.margin_device();
    assert_eq!(margin.numerics(), Numerics::Htp);
    assert_eq!(margin.stats().executions, graphs, "{name}: the margin ran every stage once, on the host");
    let first = 32 * vocab;
    let padded = if padded {
        let padded = logits(&mut x, &prompt, true);
        // The first chunk's rows do not depend on the plan.
        assert_eq!(got[..first], padded[..first], "{name}: the HTP chunk's rows are the same in both plans");
        Some(padded)
    } else {
        None
    };

    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    let agree = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(p, q)| p == q).count() as f64 / a.len() as f64;
    let (t_model, t_got) = (top1(&model, vocab), top1(&got, vocab));
    let c = PrefillCheck {
        diff_npu: max_diff(&got[..first], &model[..first]),
        diff_margin: max_diff(&got[first..], &model[first..]),
        agree_model: agree(&t_got, &t_model),
        agree_padded: padded.as_ref().map(|p| agree(&t_got, &top1(p, vocab))),
    };
    eprintln!(
        "{name}, {n} tokens: library vs model: max |logit diff| {:.3} (HTP rows) / {:.3} (margin rows), top-1 agreement {:.3}; library margin vs padded: {:?} / {:?}",
        c.diff_npu,
        c.diff_margin,
        c.agree_model,
        padded.as_ref().map(|p| max_diff(&got[first..], &p[first..])),
        c.agree_padded,
    );
    c
}

/// A whole SmolLM2 prefill through the library (see [`check_prefill`]).
#[test]
fn hexagon_prefill_follows_the_htp_numerics_model() {
    if !library_present() {
        return;
    }
    let c = check_prefill("SmolLM2", |dev| smollm2(dev, Precision::W8A8, DecodeWeights::Q8_0), 48, true);
    // The model is bit-exact on 99.7% of a stage's outputs; the rest (one FP16 step of the
    // intermediate) move later u8 roundings, and 30 layers of them move logits by up to about a
    // logit (measured on these 48 tokens, 2026-11-28: at most 0.77 in the HTP chunk's rows, 0.67
    // in the margin's). So tokens agree, not logits: measured 0.938 (45 of 48 positions; the
    // library's margin against its padded plan 0.979; 0.979 and 1.0 with the calibration windows
    // of 2026-11-25: which positions are near ties moves with the profile); 0.9 leaves room for
    // a near tie or four (a broken margin or translation gives ~0).
    let padded = c.agree_padded.expect("run padded");
    assert!(c.agree_model >= 0.9 && padded >= 0.9, "top-1 agreement {} / {padded}", c.agree_model);
    assert!(c.diff_npu.max(c.diff_margin) < 3.0, "logits {} / {} apart", c.diff_npu, c.diff_margin);
}

/// Whole prefills of Qwen2.5-Coder-0.5B and Gemma 3 270M through the library (see
/// [`check_prefill`]), 40 tokens: a 32-row HTP chunk and an 8-row margin (not padded: SmolLM2's
/// test shows the padded plan; here it would cost CI five minutes more).
#[test]
fn qwen_and_gemma_prefills_follow_the_htp_numerics_model() {
    if !library_present() {
        return;
    }
    use candle_npu_models::{assets, LoadOptions, Pipeline};
    for (name, path) in [("Qwen2.5-Coder", assets::qwen25_coder_05b().unwrap()), ("Gemma 3", assets::gemma3_270m().unwrap())] {
        let opts = LoadOptions { precision: Some(Precision::W8A8), decode_weights: DecodeWeights::Q8_0, ..Default::default() };
        let c = check_prefill(name, |dev| Pipeline::load(&path, None, dev, opts.clone()).unwrap(), 40, false);
        // SmolLM2's thresholds, for the same reason (see above). Measured on these 40 tokens:
        // (2026-11-28) Qwen top-1 agreement 0.925 (37 of 40), logits at most 0.32 apart; Gemma
        // 0.925 (37 of 40), at most 1.8 apart (its HTP rows).
        assert!(c.agree_model >= 0.9, "{name}: top-1 agreement {}", c.agree_model);
        assert!(c.diff_npu.max(c.diff_margin) < 3.0, "{name}: logits {} / {} apart", c.diff_npu, c.diff_margin);
    }
}

/// Greedy answer to `question` (chat template), at most `n` tokens, in chunks of 32 rows, with
/// the model's own default schedule for its device.
fn answer(p: &mut candle_npu_models::Pipeline, question: &str, n: usize) -> String {
    p.model.set_chunk_len(32).unwrap();
    p.generate(question, &GenerateOptions { sample_len: n, ..Default::default() }, |_| {}).unwrap().0
}

/// The README's question through the library with the default Hexagon plan (each layer one
/// graph, shadow W8A16, the last chunk padded: `SchedOptions::for_device`): the host executor's
/// answer, and the tokens the HTP numerics model predicts for the same plan. Then llm.npu's plan
/// (W8A8 stage graphs, selectable) with the model split by a small context budget.
#[test]
fn readme_question_on_the_default_hexagon_plan() {
    if !library_present() {
        return;
    }
    let question = "What is the capital of France?";
    let host = NpuDevice::host();
    let mut h = smollm2(&host, Precision::W8A8, DecodeWeights::Q8_0);
    h.ensure_profile(None, CalibrationSet::default(), |_, _| {}).unwrap();
    let profile = h.model.profile().unwrap().clone();
    let host_text = answer(&mut h, question, 8);
    drop(h);
    assert!(host_text.contains("Paris"), "host executor: {host_text:?}");

    let model_dev = NpuDevice::host_with(Numerics::Htp);
    let mut m = smollm2(&model_dev, Precision::for_device(&model_dev), DecodeWeights::Q8_0);
    assert_eq!((m.model.precision(), m.model.sched().plan), (Precision::W8A16Shadow, PrefillPlan::Layers), "the HTP numerics model's default");
    m.model.set_profile(profile.clone()).unwrap();
    let predicted = answer(&mut m, question, 8);

    let cache = std::env::temp_dir().join(format!("candle-npu-readme-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let htp = NpuDevice::hexagon(HtpConfig { cache_dir: Some(cache.clone()), ..Default::default() }).unwrap();
    let mut x = smollm2(&htp, Precision::for_device(&htp), DecodeWeights::Q8_0);
    let sched = x.model.sched().clone();
    assert_eq!((x.model.precision(), sched.plan, sched.tail), (Precision::W8A16Shadow, PrefillPlan::Layers, Tail::Pad), "a real NPU's default plan");
    x.model.set_profile(profile.clone()).unwrap();
    let text = answer(&mut x, question, 8);
    eprintln!("hexagon, default plan: {text:?}; host: {host_text:?}");
    let stats = htp.stats();
    assert_eq!(stats.fallbacks, 0);
    // One graph per layer (a 37-token prompt: two 32-row chunks, both over a 32-row cache).
    let layers = x.model.config().n_layer as u64;
    assert_eq!((stats.graphs_prepared, stats.executions), (layers, 2 * layers), "graphs prepared and run");
    assert_eq!(htp.margin_device().stats().executions, 0, "no CPU margin");
    assert!(text.contains("Paris"), "hexagon: {text:?}");
    assert_eq!(text, predicted, "the answer the HTP numerics model predicts");
    let alone = chats_through_the_library(&mut x, &mut m);
    assert_eq!(htp.stats().graphs_prepared, layers, "the chats ran on the README question's graphs");
    assert_eq!(htp.stats().fallbacks, 0);
    conversations_at_once_through_the_library(x, &alone[..2]);
    assert_eq!(htp.stats().graphs_prepared, layers, "the engine's prefills ran on the same graphs");
    assert_eq!(htp.stats().fallbacks, 0);
    std::fs::remove_dir_all(&cache).unwrap();
    std::fs::create_dir_all(&cache).unwrap();

    // llm.npu's plan (W8A8 stage graphs, 120 of them needing up to about 1.3 GB), the model split
    // by a small context budget (HtpConfig::context_budget): contexts by layer range. Its claim
    // is that the split graphs compute what the numerics model predicts for the same plan, so
    // that is what is compared: the logits of every token of the model's greedy answer, both
    // pipelines fed the same tokens. Not the library's own greedy answer: SmolLM2's first W8A8
    // answer token is a near tie ("The" leads "L" by 0.16-0.37 logits on the numerics model,
    // measured 2026-12-02 on an AMD EPYC and on CI's machine), and on CI the library took "L"
    // ("L'Étoile, la Marseillaise"). The right answer is the default plan's claim (above), the
    // one users run.
    let htp = NpuDevice::hexagon(HtpConfig { cache_dir: Some(cache.clone()), context_budget: 400 << 20, ..Default::default() }).unwrap();
    let mut x = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    assert_eq!(x.model.sched().plan, PrefillPlan::Stages, "W8A8 runs llm.npu's stages");
    x.model.set_profile(profile.clone()).unwrap();
    x.model.set_chunk_len(32).unwrap();
    let prompt = x.encode(question, true).unwrap();
    m = smollm2(&model_dev, Precision::W8A8, DecodeWeights::Q8_0);
    m.model.set_profile(profile).unwrap();
    m.model.set_chunk_len(32).unwrap();
    let (_, own) = chat_eval::answer(&mut m, &prompt).unwrap();
    let (on_library, on_model) = (forced(&mut x, &prompt, &own), forced(&mut m, &prompt, &own));
    let contexts = std::fs::read_dir(&cache).unwrap().count();
    std::fs::remove_dir_all(&cache).unwrap();
    assert_eq!(htp.stats().fallbacks, 0);
    assert!(contexts >= 3, "{contexts} context binaries");
    let kl = on_model.iter().zip(&on_library).map(|(p, q)| chat_eval::kl(p, q)).sum::<f64>() / own.len() as f64;
    let diff = on_library.concat().iter().zip(&on_model.concat()).fold(0f32, |d, (a, b)| d.max((a - b).abs()));
    let picks: Vec<u32> = on_library.iter().map(|r| argmax(&candle_core::Tensor::new(r.as_slice(), &candle_core::Device::Cpu).unwrap()).unwrap()).collect();
    eprintln!(
        "hexagon, W8A8 stages in {contexts} contexts, fed the numerics model's answer {:?}: KL(model || library) {kl:.5} nats a token, max |logit diff| {diff:.3}; the library's picks {:?}",
        m.decode_text(&own).unwrap(),
        x.decode_text(&picks).unwrap()
    );
    // Measured 0.0049 (2026-12-02, AMD EPYC; as far as float is from the model on these tokens,
    // 0.0048), logits at most 1.37 apart. 0.05, ten times that: the whole chat set's first-token
    // KL to float is 0.004-0.010 (`docs/chat.md`), Gemma's Hindi chats whose activations
    // saturated 0.35-1.06, and a graph bound to another context's weights, or a wrong split, is
    // nats off.
    assert!(kl < 0.05, "W8A8 stages: the library is {kl:.5} nats a token from the numerics model (logits up to {diff:.3} apart)");
}

/// Asserts the library's answer `lib` is the numerics model's (`own`, on `m`) token for token,
/// up to where the model's own pick is a near tie ([`NEAR_TIE`]) the library may break the
/// other way; after that the two are different conversations and nothing more is compared.
fn follows_the_model(what: &str, lib: &[u32], own: &[u32], m: &mut candle_npu_models::Pipeline, prompt: &[u32]) {
    if lib == own {
        return;
    }
    let at = lib.iter().zip(own).take_while(|(a, b)| a == b).count();
    assert!(at < lib.len().min(own.len()), "{what}: one answer stops where the other goes on: {lib:?} / {own:?}");
    // On the model only: the library's gap (0.05-0.17 when measured, `NEAR_TIE`) would cost
    // the emulator another prefill, for a figure no assertion reads.
    let lm = forced(m, prompt, &own[..=at]).pop().unwrap();
    let gap = lm[own[at] as usize] - lm[lib[at] as usize];
    eprintln!("{what}: parts from the model's answer at token {at}, where the model's pick leads by {gap:.3}");
    assert!(
        gap <= NEAR_TIE,
        "{what}: the library's answer {:?} parts from the numerics model's {:?} at token {at}, where the model leads by {gap:.3} logits",
        m.decode_text(lib).unwrap(),
        m.decode_text(own).unwrap()
    );
}

/// Short conversations of the chat eval (`models/data/chat_eval.jsonl`), each at most 64 tokens
/// in SmolLM2's template, so two 32-row chunks over a 32-row cache (the graphs the README's
/// question prepared): the issue's example (a system prompt, then "My name is Bob and I live in
/// Tokyo.", a four-way tie of first tokens within 0.11 logits in SmolLM2's own F32 prefill), code,
/// Chinese, several turns.
const LIBRARY_CHATS: &[&str] = &["intro-bob-tokyo", "py-fizzbuzz", "zh-ni-hao-capabilities", "riddle-keys"];

/// How far apart (logits) the numerics model's top choice and the library's may be on the model
/// where the chats' greedy answers part. The model reproduces the library's graphs bit for bit
/// on 99.6% of outputs and within one FP16 step on 99.96%, but over a whole prefill the rest
/// moves logits by up to 0.77 (`docs/accuracy.md`), and the library's float arithmetic differs
/// by machine: on 2026-12-02 CI's machine parted from the model in two of the four chats, where
/// the model's pick led by 0.022 and 0.043, and an Intel Xeon in three, where it led by
/// 0.000-0.055 (the library's by 0.05-0.17 on the library). 0.25, a third of the worst
/// distance: a parting where the model leads by more is a numerics model that no longer
/// predicts the library.
const NEAR_TIE: f32 = 0.25;

/// `p`'s logits predicting each of `tokens` as the answer after `prompt` (a row per token, each
/// fed the ones before it), on the path `chat_eval::measure` takes: prefill on the model's
/// device, then each answer token decoded.
fn forced(p: &mut candle_npu_models::Pipeline, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    p.model.clear();
    let mut rows = vec![p.model.prefill(prompt, &PrefillOptions::default()).unwrap()];
    for &t in &tokens[..tokens.len().saturating_sub(1)] {
        rows.push(p.model.decode(t).unwrap());
    }
    p.model.clear();
    rows.iter().map(|l| l.flatten_all().unwrap().to_vec1().unwrap()).collect()
}

/// [`LIBRARY_CHATS`] through the library (`x`) and through the HTP numerics model (`m`), both
/// on the default plan: the same 16 greedy answer tokens (decode on the CPU after either
/// prefill) up to a near tie of the model's own ([`NEAR_TIE`]), and no answer derailed (judged
/// by the F32 prefill, `chat_eval::measure`).
/// Returns each chat's prompt and the library's answer.
fn chats_through_the_library(x: &mut candle_npu_models::Pipeline, m: &mut candle_npu_models::Pipeline) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut answers = vec![];
    let all = chat_eval::conversations().unwrap();
    let mut f32p = smollm2(&NpuDevice::host(), Precision::F32, DecodeWeights::Checkpoint);
    for id in LIBRARY_CHATS {
        let c = all.iter().find(|c| c.id == *id).unwrap_or_else(|| panic!("no conversation {id}"));
        let r = chat_eval::reference(&mut f32p, c).unwrap();
        assert!(r.prompt.len() <= 64, "{id}: {} tokens, more than two 32-row chunks over a 32-row cache", r.prompt.len());
        let (on_library, on_model) = (chat_eval::measure(x, &mut f32p, &r).unwrap(), chat_eval::measure(m, &mut f32p, &r).unwrap());
        let text = x.decode_text(&on_library.answer).unwrap();
        eprintln!("{id}: library kl {:.4}, numerics model kl {:.4}: {text:?}", on_library.kl, on_model.kl);
        follows_the_model(id, &on_library.answer, &on_model.answer, m, &r.prompt);
        assert!(on_library.derail.is_none(), "{id}: derailed ({:?}) through the library: {text:?}", on_library.derail);
        answers.push((r.prompt, on_library.answer));
    }
    answers
}

/// Conversations prefilled on the library by the server's engine (`serve::Engine`: the model
/// shared, one sequence each, their decode steps batched) while the others decode: each answer
/// is the one it gave alone (`alone`: prompts and greedy answers, a stop token last if one came).
fn conversations_at_once_through_the_library(x: candle_npu_models::Pipeline, alone: &[(Vec<u32>, Vec<u32>)]) {
    use candle_npu_models::serve::{Engine, Event, Limits, Request};
    let x = std::sync::Arc::new(x);
    let engine = Engine::start(x.clone(), Limits { sequences: alone.len(), queue: 0 }).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, (prompt, answer)) in alone.iter().enumerate() {
        let tx = tx.clone();
        let opts = GenerateOptions { sample_len: answer.len(), ..Default::default() };
        let events = Box::new(move |e: Event| tx.send((i, e)).is_ok());
        assert!(engine.submit(Request { prompt: prompt.clone(), opts, events }).is_ok(), "room for {} conversations", alone.len());
    }
    drop(tx);
    let mut texts = vec![String::new(); alone.len()];
    for (i, e) in rx {
        match e {
            Event::Text(t) => texts[i] += &t,
            Event::Done(_) => {}
            Event::Error(e) => panic!("conversation {i}: {e}"),
        }
    }
    for (i, ((_, answer), text)) in alone.iter().zip(&texts).enumerate() {
        let spoken: Vec<u32> = answer.iter().copied().filter(|t| !x.stop_tokens.contains(t)).collect();
        assert_eq!(text, &x.decode_text(&spoken).unwrap(), "conversation {i} through the engine answered otherwise than alone");
    }
}

/// Prepares SmolLM2's W8A8 stage graphs for chunks of 64 and 32 rows (240 graphs) on a fresh
/// Hexagon executor (its own QNN backend, as in a new process) with the given graph cache.
fn prepare_on_fresh_executor(config: &HtpConfig, profile: &QuantProfile) -> DeviceStats {
    let htp = NpuDevice::hexagon(config.clone()).unwrap();
    let mut p = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    p.model.set_profile(profile.clone()).unwrap();
    p.model.set_sched(SchedOptions { small_chunks: vec![32], ..SchedOptions::for_device(&htp, Precision::W8A8) }).unwrap();
    p.model.prepare_chunked(64).unwrap();
    htp.stats()
}

/// The prepared-graph cache of a model's shared contexts: on x86 (no weight sharing) a context
/// per graph size, each one context binary loaded whole by the next process; a damaged entry is
/// rebuilt (that context alone), another profile is another entry; one context for the model and
/// a context per graph beside them.
#[test]
fn second_run_loads_the_models_contexts_from_the_cache() {
    if !library_present() {
        return;
    }
    // Any profile will do: the cache does not care what the scales are, only that they are fixed.
    // Calibration is the host's job even on a Hexagon model: it must not touch the HTP.
    let htp = NpuDevice::hexagon(HtpConfig { cache_dir: None, ..Default::default() }).unwrap();
    let mut h = smollm2(&htp, Precision::W8A8, DecodeWeights::Q8_0);
    let set = CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() };
    let profile = h.calibrate(set, |_, _| {}).unwrap();
    assert_eq!(htp.stats(), DeviceStats::default(), "calibration ran on the host executor");
    let other_profile = h.calibrate(CalibrationSet { seq_len: 48, ..set }, |_, _| {}).unwrap();
    drop(h);
    let dir = std::env::temp_dir().join(format!("candle-npu-model-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = || {
        let mut v: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        v.sort();
        v
    };
    let config = HtpConfig { cache_dir: Some(dir.clone()), ..Default::default() };
    assert_eq!(config.contexts(), if cfg!(target_arch = "x86_64") { Contexts::PerGraphSize } else { Contexts::PerModel });
    let config = HtpConfig { contexts: Some(Contexts::PerGraphSize), ..config };
    let (n, half) = (240, 120); // 30 layers x 4 NPU stages x 2 graph sizes

    let first = prepare_on_fresh_executor(&config, &profile);
    assert_eq!((first.graphs_prepared, first.graphs_loaded, first.fallbacks), (n, 0, 0));
    let [a, b] = files().try_into().expect("a context binary per graph size");
    let bytes = std::fs::metadata(&a).unwrap().len();

    let second = prepare_on_fresh_executor(&config, &profile);
    eprintln!(
        "{n} stage graphs in two contexts: finalized in {:.2}s, {} + {} bytes cached, loaded in {:.2}s",
        first.prepare_ns as f64 / 1e9,
        bytes,
        std::fs::metadata(&b).unwrap().len(),
        second.load_ns as f64 / 1e9
    );
    assert_eq!((second.graphs_prepared, second.graphs_loaded), (0, n), "the second run prepares nothing");

    // A damaged entry: its context is rebuilt (with a warning) and the file rewritten.
    std::fs::OpenOptions::new().write(true).open(&a).unwrap().set_len(bytes / 3).unwrap();
    let third = prepare_on_fresh_executor(&config, &profile);
    assert_eq!((third.graphs_prepared, third.graphs_loaded), (half, half));
    assert_eq!(std::fs::metadata(&a).unwrap().len(), bytes, "{} rewritten", a.display());
    assert_eq!(prepare_on_fresh_executor(&config, &profile).graphs_loaded, n);

    // Another profile (other scales in every graph) misses, and is cached beside.
    let other = prepare_on_fresh_executor(&config, &other_profile);
    assert_eq!((other.graphs_prepared, other.graphs_loaded), (n, 0));
    assert_eq!(files().len(), 4);
    assert_eq!(prepare_on_fresh_executor(&config, &other_profile).graphs_loaded, n);

    // One context for the model: one entry (SmolLM2's fits what the emulated NPU maps).
    let per_model = HtpConfig { contexts: Some(Contexts::PerModel), ..config.clone() };
    assert_eq!(prepare_on_fresh_executor(&per_model, &profile).graphs_prepared, n);
    assert_eq!(files().len(), 5);
    assert_eq!(prepare_on_fresh_executor(&per_model, &profile).graphs_loaded, n);

    // A context per graph: its own entries, one per graph.
    let per_graph = HtpConfig { contexts: Some(Contexts::PerGraph), ..config };
    assert_eq!(prepare_on_fresh_executor(&per_graph, &profile).graphs_prepared, n);
    assert_eq!(files().len(), 5 + n as usize);
    assert_eq!(prepare_on_fresh_executor(&per_graph, &profile).graphs_loaded, n);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Graphs in shared contexts compute what each computes in a context of its own: a context per
/// graph size and one for all, compiled and loaded back from the cache, and one with weight
/// sharing (in the process that prepared it: the x86 library cannot load that back), which
/// holds the weights of both sizes once.
#[test]
fn graphs_in_shared_contexts_compute_as_alone() {
    if !library_present() {
        return;
    }
    use candle_npu::{Graph, TensorData};
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    let profile = p.calibrate(CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() }, |_, _| {}).unwrap();
    p.model.set_profile(profile).unwrap();
    // Layer 0's four stage graphs at 64 and at 32 rows.
    let graphs: Vec<Graph> = [64, 32].iter().flat_map(|&m| p.model.layer_graphs(0, m, Precision::W8A8).unwrap()).collect();
    let inputs: Vec<TensorData> =
        graphs.iter().map(|g| TensorData::U8((0..g.tensor(g.inputs[0]).elem_count()).map(|i| ((i * 2654435761usize) >> 7) as u8).collect())).collect();
    let run = |config: HtpConfig| {
        let htp = NpuDevice::hexagon(config).unwrap();
        let prepared = htp.prepare_all(&graphs).unwrap();
        let out: Vec<Vec<TensorData>> = prepared.iter().zip(&inputs).map(|(g, x)| g.execute(&[x]).unwrap()).collect();
        let bytes: usize = prepared.iter().map(|g| g.serialized_size().unwrap() / g.graphs_in_unit()).sum();
        assert_eq!(htp.stats().fallbacks, 0);
        (out, htp.stats(), bytes, prepared[0].graphs_in_unit())
    };
    let alone = run(HtpConfig { contexts: Some(Contexts::PerGraph), cache_dir: None, ..Default::default() });
    assert_eq!(alone.3, 1);
    let dir = std::env::temp_dir().join(format!("candle-npu-one-context-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (contexts, graphs_in_unit) in [(Contexts::PerGraphSize, 4), (Contexts::PerModel, 8)] {
        let cached = HtpConfig { cache_dir: Some(dir.clone()), contexts: Some(contexts), ..Default::default() };
        let compiled = run(cached.clone());
        let loaded = run(cached);
        assert_eq!((compiled.1.graphs_prepared, loaded.1.graphs_loaded, loaded.3), (8, 8, graphs_in_unit), "{contexts:?}, loaded back");
        assert!(compiled.0 == alone.0, "{contexts:?} computes as a context per graph");
        assert!(loaded.0 == alone.0, "{contexts:?} loaded from the cache computes as a context per graph");
    }
    // A sound file whose side table is not that of the context's graphs (its checksum holds):
    // the context is rebuilt, and the file rewritten.
    let per_model = HtpConfig { cache_dir: Some(dir.clone()), contexts: Some(Contexts::PerModel), ..Default::default() };
    let prints: Vec<[u8; 32]> = graphs.iter().map(Graph::fingerprint).collect();
    let key = candle_npu::HtpExecutor::new(per_model.clone()).unwrap().context_cache_key(&prints);
    let cache = candle_npu::cache::GraphCache::new(&dir);
    let name = "blk.0.qkv.m64+7";
    let candle_npu::cache::Lookup::Hit(entry) = cache.load(name, &key) else { panic!("the model's context is cached as {name}") };
    cache.store(name, &key, &[8, 0], &entry.payload).unwrap();
    let rebuilt = run(per_model.clone());
    assert_eq!((rebuilt.1.graphs_prepared, rebuilt.1.graphs_loaded), (8, 0), "a wrong side table: rebuilt");
    assert!(rebuilt.0 == alone.0);
    assert_eq!(run(per_model.clone()).1.graphs_loaded, 8, "rewritten, then loaded");
    // A side table with layer 0's K and V ids swapped (same shape), its checksum recomputed:
    // the library's own metadata (libQnnSystem.so) disagrees, so the context is rebuilt rather
    // than loaded with K's and V's buffers crossed.
    let candle_npu::cache::Lookup::Hit(entry) = cache.load(name, &key) else { panic!("rewritten") };
    let mut swapped = entry.meta.clone();
    assert_eq!(graphs[0].outputs.len(), 3, "{}: q, k, v", graphs[0].name);
    swapped.swap(3, 4);
    cache.store(name, &key, &swapped, &entry.payload).unwrap();
    let rebuilt = run(per_model);
    assert_eq!((rebuilt.1.graphs_prepared, rebuilt.1.graphs_loaded), (8, 0), "ids that are not the binary's: rebuilt");
    assert!(rebuilt.0 == alone.0);
    std::fs::remove_dir_all(&dir).unwrap();
    if cfg!(target_arch = "x86_64") {
        // The x86 library refuses to load a weight-shared binary (QNN 1000): the context is
        // finalized again in each process, and the sound entry is kept, not rewritten.
        let cached = HtpConfig { cache_dir: Some(dir.clone()), weight_sharing: true, ..Default::default() };
        run(cached.clone());
        let [file] = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect::<Vec<_>>().try_into().unwrap();
        let written = std::fs::metadata(&file).unwrap().modified().unwrap();
        let again = run(cached);
        assert_eq!((again.1.graphs_prepared, again.1.graphs_loaded), (8, 0), "finalized again");
        assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), written, "{} kept", file.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let one = run(HtpConfig { contexts: Some(Contexts::PerModel), cache_dir: None, ..Default::default() });
    let shared = run(HtpConfig { weight_sharing: true, cache_dir: None, ..Default::default() });
    assert_eq!(shared.3, 8, "weight sharing: one context for the model");
    eprintln!("layer 0 at 64 + 32 rows: context binaries {} bytes alone, {} in one context, {} with weight sharing", alone.2, one.2, shared.2);
    assert!(shared.0 == alone.0, "the context that shares the weights of both sizes computes as a context per graph");
    let compiled = one;
    // Measured: 10.8 MB in a context per graph or in one, 4.1 MB with weight sharing, for 2 x 3.5
    // MB of INT8 weights: sharing saves more than one size's copy of the weights.
    let weights: usize = graphs[..4].iter().map(Graph::static_bytes).sum();
    assert!(compiled.2 - shared.2 >= weights, "weight sharing saves {} bytes of {weights}", compiled.2 - shared.2);
}

/// The stage graphs of SmolLM2, Qwen2.5-Coder and Gemma 3 (their shapes: Gemma's 1024-wide Q
/// and 256-wide heads, Qwen's 4864-wide FFN), chunk 32, with a seeded u8 input: prepared and run
/// on the HTP with no host fallback, and checked against the HTP numerics model. Four layers of
/// each (the first two, the middle, the last): a model's layers share their shapes and differ in
/// weights and scales, and the whole prefills above run every layer through the library (all of
/// them here would cost CI three minutes more). The library and
/// the model compute the same FP16 intermediate for almost every output (see
/// `candle_npu::executor::htp_numerics`); where the library's own float arithmetic lands on the
/// other neighbour, the outputs are apart by the library's own error on the intermediate: at most
/// three FP16 steps of the output, or a small share of the tensor's scale (see
/// [`fp16_steps_apart`]).
#[test]
fn every_stage_graph_of_the_real_models_follows_the_htp_numerics_model() {
    if !library_present() {
        return;
    }
    use candle_npu::{Graph, TensorData};
    use candle_npu_models::{assets, LoadOptions, Pipeline};
    let model_dev = NpuDevice::host_with(Numerics::Htp);
    for path in [assets::smollm2(), assets::qwen25_coder_05b().unwrap(), assets::gemma3_270m().unwrap()] {
        let host = NpuDevice::host();
        let mut p = Pipeline::load(&path, None, &host, LoadOptions::default()).unwrap();
        let set = CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() };
        let profile = p.calibrate(set, |_, _| {}).unwrap();
        p.model.set_profile(profile).unwrap();
        let htp = NpuDevice::hexagon(HtpConfig { cache_dir: None, ..Default::default() }).unwrap();
        let (mut same, mut near, mut total, mut worst) = (0usize, 0usize, 0usize, 0f32);
        let n_layer = p.model.config().n_layer;
        let layers = [0, 1, n_layer / 2, n_layer - 1];
        for &l in &layers {
            let graphs: Vec<Graph> = p.model.layer_graphs(l, 32, Precision::W8A8).unwrap();
            for g in &graphs {
                let k = g.tensor(g.inputs[0]).shape[1];
                let x = TensorData::U8((0..32 * k).map(|i| ((i * 2654435761usize) >> 7) as u8).collect());
                let want = model_dev.prepare(g).unwrap().execute(&[&x]).unwrap();
                let got = htp.prepare(g).unwrap().execute(&[&x]).unwrap();
                for (a, b) in got.iter().zip(&want) {
                    let (TensorData::F32(a), TensorData::F32(b)) = (a, b) else { panic!("F32 outputs") };
                    same += a.iter().zip(b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
                    near += a.iter().zip(b).filter(|(x, y)| (*x - *y).abs() <= fp16_step(x.abs().max(y.abs()))).count();
                    total += a.len();
                    let (steps, at) = fp16_steps_apart(a, b);
                    assert!(steps <= 3.0, "{}: library {:e} and model {:e} {steps} FP16 steps apart at {at}", g.name, a[at], b[at]);
                    worst = worst.max(steps);
                }
            }
        }
        let (share, near) = (same as f64 / total as f64, near as f64 / total as f64);
        eprintln!(
            "{}: {total} stage outputs, model bit-exact on {:.3}%, within one FP16 step on {:.3}%, worst {worst} FP16 steps",
            path.display(),
            100.0 * share,
            100.0 * near
        );
        // Measured 99.7-99.8% bit-exact on random inputs (candle-npu/tests/htp_conformance.rs).
        assert!(share >= 0.99, "{}: model bit-exact on {:.3}%", path.display(), 100.0 * share);
        assert!(near >= 0.998, "{}: model within one FP16 step on {:.3}%", path.display(), 100.0 * near);
        let s = htp.stats();
        let n = (layers.len() * candle_npu_models::transformer::N_STAGES) as u64;
        assert_eq!((s.fallbacks, s.graphs_prepared, s.executions), (0, n, n), "{}", path.display());
    }
}

/// How far apart the library's outputs `a` and the model's `b` are, at worst (and where): in FP16
/// steps of the larger magnitude, or of 2^-14 times the tensor's largest |value| where that is
/// larger. One FP16 step of the intermediate, times the channel ratio, is up to two steps of the
/// output (their places within a binade differ), and the output's rounding half a step on either
/// side: three steps. But the library computes the intermediate with its own float arithmetic,
/// whose error is absolute, about 1e-6 of the magnitudes it sums (measured on per-tensor F32
/// outputs): on outputs near zero that is many FP16 steps (measured up to 21 on SmolLM2's down
/// projections, at |y| ~ 1e-4 where the tensor reaches ~1), so small outputs are held to the
/// tensor's scale instead: steps of at least 2^-14 of its largest value (an eighth of the FP16
/// step there, or less).
fn fp16_steps_apart(a: &[f32], b: &[f32]) -> (f32, usize) {
    let scale = 2f32.powi(-14) * b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).enumerate().fold((0f32, 0), |(m, at), (i, (x, y))| {
        let steps = (x - y).abs() / fp16_step(x.abs().max(y.abs())).max(scale);
        if steps > m {
            (steps, i)
        } else {
            (m, at)
        }
    })
}

/// Issue 48's plan through the library: SmolLM2's first two layers, each one graph (norms,
/// linears, RoPE, attention over a masked cache, FFN), 40 tokens in two chunks of 32 (the second
/// against a cache of 32 rows, 8 of them free), F32, W8A16 and shadow W8A16 (its outliers through
/// float weights), against the host executor and the HTP numerics model; and Gemma 3's stream,
/// beyond FP16 unless scaled.
#[test]
fn whole_layer_graphs_run_on_the_library() {
    if !library_present() {
        return;
    }
    let path = candle_npu_models::assets::smollm2();
    let load = |dev: &NpuDevice, precision: Precision| {
        let opts = candle_npu_models::LoadOptions { precision: Some(precision), decode_weights: DecodeWeights::Q8_0, layers: Some(2), ..Default::default() };
        candle_npu_models::Pipeline::load(&path, None, dev, opts).unwrap()
    };
    let mut h = load(&NpuDevice::host(), Precision::W8A16);
    let profile = h.calibrate(CalibrationSet { sequences: 2, seq_len: 64, importance_sequences: 0, ..Default::default() }, |_, _| {}).unwrap();
    let prompt = heldout_tokens(&h, 40);
    let htp = NpuDevice::hexagon(HtpConfig { cache_dir: None, ..Default::default() }).unwrap();
    for precision in [Precision::F32, Precision::W8A16, Precision::W8A16Shadow] {
        let mut host = load(&NpuDevice::host(), precision);
        let mut lib = load(&htp, precision);
        if precision != Precision::F32 {
            host.model.set_profile(profile.clone()).unwrap();
            lib.model.set_profile(profile.clone()).unwrap();
        }
        for p in [&mut host, &mut lib] {
            p.model.set_sched(SchedOptions { plan: PrefillPlan::Layers, ..Default::default() }).unwrap();
        }
        let t = std::time::Instant::now();
        let got: Vec<f32> = lib.model.prefill(&prompt, &PrefillOptions::chunked(32)).unwrap().to_vec1().unwrap();
        let secs = t.elapsed().as_secs_f32();
        let want: Vec<f32> = host.model.prefill(&prompt, &PrefillOptions::chunked(32)).unwrap().to_vec1().unwrap();
        let err = rel_max_err(&got, &want);
        // The HTP numerics model of the same graphs is nearer the library than the exact host.
        let mut model = load(&NpuDevice::host_with(Numerics::Htp), precision);
        if precision != Precision::F32 {
            model.model.set_profile(profile.clone()).unwrap();
        }
        model.model.set_sched(SchedOptions { plan: PrefillPlan::Layers, ..Default::default() }).unwrap();
        let modelled: Vec<f32> = model.model.prefill(&prompt, &PrefillOptions::chunked(32)).unwrap().to_vec1().unwrap();
        let err_model = rel_max_err(&got, &modelled);
        eprintln!("{precision:?}: library against the HTP numerics model {err_model:.2e}, against the exact host {err:.2e}");
        // Op by op the model is the library's rounding (htp_conformance.rs); over a whole layer
        // what it does not model (Softmax, Sigmoid, the FullyConnected's accumulation) leaves it
        // about as far as the exact host: measured 1.0e-3 / 1.05e-3 (F32), 2.0e-3 / 2.3e-3
        // (W8A16), 1.7e-3 / 1.8e-3 (shadow W8A16). Held to the same bound.
        assert!(err_model < 1e-2, "{precision:?}: the HTP numerics model is {err_model:e} from the library");
        let same = argmax(&candle_core::Tensor::new(got.as_slice(), &candle_core::Device::Cpu).unwrap()).unwrap()
            == argmax(&candle_core::Tensor::new(want.as_slice(), &candle_core::Device::Cpu).unwrap()).unwrap();
        eprintln!("{precision:?}: two whole-layer graphs per chunk through the library ({secs:.1} s), logits against the host: max diff / max {err:.2e}, same top token {same}");
        assert_eq!(htp.stats().fallbacks, 0, "every layer graph ran on the library");
        // Each layer is a float chain in FP16 on the HTP (norms, RoPE, attention, SiLU, the
        // residual adds): 1e-2 is the bound of one float chain (htp_conformance.rs), here over
        // two layers; measured 1.1e-3 (F32) and 2.3e-3 (W8A16).
        assert!(err < 1e-2 && same, "{precision:?}: {err:e}, same top token {same}");
    }

    // Gemma 3's residual stream passes FP16's largest value (1e5 in F32): its 18 layers in F32
    // whole-layer graphs, the stream carried at STREAM_SCALE, through the library near both the
    // model and the exact host (measured 2.7e-3 and 2.1e-3). Unscaled, the library's logits were
    // 1.4e-1 from the exact host's and the model's NaN (the library's FP16 overflow stays
    // finite; the model's is infinite).
    let path = candle_npu_models::assets::gemma3_270m().unwrap();
    let gemma = |dev: &NpuDevice| {
        let opts = candle_npu_models::LoadOptions { precision: Some(Precision::F32), decode_weights: DecodeWeights::F32, ..Default::default() };
        let mut p = candle_npu_models::Pipeline::load(&path, None, dev, opts).unwrap();
        p.model.set_sched(SchedOptions { plan: PrefillPlan::Layers, ..Default::default() }).unwrap();
        p
    };
    let prompt = heldout_tokens(&gemma(&NpuDevice::host()), 40);
    let all = |dev: &NpuDevice| -> Vec<f32> {
        gemma(dev).model.prefill(&prompt, &PrefillOptions::chunked(32).all_logits()).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let got = all(&htp);
    let (modelled, exact) = (all(&NpuDevice::host_with(Numerics::Htp)), all(&NpuDevice::host()));
    assert!(got.iter().all(|v| v.is_finite()), "Gemma 3: non-finite logits through the library");
    let (err_model, err) = (rel_max_err(&got, &modelled), rel_max_err(&got, &exact));
    eprintln!("Gemma 3, F32 whole layers, every position: library against the HTP numerics model {err_model:.2e}, against the exact host {err:.2e}");
    assert!(err_model < 1e-2 && err < 1e-2, "Gemma 3: library {err_model:e} from the model, {err:e} from the exact host");
    assert_eq!(htp.stats().fallbacks, 0);
}
