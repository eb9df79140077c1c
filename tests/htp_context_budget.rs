//! NPU contexts within the NPU's address space, on the real QNN HTP library (x86 emulator).
//!
//! When a context loads, the library reserves its "context size estimate" in one protection
//! domain (PD) of the DSP and refuses it (QNN 1002) if no PD has room. Its verbose log says what
//! it reserves, per graph and per context; this process turns that log on (it follows the
//! `candle_npu::qnn` trace) and reads it, to check that:
//!
//! - [`candle_npu::executor::htp_contexts::address_space`], the crate's estimate of a graph before it
//!   is built, is at least the library's, for the three real models' stage graphs at 256 and 32
//!   rows;
//! - Qwen2.5-Coder's stage graphs at 256 + 32 rows in one context, which the library refuses
//!   (4.77 GB estimated), are split by the default budget into layer ranges, each of which the
//!   library loads, estimated within the budget;
//! - graphs compute in a split context what they compute alone.
//!
//! Its own test binary: the subscriber is process-wide, and QNN's verbose log costs time.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_npu::executor::htp_contexts::address_space;
use candle_npu::{Contexts, Graph, HtpConfig, HtpExecutor, NpuDevice, TensorData};
use candle_npu_models::{assets, CalibrationSet, LoadOptions, Pipeline, Precision};
use common::library_present;
use tracing_subscriber::layer::SubscriberExt;

/// Every message of target `candle_npu::qnn` since the process started.
fn qnn_log() -> &'static Mutex<Vec<String>> {
    static LOG: OnceLock<Arc<Mutex<Vec<String>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Capture(log.clone()));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this test binary");
        log
    })
}

struct Capture(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        if event.metadata().target() == "candle_npu::qnn" {
            let mut m = Message(String::new());
            event.record(&mut m);
            self.0.lock().unwrap().push(m.0);
        }
    }
}

/// The library's estimates in `lines`: per graph (QNN name), and per context (its id), in bytes
/// ("~84.43MB" is MiB: 88526336 B).
fn estimates(lines: &[String]) -> (HashMap<String, u64>, HashMap<u64, u64>) {
    let mib = |s: &str| {
        let v: f64 = s.trim_matches(|c: char| !c.is_ascii_digit()).parse().unwrap_or_else(|e| panic!("{e}: {s:?}"));
        (v * (1u64 << 20) as f64) as u64
    };
    let (mut graphs, mut contexts) = (HashMap::new(), HashMap::new());
    for line in lines {
        let w: Vec<&str> = line.split_whitespace().collect();
        // "QNN: <V> Context 1 graph blk_0_qkv_m256 estimated PD size ~13.49MB, including ..."
        if let Some(p) = w.windows(5).position(|x| x[0] == "graph" && x[2] == "estimated" && x[3] == "PD" && x[4] == "size") {
            graphs.insert(w[p + 1].to_string(), mib(w[p + 5]));
        }
        // "QNN: <V> Context 1 estimated PD size requirement is ~3103.90MB, including ..."
        if let Some(p) = w.windows(5).position(|x| x[0] == "Context" && x[2] == "estimated" && x[4] == "size") {
            if w.get(p + 5) == Some(&"requirement") {
                contexts.insert(w[p + 1].parse().unwrap(), mib(w[p + 7]));
            }
        }
    }
    (graphs, contexts)
}

fn model(path: &std::path::Path) -> Pipeline {
    let mut p = Pipeline::load(path, None, &NpuDevice::host(), LoadOptions::default()).unwrap();
    let set = CalibrationSet { sequences: 1, seq_len: 32, importance_sequences: 0, ..Default::default() };
    let profile = p.calibrate(set, |_, _| {}).unwrap();
    p.model.set_profile(profile).unwrap();
    p
}

/// Layers `layers` of `p`'s stage graphs at each of `sizes` rows, size-major (as a model
/// prepares them).
fn stage_graphs(p: &Pipeline, layers: std::ops::Range<usize>, sizes: &[usize]) -> Vec<Graph> {
    sizes.iter().flat_map(|&m| layers.clone().flat_map(move |l| p.model.layer_graphs(l, m, Precision::W8A8).unwrap())).collect()
}

fn qnn_name(g: &Graph) -> String {
    g.name.replace('.', "_")
}

/// Loads `graphs` (already in `config`'s cache) in a new executor; returns how many were loaded
/// and the library's log of it.
fn load(config: &HtpConfig, graphs: &[Graph]) -> (u64, Vec<String>) {
    let mark = qnn_log().lock().unwrap().len();
    let htp = NpuDevice::hexagon(config.clone()).unwrap();
    let prepared = htp.prepare_all(graphs).unwrap();
    drop(prepared);
    let loaded = htp.stats().graphs_loaded;
    drop(htp);
    let log = qnn_log().lock().unwrap()[mark..].to_vec();
    (loaded, log)
}

#[test]
fn the_library_loads_each_layer_range_of_a_model_it_refuses_whole() {
    if !library_present() {
        return;
    }
    qnn_log();
    let budget = HtpConfig::default().context_budget;
    let dir = std::env::temp_dir().join(format!("candle-npu-context-budget-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = HtpConfig { cache_dir: Some(dir.clone()), contexts: Some(Contexts::PerModel), weight_sharing: false, ..Default::default() };

    // The bound, on every stage shape of the three models at both sizes: layer 0 of each.
    for path in [assets::smollm2(), assets::gemma3_270m().unwrap()] {
        let graphs = stage_graphs(&model(&path), 0..1, &[256, 32]);
        NpuDevice::hexagon(config.clone()).unwrap().prepare_all(&graphs).unwrap();
        let (loaded, log) = load(&config, &graphs);
        assert_eq!(loaded, graphs.len() as u64, "{}", path.display());
        let (per_graph, _) = estimates(&log);
        for g in &graphs {
            let theirs = per_graph[&qnn_name(g)];
            let ours = address_space(g, None);
            eprintln!(
                "{}: library {:.2} MiB, bound {:.2} MiB ({:.2}x)",
                g.name,
                theirs as f64 / 1048576.0,
                ours as f64 / 1048576.0,
                ours as f64 / theirs as f64
            );
            assert!(ours >= theirs, "{}: the bound {ours} is under the library's estimate {theirs}", g.name);
        }
    }

    // Qwen2.5-Coder at 256 + 32 rows, one context without weight sharing: the library refuses it
    // whole (measured: 4,768,450,560 bytes estimated), so the budget splits it.
    let p = model(&assets::qwen25_coder_05b().unwrap());
    let n_layer = p.model.config().n_layer;
    let graphs = stage_graphs(&p, 0..n_layer, &[256, 32]);
    let plan = HtpExecutor::new(config.clone()).unwrap().plan_contexts(&graphs).unwrap();
    let whole = HtpExecutor::new(HtpConfig { context_budget: u64::MAX, ..config.clone() }).unwrap().plan_contexts(&graphs).unwrap();
    assert_eq!(whole.len(), 1);
    assert!(plan.len() >= 2, "split into {} contexts", plan.len());
    // Layer ranges, in order: runs of stages (a stage of a layer at both sizes shares its
    // weights, and is never cut), each with its graphs of both sizes.
    let per_size = n_layer * 4;
    let mut next = 0;
    for context in &plan {
        let mut stages: Vec<usize> = context.iter().map(|&i| i % per_size).collect();
        stages.sort_unstable();
        stages.dedup();
        assert_eq!(stages, (next..next + stages.len()).collect::<Vec<_>>(), "a run of stages");
        assert_eq!(context.len(), 2 * stages.len(), "each of its stages at both sizes");
        next += stages.len();
    }
    assert_eq!(next, per_size);

    let writer = NpuDevice::hexagon(config.clone()).unwrap();
    let prepared = writer.prepare_all(&graphs).unwrap();
    assert_eq!(writer.stats().fallbacks, 0);
    // Computes as alone: the last graph of the last context, against a context of its own.
    let last = *plan.last().unwrap().last().unwrap();
    let g = &graphs[last];
    let x = TensorData::U8((0..g.tensor(g.inputs[0]).elem_count()).map(|i| ((i * 2654435761usize) >> 7) as u8).collect());
    let split = prepared[last].execute(&[&x]).unwrap();
    drop(prepared);
    drop(writer);
    let alone = NpuDevice::hexagon(HtpConfig::default()).unwrap().prepare(g).unwrap().execute(&[&x]).unwrap();
    assert!(split == alone, "{} computes in its layer range's context as alone", g.name);

    // Each layer range, loaded alone in a new executor: the library takes it, and reserves for it
    // no more than the budget, and for each graph no more than the bound.
    for context in &plan {
        let part: Vec<Graph> = context.iter().map(|&i| graphs[i].clone()).collect();
        let (loaded, log) = load(&config, &part);
        assert_eq!(loaded, part.len() as u64, "the library loads the context of {} and {} more", part[0].name, part.len() - 1);
        let (per_graph, per_context) = estimates(&log);
        let [reserved] = per_context.values().copied().collect::<Vec<_>>()[..] else { panic!("one context estimated: {per_context:?}") };
        let ours: u64 = part.iter().map(|g| address_space(g, None)).sum();
        eprintln!(
            "context of {} + {}: library {:.0} MiB, bound {:.0} MiB, budget {} MiB",
            part[0].name,
            part.len() - 1,
            reserved as f64 / 1048576.0,
            ours as f64 / 1048576.0,
            budget >> 20
        );
        assert!(reserved <= ours && ours <= budget, "library {reserved} <= bound {ours} <= budget {budget}");
        for g in &part {
            assert!(address_space(g, None) >= per_graph[&qnn_name(g)], "{}", g.name);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
