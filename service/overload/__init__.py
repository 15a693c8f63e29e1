"""Overload: the one gate every call passes before any task is planned, with the refusal
of calls unread (``gate.py``); the call's one ticket (``ticket.py``); the pacing of
connections whose callers do not back off (``pacing.py``); admission, the one owner of who
is served: the adaptive limit, its line, the callers' fair shares, retry-after and the
CPU rule (``admission.py``); the brownout dimmer (``brownout.py``); and holding paced
refusals off the connection's greenlet (``held_connections.py``)."""
