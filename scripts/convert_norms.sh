#!/usr/bin/env bash
# A trained LayerNorm Transformer converted to DyT with calibrated parameters, and what it costs
# (docs/diagnostics.md): scripts/convert_norms.sh CKPT DATA OUT --to dyt [--finetune-updates N];
# --to none: the LayerNorms removed by fine-tuning and folded away (diagnostics/remove_norms.py)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.diagnostics.convert "$@"
