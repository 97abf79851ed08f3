"""What Reservoir's two HTTP servers (`reservoir serve`, `reservoir review serve`) share: which
addresses count as this machine only, the guard no web page gets past, strict JSON bodies, and
running an app under uvicorn until Ctrl-C.

A page in a browser can send requests to a server on this machine: a "simple" POST (a form, or
text/plain) goes without a preflight, and a DNS-rebound name reaches 127.0.0.1 as the page's
own origin. So a server takes a request only when its Host is an address it serves (a rebound
name is not), its Origin is absent or its own, and (for JSON APIs) its body is
application/json, which a page can only send after a preflight nobody answers; and never a
body past its limit.
"""

from __future__ import annotations

import ipaddress
import json
import math
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response

from reservoir.errors import ConfigError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
MAX_INTEGER_DIGITS = 30  # a JSON integer longer than this is no count, id or reward


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach the address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def served_hosts(host: str, port: int, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host headers a server bound to host:port answers: the address and, on loopback, its
    other names; `extra` names (a DNS name the server is reached by) too. None for a wildcard
    bind (0.0.0.0, ::): then a request's Origin must match its own Host."""
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False
    if wildcard and not extra:
        return None
    names = set(extra) | ({urlsplit(url_of(host, port)).hostname} if not wildcard else set())
    if is_loopback(host):
        names |= set(LOOPBACK_NAMES)
    bracketed = {f"[{name}]" if ":" in name and not name.startswith("[") else name
                 for name in names}
    return frozenset(f"{name}:{port}" for name in bracketed) | (
        frozenset(bracketed) if port == 80 else frozenset())


class Guard:
    """ASGI middleware: refuse (with `refuse(status, message)`) a request whose Host is not
    served (421), whose Origin is another's (403), a POST that is not JSON when `json_posts`
    (415), and a body past `max_body` bytes (413) before its first byte is read."""

    def __init__(self, app, *, hosts: frozenset[str] | None, json_posts: bool, max_body: int,
                 refuse: Callable[[int, str], Response]) -> None:
        self.app, self.hosts, self.json_posts = app, hosts, json_posts
        self.max_body, self.refuse = max_body, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self.problem(scope["method"], Headers(scope=scope))
        if problem is not None:
            await self.refuse(*problem)(scope, receive, send)
            return
        state = {"over": False, "started": False}

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["read"] = state.get("read", 0) + len(message.get("body", b""))
                if state["read"] > self.max_body:  # a chunked body: the app sees a hang-up
                    state["over"] = True
                    return {"type": "http.disconnect"}
            return message

        async def watched_send(message):
            state["started"] = True
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await self.refuse(413, self._too_large())(scope, receive, send)

    def problem(self, method: str, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host", "").lower()
        if self.hosts is not None and host not in self.hosts:
            return 421, (f"Host {host[:100]!r} is not an address this server answers (a page "
                         "of another site, or a rebound DNS name)")
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, host):
            return 403, f"a page of another origin ({origin[:100]}) may not use this server"
        if headers.get("sec-fetch-site") == "cross-site":
            return 403, "a page of another site may not use this server"
        if method == "POST" and self.json_posts:
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return 415, f"the body must be application/json (got {kind[:60] or 'none'!r})"
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            return 413, self._too_large()
        return None

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body:,} bytes (the server's limit)"


def _same_origin(origin: str, host: str) -> bool:
    """Whether a request's Origin is the server itself (http, or https through a proxy)."""
    parts = urlsplit(origin.lower())
    return parts.scheme in ("http", "https") and parts.netloc == host and not parts.path


def loads(body: bytes):
    """JSON as a request may hold it: numbers finite as float64 and integers of at most
    MAX_INTEGER_DIGITS digits, no NaN or Infinity, nesting Python can read; ValueError with
    what was wrong otherwise."""
    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:30]} is out of range")
        return value

    def integer(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
            raise ValueError(f"the integer {text[:30]}... has {len(text)} digits")
        return int(text)

    def constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(body, parse_float=number, parse_int=integer, parse_constant=constant)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8 text") from None


def check_free(host: str, port: int, key: str) -> None:
    """ConfigError naming `key` when the address cannot be bound (in use, or not this
    machine's), before anything slow starts."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"{key}: cannot listen on {url_of(host, port)}: "
                          f"{exc.strerror or exc}") from None


def run_app(app, host: str, port: int) -> None:
    """Serve until Ctrl-C (uvicorn's own handling: it finishes the requests in flight)."""
    _uvicorn(app, host, port).run()


@contextmanager
def serving(app, host: str, port: int):
    """The app served on a thread of its own once it listens, until the block ends (then the
    requests in flight finish, and the thread is joined)."""
    server = _uvicorn(app, host, port)
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started:  # listening, or failed to (the address taken meanwhile)
        if not thread.is_alive():
            raise ConfigError(f"cannot listen on {url_of(host, port)}")
        time.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join()


def _uvicorn(app, host: str, port: int):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                         access_log=False))
