"""The RPC surface: one handler method per IDL method, and engine outcomes to Thrift
(``handler.py``), the request's validation (``validation.py``), and the
``pool_stats()`` answer (``pool_report.py``). The only wing that knows both the
Thrift types and the engine."""
