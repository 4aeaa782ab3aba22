"""Benchmark harnesses: each prints a table, writes JSON and PNG plots, and compares in-run."""
