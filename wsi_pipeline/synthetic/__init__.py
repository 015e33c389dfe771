"""Synthetic data for tests, benchmarks and the demo: H&E-like textures, slides and cohorts."""
