#!/usr/bin/env bash
# On a machine with CUDA GPUs: the GPU tests (tests/test_gpu.py, marked `gpu`: skipped elsewhere),
# then tokens/s and MFU (against the GPU's datasheet bf16 peak) of the real trainer on one GPU for
# configs/moe_bench.yaml and configs/moe_1b_gpu.yaml (~1B activated parameters, fits one 80 GB GPU).
# Usage: ./scripts/gpu_check.sh [--quick]   (--quick: fewer steps per throughput run)
source "$(dirname "$0")/_env.sh"
install_project "[test]"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA GPU (torch.cuda.is_available() is False); run it on a GPU machine." >&2
  exit 2
fi
"$VPY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
set +e
"$VPY" -m pytest -q -p no:xdist -m gpu tests/test_gpu.py
TESTS=$?
set -e
STEPS=30; WARM=10
if [ "${1:-}" = "--quick" ]; then STEPS=12; WARM=4; fi
OUT="$(mktemp -d)"
for CFG in configs/moe_bench.yaml configs/moe_1b_gpu.yaml; do
  NAME="$(basename "$CFG" .yaml)"
  # MFU against metrics.device_peak_tflops: the GPU's datasheet bf16 peak
  "$VPY" -m moe_trainer.train --config "$CFG" --set "run.out_dir=$OUT/$NAME" --set train.dtype=bf16 \
    --set "train.max_steps=$STEPS" --set train.log_every=1 --set train.eval_every=0 --set train.checkpoint_every=0 \
    --set train.resume=none > "$OUT/$NAME.log" 2>&1 || { tail -20 "$OUT/$NAME.log"; exit 1; }
  "$VPY" - "$OUT/$NAME/metrics.jsonl" "$WARM" "$NAME" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "tokens_per_s" in r][int(sys.argv[2]):]
tps = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
print(f"{sys.argv[3]}: {tps:,.0f} tokens/s, MFU {100 * mfu:.1f}% of {rows[0]['peak_tflops']:g} TFLOP/s "
      f"(median of steps {int(sys.argv[2]) + 1}-{int(sys.argv[2]) + len(rows)}; "
      f"step {statistics.median(r['step_time_s'] for r in rows):.3f} s, peak memory {max(r['memory_gb'] for r in rows):.1f} GB)")
PY
done
exit $TESTS
