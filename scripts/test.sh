#!/usr/bin/env bash
# Make .venv if missing, install the project with its test extras, lint (ruff, the rules in
# pyproject.toml), then run the whole pytest suite.
# Two pytest workers, each taking whole test files (module fixtures are built once): a test
# of one rank or a launcher's start-up keeps one core busy, and the other worker fills the
# second; files go out in collection order (--no-loadscope-reorder: xdist would otherwise hand out the
# files with the most tests first, leaving a one-test file of minutes, the fault drill, to the end, alone;
# tests/conftest.py collects the heaviest files first). TEST_WORKERS=0 runs everything in this one process.
source "$(dirname "$0")/_env.sh"
install_project "[test]"
echo "ruff check (pyproject.toml [tool.ruff])"
"$VPY" -m ruff check --no-cache "$ROOT"
WORKERS="${TEST_WORKERS:-2}"
if [ "$WORKERS" = "0" ]; then exec "$VPY" -m pytest -q "$@"; fi
exec "$VPY" -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
