#!/usr/bin/env bash
# Run the test suite (sets up .venv/ first if needed). Extra arguments go to pytest,
# e.g. scripts/test.sh -k scalenorm -x
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m pytest tests "$@"
