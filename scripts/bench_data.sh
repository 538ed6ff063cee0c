#!/usr/bin/env bash
# Data preparation throughput: tools/prepare_data.py --workers N against the tokenizer's own batch encode
# on the same texts (the limit) and Hugging Face datasets' map(num_proc=N), with each process tree's peak
# memory. Prints a markdown table (see docs/BENCHMARKS_data.md).
# Usage: scripts/bench_data.sh [--mb 500] [--workers 2] [--dir DIR] [--hf-path DIR_WITH_DATASETS]
#        [--megatron-path MEGATRON_LM_CHECKOUT [--megatron-pythonpath DIRS]]   (its tools/preprocess_data.py, same BPE)
# The start-time benchmark: .venv/bin/python -m moe_trainer.data.bench_start [--sizes-gb 1 100] [--rounds 3]
# Makes .venv if missing and installs the project with its test and data extras, as train.sh and test.sh do.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
install_project "[test,data]"
exec .venv/bin/python -m moe_trainer.data.bench "$@"
