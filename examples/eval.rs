//! Clip-budget sweep of shadow W8A8 prefill against the F32 prefill on SmolLM2-135M: perplexity
//! on 512 held-out Wikipedia tokens, top-1 agreement, the share of values beyond the clip ranges,
//! the hot channels per point kind and the hot-channel hit rate, and prefill time.
//!
//! ```text
//! cargo run --release --example eval -- 0.01,0.01,0.01,0.01 0.001,0.001,0.001,0.001
//! ```
//!
//! Each argument gives the outlier budget of the four point kinds (attn_in, attn_out, ffn_in,
//! ffn_down_in). The full accuracy suite of issue 8 (rows for every variant, three domains, MMLU,
//! `--json`, the pruning curve as a PNG) is still to be built on this.
use anyhow::Result;
use candle_core::D;
use candle_npu::{ClipMethod, NpuDevice, WeightQuant};
use candle_npu_models::transformer::mean_nll;
use candle_npu_models::{assets, CalibrationSet, DecodeWeights, LoadOptions, Pipeline, Precision};

fn heldout(p: &Pipeline, n: usize) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for text in assets::wiki_heldout(200)? {
        ids.extend(p.encode(&text, false)?);
        ids.extend(p.encode("\n\n", false)?);
        if ids.len() >= n {
            break;
        }
    }
    ids.truncate(n);
    Ok(ids)
}

fn main() -> Result<()> {
    let dev = NpuDevice::host();
    let load = |precision, weights| Pipeline::load(&assets::smollm2(), None, &dev, LoadOptions { precision, decode_weights: DecodeWeights::Q8_0, weights });
    let mut f = load(Precision::F32, WeightQuant::PerChannel)?;
    let text = heldout(&f, 512)?;
    let r = f.model.prefill_all_logits(&text, 256)?;
    let ppl_r = mean_nll(&r, &text)?.exp();
    let top_r = r.argmax(D::Minus1)?.to_vec1::<u32>()?;
    eprintln!("F32 ppl {ppl_r:.3}");
    for wq in [WeightQuant::PerChannel] {
        let mut q = load(Precision::W8A8, wq)?;
        let seqs = q.calibration_sequences(CalibrationSet::default())?;
        let cal = q.model.calibrate(&seqs, 256, |_| {})?;
        // args: per kind budgets "attn_in,attn_out,ffn_in,ffn_down_in"
        let methods: Vec<Vec<f64>> = std::env::args().skip(1).map(|a| a.split(',').map(|x| x.parse().unwrap()).collect()).collect();
        for m in methods {
            for shadow in [true] {
                let mut prof = cal.finish(q.model.model_id().to_string(), ClipMethod::MinMax);
                for (i, kind) in ["attn_in", "attn_out", "ffn_in", "ffn_down_in"].iter().enumerate() {
                    let other = cal.finish(q.model.model_id().to_string(), ClipMethod::Budget { fraction: m[i] });
                    for (name, pt) in other.points { if name.ends_with(&format!(".{kind}")) { prof.points.insert(name, pt); } }
                }
                for kind in ["attn_in", "attn_out", "ffn_in", "ffn_down_in"] {
                    let (mut hot, mut ch, mut n) = (0, 0, 0);
                    for (name, pt) in &prof.points { if name.ends_with(&format!(".{kind}")) { hot += pt.hot.len(); ch += pt.channels; n += 1; } }
                    eprint!("{kind}: hot {:.3} ({} per point) ", hot as f64 / ch as f64, hot / n.max(1));
                }
                eprintln!();
                q.model.set_profile(prof)?;
                q.model.set_shadow_layers(&vec![shadow; 30])?;
                q.model.reset_point_stats();
                let t = std::time::Instant::now();
                let l = q.model.prefill_all_logits(&text, 256)?;
                let secs = t.elapsed().as_secs_f64();
                let ppl = mean_nll(&l, &text)?.exp();
                let top = l.argmax(D::Minus1)?.to_vec1::<u32>()?;
                let agree = top.iter().zip(&top_r).filter(|(a, b)| a == b).count() as f64 / top.len() as f64;
                let st = q.model.point_stats();
                let (o, e): (u64, u64) = st.iter().fold((0, 0), |a, (_, s)| (a.0 + s.outliers, a.1 + s.elements));
                let hot: usize = q.model.profile().unwrap().points.values().map(|p| p.hot.len()).sum();
                let cold: u64 = q.model.linears().map(|l| l.cold_reads()).sum();
                for kind in ["attn_in", "attn_out", "ffn_in", "ffn_down_in"] {
                    let mut s = candle_npu::PointStats::default();
                    for (name, p) in &st { if name.ends_with(&format!(".{kind}")) { s.add(*p); } }
                    eprint!("{kind}: out {:.1e} hit {:.3} ", s.outliers as f64 / s.elements as f64, s.hot_hit_rate());
                }
                eprintln!();
                eprintln!("{wq:?} {m:?} shadow {shadow}: ppl {ppl:.3} ratio {:.4} agree {agree:.3} outliers {:.2e} hot channels {hot} cold reads {cold} {secs:.1}s", ppl / ppl_r, o as f64 / e as f64);
            }
        }
    }
    Ok(())
}
