//! Scratch: hexagon vs HTP model, padded vs margin, on the README prompt.
use candle_npu::{HtpConfig, NpuDevice, Numerics, Tail};
use candle_npu_models::{assets, CalibrationSet, LoadOptions, Pipeline, SchedOptions};

fn main() -> anyhow::Result<()> {
    let path = assets::smollm2();
    let run = |dev: &NpuDevice, tail: Tail| -> anyhow::Result<Vec<f32>> {
        let mut p = Pipeline::load(&path, None, dev, LoadOptions::default())?;
        p.ensure_profile(None, 32, CalibrationSet::default(), |_, _| {})?;
        let toks = p.encode("What is the capital of France?", true)?;
        p.model.set_sched(SchedOptions { tail, ..Default::default() });
        let l = p.model.prefill_all_logits(&toks, 32)?;
        Ok(l.flatten_all()?.to_vec1()?)
    };
    let model = NpuDevice::host_with(Numerics::Htp);
    let hex = NpuDevice::hexagon(HtpConfig::default())?;
    let res = [
        ("model pad", run(&model, Tail::Pad)?),
        ("model margin", run(&model, Tail::Margin)?),
        ("hex pad", run(&hex, Tail::Pad)?),
        ("hex margin", run(&hex, Tail::Margin)?),
    ];
    let v = 49152;
    for (n, l) in &res {
        let rows: Vec<usize> = l.chunks(v).map(|r| (0..v).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap()).collect();
        println!("{n}: top1 {:?}", &rows[28..]);
        let last = l.chunks(v).last().unwrap();
        println!("   last row: 504 {:.3}  60 {:.3}", last[504], last[60]);
    }
    for i in 0..4 { for j in i+1..4 {
        let (a, b) = (&res[i].1, &res[j].1);
        let per_row: Vec<String> = a.chunks(v).zip(b.chunks(v)).map(|(x, y)| format!("{:.3}", x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())))).collect();
        println!("{} vs {}: max diff per row {:?}", res[i].0, res[j].0, &per_row[26..]);
    }}
    Ok(())
}
