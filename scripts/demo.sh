#!/usr/bin/env bash
# The main job: a small version of the paper's main comparison on a built-in default corpus
# (synthetic, no download), trained, evaluated, tabulated and plotted. Sets up .venv/ first.
#   scripts/demo.sh [--preset tiny|small] [--corpus DIR --src L --tgt L] [--out DIR]   (--help)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.experiments.demo "$@"
