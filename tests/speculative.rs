//! Speculative decoding by prompt lookup gives the plain decode's output token for token, greedy
//! and sampled, on the three real models; the KV cache it leaves holds exactly the conversation
//! (a second turn answers as after plain decoding); and its verifier's rows are the decode
//! steps' logits bit for bit.

mod common;

use candle_npu::NpuDevice;
use candle_npu_models::{assets, DecodeWeights, GenerateOptions, LoadOptions, Pipeline, Precision, Speculative};

/// A prompt whose answer copies it: where prompt lookup proposes.
const PROMPT: &str = "Rewrite this function with the same names, adding a comment line above it:\n\
fn total_price(items: &[Item], tax_rate: f64) -> f64 {\n    let subtotal: f64 = items.iter().map(|item| item.price * item.quantity as f64).sum();\n    subtotal * (1.0 + tax_rate)\n}";

fn load(path: &std::path::Path) -> Pipeline {
    // F32 prefill: no calibration needed; decode (what speculation changes) is the CPU path.
    Pipeline::load(path, None, &NpuDevice::host(), LoadOptions { precision: Precision::F32, ..Default::default() }).unwrap()
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
        let fixed = Speculative::Lookup { ngram_max: 3, ngram_min: 2, max_draft: 4, adaptive: false };
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
        p.model.forward_cpu(&prompt).unwrap();
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
