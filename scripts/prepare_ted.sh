#!/usr/bin/env bash
# Prepare a TED language pair of Qi et al. (2018) for fairseq-train: scripts/prepare_ted.sh SRC TGT [options]
# --help lists the options; docs/data.md describes the output. Sets up .venv/ first if needed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.prepare.ted "$@"
