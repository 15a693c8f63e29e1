"""What operators run the service by: backend health (``health.py``), HTTP probes
(``probes.py``), the Prometheus scrape (``metrics_endpoint.py``) on a native thread
(``native_http.py``), the event-loop monitor (``hub_monitor.py``), the RPC call metric
(``rpc_metrics.py``), logs (``logs.py``), and listening ports (``ports.py``)."""
