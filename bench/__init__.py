"""Benchmarks and long-running load tools; never part of ``make test``.

``python -m bench`` runs the side-by-side comparison (``make bench``);
``python -m bench.soak`` runs the bounded soak (``make soak``). Sub-packages by role:
servers/ (what a stack runs), harness/ (stacks, scenarios, runner), load/ (the load
generator), analysis/ (intervals, goals, report, plots), baselines/ (the designs compared),
soak/; micro.py holds the engine and memory micro-benchmarks.
"""
