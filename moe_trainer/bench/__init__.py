"""Benchmarks, apart from the trainer they measure.

Each module is a command (`python -m moe_trainer.bench.<name>`, or the `scripts/bench_<name>.sh`
that users type): `moe` one MoE layer against DeepSpeed's and transformers', `ep` expert
parallelism against DeepSpeed AutoEP, `train` end to end against transformers + DeepSpeed, `pp`
the pipeline bubble, activation memory and recomputation (the in-process parts in `pp_memory`),
`layouts` MoE against dense layouts, `collectives` nccl-tests-style bandwidth
(`tools/bench_collectives.py`). `turns` is the driver that lets jobs take turns one optimizer
step at a time; `headline` runs each job alone in alternating rounds (the headline figures),
`bench_all` runs the headline set and rewrites docs/BENCHMARKS.md.
"""
