#!/usr/bin/env bash
# Prepare WMT'14 en-de as fairseq's recipe does for fairseq-train: scripts/prepare_wmt14.sh [options]
# --help lists the options; docs/data.md describes the output. Sets up .venv/ first if needed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.prepare.wmt14 "$@"
