"""The ``fanout`` command: ``main.py`` parses and dispatches, ``demo.py`` runs the demo,
``report.py`` prints a call's answer and waterfall. ``python -m service.cli`` runs it."""
