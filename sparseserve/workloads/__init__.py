"""What benchmarks and calibration run on: long-context tasks, completion tasks, datasets and traces, and the
LongBench request mix (docs/benchmarks/serving.md)."""
