"""Benchmarks (scripts/bench_*.sh): measured side by side, reported as ratios with their spread."""
