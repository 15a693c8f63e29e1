"""The results cache: panels merged from cached, aligned time buckets.

- :mod:`~lookups.cache.buckets`: a window as settled buckets and the edges around them;
- :mod:`~lookups.cache.stores`: where buckets live (this process, or Redis) and the counters;
- :mod:`~lookups.cache.cached`: a MongoDB panel from its buckets' parts and its edges;
- :mod:`~lookups.cache.alerts`: the alerts panel from its buckets' alerts;
- :mod:`~lookups.cache.panel`: what both are, for a caller asking for a fresh answer;
- :mod:`~lookups.cache.merged`: the sums of whole runs of buckets, kept decoded;
- :mod:`~lookups.cache.plans`: whether a window is cheaper from the buckets or the panel's
  own query, as measured;
- :mod:`~lookups.cache.settings`: the ``[cache]`` section;
- :mod:`~lookups.cache.wiring`: the store a server opens, and its lookups answered through it.

This package's own module imports nothing: the settings load without the backends' clients
(a short command such as ``fanout call`` reads the settings and never opens a backend).

The parts themselves, and why their sum is exactly the panel's one query, are in
:mod:`lookups.mongo_parts`.
"""
