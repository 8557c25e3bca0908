"""Benchmarks with same-run baselines (``kvconnect bench …``); never timed tests."""
