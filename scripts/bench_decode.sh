#!/usr/bin/env bash
# Decoding throughput of a FixNorm model vs the same model without FixNorm at a 32k vocabulary
# (see docs/speed.md). Arguments go to the Python entry point, e.g.
#   scripts/bench_decode.sh --reps 7 --vocab 40000
# Writes results/bench_decode.md (table) and results/bench_decode.json (every run).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.bench.bench_decode "$@"
