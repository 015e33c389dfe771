"""Benchmark commands (`make bench-*`): ratios measured side by side in one run and printed."""
