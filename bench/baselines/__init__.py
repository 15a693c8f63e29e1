"""The servers Fanout is compared with, each run as its own process by :mod:`bench.harness.stack`.

* :mod:`bench.baselines.sequential`: the same seven lookups called one after another in
  the handler, on Fanout's own ``ThriftServer`` (the "before" picture).
* :mod:`bench.baselines.threaded`: thriftpy2's ``TThreadedServer`` (a thread per
  connection, no gevent) with a ``ThreadPoolExecutor`` fan-out of the same lookups.
* :mod:`bench.baselines.bare`: a bare gevent ``StreamServer`` and thriftpy2 processor
  loop serving ``ping`` and ``panels``, the floor for raw RPC cost.
* :mod:`bench.baselines.handwritten`: that loop with a plain ``gevent.spawn`` fan-out of
  plain pymongo and requests calls (same queries and parsing): the CPU-per-call yardstick.
"""
