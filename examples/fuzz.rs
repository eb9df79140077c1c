//! The fuzz properties of `tests/fuzz.rs` (see `tests/fuzz/props.rs`) with as many cases as
//! asked for, from a random seed, outside CI; prints the cases each property ran and how they
//! ended. A failure prints the (shrunk) input and exits non-zero.
//!
//! ```text
//! cargo run --release --example fuzz -- --cases 100000
//! ```
#[path = "../tests/fuzz/props.rs"]
mod props;

use clap::Parser;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

#[derive(Parser)]
struct Args {
    /// Cases per property.
    #[arg(long, default_value_t = 10_000)]
    cases: u32,
}

fn run<S: Strategy>(name: &str, cases: u32, strategy: S, case: impl Fn(S::Value, &props::Tally) -> Result<(), TestCaseError>) -> anyhow::Result<()> {
    let t = std::time::Instant::now();
    let tally = props::Tally::default();
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    runner.run(&strategy, |v| case(v, &tally)).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    let (accepted, refused) = tally.get();
    println!("| {name} | {cases} | {accepted} | {refused} | {:.1} |", t.elapsed().as_secs_f64());
    Ok(())
}

// The allocator that bounds a template render's memory (as the example CLIs install it).
#[global_allocator]
static ALLOC: candle_npu_models::sandbox::GuardedAlloc = candle_npu_models::sandbox::GuardedAlloc;

fn main() -> anyhow::Result<()> {
    let n = Args::parse().cases;
    println!("| property | cases | accepted | refused | seconds |\n|---|---|---|---|---|");
    let dir = props::scratch("example");
    let good = props::tiny_gguf(&dir.join("good.gguf"));
    run("GGUF bytes", n, props::edits(), |e, t| props::gguf_case(&dir, &good, &e, t))?;
    let (profile, model) = props::profile_setup(&dir);
    let model = std::cell::RefCell::new(model);
    let json = serde_json::to_vec(&profile)?;
    run("profile bytes", n, props::edits(), |e, t| props::profile_case(&dir, &profile, &mut model.borrow_mut(), &props::mutate_text(&json, &e), t))?;
    run("profile values", n, props::json_edits(), |e, t| props::profile_case(&dir, &profile, &mut model.borrow_mut(), &props::edit_json(&profile, &e), t))?;
    run("cache entry bytes", n, props::edits(), |e, t| props::cache_case(&dir, &e, false, t))?;
    run("cache entry bytes, resealed", n, props::edits(), |e, t| props::cache_case(&dir, &e, true, t))?;
    let json = props::tiny_tokenizer_json();
    run("tokenizer.json bytes", n, props::edits(), |e, t| props::tokenizer_case(&dir, &props::mutate_text(&json, &e), t))?;
    run("tokenizer.json values", n, props::any_json_edits(), |e, t| props::tokenizer_case(&dir, &props::edit_any_json(&json, &e), t))?;
    let mut p = props::tiny_pipeline(&dir);
    let (good, header) = props::saved_session(&mut p, &dir.join("good.kv"));
    let p = std::cell::RefCell::new(p);
    run("saved sessions, resealed", n, props::edits(), |e, t| props::session_case(&mut p.borrow_mut(), &dir, &good, header, &e, t))?;
    run("graphs", n, props::graph_edits(), |e, t| props::graph_case(&props::edited_graph(&e), t))?;
    run("chat templates", n, props::template_edits(), |e, t| props::template_case(&props::edited_template(&e), t))?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
