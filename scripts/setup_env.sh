#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv/ with torch, fairseq and this plugin
# (editable). Idempotent: a second run with the same settings returns at once. Called by
# scripts/demo.sh, scripts/test.sh and the other scripts; safe to run by hand.
#
# Which torch (fairseq_normplug/install_plan.py decides; the log says which and why):
#   * no NVIDIA driver (nvidia-smi / /proc/driver/nvidia): a CPU build, from
#     https://download.pytorch.org/whl/cpu, or from the default index where only that one is
#     reachable and serves a CPU build; set-up stops (one line) rather than download a CUDA build;
#   * an NVIDIA driver: the default index's build (on Linux x86_64 a CUDA build).
#
#   NORMPLUG_TORCH        torch requirement (default: torch==2.13.0)
#   NORMPLUG_TORCH_INDEX  --index-url for torch, used as given (e.g.
#                         https://download.pytorch.org/whl/cu126); skips the detection
#   NORMPLUG_CUDA         1 or 0: take the NVIDIA-driver probe's answer as given
#   NORMPLUG_VENV         where the environment lives (default: <repo>/.venv)
#   NORMPLUG_SETUP        0: install nothing, use NORMPLUG_VENV as it is (an environment you
#                         manage yourself; the test suite sets it for the scripts it runs)
#   PYTHON                interpreter used to create it (default: python3)
#
# fairseq's own requirements name torchaudio, which pins (and would silently replace) torch;
# fairseq is therefore built with --no-deps; its real runtime requirements come with the
# plugin (pyproject.toml), all installed under a constraint that keeps torch fixed.
#
# Any failed step stops set-up with a line naming it (set -e and the ERR trap; no check runs
# inside another command's arguments, where set -e would not see it fail). The "done" stamp
# is removed first and written last, after every check has passed, so a failed or
# interrupted set-up is never skipped by the next run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${NORMPLUG_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
PLAN_PY="$ROOT/fairseq_normplug/install_plan.py"

log() { echo "[setup_env] $*" >&2; }

if [ "${NORMPLUG_SETUP:-1}" = 0 ]; then
  [ -x "$VENV/bin/python" ] && exit 0
  log "NORMPLUG_SETUP=0 uses the environment as it is, but $VENV/bin/python does not exist; set NORMPLUG_VENV"
  exit 1
fi

stamp="$VENV/.normplug-setup"
sources=$(cat "$ROOT/pyproject.toml" "$PLAN_PY" "$ROOT/scripts/setup_env.sh" | cksum)
settings="${NORMPLUG_TORCH:-}|${NORMPLUG_TORCH_INDEX:-}|${NORMPLUG_CUDA:-}|$sources"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$settings" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

trap 'log "FAILED (exit status $?): $BASH_COMMAND; set-up is not recorded as done, the next run starts again"' ERR
rm -f "$stamp"

plan=$("$PYTHON" "$PLAN_PY" torch)
{ read -r TORCH_SPEC; read -r TORCH_INDEX; read -r TORCH_EXPECT; read -r TORCH_REASON; } <<< "$plan"
log "preparing $VENV; torch: $TORCH_SPEC ($TORCH_REASON)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel
# numpy before torch: torch imported without it warns "Failed to initialize NumPy" at each check
"${PIP[@]}" install -q numpy cython

torch_args=("$TORCH_SPEC")
if [ -n "$TORCH_INDEX" ]; then torch_args+=(--index-url "$TORCH_INDEX"); fi
if [ "$TORCH_EXPECT" = cpu ] && [ -z "$TORCH_INDEX" ]; then
  # the default index: look before downloading (a CUDA build is gigabytes)
  report="$VENV/normplug-torch-report.json"
  "${PIP[@]}" install -q --dry-run --report "$report" "${torch_args[@]}"
  "$VENV/bin/python" "$PLAN_PY" check-report "$report"
fi
"${PIP[@]}" install -q "${torch_args[@]}"
torch_line=$("$VENV/bin/python" "$PLAN_PY" check-installed "$TORCH_EXPECT")
log "$torch_line"
# Every later install must keep exactly the torch that is now there.
torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
constraints="$VENV/normplug-constraints.txt"
echo "torch==$torch_version" > "$constraints"
PIPC=("${PIP[@]}" install -q -c "$constraints")

fairseq_req=$("$VENV/bin/python" "$PLAN_PY" fairseq)
if ! "$VENV/bin/python" -c 'import fairseq' >/dev/null 2>&1; then
  log "building $fairseq_req (compiles C++/Cython extensions: a few minutes, once)"
  "${PIPC[@]}" --no-build-isolation --no-deps "$fairseq_req"
fi
# the plugin with its requirements (fairseq's runtime ones, tensorboardX, ...; pyproject.toml), the
# test tools and the optional CTranslate2 export (extras test, export), so every test runs
# pip's resolver reports fairseq's torchaudio requirement, left out on purpose (above), as an
# "ERROR" the user can do nothing about: that one report is not shown, all else pip says is;
# setuptools' note on editable installs is silenced (PYTHONWARNINGS reaches the build backend)
plugin_log="$VENV/normplug-plugin-install.log"
status=0
PYTHONWARNINGS=ignore "${PIPC[@]}" --no-build-isolation -e "$ROOT[test,export]" 2> "$plugin_log" || status=$?
grep -v -e "requires torchaudio" -e "^ERROR: pip's dependency resolver does not currently take into account" \
  "$plugin_log" >&2 || true
if [ "$status" != 0 ]; then
  log "FAILED (exit status $status): pip install -e $ROOT[test,export]; set-up is not recorded as done, the next run starts again"
  exit "$status"
fi
"$VENV/bin/python" -c 'import fairseq_normplug'
# the native CPU norm kernels (fairseq_normplug/modules/native.py), built here once per machine and
# torch (10-25 s) rather than in the first training or test; where they cannot be built, the
# plugin's one-line warning says why and set-up goes on, as training does: the other fast paths
# take over (NORMPLUG_NATIVE=0: not built)
log "building the native CPU norm kernels (once per machine and torch, 10-25 s)"
"$VENV/bin/python" -c 'from fairseq_normplug.modules import native; native.enabled() and native.ops()' \
  || log "the native CPU norm kernels were not built (above): training falls back to the other fast paths"
echo "$settings" > "$stamp"
log "ready: $VENV"
