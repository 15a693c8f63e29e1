"""The multi-process load generator and its pre-encoded request frames."""
