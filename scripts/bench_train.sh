#!/usr/bin/env bash
# Training throughput of stock transformer vs the plugin, flags off and per norm variant
# (see docs/speed.md). Arguments go to the Python entry point, e.g.
#   scripts/bench_train.sh --reps 5 --variants stock,off,scalenorm,dyt
# Writes results/bench_train.md (table) and results/bench_train.json (every run).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# the same allocator settings as scripts/bench_norms.sh (fewer random page faults, steadier
# numbers); they apply to every variant alike
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.bench.bench_train "$@"
