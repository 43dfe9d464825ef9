#!/usr/bin/env bash
# Prepare any raw parallel corpus folder for fairseq-train: scripts/prepare_corpus.sh RAW_DIR --src SRC --tgt TGT [--tokenized]
# --help lists the options; docs/data.md describes the output. Sets up .venv/ first if needed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.prepare.corpus "$@"
