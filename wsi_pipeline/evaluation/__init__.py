"""Evaluation: embedding slides once, test protocols (all tiles, R x k subsets), metrics, the eval runner."""
