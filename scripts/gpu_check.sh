#!/usr/bin/env bash
# GPU acceptance run: fast paths vs reference (fp32/bf16/fp16), 200 fp16/bf16 updates of the
# paper's rows at d=512 6+6, fairseq-generate --fp16 of a FixNorm model, GPU benchmarks; at
# most 8 minutes on one GPU (see docs/gpu_check.md). Arguments go to the Python entry point,
# e.g. scripts/gpu_check.sh --budget-s 400; --device cpu is the (toy-sized) CPU test mode.
# Writes results/gpu_check.md and results/gpu_check.json; exit status 0 = every check passed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.bench.gpu_check "$@"
