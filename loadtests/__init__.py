"""Benchmarks and Locust files, run as modules from the repository root:
``python -m loadtests.bench_pipeline``."""
