"""Serving metrics: each declared once in `serving` through `registry` (name, header, unit, better direction,
explanation, how a run's requests give it, the reports that show it); `summary` turns a run's request records into
its summary, `repeats` estimates a metric across repeats. Summaries, tables, compare, the gate, export and
`mpfa metrics` all read the registry.
"""
from . import serving  # noqa: F401  (importing the package declares the built-in metrics)
