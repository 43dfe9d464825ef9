#!/usr/bin/env bash
# Micro-benchmark of the norm layers against torch's fused layer_norm (see docs/speed.md).
# Arguments go to the Python entry point, e.g. scripts/bench_norms.sh --reps 200 --reference
# Writes results/bench_norms.md (table) and results/bench_norms.json (raw medians).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.bench.bench_norms "$@"
