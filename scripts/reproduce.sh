#!/usr/bin/env bash
# Run a whole paper table (scripts/reproduce.sh TABLE [PAIR ...]; --help), resumably, then
# write results/TABLE/results.{csv,md} and the figures.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.experiments.reproduce "$@"
