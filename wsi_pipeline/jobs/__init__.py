"""Per-slide jobs: where they run (a local pool or a Dask cluster)."""
