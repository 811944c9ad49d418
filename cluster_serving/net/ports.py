"""Whether a server could listen on a TCP port now."""

from __future__ import annotations

import socket


def port_taken(host: str, port: int) -> bool:
    """True when a server could not listen on host:port now. The probe binds as servers do, with
    SO_REUSEADDR (Kafka's, Flink's and the bridge's sockets set it), so connections still closing
    on that port (TIME_WAIT) do not count: only a listener or another bound socket does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False
