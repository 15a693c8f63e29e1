"""Tracing: provider set-up, span helpers, the caller's context carried on (trace
headers and greenlets), and a text waterfall.

Import from the submodules (``tracing.setup``, ``tracing.spans``,
``tracing.context``, ``tracing.waterfall``). This package imports nothing
eagerly, so importing a span helper never loads pymongo or requests before
gevent has patched the standard library.
"""

__all__: list[str] = []
