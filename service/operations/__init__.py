"""What operators run the service by: backend health (``health.py``), HTTP probes
(``probes.py``), the Prometheus scrape (``metrics_endpoint.py``) on a native thread
(``native_http.py``), the event-loop monitor (``hub_monitor.py``), one reading of the
service's parts (``snapshot.py``) and every series read from it (``service_metrics.py``),
logs (``logs.py``), and listening ports (``ports.py``). The RPC call metric is recorded
beside the server span (:class:`tracing.spans.CallDurations`)."""
