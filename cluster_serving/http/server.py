"""The HTTP bridge process: BigDL's `/predict` and `/metrics`, KServe v1 and v2 routes over the Kafka topics.

    python -m cluster_serving.http.server --config run/serving/config.yaml     (or: cluster-serving http)

uvicorn serves the app of `bridge.http.app` (the routes are `bridge.protocol`'s) over the core
`bridge.dataplane.Bridge`, which this module starts before it listens and stops after.
Every error is `{"error": "<message>"}`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import ssl
import sys
from http import HTTPStatus

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cluster_serving.config import ConfigError, HttpConfig, load_config
from cluster_serving.config.command_line import config_parser
from cluster_serving.http import READY_LINE
from cluster_serving.http.app import create_app
from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import InvalidRequest
from cluster_serving.http.json_tensors import json_bytes
from cluster_serving.http.metrics import BridgeMetrics

log = logging.getLogger("cluster_serving.http")


def json_error_protocol(metrics: BridgeMetrics) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP/1.1 protocol on httptools (llhttp, in C, cheaper per request than the pure
    Python h11), answering a request it cannot parse (a malformed request line, header or
    Content-Length), before any app sees it, in the bridge's JSON error shape and counted like every
    other response; uvicorn's own answer is plain text."""

    class JsonErrorProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            # uvicorn calls this in its `except httptools.HttpParserError:`, whose reason says more.
            reason = sys.exc_info()[1]
            error = InvalidRequest(
                f"malformed HTTP request: {reason}" if isinstance(reason, httptools.HttpParserError) else msg
            )
            body = json_bytes({"error": str(error)})
            status = HTTPStatus(error.status)
            head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
                status.value, status.phrase.encode(), len(body)
            )
            self.transport.write(head + b"connection: close\r\n\r\n" + body)
            self.transport.close()
            metrics.count_response(status.value)

    return JsonErrorProtocol


def serve(config_path: str | None) -> int:
    """Runs the bridge in the foreground until SIGINT/SIGTERM; 2 with one line on a set-up error
    (the repository or a model in it, the port, the broker), 130 when stopped while starting."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        config = load_config(config_path)
        bridge = Bridge(config)  # reads and checks the repository's models first
        check_tls(config.http)
        listener = listen(config.http.host, config.http.port)
        return asyncio.run(run_bridge(bridge, listener))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # stopped before it listened (run_bridge handles signals after)
        return 130


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host:port`, made before the bridge starts so a taken port is a
    set-up error (ConfigError), not a failure after Kafka was connected."""
    # IPPROTO_TCP named explicitly: asyncio turns Nagle's algorithm off only for sockets whose
    # proto says TCP, and accepted sockets inherit the listener's 0 otherwise. With Nagle on, a
    # response's body waited for the client's delayed ACK: 40 ms added to every request.
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        raise ConfigError(
            f"http.port: cannot listen on {host}:{port} ({exc.strerror}); stop what listens there or set another http.port"
        ) from None
    listener.listen(2048)
    return listener


def check_tls(http: HttpConfig) -> None:
    """A certificate and key that do not load are a set-up error, said before anything starts."""
    if http.tls_cert is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(http.tls_cert, http.tls_key)
    except ssl.SSLError as exc:  # OpenSSL's reason: KEY_VALUES_MISMATCH, NO_START_LINE, ...
        reason = (exc.reason or str(exc)).lower().replace("_", " ")
        raise ConfigError(
            f"http.tls_cert/http.tls_key: {http.tls_cert} and {http.tls_key} do not load as a PEM certificate and its key: {reason}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"http.tls_cert/http.tls_key: {exc.filename or http.tls_cert}: {exc.strerror}") from None


def server_config(bridge: Bridge) -> uvicorn.Config:
    """uvicorn serving the bridge's routes, with the protocol that answers unparsable requests,
    over TLS when http.tls_cert is set. No X-Forwarded-For rewriting (proxy_headers): nothing here
    reads the client's address, and it is a middleware less per request."""
    http = bridge.config.http
    return uvicorn.Config(
        create_app(bridge), http=json_error_protocol(bridge.metrics), log_level="warning", access_log=False,
        lifespan="off", proxy_headers=False,
        ssl_certfile=http.tls_cert and str(http.tls_cert), ssl_keyfile=http.tls_key and str(http.tls_key),
    )


async def run_bridge(bridge: Bridge, listener: socket.socket) -> int:
    """Connects to Kafka first, so the ready line means requests can be enqueued and answered."""
    await bridge.start()
    # uvicorn handles SIGINT/SIGTERM while it serves, then raises the signal again for the handler
    # below it: a no-op one, so the cleanup here finishes instead of being cancelled.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    try:
        server = uvicorn.Server(server_config(bridge))
        # What exists now (modules, the app, the Kafka clients) lives as long as the process: out of
        # the collector's sight, a full collection no longer walks it, a stall of every waiting request.
        gc.freeze()
        host, port = listener.getsockname()[:2]
        log.info(
            "%s%s://%s:%d (models: %s; default %r)", READY_LINE, bridge.config.http.scheme, host, port, bridge.catalog.reading.describe(),
            bridge.model_name,
        )
        await server.serve(sockets=[listener])
    finally:
        await bridge.stop()
    log.info("http bridge stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(config_parser("python -m cluster_serving.http.server", __doc__.splitlines()[0]).parse_args(argv).config)


if __name__ == "__main__":
    sys.exit(main())
