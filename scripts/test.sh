#!/usr/bin/env bash
# Make .venv if missing, install the project with its test extras, run the whole pytest suite.
source "$(dirname "$0")/_env.sh"
install_project "[test]"
exec "$VPY" -m pytest -q "$@"
