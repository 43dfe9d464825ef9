#!/usr/bin/env bash
# One row of an experiment table on one prepared data folder: evaluate it (scripts/evaluate.sh --help).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.experiments.single_run evaluate "$@"
