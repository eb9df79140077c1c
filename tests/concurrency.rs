//! Concurrent use: one `NpuDevice` and its models from several threads, and two processes that
//! share a quant profile path and a prepared-graph cache folder. Every output must equal the
//! single-threaded one, and no file may be lost, torn or left half-written.

mod common;
#[path = "fuzz/props.rs"]
mod props;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use candle_npu::{DType, Graph, HtpConfig, NpuDevice, Op, Quant, QuantProfile, StaticData, TensorData};
use candle_npu_models::{logits, CalibrationSet, DecodeWeights, Model, Precision, PrefillOptions, Sequence};

/// Prefill of `tokens` then `steps` greedy tokens: what each thread computes.
fn generate(m: &mut Model, tokens: &[u32], steps: usize) -> (Vec<u32>, Vec<f32>) {
    let logits = m.prefill(tokens, &PrefillOptions::chunked(4)).unwrap();
    let mut out = vec![candle_npu_models::logits::argmax(&logits).unwrap()];
    let first: Vec<f32> = logits.to_vec1().unwrap();
    while out.len() < steps {
        out.push(candle_npu_models::logits::argmax(&m.decode(*out.last().unwrap()).unwrap()).unwrap());
    }
    (out, first)
}

#[test]
fn one_device_and_its_models_from_several_threads() {
    let dir = props::scratch("threads");
    let path = dir.join("m.gguf");
    props::tiny_gguf(&path);
    let (profile, _) = props::profile_setup(&dir);
    let device = NpuDevice::host();
    let load_with = |decode_weights| {
        let opts = candle_npu_models::LoadOptions { precision: Some(Precision::W8A8), decode_weights, ..Default::default() };
        let mut m = candle_npu_models::families::load_gguf(Arc::new(candle_npu_models::gguf::Gguf::open(&path).unwrap()), &device, opts).unwrap();
        m.set_profile(profile.clone()).unwrap();
        m
    };
    let load = || load_with(DecodeWeights::F32);
    let prompts: Vec<Vec<u32>> = (0..4).map(|t| (0..9 + t).map(|i| ((i * 7 + t * 3) % 40) as u32).collect()).collect();
    let want: Vec<_> = prompts.iter().map(|p| generate(&mut load(), p, 6)).collect();
    // A model per thread, on the one device: the graphs (and the host's packed weights) are
    // prepared concurrently and shared.
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| generate(&mut load(), p, 6))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want, "a model per thread");
    // One model behind a mutex, shared by the threads (a request holds it from prefill to its
    // last token: `Model` takes `&mut self`).
    let shared = Mutex::new(load());
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| generate(&mut shared.lock().unwrap(), p, 6))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want, "one model shared by threads");
    // One model shared without a lock (`Arc<Model>`, `&self`), each thread its own conversation.
    let shared = Arc::new(load());
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| generate_in(&shared, &mut shared.sequence(), p, 6))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want, "one model, a sequence per thread");
    // The four conversations decoded together, one pass over the weights per step: each row's
    // logits bit for bit its conversation's decoded alone. With decode weights in blocks, as
    // every model runs them (this crate's kernels compute each row on its own; candle's float
    // matmul of the reference weights sums in another order for another row count).
    let shared = Arc::new(load_with(DecodeWeights::Q8_0));
    let want: Vec<_> = prompts.iter().map(|p| generate_in(&shared, &mut shared.sequence(), p, 6)).collect();
    let mut seqs: Vec<Sequence> = prompts.iter().map(|_| shared.sequence()).collect();
    let mut next: Vec<u32> = seqs.iter_mut().zip(&prompts).map(|(s, p)| logits::argmax(&shared.prefill_sequence(s, p, &by_4()).unwrap()).unwrap()).collect();
    let mut alone: Vec<Sequence> = prompts.iter().map(|_| shared.sequence()).collect();
    alone.iter_mut().zip(&prompts).for_each(|(s, p)| drop(shared.prefill_sequence(s, p, &by_4()).unwrap()));
    for step in 1..6 {
        let mut batch: Vec<(&mut Sequence, &[u32])> = seqs.iter_mut().zip(&next).map(|(s, t)| (s, std::slice::from_ref(t))).collect();
        let rows = shared.decode_sequences(&mut batch).unwrap();
        for (i, (s, &t)) in alone.iter_mut().zip(&next).enumerate() {
            let solo: Vec<f32> = shared.decode_sequences(&mut [(s, &[t])]).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
            let row: Vec<f32> = rows.get(i).unwrap().to_vec1().unwrap();
            assert!(row == solo, "step {step}, conversation {i}: the batched row differs from the conversation decoded alone");
        }
        next = (0..prompts.len()).map(|i| logits::argmax(&rows.get(i).unwrap()).unwrap()).collect();
        for (w, &t) in want.iter().zip(&next) {
            assert_eq!(t, w.0[step], "step {step}: a batched conversation's token differs from its solo run's");
        }
    }
    assert!(seqs.iter().zip(&prompts).all(|(s, p)| s.position() == p.len() + 5), "each sequence holds its prompt and 5 decoded tokens");
    // A bad token in one conversation fails the batch and leaves every sequence as it was.
    let before: Vec<usize> = seqs.iter().map(Sequence::position).collect();
    let bad: Vec<[u32; 1]> = (0..seqs.len()).map(|i| [if i == 2 { u32::MAX } else { 1 }]).collect();
    let mut batch: Vec<(&mut Sequence, &[u32])> = seqs.iter_mut().zip(&bad).map(|(s, t)| (s, &t[..])).collect();
    let err = shared.decode_sequences(&mut batch).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    assert_eq!(seqs.iter().map(Sequence::position).collect::<Vec<_>>(), before);
    // A sequence that is not this model's (here: no layers) is refused, not indexed.
    let err = shared.prefill_sequence(&mut Sequence::default(), &prompts[0], &by_4()).unwrap_err().to_string();
    assert!(err.contains("a sequence of 0 layers"), "{err}");
    let err = shared.decode_sequences(&mut [(&mut Sequence::default(), &[1])]).unwrap_err().to_string();
    assert!(err.contains("a sequence of 0 layers"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Chunks of 4 rows, as `generate`'s prefill.
fn by_4() -> PrefillOptions {
    PrefillOptions::chunked(4)
}

/// [`generate`] on a conversation of its own on a shared model.
fn generate_in(m: &Model, seq: &mut Sequence, tokens: &[u32], steps: usize) -> (Vec<u32>, Vec<f32>) {
    let logits = m.prefill_sequence(seq, tokens, &by_4()).unwrap();
    let mut out = vec![logits::argmax(&logits).unwrap()];
    let first: Vec<f32> = logits.to_vec1().unwrap();
    while out.len() < steps {
        let next = m.decode_sequences(&mut [(&mut *seq, &[*out.last().unwrap()])]).unwrap();
        out.push(logits::argmax(&next.squeeze(0).unwrap()).unwrap());
    }
    (out, first)
}

/// The environment variables that make `child` do its part: the folder the processes share, and
/// how many start together (each waits for the others before it looks for the profile).
const CHILD_DIR: &str = "CANDLE_NPU_CONCURRENCY_CHILD";
const CHILD_PEERS: &str = "CANDLE_NPU_CONCURRENCY_PEERS";

/// Waits until `peers` processes have announced themselves in `dir` (files `ready.<pid>`).
fn barrier(dir: &Path, peers: usize) {
    std::fs::write(dir.join(format!("ready.{}", std::process::id())), b"").unwrap();
    let t = std::time::Instant::now();
    while std::fs::read_dir(dir).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("ready.")).count() < peers {
        assert!(t.elapsed().as_secs() < 120, "the other processes never started");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A W8A8 graph for the shared cache (a FullyConnected, then Dequantize).
fn cache_graph() -> Graph {
    let (m, k, n) = (32, 128, 64);
    let mut g = Graph::new("shared.fc.m32");
    let x = g.input("x", &[m, k], DType::U8, Some(Quant::u8_range(-2.0, 2.0)));
    let w: Vec<i8> = (0..n * k).map(|i| ((i * 31) % 255) as i8).collect();
    let w = g.constant("w", &[n, k], StaticData::I8(Arc::new(w)), Some(Quant::symmetric(0.01)));
    let y = g.tensor_new("y", &[m, n], DType::U8, Some(Quant::u8_range(-4.0, 4.0)));
    g.ops.push(Op::FullyConnected { input: x, weight: w, bias: None, output: y });
    let z = g.tensor_new("z", &[m, n], DType::F32, None);
    g.ops.push(Op::Dequantize { input: y, output: z });
    g.mark_output(z);
    g
}

/// One process's part: SmolLM2 with the shared profile path (calibrated and saved by whichever
/// process finds it missing), a prefill; the shared graph cache (QNN, when its library is
/// there), an execution. Prints one line of results.
#[test]
#[ignore = "one process's part of two_processes_share_a_profile_and_a_graph_cache"]
fn child() {
    let Ok(dir) = std::env::var(CHILD_DIR).map(PathBuf::from) else {
        eprintln!("nothing to do: only two_processes_share_a_profile_and_a_graph_cache runs this, with {CHILD_DIR} set");
        return;
    };
    let peers: usize = std::env::var(CHILD_PEERS).unwrap().parse().unwrap();
    let mut p = common::smollm2(&NpuDevice::host(), Precision::W8A8, DecodeWeights::Q8_0);
    let set = CalibrationSet { sequences: 2, seq_len: 64, ..CalibrationSet::default() };
    let profile = dir.join("profile.json");
    barrier(&dir.join("barrier"), peers);
    let calibrated = !profile.exists();
    p.ensure_profile(Some(&profile), set, |_, _| {}).unwrap();
    let logits: Vec<f32> = p.model.prefill(&common::heldout_tokens(&p, 40), &PrefillOptions::chunked(32)).unwrap().to_vec1().unwrap();
    let graph = match HtpConfig::default().library_path().is_file() {
        true => {
            let dev = NpuDevice::hexagon(HtpConfig { cache_dir: Some(dir.join("graphs")), ..Default::default() }).unwrap();
            let x = TensorData::U8((0..32 * 128).map(|i| (i * 13 % 256) as u8).collect());
            let TensorData::F32(out) = dev.prepare(&cache_graph()).unwrap().execute(&[&x]).unwrap().remove(0) else { panic!("F32 output") };
            format!("{:x}", fingerprint(&out.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
        }
        false => "no-qnn".into(),
    };
    println!("RESULT {:x} {graph}", fingerprint(&logits.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()));
    println!("CALIBRATED {calibrated}");
}

fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Runs `n` children at once on `dir`; their output (result and calibration lines).
fn children(dir: &Path, n: usize) -> Vec<String> {
    let barrier = dir.join("barrier");
    let _ = std::fs::remove_dir_all(&barrier);
    std::fs::create_dir_all(&barrier).unwrap();
    let exe = std::env::current_exe().unwrap();
    let procs: Vec<_> = (0..n)
        .map(|_| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--ignored", "--exact", "child", "--nocapture"]).env(CHILD_DIR, dir).env(CHILD_PEERS, n.to_string());
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    procs
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            let out = String::from_utf8_lossy(&o.stdout).into_owned();
            assert!(o.status.success(), "child failed:\n{out}\n{}", String::from_utf8_lossy(&o.stderr));
            let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("RESULT") || l.starts_with("CALIBRATED")).collect();
            assert_eq!(lines.len(), 2, "no result lines:\n{out}");
            lines.join("\n")
        })
        .collect()
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn two_processes_share_a_profile_and_a_graph_cache() {
    let dir = props::scratch("processes");
    // Two at once, on an empty folder: both calibrate and both compile, each writes its file.
    let first = children(&dir, 2);
    eprintln!("results: {first:?}");
    // Both looked for the profile after both had started (the barrier), and calibration takes
    // longer than that skew: both calibrated and both wrote it.
    assert!(first.iter().all(|r| r.ends_with("CALIBRATED true")), "the two processes did not overlap: {first:?}");
    assert_eq!(first[0], first[1], "two processes computed different results");
    if HtpConfig::default().library_path().is_file() {
        assert!(!first[0].contains("no-qnn"), "the graph cache half did not run");
    }
    let profile = dir.join("profile.json");
    let p = QuantProfile::load(&profile, &candle_npu::quant::model_id(&candle_npu_models::assets::smollm2()).unwrap()).unwrap();
    assert!(p.validate().is_ok());
    let left: Vec<String> = files(&dir).into_iter().filter(|f| f != "graphs" && f != "barrier").collect();
    assert_eq!(left, ["profile.json"], "a temporary file was left behind");
    if dir.join("graphs").exists() {
        let entries = files(&dir.join("graphs"));
        assert_eq!(entries.len(), 1, "one cache entry and no temporary file: {entries:?}");
    }
    // Then one more: it loads the profile and the graph and computes the same.
    let again = children(&dir, 1);
    assert_eq!(again[0], first[0].replace("CALIBRATED true", "CALIBRATED false"), "a run on the shared files computed something else");
    std::fs::remove_dir_all(dir).unwrap();
}
