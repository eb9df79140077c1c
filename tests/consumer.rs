//! A consumer crate outside the workspace, as a candle user would write it: it depends on
//! `candle-npu` and `candle-npu-models` by path, is built with the workspace's lock file and
//! target folder (so the dependencies already built are reused), and runs from a temporary
//! folder holding only the model file, with `CANDLE_NPU_ASSETS` unset: it calibrates on the
//! shipped text, generates with streaming, and runs a two-turn session whose second turn
//! prefills only its new tokens and whose restored KV answers the same, beside a second
//! conversation on the same model; and it moves its own
//! candle-nn model's linears to the NPU with `candle_npu::nn` (tests/consumer/).


use std::path::Path;
use std::process::Command;

#[test]
fn a_crate_outside_the_workspace_uses_the_public_api() {
    let ws = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("candle-npu-consumer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let release = std::fs::read_to_string(ws.join("Cargo.toml")).unwrap();
    // The workspace's release profile, so that its built dependencies are reused.
    let profile = &release[release.find("[profile.release]").expect("release profile")..];
    let manifest = format!(
        "[package]\nname = \"npu-consumer\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\ncandle-npu = {{ path = {:?} }}\ncandle-npu-models = {{ path = {:?} }}\ncandle-core = \"0.11.1\"\ncandle-nn = \"0.11.1\"\nanyhow = \"1\"\n\n[workspace]\n\n[profile.dev.package.\"*\"]\nopt-level = 3\n\n{profile}",
        ws.join("candle-npu"),
        ws.join("models"),
    );
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::copy(ws.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    std::fs::copy(ws.join("tests/consumer/main.rs.txt"), dir.join("src/main.rs")).unwrap();
    let model = candle_npu_models::assets::smollm2();
    std::fs::copy(&model, dir.join("model.gguf")).unwrap();

    let target = ws.join("target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let build = Command::new(&cargo)
        .args(["build", "--release", "--quiet"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", &target)
        .status()
        .unwrap();
    assert!(build.success(), "the consumer crate does not build");
    let out = Command::new(target.join("release/npu-consumer"))
        .arg("model.gguf")
        .current_dir(&dir)
        .env_remove("CANDLE_NPU_ASSETS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the consumer failed");
    assert!(stdout.contains("ANSWER The capital of France is Paris."), "{stdout}");
    assert!(stdout.contains("RESTORED same answer") && stdout.contains("TWO SESSIONS"));
    // Its own candle-nn model's linears on the NPU (`candle_npu::nn`): within W8A8's error of
    // candle's CPU (0.85% of the largest output here, 1.1-1.4% on tests/nn.rs's model; 3% as there).
    let err: f32 = stdout.split("OWN MODEL relative max error ").nth(1).and_then(|s| s.split_whitespace().next()).and_then(|s| s.parse().ok()).expect("the own-model line");
    assert!(err < 3e-2, "own model on the NPU: {err}");
    assert!(dir.join("model.gguf.w8a8.json").is_file(), "the profile is saved next to the copied model");
    std::fs::remove_dir_all(&dir).unwrap();
}
