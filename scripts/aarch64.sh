#!/usr/bin/env bash
# The phone's CPU side, built and tested on this x86_64 machine: the crates cross-built for
# aarch64-unknown-linux-gnu with Debian's rustc and gcc, run under qemu-user (docs/android.md).
#
#   bash scripts/aarch64.sh            # everything below (CI runs it after the x86_64 tests)
#   bash scripts/aarch64.sh tests      # only the tests of the three crates on the two CPUs
#
# 1. Installs Debian's cross toolchain when missing (apt, as root).
# 2. Builds the tests and examples of candle-npu, candle-npu-models and qnn-sys for aarch64: one
#    build, which steps 3 and 4 run. (The examples package's 27 tests and 20 examples are not
#    built for aarch64: that was 23 of CI's 90 minutes, and step 5 type-checks them.)
# 3. Runs every test of the three crates (unit, integration, doc) on two emulated CPUs:
#    cortex-a53 (NEON only: the plain NEON paths) and max (dotprod, i8mm, fp16: the default
#    paths of a Snapdragon 8 Gen 1 and later). No QNN library for aarch64 exists here (set-up's
#    is the x86_64 emulator): the tests that need one skip, saying so. The examples package's
#    tests (real models end to end, minutes natively) are left to step 4.
# 4. One greedy SmolLM2 generation under qemu (max), checked token for token and logit for logit
#    against the x86_64 build's (models/examples/cross_check.rs); the profile is calibrated
#    natively. Both binaries are run as built: the x86_64 one by `cargo test --workspace` (CI's
#    step before this one; a no-op there), the aarch64 one by step 2.
# 5. Type-checks the workspace (every package's lib, tests and examples) for
#    aarch64-linux-android (std built from Debian's rust-web-src; no NDK exists here, so C code of
#    build scripts is compiled by the Linux cross gcc: the check covers the Rust side only,
#    nothing is linked).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"

packages=(rustc-web libstd-rust-web-dev:arm64 rust-web-src gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6:arm64 qemu-user-static)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    echo "[aarch64] installing ${packages[*]} (at ${SECONDS}s)"
    dpkg --add-architecture arm64
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
fi

# Debian's rustc (1.96) has the aarch64 std; rustup's (x86_64 only) does not. Its own target dir:
# the two compilers' artifacts do not mix. Linker and runner: .cargo/config.toml (qemu without -L:
# with the cross toolchain's prefix every pthread_create hangs).
export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc CARGO_TARGET_DIR="$PWD/target/aarch64"
target=aarch64-unknown-linux-gnu
crates=(-p candle-npu -p candle-npu-models -p qnn-sys)
no_qnn="$CARGO_TARGET_DIR/no-qnn-library"
mkdir -p "$no_qnn"

echo "[aarch64] building the three crates' tests and examples (at ${SECONDS}s)"
cargo test --release --target $target "${crates[@]}" --no-run

for cpu in cortex-a53 max; do
    echo "[aarch64] tests on qemu's $cpu (at ${SECONDS}s)"
    CANDLE_NPU_QNN_LIB_DIR="$no_qnn" QEMU_CPU=$cpu cargo test --release --target $target "${crates[@]}"
done
[[ $what == tests ]] && exit 0

echo "[aarch64] SmolLM2 under qemu against the x86_64 build (at ${SECONDS}s)"
record="$CARGO_TARGET_DIR/cross_check.x86_64.json"
(unset RUSTC RUSTDOC CARGO_TARGET_DIR; cargo test --release --workspace --no-run)
# Outside cargo, the checkout's assets are named here (.cargo/config.toml does it for cargo).
export CANDLE_NPU_ASSETS="${CANDLE_NPU_ASSETS:-$PWD/assets}"
target/release/examples/cross_check --record "$record"
QEMU_CPU=max qemu-aarch64-static "$CARGO_TARGET_DIR/$target/release/examples/cross_check" --check "$record"

echo "[aarch64] type-checking the workspace for aarch64-linux-android (at ${SECONDS}s)"
CC_aarch64_linux_android=aarch64-linux-gnu-gcc AR_aarch64_linux_android=aarch64-linux-gnu-ar RUSTC_BOOTSTRAP=1 \
    cargo check --release -Zbuild-std=std,panic_abort --target aarch64-linux-android --workspace --lib --examples --tests
echo "[aarch64] done (at ${SECONDS}s)"
