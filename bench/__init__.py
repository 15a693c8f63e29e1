"""Benchmarks and long-running load tools; never part of ``make test``.

``python -m bench`` runs the side-by-side comparison (``make bench``);
``python -m bench.soak`` runs the bounded soak (``make soak``).
"""
