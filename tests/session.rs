//! Multi-turn sessions: a turn prefills only its own tokens after the KV cache of the earlier
//! ones (`Model::extend`), and answers as re-prefilling the whole conversation would.

mod common;

use candle_npu::NpuDevice;
use candle_npu_models::logits::argmax;
use candle_npu_models::PrefillOptions;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, GenerateOptions, KvType, LoadOptions, Message, Pipeline, Precision, StopReason};
use common::*;
use sha2::Digest;

fn calibrated(device: &NpuDevice, precision: Precision) -> Pipeline {
    let mut p = smollm2(device, precision, DecodeWeights::Q8_0);
    p.model.set_chunk_len(64).unwrap();
    if precision != Precision::F32 {
        let set = CalibrationSet { sequences: 2, seq_len: 128, importance_sequences: 0, ..Default::default() };
        let profile = p.calibrate(set, |_, _| {}).unwrap();
        p.model.set_profile(profile).unwrap();
    }
    p
}

/// Prefilling `a` then extending by `b` gives the logits of prefilling `a ++ b`, bit for bit:
/// rows are computed row by row (W8A8 included), and attention sums each row's keys in the same
/// blocks wherever the chunks are cut.
#[test]
fn extend_continues_a_prefill() {
    let host = NpuDevice::host();
    for precision in [Precision::F32, Precision::W8A8] {
        let mut p = calibrated(&host, precision);
        let toks = heldout_tokens(&p, 150);
        let whole = p.model.prefill(&toks, &PrefillOptions::default()).unwrap().to_vec1::<f32>().unwrap();
        for cut in [1, 64, 100, 149] {
            p.model.prefill(&toks[..cut], &PrefillOptions::default()).unwrap();
            assert_eq!(p.model.position(), cut);
            let got = p.model.extend(&toks[cut..], &PrefillOptions::default()).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(p.model.position(), toks.len());
            assert_eq!(got, whole, "{precision:?}, cut at {cut}");
        }
        // Beyond the context: refused, and the cache is as it was.
        let ctx = p.model.config().context_len;
        p.model.prefill(&toks[..10], &PrefillOptions::default()).unwrap();
        let long = vec![toks[0]; ctx];
        assert!(p.model.extend(&long, &PrefillOptions::default()).is_err());
        assert_eq!(p.model.position(), 10);
    }
}

/// Turn 2 of a session prefills only its own tokens and answers as a fresh prefill of the whole
/// conversation does (greedy); a system message goes where the template puts it.
#[test]
fn a_session_turn_prefills_only_its_new_tokens() {
    let host = NpuDevice::host();
    let mut p = calibrated(&host, Precision::W8A8);
    let opts = GenerateOptions { sample_len: 12, ..Default::default() };
    let mut s = p.session();
    let mut streamed = String::new();
    let (a1, s1) = s.send(&p, "What is the capital of France?", &opts, |t| streamed += t).unwrap();
    assert_eq!(streamed, a1, "the streamed text is the answer");
    assert_eq!(s1.cached_tokens, 0);
    let after1 = s.tokens().len();
    let (a2, s2) = s.send(&p, "And of Germany?", &opts, |_| {}).unwrap();
    assert!(s2.cached_tokens >= after1 - 1, "turn 2 starts after turn 1 in the cache ({} of {after1})", s2.cached_tokens);
    assert!(s2.prompt_tokens < 20, "turn 2 prefilled {} tokens: only its own", s2.prompt_tokens);
    assert_eq!(s.messages().len(), 4, "two questions, two answers");
    assert_eq!(s.messages()[3].content, a2);
    eprintln!("turn 1: {a1:?}; turn 2: {a2:?} ({} new tokens after {})", s2.prompt_tokens, s2.cached_tokens);
    assert!(a1.contains("Paris"), "{a1:?}");
    // The same conversation rendered and prefilled from scratch: the same answer to turn 2.
    let conversation = p.encode_chat(&s.messages()[..3], true, false).unwrap();
    let logits = p.model.prefill(&conversation, &PrefillOptions::default()).unwrap();
    let mut ids = vec![argmax(&logits).unwrap()];
    while ids.len() < s2.generated_tokens {
        ids.push(argmax(&p.model.decode(*ids.last().unwrap()).unwrap()).unwrap());
    }
    assert_eq!(p.decode_text(&ids).unwrap(), a2, "re-prefilled conversation");
    // A system message, in the template's place.
    let mut sys = p.session();
    let (answer, _) = sys.chat(&p, &[Message::system("Answer in French."), Message::user("What is the capital of Italy?")], &opts, |_| {}).unwrap();
    assert!(p.tokenizer.decode(sys.tokens(), false).unwrap().starts_with("<|im_start|>system\nAnswer in French.<|im_end|>"), "{answer}");
}

/// Two conversations on one loaded model, turns interleaved: each answers as it does alone (its
/// own KV cache), and the model's weights and graphs are shared.
#[test]
fn two_sessions_interleave_on_one_model() {
    let host = NpuDevice::host();
    let mut p = calibrated(&host, Precision::W8A8);
    let opts = GenerateOptions { sample_len: 10, ..Default::default() };
    let alone = |p: &mut Pipeline, turns: [&str; 2]| {
        let mut s = p.session();
        turns.map(|t| s.send(p, t, &opts, |_| {}).unwrap().0)
    };
    let (fr, de) = (["What is the capital of France?", "And its largest river?"], ["Name a German city.", "How many people live there?"]);
    let (want_fr, want_de) = (alone(&mut p, fr), alone(&mut p, de));
    let (mut a, mut b) = (p.session(), p.session());
    let mut got_fr = vec![a.send(&p, fr[0], &opts, |_| {}).unwrap().0];
    let mut got_de = vec![b.send(&p, de[0], &opts, |_| {}).unwrap().0];
    got_fr.push(a.send(&p, fr[1], &opts, |_| {}).unwrap().0);
    got_de.push(b.send(&p, de[1], &opts, |_| {}).unwrap().0);
    assert_eq!(got_fr, want_fr);
    assert_eq!(got_de, want_de);
    assert_ne!(want_fr, want_de);
    // A conversation whose model was given another profile since refuses, saying which setting.
    let set = CalibrationSet { sequences: 1, seq_len: 64, importance_sequences: 0, ..Default::default() };
    let other = p.calibrate(set, |_, _| {}).unwrap();
    p.model.set_profile(other).unwrap();
    let e = a.send(&p, "And of Spain?", &opts, |_| {}).unwrap_err().to_string();
    assert!(e.contains("profile") && e.contains("then") && e.contains("now") && e.contains("start a new session") && e.len() < 300, "{e}");
}

#[test]
fn generation_stops_and_checks_its_options() {
    let host = NpuDevice::host();
    let mut p = calibrated(&host, Precision::W8A8);
    let opts = GenerateOptions { sample_len: 3, ..Default::default() };
    let (_, s) = p.generate("Tell me a long story about the sea.", &opts, |_| {}).unwrap();
    assert_eq!((s.stop, s.generated_tokens), (StopReason::SampleLen, 3));
    let (_, s) = p.generate("What is the capital of France?", &GenerateOptions { sample_len: 64, ..opts.clone() }, |_| {}).unwrap();
    assert_eq!(s.stop, StopReason::StopToken, "a short answer ends with the end of turn");
    for bad in [
        GenerateOptions { temperature: Some(-1.0), ..opts.clone() },
        GenerateOptions { top_p: Some(0.0), ..opts.clone() },
        GenerateOptions { top_k: Some(0), ..opts.clone() },
    ] {
        assert!(p.generate("hi", &bad, |_| {}).is_err(), "{bad:?}");
    }
    // Without a template an empty prompt has no token: refused, not a failed prefill.
    let (jinja, template) = (p.jinja.take(), std::mem::replace(&mut p.template, candle_npu_models::chat::ChatTemplate::None));
    let e = p.session().send(&p, "", &opts, |_| {}).unwrap_err().to_string();
    assert!(e.contains("empty prompt"), "{e}");
    (p.jinja, p.template) = (jinja, template);
    // No message at all: nothing to answer, refused, the conversation as it was.
    let mut s = p.session();
    let e = s.chat(&p, &[], &opts, |_| {}).unwrap_err().to_string();
    assert!(e.contains("no messages") && s.messages().is_empty() && s.tokens().is_empty(), "{e}");
    // Sampled generation is reproducible from its seed.
    let sampled = GenerateOptions { sample_len: 8, temperature: Some(0.9), top_k: Some(40), top_p: Some(0.95), ..opts };
    let a = p.generate("Write about the sea.", &sampled, |_| {}).unwrap().0;
    let b = p.generate("Write about the sea.", &sampled, |_| {}).unwrap().0;
    assert_eq!(a, b);
}

/// A conversation saved to a file and restored gives the same logits for what follows, and a
/// damaged file, or one saved with another profile, is refused with the cache left as it was.
#[test]
fn a_saved_session_restores_the_same_kv() {
    let host = NpuDevice::host();
    let mut p = calibrated(&host, Precision::W8A8);
    let dir = std::env::temp_dir().join(format!("candle-npu-session-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("turn1.kv");
    let opts = GenerateOptions { sample_len: 6, ..Default::default() };
    // A turn, saved; then the same next turn on the live conversation and on the restored one.
    let mut s = p.session();
    s.send(&p, "What is the capital of France?", &opts, |_| {}).unwrap();
    s.save(&p, &path).unwrap();
    let saved_tokens = s.tokens().to_vec();
    let live = s.send(&p, "And of Spain?", &opts, |_| {}).unwrap();
    let mut r = p.restore_session(&path).unwrap();
    assert_eq!(r.tokens(), &saved_tokens[..]);
    assert_eq!(r.messages(), &s.messages()[..2]);
    let restored = r.send(&p, "And of Spain?", &opts, |_| {}).unwrap();
    assert_eq!(restored.0, live.0, "the restored conversation answers as the live one");
    assert_eq!((restored.1.cached_tokens, restored.1.prompt_tokens), (live.1.cached_tokens, live.1.prompt_tokens), "and prefills as little");

    let refused = |p: &mut Pipeline, file: &std::path::Path, why: &str| {
        p.model.clear();
        p.model.prefill(&saved_tokens[..5], &PrefillOptions::default()).unwrap();
        let e = p.restore_session(file).err().unwrap_or_else(|| panic!("{} accepted", file.display()));
        assert!(matches!(e, candle_npu::Error::KvState { .. } | candle_npu::Error::Io { .. }), "{e}");
        assert!(e.to_string().contains(why), "{e}");
        assert_eq!(p.model.position(), 5, "a refused restore changes nothing");
    };
    let bytes = std::fs::read(&path).unwrap();
    let damaged = dir.join("damaged.kv");
    let mut b = bytes.clone();
    let at = b.len() - 100;
    b[at] ^= 1;
    std::fs::write(&damaged, &b).unwrap();
    refused(&mut p, &damaged, "checksum");
    std::fs::write(&damaged, &bytes[..bytes.len() / 2]).unwrap();
    refused(&mut p, &damaged, "its header says");
    std::fs::write(&damaged, b"not a kv file at all").unwrap();
    refused(&mut p, &damaged, "magic");
    refused(&mut p, &dir, "not a regular file");
    // Values no attention produces, the checksum recomputed over them: refused by content. The
    // file holds f16 values (the default cache's type), so beyond f16's range is infinite
    // (an f32 file's 3e30 is refused by the same comparison after widening).
    assert_eq!(p.model.kv_type(), candle_npu_models::KvType::F16);
    let body = bytes.len() - 32 - 64 * 2;
    for (value, why) in [(half::f16::NAN, "NaN"), (half::f16::INFINITY, "inf"), (half::f16::NEG_INFINITY, "-inf")] {
        let mut b = bytes[..bytes.len() - 32].to_vec();
        b[body..body + 2].copy_from_slice(&value.to_le_bytes());
        let digest = sha2::Sha256::digest(&b);
        b.extend_from_slice(&digest);
        std::fs::write(&damaged, &b).unwrap();
        refused(&mut p, &damaged, why);
    }
    // Pruned shadow paths compute other rows: refused too.
    let n_layer = p.model.config().n_layer;
    p.model.set_shadow_layers(&vec![false; n_layer]).unwrap();
    refused(&mut p, &path, "shadow layers");
    p.model.set_shadow_layers(&vec![true; n_layer]).unwrap();
    // An empty conversation saves and restores too.
    let empty = dir.join("empty.kv");
    p.session().save(&p, &empty).unwrap();
    assert!(p.restore_session(&empty).unwrap().tokens().is_empty());
    // Another profile computes other W8A8 rows: its KV is not this one's.
    let set = CalibrationSet { sequences: 1, seq_len: 64, importance_sequences: 0, ..Default::default() };
    let other = p.calibrate(set, |_, _| {}).unwrap();
    p.model.set_profile(other).unwrap();
    refused(&mut p, &path, "profile");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With an f16 (the default) or q8 KV cache (`LoadOptions::kv`) a conversation's cache keeps
/// its type through its turns, a save and a restore: the restored conversation answers as the
/// live one, and the file holds f16 values for f16 (half an f32 file) and f32 for q8 (its values
/// exactly).
#[test]
fn a_kv_cache_keeps_its_type_through_a_saved_session() {
    let mut sizes = vec![];
    for kv in [KvType::F16, KvType::Q8, KvType::F32] {
        let opts = LoadOptions { precision: Some(Precision::F32), decode_weights: DecodeWeights::Q8_0, kv, ..Default::default() };
        let p = Pipeline::load(&assets::smollm2(), None, &NpuDevice::host(), opts).unwrap();
        assert_eq!(p.model.kv_type(), kv);
        let dir = std::env::temp_dir().join(format!("candle-npu-session-{kv:?}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("turn1.kv");
        let gen = GenerateOptions { sample_len: 6, ..Default::default() };
        let mut s = p.session();
        s.send(&p, "What is the capital of France?", &gen, |_| {}).unwrap();
        assert_eq!(s.sequence().kv_type(), kv, "after a turn");
        s.save(&p, &path).unwrap();
        sizes.push(std::fs::metadata(&path).unwrap().len());
        let live = s.send(&p, "And of Spain?", &gen, |_| {}).unwrap();
        let mut r = p.restore_session(&path).unwrap();
        assert_eq!(r.sequence().kv_type(), kv, "restored");
        let restored = r.send(&p, "And of Spain?", &gen, |_| {}).unwrap();
        assert_eq!(restored.0, live.0, "{kv:?}: the restored conversation answers as the live one");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // The header (tokens, messages) is the same size for all three: the values differ.
    let (f16, q8, f32) = (sizes[0], sizes[1], sizes[2]);
    assert_eq!(q8, f32, "q8 saved as f32");
    assert!(f16 < f32 && f32 - f16 > f16 / 2, "f16 file {f16} bytes, f32 {f32}");
}

/// The chunk length is set once, at load (or with `set_chunk_len`), and checked there.
#[test]
fn chunk_length_is_checked_where_it_is_set() {
    let host = NpuDevice::host();
    let path = candle_npu_models::assets::smollm2();
    let ctx = 8192;
    for bad in [0, ctx + 1] {
        let opts = candle_npu_models::LoadOptions { chunk_len: Some(bad), ..Default::default() };
        let e = Pipeline::load(&path, None, &host, opts).err().expect("refused");
        assert!(e.to_string().contains(&format!("chunk length {bad}: expected 1 to the model's context of {ctx}")), "{e}");
    }
    let mut p = smollm2(&host, Precision::W8A8, DecodeWeights::Q8_0);
    assert_eq!(p.model.chunk_len(), 256, "the default");
    assert!(p.model.set_chunk_len(ctx + 1).is_err());
    assert_eq!(p.model.chunk_len(), 256, "a refused length changes nothing");
    p.model.set_chunk_len(32).unwrap();
    assert_eq!(p.model.plan(100).unwrap().chunk_len, 32);
}

/// A conversation saved by the run that calibrated (and saved) the profile goes on in a later
/// run that loads that profile: the two runs' models have the same arithmetic. (serde_json's
/// default float parsing read some clip statistics back 1 ulp off: the profile's hash changed
/// and the conversation was refused. The default calibration set, as the CLI uses it: its
/// profile held such values.)
#[test]
fn a_session_saved_while_calibrating_restores_with_the_saved_profile() {
    let dir = std::env::temp_dir().join(format!("candle-npu-session-cal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (profile, state) = (dir.join("p.w8a8.json"), dir.join("s.kv"));
    let set = CalibrationSet::default();
    let gen = GenerateOptions { sample_len: 2, ..Default::default() };
    let mut first = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    first.ensure_profile(Some(&profile), set, |_, _| {}).unwrap();
    let mut s = first.session();
    s.send(&first, "Hello", &gen, |_| {}).unwrap();
    s.save(&first, &state).unwrap();
    drop(first);
    let mut later = smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    later.ensure_profile(Some(&profile), set, |_, _| {}).unwrap();
    let restored = later.restore_session(&state);
    assert!(restored.is_ok(), "{:#}", restored.err().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A session is never saved onto a file its pipeline read: the model (on a copy: were the
/// check to fail, the save would replace it) or the profile it uses.
#[test]
fn a_session_is_not_saved_over_the_pipeline_s_own_files() {
    let dir = std::env::temp_dir().join(format!("candle-npu-session-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("m.gguf");
    std::fs::copy(assets::smollm2(), &model).unwrap();
    let size = std::fs::metadata(&model).unwrap().len();
    let p = Pipeline::load(&model, None, &NpuDevice::host(), LoadOptions { precision: Some(Precision::F32), ..Default::default() }).unwrap();
    let s = p.session();
    for target in [model.clone(), dir.join(".").join("m.gguf")] {
        let e = s.save(&p, &target).unwrap_err().to_string();
        assert!(e.contains("which this run reads") && e.contains("m.gguf"), "{e}");
    }
    assert_eq!(std::fs::metadata(&model).unwrap().len(), size, "the model file is untouched");
    s.save(&p, &dir.join("chat.session")).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
