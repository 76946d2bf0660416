"""Benchmarks run by tools/bench.py: one module per benchmark, each with run(quick, log) -> dict."""
