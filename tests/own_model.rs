//! `examples/own_model.rs` (a candle-nn transformer whose linears move to the NPU) runs and stays
//! within 3% of candle's CPU on each executor; the example checks the figure itself.

mod common;

fn run(executor: &str, rows: &str) -> String {
    let out = std::process::Command::new(common::example("own_model")).args(["--executor", executor, "--rows", rows]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{executor}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn the_own_model_example_runs_on_each_executor() {
    for (executor, name) in [("host", "| host |"), ("htp-model", "| host (HTP numerics) |")] {
        for rows in ["1", "300"] {
            assert!(run(executor, rows).contains(name));
        }
    }
    if common::library_present() {
        assert!(run("hexagon", "70").contains("| htp | 70 |"));
    }
}
