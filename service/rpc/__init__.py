"""The RPC surface: one handler method per IDL method (``handler.py``), the request's
validation (``validation.py``), engine outcomes to Thrift (``mapping.py``), and the
``pool_stats()`` answer (``pool_report.py``). The only wing that knows both the
Thrift types and the engine."""
