"""Stored results: the metrics of a run, the SQLite store, export and import."""
