"""Overload: the one gate every call passes before any task is planned, with the pacing
of callers who do not back off and the refusal of their calls unread (``gate.py``); the
adaptive admission limit (``admission.py``); and holding paced refusals off the
connection's greenlet (``held_connections.py``)."""
