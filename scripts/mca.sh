#!/usr/bin/env bash
# llvm-mca estimates of our aarch64 inner loops against ggml's (llama.cpp's) for the same job.
#
# Usage: scripts/mca.sh GGML_SRC OURS [MCPU]
#   GGML_SRC  a ggml source tree: the ggml repository's root, or llama.cpp's (its ggml/ is used).
#             It is compiled here into $MCA_TMP (default /tmp/mca-ggml); nothing of it is kept in
#             this repository.
#   OURS      our aarch64 build: an object, the rlib, or a test binary, e.g.
#             target/cross/aarch64-unknown-linux-gnu/release/libcandle_npu.rlib. OURS_GEMV,
#             OURS_INT8 and OURS_ROWS override it per kernel file (each branch's own build).
#   MCPU      llvm-mca's core model (default cortex-a715; in LLVM 16 it is the Neoverse N2 model,
#             see docs/aarch64.md).
# Prints one markdown row per job: cycles per unit of work, ours and ggml's, and the ratio.
# ggml is built as Android's NDK builds it: clang, -O3, armv8.2-a with dotprod, i8mm and fp16
# (no SVE: the Snapdragon 8 Gen 3's cores do not expose it). clang-16 if present, else gcc.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="${1:?usage: scripts/mca.sh GGML_SRC OURS [MCPU]}"
OURS="${2:?usage: scripts/mca.sh GGML_SRC OURS [MCPU]}"
MCPU="${3:-cortex-a715}"
[ -d "$SRC/ggml/src" ] && SRC="$SRC/ggml"
TMP="${MCA_TMP:-/tmp/mca-ggml}"
mkdir -p "$TMP"
MCA="$HERE/mca.py"

ARCH="-march=armv8.2-a+dotprod+i8mm+fp16"
if command -v clang-16 >/dev/null; then
  CC=(clang-16 --target=aarch64-linux-gnu) CXX=(clang++-16 --target=aarch64-linux-gnu)
else
  CC=(aarch64-linux-gnu-gcc) CXX=(aarch64-linux-gnu-g++)
fi
FLAGS=(-O3 "$ARCH" -DNDEBUG -D_GNU_SOURCE -I"$SRC/include" -I"$SRC/src" -I"$SRC/src/ggml-cpu")
C="$SRC/src/ggml-cpu"
build() { # out src compiler...
  local out="$TMP/$1" src="$2"; shift 2
  [ "$out" -nt "$src" ] || "$@" "${FLAGS[@]}" -c "$src" -o "$out"
}
build quants.o "$C/arch/arm/quants.c" "${CC[@]}" -std=c11
build repack.o "$C/arch/arm/repack.cpp" "${CXX[@]}" -std=c++17
build vec.o "$C/vec.cpp" "${CXX[@]}" -std=c++17
build ops.o "$C/ops.cpp" "${CXX[@]}" -std=c++17
# ggml_vec_mad_f32 and ggml_vec_scale_f32 are `inline static` in vec.h: one-line wrappers give
# them a symbol.
printf '#include "vec.h"\n__attribute__((noinline)) void mca_vec_mad_f32(int n, float *y, const float *x, float v) { ggml_vec_mad_f32(n, y, x, v); }\n__attribute__((noinline)) void mca_vec_scale_f32(int n, float *y, float v) { ggml_vec_scale_f32(n, y, v); }\n' > "$TMP/mad.c"
build mad.o "$TMP/mad.c" "${CC[@]}" -std=c11

# job | our file (GEMV, INT8, ROWS) | our symbol | our loop selection and work | unit |
#   ggml object | ggml symbol | ggml loop selection and work          ("-": no ggml counterpart)
# Work: sdot = 16 MACs (2 per 32-weight block), smmla = 32 MACs (2 per 32-weight block of one
# weight row for two input rows in our gemv), fmla = 4 MACs, smull .8h = 8 MACs
# (our NEON gemv: one smull per block, with smull2, smlal, smlal2); @st32 = f32
# values stored (a row kernel's outputs), @f32 = values loaded. Without --loop the loop with the
# most of the work measure (or of SIMD) among the innermost is taken.
# ggml's soft_max and swiglu loops are laid out rotated (the out-of-range fix-up of its expf
# first): loop 1 is the path every in-range vector takes. rms_norm's sum of squares is a scalar
# loop over doubles (fcvtl), inlined into ggml_compute_forward_rms_norm, which then scales the
# row with ggml_vec_scale_f32; ours (the portable add_rms_norm, no NEON path) is inlined into a
# rayon closure: the call_mut with an fsqrt.
JOBS=$(cat <<'EOF'
Q8_0 x Q8_0 dot (sdot)|GEMV|gemv_q8_0_dotprod|--count sdot --per 2|32-weight block|quants.o|ggml_vec_dot_q8_0_q8_0|--count sdot --per 2
Q4_1 x Q8 dot (sdot)|GEMV|gemv_q4_1_dotprod|--count sdot --per 2|32-weight block|quants.o|ggml_vec_dot_q4_1_q8_1|--count sdot --per 2
Q8_0 x Q8_0 dot, two input rows (smmla)|GEMV|gemv_q8_0_i8mm|--count smmla --per 2|32-weight block, both rows|-|-|-
Q4_1 x Q8 dot, two input rows (smmla)|GEMV|gemv_q4_1_i8mm|--count smmla --per 2|32-weight block, both rows|-|-|-
Q8_0 x Q8_0 dot (no dotprod)|GEMV|gemv_q8_0_neon|--count smull --per 1|32-weight block|-|-|-
Q4_1 x Q8 dot (no dotprod)|GEMV|gemv_q4_1_neon|--count smull --per 1|32-weight block|-|-|-
INT8 GEMM (smmla)|INT8|@INT8_SMMLA@|--count smmla --per 2|64 MACs|repack.o|ggml_gemm_q8_0_4x8_q8_0|--count smmla --per 2
INT8 GEMM (smmla), 2x2 vec_dot|INT8|@INT8_SMMLA@|--count smmla --per 2|64 MACs|quants.o|ggml_vec_dot_q8_0_q8_0|--count smmla --per 2
INT8 GEMM (sdot)|INT8|@INT8_SDOT@|--count sdot --per 4|64 MACs|quants.o|ggml_vec_dot_q8_0_q8_0|--count sdot --per 4
INT8 GEMM (no dotprod)|INT8|kernels::int8::tile_neon|--count smull --per 8|64 MACs|-|-|-
attention q.k (f32 FMA)|ROWS|attention::neon::dots|--count fmla --per 0.25|MAC|vec.o|ggml_vec_dot_f32|--count fmla --per 0.25
attention p.V (f32 FMA)|ROWS|attention::neon::strip|--count fmla --per 0.25|MAC|mad.o|mca_vec_mad_f32|--count fmla --per 0.25
softmax exp|ROWS|rows::neon::exp_shifted|--count @st32|value|vec.o|ggml_vec_soft_max_f32|--loop 1 --count @st32
SiLU(gate) x up|ROWS|rows::neon::silu_mul|--count @st32|value|vec.o|ggml_vec_swiglu_f32|--loop 1 --count @st32
GELU-tanh(gate) x up|ROWS|rows::neon::gelu_tanh_mul|--count @st32|value|-|-|-
shadow row|ROWS|rows::neon::shadow_row|--count fmla --per 0.25|MAC|-|-|-
outliers|ROWS|rows::neon::outliers|--count @f32|value|-|-|-
RMS norm: sum of squares|ROWS|core::ops::function::impls::<impl core::ops::function::FnMut<A> for &F>::call_mut|--exact --fn-has fsqrt --has fmul,fadd --count @f32|value|ops.o|ggml_compute_forward_rms_norm|--exact --has fcvtl --count @f32
RMS norm: scaling pass|ROWS|core::ops::function::impls::<impl core::ops::function::FnMut<A> for &F>::call_mut|--exact --fn-has fsqrt --has fmul --count @st32|value|mad.o|mca_vec_scale_f32|--count @st32
EOF
)
INT8_SMMLA="${INT8_SMMLA:-kernels::int8::tile_i8mm}" INT8_SDOT="${INT8_SDOT:-kernels::int8::tile_dotprod}"
JOBS="${JOBS//@INT8_SMMLA@/$INT8_SMMLA}"; JOBS="${JOBS//@INT8_SDOT@/$INT8_SDOT}"
[ -n "${MCA_JOBS:-}" ] && JOBS="$(cat "$MCA_JOBS")"

est() { # obj symbol args... -> "cycles_per_unit<TAB>rthroughput_per_unit<TAB>bottleneck" or "-<TAB>-<TAB>why"
  local obj="$1" sym="$2"; shift 2
  local out
  if out=$(python3 "$MCA" "$obj" "$sym" --mcpu "$MCPU" --json "$@" 2>&1); then
    python3 -c 'import json,sys; r=json.loads(sys.argv[1].splitlines()[-1]); print("%.3f\t%.3f\t%s" % (r["cycles_per_unit"], r["rthroughput_per_unit"], r["bottleneck"]))' "$out"
  else
    printf -- '-\t-\t%s\n' "$(echo "$out" | tail -1)"
  fi
}

echo "llvm-mca: $(llvm-mca-16 --version | grep -o 'LLVM version [0-9.]*'), -mcpu=$MCPU; ggml: ${CC[0]} $ARCH -O3"
echo
echo "| job | our symbol | ggml function | unit | ours (cycles/unit) | ggml (cycles/unit) | ours/ggml | ours/ggml, resource bound only | our bottleneck | ggml bottleneck |"
echo "|---|---|---|---|---|---|---|---|---|---|"
while IFS='|' read -r job file osym oargs unit gobj gsym gargs; do
  [ -z "$job" ] && continue
  var="OURS_$file"; obj="${!var:-$OURS}"
  # shellcheck disable=SC2086
  IFS=$'\t' read -r oc orr ob < <(est "$obj" "$osym" $oargs)
  if [ "$gobj" = "-" ]; then
    gc=- grr=- gb="no ggml counterpart"
  else
    # shellcheck disable=SC2086
    IFS=$'\t' read -r gc grr gb < <(est "$TMP/$gobj" "$gsym" $gargs)
  fi
  div() { python3 -c "import sys; a,b=sys.argv[1:]; print('%.2f' % (float(a)/float(b)) if a!='-' and b!='-' else '-')" "$1" "$2"; }
  short="${osym##*impls::}"
  echo "| $job | \`$short\` | \`$gsym\` | $unit | $oc | $gc | $(div "$oc" "$gc") | $(div "$orr" "$grr") | $ob | $gb |"
done <<< "$JOBS"
