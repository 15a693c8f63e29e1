"""From samples to verdicts: intervals (``stats.py``), goals, the report and its plots."""
