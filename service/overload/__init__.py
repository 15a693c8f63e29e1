"""Overload: refusing a call from its header alone (``shedding.py``), and holding the
refusals of callers who do not back off off their greenlets (``held_connections.py``).
Admission and pacing are the engine's (``service/engine/``)."""
