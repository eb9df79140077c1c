//! SmolLM2-135M on the host executor: W8A8 accuracy on real text, chunk sharing, end to end,
//! and bad input.

mod common;

use std::sync::{Mutex, OnceLock};

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor, D};
use candle_npu::{Calibrator, ClipMethod, NpuDevice, QuantProfile, WeightQuant};
use candle_npu_models::logits::{argmax, mean_nll};
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision};
use common::*;

/// The calibration these tests measured with: 8 x 256 Wikipedia tokens (the eval's).
fn wikipedia() -> CalibrationSet {
    CalibrationSet { source: candle_npu_models::CalibrationSource::Wikipedia, ..Default::default() }
}

/// One calibration pass per test process (8 x 256 Wikipedia tokens, the eval's default) for
/// the default (per-channel) weights; profiles of any clip method are made from it.
/// Calibration runs with the model's INT8 weights, so a model with other weights calibrates
/// itself.
fn calibration(p: &mut Pipeline) -> Calibrator {
    static CAL: OnceLock<Mutex<Option<Calibrator>>> = OnceLock::new();
    let mut slot = CAL.get_or_init(Default::default).lock().unwrap();
    if slot.is_none() {
        let seqs = p.calibration_sequences(wikipedia()).unwrap();
        *slot = Some(p.model.calibrate(&seqs, |_| {}).unwrap());
    }
    slot.clone().unwrap()
}

/// Set the default profile (clip ranges at the default outlier budget; no importance).
fn calibrated(p: &mut Pipeline) -> QuantProfile {
    let prof = calibration(p).finish(p.model.model_id().to_string(), CalibrationSet::default().clip);
    p.model.set_profile(prof.clone()).unwrap();
    prof
}

/// Perplexity and top-1 agreement of `q` against the F32 prefill on 512 held-out tokens.
fn against_f32(q: &mut Pipeline) -> (f64, f64, f64) {
    let text = heldout_tokens(q, 512);
    let lq = q.model.prefill(&text, &PrefillOptions::chunked(256).all_logits()).unwrap();
    let mut f = smollm2(&NpuDevice::host(), Precision::F32, DecodeWeights::Q8_0);
    let lr = f.model.prefill(&text, &PrefillOptions::chunked(256).all_logits()).unwrap();
    let top_q = lq.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
    let top_r = lr.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
    let agree = top_q.iter().zip(&top_r).filter(|(a, b)| a == b).count() as f64 / top_q.len() as f64;
    let ppl = |l: &Tensor| mean_nll(l, &text).unwrap().exp();
    (ppl(&lq), ppl(&lr), agree)
}

#[test]
fn shadow_w8a8_prefill_is_within_2_percent_of_f32_on_heldout_wikipedia() {
    let mut p = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    calibrated(&mut p);
    let (ppl_q, ppl_r, agree) = against_f32(&mut p);
    eprintln!(
        "shadow W8A8 vs F32, 512 held-out Wikipedia tokens: perplexity {ppl_q:.3} vs {ppl_r:.3} (ratio {:.4}), top-1 agreement {agree:.3}",
        ppl_q / ppl_r
    );
    // Measured here: 16.639 vs 16.574 (ratio 1.0039), agreement 0.955 (outlier budget 1%,
    // per-channel weights, every shadow path on). The bounds: ratio <= 1.02, agreement >= 0.9.
    assert!(ppl_r < 30.0, "F32 reference perplexity {ppl_r} is not that of a working model");
    assert!(ppl_q / ppl_r <= 1.02, "perplexity ratio {}", ppl_q / ppl_r);
    assert!(agree >= 0.9, "top-1 agreement {agree}");
}

#[test]
fn naive_w8a8_baseline_stays_far_from_f32() {
    // Today's baseline before shadow outliers, kept so the gain stays visible: per-tensor
    // weights, min/max activation ranges, no shadow path.
    let dev = NpuDevice::host();
    let mut p = candle_npu_models::Pipeline::load(
        &assets::smollm2(),
        None,
        &dev,
        LoadOptions { precision: Some(Precision::W8A8), decode_weights: DecodeWeights::Q8_0, weights: WeightQuant::PerTensor, ..Default::default() },
    )
    .unwrap();
    let seqs = p.calibration_sequences(wikipedia()).unwrap();
    let prof = p.model.calibrate(&seqs, |_| {}).unwrap().finish(p.model.model_id().to_string(), ClipMethod::MinMax);
    p.model.set_profile(prof).unwrap();
    p.model.set_shadow_layers(&vec![false; p.model.config().n_layer]).unwrap();
    let (ppl_q, ppl_r, agree) = against_f32(&mut p);
    eprintln!("naive W8A8 vs F32: perplexity {ppl_q:.2} vs {ppl_r:.2} (ratio {:.3}), top-1 agreement {agree:.3}", ppl_q / ppl_r);
    // Measured here: perplexity 35.35 vs 16.57, ratio 2.133, agreement 0.527 (issue 2, with SiLU
    // inside one FFN graph: 37.77, 2.279, 0.555). The bounds are issue 2's; they fail if
    // quantization breaks entirely (agreement towards 0, the ratio explodes).
    assert!(agree >= 0.50, "top-1 agreement {agree}");
    assert!(ppl_q / ppl_r <= 2.5, "perplexity ratio {}", ppl_q / ppl_r);
}

#[test]
fn npu_graphs_are_prepared_once_and_shared_by_all_chunks() {
    let dev = NpuDevice::host();
    let mut p = smollm2(&dev, Precision::W8A8, DecodeWeights::Q8_0);
    calibrated(&mut p);
    let tokens = heldout_tokens(&p, 1000);
    let before = dev.stats();
    // The default plan: 3 chunks of 256, 7 of 32 (the small graphs), 8 margin rows, which run
    // on the 256-row graphs (the host runs them on any row count).
    let plan = p.model.plan_chunked(1000, 256).unwrap();
    assert_eq!((plan.npu_sizes(), plan.chunks.len(), plan.margin_tokens(), plan.padded_tokens()), (vec![32, 256], 11, 8, 0), "{plan:?}");
    p.model.prefill(&tokens, &PrefillOptions::chunked(256)).unwrap();
    let after = dev.stats();
    let layers = p.model.config().n_layer as u64;
    let per_chunk = layers * candle_npu_models::transformer::N_STAGES as u64;
    assert_eq!(after.graphs_prepared - before.graphs_prepared, 2 * per_chunk, "graphs prepared = sizes x layers x NPU stages, not x chunks");
    assert_eq!(after.executions - before.executions, per_chunk * 11, "10 chunks and the margin");
    assert_eq!(after.fallbacks, 0);
    // A second prompt of another length with the same chunk length prepares nothing new.
    p.model.prefill(&tokens[..300], &PrefillOptions::chunked(256)).unwrap();
    assert_eq!(dev.stats().graphs_prepared, after.graphs_prepared);
}

#[test]
fn calibration_runs_on_its_own_host_device_and_keeps_the_models_graphs() {
    // A float model whose graphs are already prepared on its device: calibration must neither
    // run on that device (on an NPU: FP16, slow) nor drop its prepared graphs.
    let dev = NpuDevice::host();
    let mut p = smollm2(&dev, Precision::F32, DecodeWeights::Q8_0);
    p.model.prepare_chunked(32).unwrap();
    let before = dev.stats();
    assert_eq!(before.graphs_prepared, 120, "30 layers x 4 NPU stages");
    let profile = p.calibrate(CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() }, |_, _| {}).unwrap();
    assert_eq!(profile.tokens, 32);
    assert_eq!(dev.stats(), before, "calibration used the model's device");
    p.model.prepare_chunked(32).unwrap();
    assert_eq!(dev.stats().graphs_prepared, 120, "the model's prepared graphs were kept");
}

/// Greedy answer (at most 16 tokens, or to a stop token) to a chat question.
fn answer(p: &mut Pipeline, question: &str) -> String {
    let prompt = p.encode(question, true).unwrap();
    let mut out = vec![argmax(&p.model.prefill(&prompt, &PrefillOptions::chunked(256)).unwrap()).unwrap()];
    while out.len() < 16 && !p.stop_tokens.contains(out.last().unwrap()) {
        out.push(argmax(&p.model.decode(*out.last().unwrap()).unwrap()).unwrap());
    }
    p.decode_text(&out).unwrap()
}

#[test]
fn greedy_answers_to_factual_questions_are_right_where_the_f32_prefill_is() {
    let dev = NpuDevice::host();
    let mut q = smollm2(&dev, Precision::W8A8, DecodeWeights::Q8_0);
    calibrated(&mut q);
    let mut f = smollm2(&dev, Precision::F32, DecodeWeights::Q8_0);
    // Chosen among questions the F32 prefill answers correctly (measured: Paris, Tokyo, carbon
    // dioxide; it answers "Neptune" for the largest planet, so that one would test nothing).
    // The answer, not its wording: 16 greedy tokens after two prefills that differ by rounding
    // may phrase it differently ("The answer is carbon dioxide" / "... is called carbon dioxide").
    let questions = [
        ("What is the capital of France? Answer with one word.", "Paris"),
        ("What is the capital of Japan? Answer with one word.", "Tokyo"),
        ("What gas do plants absorb from the air? Answer with one word.", "carbon dioxide"),
    ];
    for (question, fact) in questions {
        let (got, want) = (answer(&mut q, question), answer(&mut f, question));
        eprintln!("{question} -> W8A8 {got:?}, F32 {want:?}");
        assert!(want.to_lowercase().contains(&fact.to_lowercase()), "the F32 prefill no longer answers {question:?}: {want:?}");
        assert!(got.to_lowercase().contains(&fact.to_lowercase()), "{question:?}: W8A8 answered {got:?}, F32 {want:?}");
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("candle-npu-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn load_err(path: &std::path::Path) -> String {
    match Pipeline::load(path, None, &NpuDevice::host(), Default::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_prompts_are_errors() {
    let dev = NpuDevice::host();
    let mut p = smollm2(&dev, Precision::F32, DecodeWeights::Q8_0);
    let e = p.model.prefill(&[], &PrefillOptions::chunked(256)).unwrap_err().to_string();
    assert!(e.contains("empty prompt"), "{e}");
    let ctx = p.model.config().context_len;
    let e = p.model.prefill(&vec![1; ctx + 1], &PrefillOptions::chunked(256)).unwrap_err().to_string();
    assert!(e.contains("longer than the model's context") && e.contains(&ctx.to_string()), "{e}");
    let e = p.model.prefill(&[1, 2, 3], &PrefillOptions::chunked(0)).unwrap_err().to_string();
    assert!(e.contains("chunk length 0"), "{e}");
    let e = p.model.prefill(&[1, 9_999_999], &PrefillOptions::chunked(32)).unwrap_err().to_string();
    assert!(e.contains("9999999") && e.contains("vocabulary"), "{e}");
    // W8A8 without a profile says what to do.
    let mut q = smollm2(&dev, Precision::W8A8, DecodeWeights::Q8_0);
    let e = q.model.prefill(&[1, 2], &PrefillOptions::chunked(32)).unwrap_err().to_string();
    assert!(e.contains("quant profile"), "{e}");
}

#[test]
fn bad_model_files_are_errors() {
    let e = load_err(std::path::Path::new("/nonexistent/model.gguf"));
    assert!(e.contains("/nonexistent/model.gguf") && e.contains("No such file"), "{e}");
    // A FIFO where the model should be: refused from its type (opening it would block until a
    // writer came), and so is a device.
    let fifo = tmp("fifo.gguf");
    let _ = std::fs::remove_file(&fifo);
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let e = load_err(&fifo);
    assert!(e.contains("fifo.gguf") && e.contains("FIFO (named pipe), not a regular file"), "{e}");
    assert!(load_err(std::path::Path::new("/dev/zero")).contains("a character device, not a regular file"));

    let src = std::fs::read(assets::smollm2()).unwrap();
    let truncated = tmp("truncated.gguf");
    std::fs::write(&truncated, &src[..src.len() / 2]).unwrap();
    let e = load_err(&truncated);
    assert!(e.contains("truncated") && e.contains("truncated.gguf"), "{e}");

    let garbage = tmp("garbage.gguf");
    std::fs::write(&garbage, b"definitely not gguf").unwrap();
    assert!(load_err(&garbage).contains("not a valid GGUF"));

    // The real file with one tensor left out.
    let mut f = std::fs::File::open(assets::smollm2()).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors = vec![];
    for name in ct.tensor_infos.keys().filter(|n| *n != "blk.3.ffn_down.weight") {
        tensors.push((name.clone(), ct.tensor(&mut f, name, &Device::Cpu).unwrap()));
    }
    let md: Vec<(&str, &gguf_file::Value)> = ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tr: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let missing = tmp("missing.gguf");
    gguf_file::write(&mut std::fs::File::create(&missing).unwrap(), &md, &tr).unwrap();
    let e = load_err(&missing);
    assert!(e.contains("missing tensor 'blk.3.ffn_down.weight'") && e.contains("missing.gguf"), "{e}");
}

#[test]
fn profile_of_another_model_is_an_error() {
    let dev = NpuDevice::host();
    let mut p = smollm2(&dev, Precision::W8A8, DecodeWeights::Q8_0);
    let mut prof = calibrated(&mut p);
    prof.model_id = "0123456789abcdef".into();
    let path = tmp("other-model.w8a8.json");
    prof.save(&path).unwrap();
    let e = p.ensure_profile(Some(&path), CalibrationSet::default(), |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("calibrated for model 0123456789abcdef") && e.contains("other-model.w8a8.json"), "{e}");
    assert!(p.model.set_profile(prof.clone()).is_err());
    // This model's profile with a point left out: the error names the file, the point and what
    // to do.
    prof.model_id = p.model.model_id().to_string();
    prof.points.remove("blk.3.ffn_down_in").expect("the profile has blk.3.ffn_down_in");
    let path = tmp("missing-point.w8a8.json");
    prof.save(&path).unwrap();
    let e = p.ensure_profile(Some(&path), CalibrationSet::default(), |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("missing-point.w8a8.json") && e.contains("blk.3.ffn_down_in") && e.contains("delete it to recalibrate"), "{e}");
}

/// The command line's conversation: `--save-session` after a turn, then `--load-session` goes on
/// from it (the turn prefills only its own tokens) with `--interactive` turns from stdin, a
/// system prompt and sampling options.
#[test]
fn the_command_line_saves_loads_and_goes_on_with_a_conversation() {
    let state = tmp("cli-turn1.kv");
    let _ = std::fs::remove_file(&state);
    let run = |args: &[&str], stdin: &[u8]| {
        let out = llama_with_stdin(&[&["--sample-len", "8"], args].concat(), stdin);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        assert!(out.status.success(), "{args:?}:\n{stdout}\n{stderr}");
        (stdout, stderr)
    };
    let s = state.to_str().unwrap();
    // Its own profile, calibrated by the first run (as a first-time user's run calibrates) and
    // loaded by the second, whatever other tests left at the model's default path.
    let profile = tmp("cli-turn1.w8a8.json");
    let _ = std::fs::remove_file(&profile);
    let run = |args: &[&str], stdin: &[u8]| run(&[&["--profile", profile.to_str().unwrap()], args].concat(), stdin);
    // (What a 135M model answers under a system prompt depends on its calibration: not asserted.)
    let (first, err) = run(&["--prompt", "What is the capital of France?", "--system", "Answer briefly.", "--save-session", s], b"");
    assert!(first.contains("prompt tokens processed") && err.contains("saved to"), "{first}\n{err}");
    let (next, err) = run(
        &["--load-session", s, "--prompt", "And of Germany?", "--interactive", "--repeat-penalty", "1.1", "--temperature", "0.5", "--top-k", "20"],
        b"And of Italy?\n\n",
    );
    let line = next.lines().find(|l| l.contains("prompt tokens processed")).unwrap_or_else(|| panic!("{next}"));
    let new: usize = line.split_whitespace().next().unwrap().parse().unwrap();
    assert!(new < 25, "the loaded turn prefilled only its own tokens: {line}");
    assert!(err.contains("new tokens after") && err.contains("kept"), "the interactive turn: {err}");
    // A line that is not UTF-8 ends the conversation, named as standard input's, and what was
    // said before it is saved.
    let after = tmp("cli-turn3.kv");
    let (_, err) = run(
        &["--load-session", s, "--prompt", "And of Spain?", "--interactive", "--save-session", after.to_str().unwrap()],
        b"And of Italy?\n\xff\xfe oops\nAnd of Peru?\n",
    );
    assert!(err.contains("standard input, line 2: not UTF-8 text (invalid byte 0xff at byte 1)"), "{err}");
    // The saved header's messages (the file: magic, a u32 length, the header's JSON, the KV).
    let bytes = std::fs::read(&after).unwrap();
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[12..12 + len]).unwrap();
    let said: Vec<&str> = header["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap()).collect();
    assert!(said.contains(&"And of Italy?") && !said.iter().any(|m| m.contains("Peru")), "{said:?}");
    std::fs::remove_file(&after).unwrap();
    // Options the parser refuses, before anything loads.
    let out = std::process::Command::new(llama_example()).args(["--repeat-penalty", "0", "--system", "x"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not a repeat penalty"));
    std::fs::remove_file(&state).unwrap();
    std::fs::remove_file(&profile).unwrap();
}
