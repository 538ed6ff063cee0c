#!/usr/bin/env bash
# copies' gradients per micro-batch (old, 13c134f) against once a step (new, working tree): alternating
ARGS="--rounds 1 --steps 24 --every 8 --skew 1.5 --topk 1 --redundant 1 --set model.moe_intermediate_size=512"
for i in 1 2 3; do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for t in $order; do
    dir=/tmp/wt_old; [ $t = new ] && dir=/work/main
    echo "== round $i $t $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $dir && /work/main/.venv/bin/python -m moe_trainer.bench.replace $ARGS --out /tmp/bench_${t}_$i.json 2>&1 | tail -12)
  done
done
