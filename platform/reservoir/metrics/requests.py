"""`/metrics` of Reservoir's HTTP servers: requests by route, method and status, their
latency, errors by kind (the status answered), and each server's own counters (tokens and
episodes of `reservoir serve`, actions of the review page), on a registry of the server's own.

`RequestMetrics.wrap(app)` is ASGI middleware around the app (inside reservoir.http.Guard:
refused requests are the guard's and are not counted). Routes are labelled by their template
(`/reviews/{review_id}`), never by the path asked for, so a scan of random paths adds one
series ("unmatched"), not one per path. `for_service` gives None when prometheus-client is not
installed: the servers then answer /metrics with 501 and a hint.
"""

from __future__ import annotations

import time

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
UNMATCHED = "unmatched"
MISSING = "prometheus-client is not installed: pip install 'reservoir[metrics]'\n"
# Each service's own counters: {service: {key: (name without _total, help, labels)}}.
COUNTERS = {
    "serve": {
        "tokens": ("reservoir_serve_tokens", "Tokens of the calls served, by kind (prompt, "
                   "completion)", ("kind",)),
        "recorded": ("reservoir_serve_responses_recorded", "Responses recorded in their "
                     "episodes", ()),
        "reported": ("reservoir_serve_episodes_reported", "Episodes reported and written as a "
                     "group", ())},
    "review": {
        "actions": ("reservoir_review_actions", "Review actions recorded, by action",
                    ("action",)),
        "failed_logins": ("reservoir_review_failed_logins", "Logins refused (wrong token or "
                          "locked out)", ())},
}


def for_service(service: str) -> "RequestMetrics | None":
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return None
    return RequestMetrics(service)


class RequestMetrics:
    def __init__(self, service: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.service, self.registry = service, CollectorRegistry()
        self.requests = Counter("reservoir_http_requests", "Requests answered, by route, "
                                "method and status", ["route", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("reservoir_http_request_duration_seconds", "Seconds from a "
                                 "request's arrival to the end of its answer, by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("reservoir_http_errors", "Requests answered with an error, by "
                              "kind (the status: 4xx the caller's, 5xx the server's)",
                              ["kind"], registry=self.registry)

        self.counters = {key: Counter(name, doc, list(labels), registry=self.registry)
                         for key, (name, doc, labels) in COUNTERS.get(service, {}).items()}

    def count(self, key: str, amount: float = 1, *labels: str) -> None:
        """Add to one of the service's own counters (COUNTERS)."""
        counter = self.counters[key]
        (counter.labels(*labels) if labels else counter).inc(amount)

    def exposition(self) -> tuple[bytes, str]:
        """(the registry in Prometheus' text format, its content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def wrap(self, app):
        """ASGI middleware counting every HTTP request `app` answers (but /metrics)."""
        async def counted(scope, receive, send):
            if scope["type"] != "http" or scope["path"] == "/metrics":
                await app(scope, receive, send)
                return
            started, answer = time.perf_counter(), {"status": 500}

            async def watched(message):
                if message["type"] == "http.response.start":
                    answer["status"] = message["status"]
                await send(message)
            try:
                await app(scope, receive, watched)
            finally:
                route = getattr(scope.get("route"), "path", UNMATCHED)
                self.record(route, scope["method"], answer["status"],
                            time.perf_counter() - started)
        return counted

    def record(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if status >= 400:
            self.errors.labels(str(status)).inc()
