//! The Hexagon executor's prepared-graph cache and profiling, on the real QNN HTP library (x86
//! emulator from onnxruntime-qnn). Skipped, with the reason printed, only when the library file
//! is absent.
#![cfg(feature = "qnn")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_npu::cache::{GraphCache, Lookup};
use candle_npu::{DType, Graph, HtpConfig, HtpExecutor, NpuDevice, Op, Origin, ProfilingLevel, Quant, StaticData, TensorData};

fn library_present() -> bool {
    let path = HtpConfig::default().library_path();
    if !path.is_file() {
        eprintln!("skipping: QNN HTP library {} is absent (run scripts/setup.sh or set CANDLE_NPU_QNN_LIB_DIR)", path.display());
    }
    path.is_file()
}

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("candle-npu-htp-cache-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A W8A8 FullyConnected with bias, u8 out, then Dequantize: [32, 256] x [128, 256]^T.
fn graph(seed: u8) -> Graph {
    let (m, k, n) = (32, 256, 128);
    let mut g = Graph::new("fc.m32");
    let x = g.input("x", &[m, k], DType::U8, Some(Quant::u8_range(-2.0, 2.0)));
    let w: Vec<i8> = (0..n * k).map(|i| ((i * 37 + seed as usize) % 255) as i8).collect();
    let w = g.constant("w", &[n, k], StaticData::I8(Arc::new(w)), Some(Quant::symmetric(0.02 / 127.0)));
    let y = g.tensor_new("y", &[m, n], DType::U8, Some(Quant::u8_range(-3.0, 3.0)));
    g.ops.push(Op::FullyConnected { input: x, weight: w, bias: None, output: y });
    let z = g.tensor_new("z", &[m, n], DType::F32, None);
    g.ops.push(Op::Dequantize { input: y, output: z });
    g.mark_output(z);
    g
}

fn input() -> TensorData {
    TensorData::U8((0..32 * 256).map(|i| (i * 13 % 256) as u8).collect())
}

fn config(cache: &Path) -> HtpConfig {
    HtpConfig { cache_dir: Some(cache.to_path_buf()), profiling: Some(ProfilingLevel::Basic), ..Default::default() }
}

fn cache_files(dir: &PathBuf) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

/// Prepares `g` on a fresh executor (own backend, as in a new process) and runs it once.
fn prepare_and_run(cfg: &HtpConfig, g: &Graph) -> (Origin, TensorData, NpuDevice) {
    let d = NpuDevice::hexagon(cfg.clone()).unwrap();
    let p = d.prepare(g).unwrap();
    let out = p.execute(&[&input()]).unwrap().remove(0);
    (p.origin(), out, d)
}

#[test]
fn a_second_executor_loads_the_graph_instead_of_compiling_it() {
    if !library_present() {
        return;
    }
    let dir = tmp_dir("load");
    let cfg = config(&dir);
    let (origin, first, d1) = prepare_and_run(&cfg, &graph(1));
    assert_eq!(origin, Origin::Compiled);
    assert_eq!((d1.stats().graphs_prepared, d1.stats().graphs_loaded), (1, 0));
    assert_eq!(cache_files(&dir).len(), 1, "the context binary was written, and only it");

    let (origin, second, d2) = prepare_and_run(&cfg, &graph(1));
    assert_eq!(origin, Origin::Loaded);
    assert_eq!((d2.stats().graphs_prepared, d2.stats().graphs_loaded), (0, 1));
    assert_eq!(first, second, "the loaded graph computes what the compiled one did");

    // Profiles: QNN's own finalize and load times, and per-execute times.
    let (p1, p2) = (&d1.graph_profiles()[0], &d2.graph_profiles()[0]);
    eprintln!("finalize {} us, load {} us; execute {} us / {} us", p1.prepare_us, p2.prepare_us, p1.execute_us, p2.execute_us);
    assert_eq!((p1.origin, p2.origin), (Origin::Compiled, Origin::Loaded));
    assert!(p1.events.iter().any(|e| e.phase == "prepare" && e.name == "QNN (finalize) time" && e.unit == "us"), "{:?}", p1.events);
    assert!(p2.events.iter().any(|e| e.phase == "prepare" && e.name == "QNN (load binary) time"), "{:?}", p2.events);
    assert!(p1.prepare_us > 0 && p2.prepare_us > 0 && p1.executions == 1 && p1.execute_us > 0);

    // Other weights, or another graph config, are other keys: compiled, cached beside.
    assert_eq!(prepare_and_run(&cfg, &graph(2)).0, Origin::Compiled);
    let fast = HtpConfig { optimization_level: Some(1), ..cfg.clone() };
    assert_eq!(prepare_and_run(&fast, &graph(1)).0, Origin::Compiled);
    assert_eq!(cache_files(&dir).len(), 3);
    assert_eq!(prepare_and_run(&fast, &graph(1)).0, Origin::Loaded);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unusable_cache_files_are_rebuilt() {
    if !library_present() {
        return;
    }
    let dir = tmp_dir("rebuild");
    let cfg = config(&dir);
    let g = graph(3);
    let (_, want, _) = prepare_and_run(&cfg, &g);
    let [file] = cache_files(&dir).try_into().unwrap();
    let good = std::fs::read(&file).unwrap();
    let key = HtpExecutor::new(cfg.clone()).unwrap().cache_key(&g);
    let cache = GraphCache::new(&dir);
    assert_eq!(cache.path(&g.name, &key), file, "the key is deterministic across executors");
    let Lookup::Hit(entry) = cache.load(&g.name, &key) else { panic!("{} does not load", file.display()) };

    let broken: [(&str, Box<dyn Fn()>); 4] = [
        ("truncated", Box::new(|| std::fs::write(&file, &good[..good.len() / 2]).unwrap())),
        ("bit flip", Box::new(|| std::fs::write(&file, [&good[..good.len() - 9], &[good[good.len() - 9] ^ 0x10], &good[good.len() - 8..]].concat()).unwrap())),
        // Valid file, but the payload is not a context binary: the library refuses it.
        ("not a context binary", Box::new(|| drop(cache.store(&g.name, &key, &[0, 1], &vec![0x5a; 4096]).unwrap()))),
        // Valid file, wrong number of tensor ids.
        ("wrong side table", Box::new(|| drop(cache.store(&g.name, &key, &entry.meta[..1], &entry.payload).unwrap()))),
    ];
    for (what, damage) in broken {
        damage();
        let (origin, got, d) = prepare_and_run(&cfg, &g);
        assert_eq!(origin, Origin::Compiled, "{what}: rebuilt");
        assert_eq!(d.stats().graphs_prepared, 1, "{what}");
        assert_eq!(got, want, "{what}");
        // Rewritten with a valid entry (context binaries are not byte-identical across
        // finalizes, and QNN tensor ids depend on what the backend created before).
        let now = cache.load(&g.name, &key);
        assert!(
            matches!(&now, Lookup::Hit(e) if e.meta.len() == entry.meta.len()),
            "{what}: the file was rewritten: {}",
            match &now {
                Lookup::Hit(e) => format!("meta {:?}", e.meta),
                Lookup::Miss => "miss".into(),
                Lookup::Invalid(w) => w.clone(),
            }
        );
        assert_eq!(prepare_and_run(&cfg, &g).0, Origin::Loaded, "{what}: then loaded");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn detailed_profiling_reports_per_op_events() {
    if !library_present() {
        return;
    }
    let cfg = HtpConfig { profiling: Some(ProfilingLevel::Detailed), cache_dir: None, ..Default::default() };
    let (_, _, d) = prepare_and_run(&cfg, &graph(4));
    let [p] = d.graph_profiles().try_into().unwrap();
    let names: Vec<&str> = p.events.iter().map(|e| e.name.as_str()).collect();
    // Sub-events are named "<parent> / <child>"; per-node ones carry the node name QNN was given
    // ("op<index>_<output>", see executor::htp), here the FullyConnected producing `y`.
    assert!(names.iter().any(|n| n.starts_with("QNN (finalize) time / ")), "{names:?}");
    assert!(p.events.iter().any(|e| e.phase == "execute" && e.name.contains(" / op0_y")), "{names:?}");
    assert_eq!((p.origin, p.executions), (Origin::Compiled, 1));
}
