"""Exports a person opens: predictions CSV, heatmap PNGs, per-tile scores, GeoJSON for QuPath, report.html."""
