"""Prometheus metrics: the store's gauges (`reservoir metrics serve`) and the requests of
Reservoir's HTTP servers (`/metrics` on `reservoir serve` and `reservoir review serve`).
prometheus-client (the `metrics` extra) is imported only here, when one of them starts."""
