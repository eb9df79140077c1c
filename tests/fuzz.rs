//! Property tests of every reader of outside data (`tests/fuzz/props.rs` says what each checks),
//! bounded for CI: a fixed number of cases per property from a fixed seed, so a run is
//! repeatable and takes seconds. `cargo run --release --example fuzz -- --cases N` runs more.

#[path = "fuzz/props.rs"]
mod props;

use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

// The allocator that bounds a template render's memory (as the example CLIs install it).
#[global_allocator]
static ALLOC: candle_npu_models::sandbox::GuardedAlloc = candle_npu_models::sandbox::GuardedAlloc;

/// Cases per property in CI (a few seconds in all on 2 cores).
const CASES: u32 = 1000;

/// Runs `CASES` cases of a property and checks both outcomes occurred: mutations that only ever
/// fail (or never do) would test one side of the reader.
fn check<S: proptest::strategy::Strategy>(name: &str, strategy: S, case: impl Fn(S::Value, &props::Tally) -> Result<(), proptest::test_runner::TestCaseError>) {
    check_n(name, CASES, strategy, case)
}

/// [`check`] of `cases` cases.
fn check_n<S: proptest::strategy::Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    case: impl Fn(S::Value, &props::Tally) -> Result<(), proptest::test_runner::TestCaseError>,
) {
    let tally = props::Tally::default();
    runner(cases).run(&strategy, |v| case(v, &tally)).unwrap();
    let (accepted, refused) = tally.get();
    eprintln!("{name}: {accepted} accepted, {refused} refused");
    assert!(accepted > 0 && refused > 0, "{name}: {accepted} accepted, {refused} refused");
}

fn runner(cases: u32) -> TestRunner {
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]))
}

#[test]
fn mutated_gguf_files_load_or_fail_cleanly() {
    let dir = props::scratch("gguf");
    let good = props::tiny_gguf(&dir.join("good.gguf"));
    check("GGUF", props::edits(), |e, t| props::gguf_case(&dir, &good, &e, t));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mutated_profiles_are_refused_or_work() {
    let dir = props::scratch("profile");
    let (good, model) = props::profile_setup(&dir);
    let model = std::cell::RefCell::new(model);
    let json = serde_json::to_vec(&good).unwrap();
    check("profile bytes", props::edits(), |e, t| props::profile_case(&dir, &good, &mut model.borrow_mut(), &props::mutate_text(&json, &e), t));
    check("profile values", props::json_edits(), |e, t| props::profile_case(&dir, &good, &mut model.borrow_mut(), &props::edit_json(&good, &e), t));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mutated_cache_entries_are_invalid() {
    let dir = props::scratch("cache");
    // Damage never passes the checksum: a hit only where the edits rewrote the same bytes (the
    // property checks that).
    let tally = props::Tally::default();
    runner(CASES).run(&props::edits(), |e| props::cache_case(&dir, &e, false, &tally)).unwrap();
    assert!(tally.get().1 > 0, "no damaged entry was tried");
    check("cache, resealed", props::edits(), |e, t| props::cache_case(&dir, &e, true, t));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mutated_tokenizer_files_load_or_fail_cleanly() {
    let dir = props::scratch("tokenizer");
    let json = props::tiny_tokenizer_json();
    check("tokenizer.json bytes", props::edits(), |e, t| props::tokenizer_case(&dir, &props::mutate_text(&json, &e), t));
    check("tokenizer.json values", props::any_json_edits(), |e, t| props::tokenizer_case(&dir, &props::edit_any_json(&json, &e), t));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn mutated_session_files_are_refused_or_restore_a_usable_state() {
    let dir = props::scratch("session");
    let mut p = props::tiny_pipeline(&dir);
    let (good, header) = props::saved_session(&mut p, &dir.join("good.kv"));
    let p = std::cell::RefCell::new(p);
    check("saved sessions, resealed", props::edits(), |e, t| props::session_case(&mut p.borrow_mut(), &dir, &good, header, &e, t));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn random_graphs_validate_or_fail_cleanly() {
    check("graphs", props::graph_edits(), |e, t| props::graph_case(&props::edited_graph(&e), t));
}

/// Fewer cases: about one in twelve runs a template to its fuel or time bound (a second each).
const TEMPLATE_CASES: u32 = 150;

#[test]
fn mutated_and_hostile_chat_templates_render_or_fail_cleanly() {
    check_n("chat templates", TEMPLATE_CASES, props::template_edits(), |e, t| props::template_case(&props::edited_template(&e), t));
}
