#!/usr/bin/env bash
# Prepare IWSLT'15 en-vi (Stanford NLP release) for fairseq-train: scripts/prepare_iwslt15.sh [options]
# --help lists the options; docs/data.md describes the output. Sets up .venv/ first if needed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.prepare.iwslt15 "$@"
