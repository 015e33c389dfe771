"""Data: bags of tiles from stores, per-slide augmentation, frozen-feature files."""
