"""Fanout's server: the wings are listed in ``docs/explanation/architecture.md``."""

from service import compiled

if compiled.pure_requested():  # before any module of the hot path is imported
    compiled.run_sources()
