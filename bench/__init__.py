"""Benchmarks: `python -m bench.run_all [--quick]`. Not tests: pytest never collects this folder."""
