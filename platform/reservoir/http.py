"""What Reservoir's two HTTP servers (`reservoir serve`, `reservoir review serve`) share: which
addresses count as this machine only, and running an app under uvicorn until Ctrl-C."""

from __future__ import annotations

import ipaddress
import socket

from reservoir.errors import ConfigError


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach the address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


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
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  access_log=False)).run()
