"""The listener: the evented Thrift server, its accept loop and drain (``server.py``),
one connection's message loop (``connection.py``), its counters (``stats.py``), and
moving a live connection to another process (``handover.py``)."""
