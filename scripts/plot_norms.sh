#!/usr/bin/env bash
# What every norm of a trained model does on real data: S-curves, scale vs input std, DyT
# saturation, attention logits and entropy (docs/diagnostics.md): scripts/plot_norms.sh CKPT DATA OUT_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m fairseq_normplug.diagnostics.plot_norms "$@"
