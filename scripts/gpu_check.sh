#!/usr/bin/env bash
# On a machine with CUDA GPUs: the GPU tests (tests/test_gpu.py, marked `gpu`: skipped elsewhere; the
# 2-GPU layout comparisons skip with a sentence on one GPU), then tokens/s and MFU (against the GPU's
# datasheet bf16 peak) of the real trainer on one GPU for configs/moe_bench.yaml and
# configs/moe_1b_gpu.yaml (~1B activated parameters, fits one 80 GB GPU), the latter eager and with
# train.compile=true, and their ratio. Sized for about 13 minutes on one H200 (run there with --quick on
# 2026-12-04, compile 28 s; the inductor sub-layer regions test added since is a guess of 1-2 minutes).
# Everything it writes (the tests' runs, the
# throughput runs and their final checkpoints, ~34 GB for moe_1b_gpu) goes under one scratch directory
# in TMPDIR, deleted when the script ends, however it ends.
# The moe_1b_gpu runs then take one more step under torch.profiler (debug.profile_steps, outside the
# median) and tools/plan.py --time --profile holds the step-time model's split (GEMMs, attention, the
# rest, communication, device idle) against theirs; with PROFILE_OUT=DIR their traces and summaries are
# kept there (DIR/<run>/), the only thing the script keeps. The two profiled steps (one a run: a
# trace holds every kernel and operator, ~10^5 of each a step here) and reading their traces add about a
# minute (a guess: not yet run on a GPU).
# Usage: ./scripts/gpu_check.sh [--quick] [--no-tests]   (--quick: fewer steps per throughput run;
# --no-tests: the throughput runs alone, e.g. after the tests ran under their own time limit)
source "$(dirname "$0")/_env.sh"
install_project "[test]"
START=$SECONDS
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM  # a signal ends the script through the EXIT trap as well
echo "gpu_check: writing under $WORK (deleted when this script ends)"
export DS_ACCELERATOR=cuda  # the throughput runs (the tests ask for it themselves)
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine." >&2
  exit 2
fi
"$VPY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
# the step-time model's GPU (tools/plan.py --gpu) named by the card, if it knows the card
PLAN_GPU="$("$VPY" -c "import torch; n = torch.cuda.get_device_name(0).upper(); print(next((g.lower() for g in ('H200', 'H800', 'H100', 'B200', 'A100') if g in n), ''))")"
GPUS="$("$VPY" -c "import torch; print(torch.cuda.device_count())")"
if [ "$GPUS" -lt 2 ]; then
  echo "gpu_check: one GPU here, so the ep 2 / pp 2 / pp 2 x ep 2 comparisons over NCCL skip (they need 2 or 4 GPUs)."
fi
STEPS=20; WARM=6; RUN_TESTS=1
for ARG in "$@"; do
  case "$ARG" in
    --quick) STEPS=12; WARM=4 ;;
    --no-tests) RUN_TESTS=0 ;;
    *) echo "gpu_check: unknown argument '$ARG' (valid: --quick, --no-tests)." >&2; exit 2 ;;
  esac
done
TESTS=0
if [ "$RUN_TESTS" = 1 ]; then
  set +e
  "$VPY" -m pytest -q -p no:xdist -m gpu --basetemp "$WORK/pytest" tests/test_gpu.py
  TESTS=$?
  set -e
  echo "gpu_check: tests done after $((SECONDS - START)) s (pytest exit $TESTS)"
fi
# moe_1b_gpu runs twice, eager and with train.compile=true (regional torch.compile, moe_trainer/compile.py):
# the two lines settle the GPU default of train.compile. The compiled run's first steps include the
# compilation (printed apart: its step 1 time); the median skips them with the other warm-up steps.
for RUN in configs/moe_bench.yaml:false configs/moe_1b_gpu.yaml:false configs/moe_1b_gpu.yaml:true; do
  CFG="${RUN%%:*}"; COMPILE="${RUN##*:}"
  NAME="$(basename "$CFG" .yaml)"
  if [ "$COMPILE" = "true" ]; then NAME="${NAME}_compiled"; fi
  # MFU against metrics.device_peak_tflops: the GPU's datasheet bf16 peak. The run ends with a
  # checkpoint (every run does), written into the scratch directory and deleted with it.
  # moe_1b_gpu: one more step under the profiler, left out of the median
  LAST=$STEPS; PROFILE=()
  if [ "$NAME" != moe_bench ]; then LAST=$((STEPS + 1)); PROFILE=(--set "debug.profile_steps=[$LAST,$LAST]"); fi
  "$VPY" -m moe_trainer.train --config "$CFG" --set "run.out_dir=$WORK/$NAME" --set train.dtype=bf16 \
    --set "train.max_steps=$LAST" --set train.log_every=1 --set train.eval_every=0 --set train.checkpoint_every=0 \
    --set train.resume=none --set "train.compile=$COMPILE" ${PROFILE[@]+"${PROFILE[@]}"} > "$WORK/$NAME.log" 2>&1 \
    || { tail -20 "$WORK/$NAME.log"; exit 1; }
  "$VPY" - "$WORK/$NAME/metrics.jsonl" "$WARM" "$NAME" "$STEPS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "tokens_per_s" in r and r["step"] <= int(sys.argv[4])]
first = rows[0]["step_time_s"]
rows = rows[int(sys.argv[2]):]
tps = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
print(f"{sys.argv[3]}: {tps:,.0f} tokens/s, MFU {100 * mfu:.1f}% of {rows[0]['peak_tflops']:g} TFLOP/s "
      f"(median of steps {int(sys.argv[2]) + 1}-{int(sys.argv[2]) + len(rows)}; "
      f"step {statistics.median(r['step_time_s'] for r in rows):.3f} s, first step {first:.1f} s, "
      f"peak memory {max(r['memory_gb'] for r in rows):.1f} GB)")
open(sys.argv[1].rsplit("/", 2)[0] + f"/{sys.argv[3]}.tokens_per_s", "w").write(f"{tps}\n")
PY
  if [ ${#PROFILE[@]} -gt 0 ]; then
    grep "^profile rank" "$WORK/$NAME.log" || true
    if [ -n "$PLAN_GPU" ]; then  # the model's split against the profiled steps (the run's own resolved config)
      "$VPY" tools/plan.py --config "$WORK/$NAME/config.yaml" --gpus 1 --time --gpu "$PLAN_GPU" \
        --profile "$WORK/$NAME" | sed -n '/^### Against the profile/,$p' || true
    fi
    if [ -n "${PROFILE_OUT:-}" ]; then mkdir -p "$PROFILE_OUT/$NAME" && cp "$WORK/$NAME"/profile/* "$PROFILE_OUT/$NAME/"; fi
  fi
  rm -rf "${WORK:?}/$NAME"  # its checkpoint: the next run needs the disk
done
"$VPY" - "$WORK" <<'PY'
import sys
eager, compiled = (float(open(f"{sys.argv[1]}/moe_1b_gpu{s}.tokens_per_s").read()) for s in ("", "_compiled"))
print(f"moe_1b_gpu: compiled / eager tokens/s {compiled / eager:.2f}x (train.compile's GPU default: "
      f"{'true' if compiled > eager else 'false'} by this run)")
PY
echo "gpu_check: done after $((SECONDS - START)) s"
exit $TESTS
