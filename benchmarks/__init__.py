"""Issue-driven experiments, run from a clone: `python -m benchmarks.NAME --help`.

They build on the package's workload library (sparseserve/bench/) and on `benchmarks.common`; none imports
another experiment. Results and commands: BENCHMARKS.md (summary) and docs/benchmarks/ (logs).
"""
