#!/usr/bin/env bash
# One entry point, two jobs. Creates .venv and installs on first use.
#   bash run.sh demo [args]   the two-node example under load, with a report (python -m examples.two_node demo)
#   bash run.sh test [args]   the test suite (what CI runs), on two workers (TEST_WORKERS to change)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[test,nixl]'
    touch .venv/.installed
fi
job=${1:-}
shift || true
case "$job" in
    demo) exec .venv/bin/python -m examples.two_node demo "$@" ;;
    # two workers (pytest-xdist), a test file per worker at a time: the suite is CPU-bound and most
    # of its time is node processes starting; TEST_WORKERS=0 runs it in this one process
    test) exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@" ;;
    *) echo "usage: bash run.sh demo|test [args]" >&2; exit 2 ;;
esac
