#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv/ with fairseq, a CPU build of torch and
# this plugin installed in editable mode. Idempotent: a second run with the same settings
# returns at once. Called by scripts/demo.sh and scripts/test.sh; safe to run by hand.
#
#   NORMPLUG_TORCH        torch requirement to install (default: torch==2.13.0, a CPU build
#                         where this machine has it). GPU users: e.g. NORMPLUG_TORCH=torch==2.6.0
#   NORMPLUG_TORCH_INDEX  optional --index-url for torch, e.g.
#                         https://download.pytorch.org/whl/cu124
#   NORMPLUG_VENV         where the environment lives (default: <repo>/.venv)
#   PYTHON                interpreter used to create it (default: python3)
#
# fairseq's own requirements name torchaudio, which pins (and would silently replace) torch
# with a multi-GB CUDA build; fairseq is therefore installed with --no-deps and its real
# runtime requirements are listed below, all under a constraint that keeps torch fixed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${NORMPLUG_VENV:-$ROOT/.venv}
TORCH_SPEC=${NORMPLUG_TORCH:-torch==2.13.0}
TORCH_INDEX=${NORMPLUG_TORCH_INDEX:-}
PYTHON=${PYTHON:-python3}

stamp="$VENV/.normplug-setup"
want="$TORCH_SPEC|$TORCH_INDEX|$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | cksum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

log() { echo "[setup_env] $*" >&2; }
log "preparing $VENV (torch: $TORCH_SPEC)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel

torch_args=("$TORCH_SPEC")
[ -n "$TORCH_INDEX" ] && torch_args+=(--index-url "$TORCH_INDEX")
"${PIP[@]}" install -q "${torch_args[@]}"
# Every later install must keep exactly the torch that is now there.
torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
constraints="$VENV/normplug-constraints.txt"
echo "torch==$torch_version" > "$constraints"
PIPC=("${PIP[@]}" install -q -c "$constraints")

"${PIPC[@]}" numpy cython
py_minor=$("$VENV/bin/python" -c 'import sys; print(sys.version_info[1])')
if [ "$py_minor" -ge 11 ]; then
  fairseq_req="fairseq-fixed==0.12.3.1"
  fairseq_deps=(cffi "hydra-core==1.3.2" "omegaconf==2.3.0" regex tqdm bitarray scikit-learn packaging)
else
  fairseq_req="fairseq==0.12.2"
  fairseq_deps=(cffi "hydra-core>=1.0.7,<1.1" "omegaconf<2.1" "numpy<1.24" regex tqdm bitarray scikit-learn packaging)
fi
if ! "$VENV/bin/python" -c 'import fairseq' >/dev/null 2>&1; then
  log "building $fairseq_req (compiles C++/Cython extensions: a few minutes, once)"
  "${PIPC[@]}" --no-build-isolation --no-deps "$fairseq_req"
fi
"${PIPC[@]}" "${fairseq_deps[@]}" "sacrebleu>=2.0" sentencepiece subword-nmt sacremoses matplotlib "pytest>=7"
"${PIPC[@]}" --no-deps --no-build-isolation -e "$ROOT"
"$VENV/bin/python" -c 'import fairseq_normplug' || { log "plugin import failed"; exit 1; }
echo "$want" > "$stamp"
log "ready: $VENV"
