"""The bounded soak run (``python -m bench.soak``): mixed load, chaos, garbage connections."""
