#!/usr/bin/env bash
# The trainer's own speed on CPU ranks: this checkout against an older commit, the same jobs through
# the real command line, alone, in alternating rounds (moe_trainer/bench/codes.py).
# Usage: BEFORE=028a211 scripts/bench_codes.sh [--jobs e2e,ep2] [--steps 10] [--rounds 3] [--json PATH]
#        [--code-set after=parallel.overlap=a2a]   (an extra --set for one tree only, repeatable)
# Makes .venv if missing and installs the project, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test]"
: "${BEFORE:?set BEFORE=<commit>, the baseline}"
OLD="$(mktemp -d)/before"
mkdir -p "$OLD" && git archive "$BEFORE" | tar -x -C "$OLD"
exec "$VPY" -m moe_trainer.bench.codes --code "$BEFORE=$OLD" --code "after=$ROOT" "$@"
