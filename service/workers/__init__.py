"""Pre-forked workers: the master (``master.py``) and the processes it starts
(``worker.py``, each a program of its own, with ``member.py`` its side of the
control line, ``control.py``), the group's probe and metrics endpoints the master
serves (``group.py``), heartbeats (``heartbeat.py``), positions and their restarts
(``positions.py``), spreading connections (``balance.py``), and what they need of the
operating system (``process.py``).

Nothing is imported here: ``python -m service.workers.worker`` loads this package
first, and must patch the standard library before anything else loads.
"""
