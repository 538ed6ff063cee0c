#!/usr/bin/env bash
# Kill a random rank of a short training job several times, restart it with
# resume=auto, and print the steps lost and the time to recover each time.
source "$(dirname "$0")/_env.sh"
install_project ""
exec "$VPY" -m moe_trainer.fault_drill "$@"
