#!/usr/bin/env bash
# Run the test suite (sets up .venv/ first if needed). Extra arguments go to pytest,
# e.g. scripts/test.sh -k scalenorm -x; test files or folders named on the command line
# (scripts/test.sh tests/test_norms.py tests/test_cli.py::test_norm_stats_are_logged) run
# instead of the whole of tests/ and examples/.
# The test files run in parallel, one worker more than there are cores (at most 8;
# NORMPLUG_TEST_WORKERS=N overrides, 0 = no workers): many tests wait on the commands they
# start, so on 2 cores a third worker uses the idle time (9m01s -> 8m03s for the suite). The
# quick loop (-m "not slow") starts few commands and computes throughout: there one worker per
# core is faster (on 2 cores, side by side: 3m15s and 3m11s with 2 workers, 3m29s with 3). Each
# file's tests run on one worker (pytest-xdist --dist loadfile, so a module's fixtures are
# built once), with the cores shared out among the workers (OMP_NUM_THREADS = cores / workers,
# at least 1, unless set).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
CORES=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
# the quick loop (-m "not slow") takes one worker per core, the suite one more (above); what
# runs: tests/ and examples/, unless arguments name files or folders (a node id by its file);
# files only: at most one worker per file (a file's tests share one worker)
EXTRA_WORKER=1 TARGETS=(tests examples) NAMED_FILES=() NAMED_FOLDER=0
for arg in "$@"; do
  if [ "$arg" = "not slow" ] || [ "$arg" = "-mnot slow" ]; then EXTRA_WORKER=0; fi
  case "$arg" in -*) continue ;; esac
  path=${arg%%::*}
  if [ -d "$path" ]; then NAMED_FOLDER=1; elif [ -e "$path" ]; then NAMED_FILES+=("$path"); else continue; fi
  TARGETS=()
done
WORKERS=${NORMPLUG_TEST_WORKERS:-$(( CORES + EXTRA_WORKER < 8 ? CORES + EXTRA_WORKER : 8 ))}
if [ -z "${NORMPLUG_TEST_WORKERS:-}" ] && [ "$NAMED_FOLDER" = 0 ] && [ "${#NAMED_FILES[@]}" -gt 0 ]; then
  FILES=$(printf '%s\n' "${NAMED_FILES[@]}" | sort -u | wc -l)
  WORKERS=$(( FILES < WORKERS ? FILES : WORKERS ))
fi
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then
  # in pytest-xdist's order (files with the most tests first): starting the longest files first
  # (--no-loadscope-reorder) was measured slower, 10 min 32 s against 8 min 01 s, as their real
  # processes then all compete at once (docs/setup.md)
  PARALLEL=(-n "$WORKERS" --dist loadfile)
  # the cores shared out: two 2-thread trainings on 2 cores would each run slower than alone
  THREADS=$(( CORES / WORKERS > 0 ? CORES / WORKERS : 1 ))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS} MKL_NUM_THREADS=${MKL_NUM_THREADS:-$THREADS}
fi
# Python's bytecode cache on, even where the environment turns it off (PYTHONDONTWRITEBYTECODE):
# every fairseq-train a test starts imports the plugin, 1.3 s of compiling each time without
# its cache, and each worker's collection takes twice as long (pytest keeps its rewritten test
# modules there too); __pycache__/ is ignored by git
unset PYTHONDONTWRITEBYTECODE
exec "${NORMPLUG_VENV:-$ROOT/.venv}/bin/python" -m pytest ${TARGETS[@]+"${TARGETS[@]}"} ${PARALLEL[@]+"${PARALLEL[@]}"} "$@"
