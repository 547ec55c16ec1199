"""Benchmarks: each prints baseline and candidate side by side in one run, with the ratio and the hardware."""
