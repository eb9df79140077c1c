#!/usr/bin/env bash
# The phone's CPU side, built and tested on this x86_64 machine: the workspace cross-built for
# aarch64-unknown-linux-gnu with Debian's rustc and gcc, run under qemu-user (docs/android.md).
#
#   bash scripts/aarch64.sh            # everything below (CI runs it after the x86_64 tests)
#   bash scripts/aarch64.sh tests      # only the tests of the three crates on the two CPUs
#
# 1. Installs Debian's cross toolchain when missing (apt, as root).
# 2. Builds every test target and example of the workspace for aarch64.
# 3. Runs every test of candle-npu, candle-npu-models and qnn-sys (unit, integration, doc) on two
#    emulated CPUs: cortex-a53 (NEON only: the plain NEON paths) and max (dotprod, i8mm, fp16:
#    the default paths of a Snapdragon 8 Gen 1 and later). No QNN library for aarch64 exists
#    here (set-up's is the x86_64 emulator): the tests that need one skip, saying so. The root
#    package's tests (real models end to end, minutes natively) are left to step 4.
# 4. One greedy SmolLM2 generation under qemu (max), checked token for token and logit for logit
#    against the x86_64 build's (examples/cross_check.rs); the profile is calibrated natively.
# 5. Type-checks the workspace for aarch64-linux-android (std built from Debian's rust-web-src;
#    no NDK exists here, so C code of build scripts is compiled by the Linux cross gcc: the check
#    covers the Rust side only, nothing is linked).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"

packages=(rustc-web libstd-rust-web-dev:arm64 rust-web-src gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6:arm64 qemu-user-static)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    echo "[aarch64] installing ${packages[*]}"
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

if [[ $what == all ]]; then
    echo "[aarch64] building the workspace's tests and examples"
    cargo test --release --target $target --workspace --no-run
fi

for cpu in cortex-a53 max; do
    echo "[aarch64] tests on qemu's $cpu"
    CANDLE_NPU_QNN_LIB_DIR="$no_qnn" QEMU_CPU=$cpu cargo test --release --target $target "${crates[@]}"
done
[[ $what == tests ]] && exit 0

echo "[aarch64] SmolLM2 under qemu against the x86_64 build"
record="$CARGO_TARGET_DIR/cross_check.x86_64.json"
(unset RUSTC RUSTDOC CARGO_TARGET_DIR; cargo run --release --example cross_check -- --record "$record")
QEMU_CPU=max cargo run --release --target $target --example cross_check -- --check "$record"

echo "[aarch64] type-checking the workspace for aarch64-linux-android"
CC_aarch64_linux_android=aarch64-linux-gnu-gcc AR_aarch64_linux_android=aarch64-linux-gnu-ar RUSTC_BOOTSTRAP=1 \
    cargo check --release -Zbuild-std=std,panic_abort --target aarch64-linux-android --workspace --lib --examples
