"""The benchmarks: one module per question, each run from the repository root as `python -m benchmarks.NAME`
(`--help` for its options), over one common module for building the models and timing them. BENCHMARKS.md
holds every figure with its command."""
