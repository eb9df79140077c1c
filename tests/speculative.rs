//! Speculative decoding by prompt lookup gives the plain decode's output token for token, greedy
//! and sampled, on the three real models; the KV cache it leaves holds exactly the conversation
//! (a second turn answers as after plain decoding); and its verifier's rows are the decode
//! steps' logits bit for bit.

mod common;

use candle_npu::{NpuDevice, Numerics};
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, GenerateOptions, LoadOptions, Pipeline, Precision, Speculative, Verify};
use candle_npu_models::{PrefillOptions, PrefillRows};

/// A prompt whose answer copies it: where prompt lookup proposes.
const PROMPT: &str = "Rewrite this function with the same names, adding a comment line above it:\n\
fn total_price(items: &[Item], tax_rate: f64) -> f64 {\n    let subtotal: f64 = items.iter().map(|item| item.price * item.quantity as f64).sum();\n    subtotal * (1.0 + tax_rate)\n}";

fn load(path: &std::path::Path) -> Pipeline {
    // F32 prefill: no calibration needed; decode (what speculation changes) is the CPU path.
    Pipeline::load(path, None, &NpuDevice::host(), LoadOptions { precision: Some(Precision::F32), ..Default::default() }).unwrap()
}

/// Two turns with `speculative`; the answers and the first turn's speculation stats.
fn two_turns(p: &mut Pipeline, opts: &GenerateOptions) -> (String, String, candle_npu_models::SpeculationStats) {
    let mut s = p.session();
    let (first, stats) = s.send(p, PROMPT, opts, |_| {}).unwrap();
    let (second, _) = s.send(p, "Now the same with a discount parameter.", opts, |_| {}).unwrap();
    (first, second, stats.speculation)
}

fn check(name: &str, path: &std::path::Path) {
    let mut p = load(path);
    for (how, base) in [
        ("greedy", GenerateOptions { sample_len: 48, ..Default::default() }),
        ("sampled", GenerateOptions { sample_len: 48, temperature: Some(0.7), top_k: Some(40), repeat_penalty: 1.1, ..Default::default() }),
    ] {
        let plain = two_turns(&mut p, &base);
        assert_eq!(plain.2, Default::default(), "no speculation when off");
        // A fixed draft (no timing in it: the same passes on any machine), and the default.
        let fixed = Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 4, adaptive: false, verify: Verify::Cpu };
        for speculative in [fixed, Speculative::lookup()] {
            let spec = two_turns(&mut p, &GenerateOptions { speculative, ..base.clone() });
            eprintln!("{name} {how} {speculative:?}: {:?}\n{}", spec.2, spec.0);
            assert_eq!((&plain.0, &plain.1), (&spec.0, &spec.1), "{name} {how} {speculative:?}: speculation changed the output");
            if speculative == fixed {
                // Proposals were verified (each pass rewound past its first wrong token), and
                // greedy copying accepted some: else this would check nothing speculative.
                assert!(spec.2.passes > 0 && (how == "sampled" || spec.2.accepted > 0), "{name} {how}: {:?}", spec.2);
            }
        }
    }
}

#[test]
fn prompt_lookup_decodes_what_plain_decoding_does_smollm2() {
    check("SmolLM2", &assets::smollm2());
}

#[test]
fn prompt_lookup_decodes_what_plain_decoding_does_qwen() {
    check("Qwen2.5-Coder", &assets::qwen25_coder_05b().unwrap());
}

#[test]
fn prompt_lookup_decodes_what_plain_decoding_does_gemma() {
    check("Gemma 3", &assets::gemma3_270m().unwrap());
}

/// The verifier's rows (`Model::decode_rows`) are the decode steps' logits, bit for bit, with
/// the model's decode weights in both forms; and `rewind` drops rows exactly.
#[test]
fn verification_rows_are_decode_steps_bit_for_bit() {
    for dw in [DecodeWeights::Q8_0, DecodeWeights::Checkpoint] {
        let mut p = common::smollm2(&NpuDevice::host(), Precision::F32, dw);
        let prompt = p.encode("The quick brown fox jumps over the lazy dog and then", false).unwrap();
        let next = [1010u32, 2020, 3030, 40, 50, 60, 70];
        p.model.extend(&prompt, &PrefillOptions::default().all_logits().rows(PrefillRows::Cpu)).unwrap();
        let one: Vec<Vec<f32>> = next.iter().map(|&t| p.model.decode(t).unwrap().to_vec1().unwrap()).collect();
        p.model.rewind(prompt.len()).unwrap();
        let many: Vec<Vec<f32>> = p.model.decode_rows(&next).unwrap().to_vec2().unwrap();
        assert!(one == many, "{dw:?}: a verifier's rows differ from decode steps");
        // Rewound past three of them, the fourth decodes as before.
        p.model.rewind(prompt.len() + 3).unwrap();
        assert_eq!(p.model.decode(next[3]).unwrap().to_vec1::<f32>().unwrap(), one[3], "{dw:?}");
        assert!(p.model.rewind(p.model.position() + 1).is_err(), "no rewinding forward");
    }
}

/// SmolLM2 in the configuration users run on the NPU (W8A8 with shadow outliers, chunks of 32
/// rows), on the host with the HTP's numerics (`executor::htp_numerics`, proven against the
/// library in `tests/hexagon.rs`), calibrated on a small set.
fn smollm2_npu() -> Pipeline {
    let mut p = common::smollm2(&NpuDevice::host_with(Numerics::Htp), Precision::W8A8, DecodeWeights::Checkpoint);
    p.model.set_chunk_len(32).unwrap();
    let set = CalibrationSet { sequences: 4, seq_len: 128, importance_sequences: 0, ..Default::default() };
    let profile = p.calibrate(set, |_, _| {}).unwrap();
    p.model.set_profile(profile).unwrap();
    p
}

/// An NPU verifier's pass (`PrefillRows::NpuOnly`, one padded chunk) gives each row what the NPU's
/// prefill gives that token alone after the ones before it, and the rows it leaves in the KV
/// cache are those of the NPU's prefill: so the tokens sampled from a pass are the NPU's own.
#[test]
fn npu_verification_rows_are_the_npus_prefill_of_each_token() {
    let mut p = smollm2_npu();
    let prompt = p.encode(PROMPT, true).unwrap();
    let next = [1010u32, 2020, 3030, 40, 50, 60, 70];
    p.model.extend(&prompt, &PrefillOptions::default()).unwrap();
    let alone: Vec<Vec<f32>> = next.iter().map(|&t| p.model.extend(&[t], &PrefillOptions::default()).unwrap().to_vec1().unwrap()).collect();
    let after_alone = p.model.decode(9).unwrap().to_vec1::<f32>().unwrap();
    p.model.rewind(prompt.len()).unwrap();
    let pass: Vec<Vec<f32>> = p.model.extend(&next, &PrefillOptions::default().all_logits().rows(PrefillRows::NpuOnly)).unwrap().to_vec2().unwrap();
    let vocab = pass[0].len();
    let max_diff = alone.iter().flatten().zip(pass.iter().flatten()).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let top = |rows: &[Vec<f32>]| {
        rows.iter()
            .map(|r| candle_npu_models::logits::argmax(&candle_core::Tensor::new(r.as_slice(), &candle_core::Device::Cpu).unwrap()).unwrap())
            .collect::<Vec<_>>()
    };
    eprintln!("NPU pass of {} rows against {} one-token NPU extends: max |logit diff| {max_diff}, vocab {vocab}", next.len(), next.len());
    assert_eq!(top(&pass), top(&alone), "a pass's rows pick other tokens than the NPU's prefill of each");
    assert!(alone == pass, "a pass's rows differ from one-token NPU extends by up to {max_diff}");
    // The cache it leaves is the prefill's: the next step decodes as after the one-token extends.
    assert_eq!(p.model.decode(9).unwrap().to_vec1::<f32>().unwrap(), after_alone);
    // A rejected tail goes exactly: rewound past three, the fourth row is computed again.
    p.model.rewind(prompt.len() + 3).unwrap();
    assert_eq!(p.model.extend(&next[3..4], &PrefillOptions::default().all_logits().rows(PrefillRows::NpuOnly)).unwrap().to_vec2::<f32>().unwrap()[0], alone[3]);
}

/// Prompt lookup verified on the NPU: passes happen, greedy copying accepts proposals, and the
/// answer is what the NPU's prefill of the whole conversation picks at every position where the
/// answer took a pass's row.
#[test]
fn prompt_lookup_verified_on_the_npu_takes_the_npus_tokens() {
    let p = smollm2_npu();
    let speculative = Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 8, adaptive: false, verify: Verify::Npu };
    let opts = GenerateOptions { sample_len: 40, speculative, ..Default::default() };
    let mut s = p.session();
    let (answer, stats) = s.send(&p, PROMPT, &opts, |_| {}).unwrap();
    eprintln!("NPU-verified: {:?}\n{answer}", stats.speculation);
    assert!(stats.speculation.passes > 0 && stats.speculation.accepted > 0, "{:?}", stats.speculation);
    // The NPU's prefill of the whole conversation (every row a padded chunk's) against the
    // answer's tokens. They differ only through the rows the CPU decoded (steps without a
    // proposal) that the conversation's later rows attend to.
    let tokens = s.tokens().to_vec();
    let n_prompt = stats.prompt_tokens;
    let mut r = smollm2_npu();
    let rows = r.model.extend(&tokens, &PrefillOptions::default().all_logits().rows(PrefillRows::NpuOnly)).unwrap();
    let picked: Vec<u32> = (n_prompt..tokens.len()).map(|i| candle_npu_models::logits::argmax(&rows.get(i - 1).unwrap()).unwrap()).collect();
    let same = picked.iter().zip(&tokens[n_prompt..]).filter(|(a, b)| a == b).count();
    eprintln!("NPU prefill of the conversation picks the answer's token at {same} of {} positions", picked.len());
    assert_eq!(same, picked.len(), "the NPU's prefill picks other tokens: {picked:?} against {:?}", &tokens[n_prompt..]);
    // A second turn runs on the cache the first left (every rejected row rewound).
    let (second, _) = s.send(&p, "Now the same with a discount parameter.", &opts, |_| {}).unwrap();
    assert!(!second.is_empty());
}

/// A draft for SmolLM2, on the CPU only: the model itself (its first `layers`, or all).
fn smollm2_draft(layers: Option<usize>) -> Pipeline {
    Pipeline::load(&assets::smollm2(), None, &NpuDevice::host(), LoadOptions { precision: Some(Precision::F32), layers, ..Default::default() }).unwrap()
}

/// Proposals of a draft model give the plain decode's output too, greedy and sampled, over two
/// turns (the draft's own cache follows the conversation); a draft as good as the model is
/// accepted nearly always under greedy decoding.
#[test]
fn a_draft_model_decodes_what_plain_decoding_does() {
    let mut p = load(&assets::smollm2());
    for (how, base) in [
        ("greedy", GenerateOptions { sample_len: 48, ..Default::default() }),
        ("sampled", GenerateOptions { sample_len: 48, temperature: Some(0.7), top_k: Some(40), repeat_penalty: 1.1, ..Default::default() }),
    ] {
        let plain = two_turns(&mut p, &base);
        // A draft model of its own (the whole model, loaded again), and the model's own first
        // 10 layers sharing its weights.
        for layers in [None, Some(10)] {
            match layers {
                None => p.set_draft(smollm2_draft(None)).unwrap(),
                Some(n) => p.set_draft_layers(n).unwrap(),
            }
            assert_eq!(p.draft().unwrap().1, layers.unwrap_or(30));
            assert_eq!(std::ptr::eq(p.draft().unwrap().0, &p.model), layers.is_some(), "a cut draft is the model itself");
            let fixed = Speculative::Draft { max_draft: 4, adaptive: false, verify: Verify::Cpu };
            for speculative in [fixed, Speculative::draft()] {
                let spec = two_turns(&mut p, &GenerateOptions { speculative, ..base.clone() });
                eprintln!("draft of {layers:?} layers, {how} {speculative:?}: {:?}", spec.2);
                assert_eq!((&plain.0, &plain.1), (&spec.0, &spec.1), "draft of {layers:?} layers, {how} {speculative:?}: speculation changed the output");
                if speculative == fixed {
                    assert!(spec.2.passes > 0, "{:?}", spec.2);
                }
                if (speculative, how, layers) == (fixed, "greedy", None) {
                    // The draft is the model on the CPU path: its greedy tokens are the model's
                    // but where the F32 prefill's rows and the draft's own differ in rounding.
                    assert!(spec.2.accepted * 10 >= spec.2.proposed * 9, "{:?}", spec.2);
                }
            }
        }
    }
}

/// A draft of another tokenizer, a draft asked for with none set, and layers the model does not
/// have are errors, before any work.
#[test]
fn bad_drafts_are_errors() {
    let mut p = load(&assets::smollm2());
    let opts = GenerateOptions { sample_len: 4, speculative: Speculative::draft(), ..Default::default() };
    let e = p.generate("Hello", &opts, |_| {}).unwrap_err().to_string();
    assert!(e.contains("draft model") && e.contains("set_draft"), "{e}");
    let gemma =
        Pipeline::load(&assets::gemma3_270m().unwrap(), None, &NpuDevice::host(), LoadOptions { precision: Some(Precision::F32), ..Default::default() })
            .unwrap();
    let e = p.set_draft(gemma).unwrap_err().to_string();
    assert!(e.contains("does not share the tokenizer") && e.contains("gemma"), "{e}");
    assert!(p.draft().is_none());
    for layers in [0, 31] {
        let e = Pipeline::load(
            &assets::smollm2(),
            None,
            &NpuDevice::host(),
            LoadOptions { precision: Some(Precision::F32), layers: Some(layers), ..Default::default() },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains(&format!("first {layers} layers")) && e.contains("1 to 30"), "{e}");
        // The model's own first layers as its draft: the same bound.
        let e = p.set_draft_layers(layers).unwrap_err().to_string();
        assert!(e.contains(&format!("first {layers} layers")) && e.contains("1 to 30"), "{e}");
        assert!(p.draft().is_none());
    }
}

/// The command line's `--lookup` and `--draft-layers` answer as without them and say what was
/// accepted; `--verify npu` alone and two proposers at once are refused before anything loads.
#[test]
fn the_command_line_speculates_with_the_same_answer() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(common::llama_example())
            .args(["--sample-len", "24", "--prompt", "Repeat exactly: the quick brown fox jumps over the lazy dog."])
            .args(args)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    // The answer: what is printed before the prompt's statistics.
    let answer = |stdout: &str| stdout.split("prompt tokens processed").next().unwrap().to_string();
    let (ok, plain, err) = run(&[]);
    assert!(ok, "{plain}\n{err}");
    for (args, says) in [(&["--lookup"][..], "prompt lookup: "), (&["--draft-layers", "30"][..], "draft model: ")] {
        let (ok, out, err) = run(args);
        assert!(ok, "{args:?}: {out}\n{err}");
        assert_eq!(answer(&out), answer(&plain), "{args:?}");
        assert!(out.contains(says) && out.contains("proposed tokens accepted"), "{args:?}: {out}");
    }
    let (ok, _, err) = run(&["--verify", "npu"]);
    assert!(!ok && err.contains("--verify npu") && err.contains("--lookup"), "{err}");
    let (ok, _, err) = run(&["--lookup", "--draft-layers", "10"]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");
}
