//! A candle user's program (examples/consumer.rs) run from a temporary folder holding only the
//! model file, with `CANDLE_NPU_ASSETS` unset: it calibrates on the shipped text, generates with
//! streaming, and runs a two-turn session whose second turn prefills only its new tokens and
//! whose restored KV answers the same, beside a second conversation on the same model; and it
//! moves its own candle-nn model's linears to the NPU with `candle_npu::nn`.
//!
//! It was once built as a crate of its own outside the workspace. Its features unify apart from
//! the workspace's, so that rebuilt candle and both crates: five of CI's ninety minutes to show
//! what an example shows as well, since an example, too, sees only the public API.

mod common;

use std::process::Command;

#[test]
fn a_program_of_a_candle_user_uses_the_public_api() {
    let dir = std::env::temp_dir().join(format!("candle-npu-consumer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(candle_npu_models::assets::smollm2(), dir.join("model.gguf")).unwrap();
    let out = Command::new(common::example("consumer")).arg("model.gguf").current_dir(&dir).env_remove("CANDLE_NPU_ASSETS").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the consumer failed");
    assert!(stdout.contains("ANSWER The capital of France is Paris."), "{stdout}");
    assert!(stdout.contains("RESTORED same answer") && stdout.contains("TWO SESSIONS"));
    // Its own candle-nn model's linears on the NPU (`candle_npu::nn`): within W8A8's error of
    // candle's CPU (0.85% of the largest output here, 1.1-1.4% on tests/nn.rs's model; 3% as there).
    let err: f32 = stdout
        .split("OWN MODEL relative max error ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .expect("the own-model line");
    assert!(err < 3e-2, "own model on the NPU: {err}");
    assert!(dir.join("model.gguf.w8a8.json").is_file(), "the profile is saved next to the copied model");
    std::fs::remove_dir_all(&dir).unwrap();
}
