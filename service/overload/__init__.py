"""Overload: the one gate every call passes before any task is planned (``gate.py``):
the adaptive admission limit (``admission.py``) and the pacing of callers who do not
back off (``pacing.py``); refusing a call from its header alone (``shedding.py``); and
holding such refusals off the connection's greenlet (``held_connections.py``)."""
