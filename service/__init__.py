"""Fanout's server: the wings are listed in ``docs/explanation/architecture.md``."""
