"""A free local TCP port (the OS picks it), for one-process rendezvous and the test servers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port that was free a moment ago (the OS picks it); for one-process rendezvous.
    ``span``: the ``span`` ports from it were all free (one link per online producer)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port + span <= 65536 and all(_bindable(host, port + k) for k in range(1, span)):
            return port
    raise RuntimeError(f"no {span} consecutive free TCP ports found on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False
