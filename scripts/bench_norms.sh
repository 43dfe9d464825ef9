#!/usr/bin/env bash
# Micro-benchmark of the norm layers against torch's fused layer_norm (see docs/speed.md).
# Arguments go to the Python entry point, e.g. scripts/bench_norms.sh --reps 200 --reference
# Writes results/bench_norms.md (table) and results/bench_norms.json (raw medians).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# glibc returns freed memory to the kernel and page-faults it back on the next allocation
# (8 MB tensors: hundreds of faults, randomly); keep it mapped so the numbers measure the
# kernels, not the allocator. Override by setting these variables yourself.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-4294967296}
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-68719476736}
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.bench.bench_norms "$@"
