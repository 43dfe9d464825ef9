#!/usr/bin/env bash
# Training throughput of stock transformer vs the plugin, flags off and per norm variant
# (see docs/speed.md). Arguments go to the Python entry point, e.g.
#   scripts/bench_train.sh --reps 5 --variants stock,off,scalenorm,dyt
# Writes results/bench_train.md (table) and results/bench_train.json (every run).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.bench.bench_train "$@"
