"""A reverse proxy in front of an S3 server that answers chosen requests with real S3 errors.

``FaultProxy(upstream, fault)`` listens on loopback; point a client's endpoint at ``proxy.url``.
``fault(n, method, path)`` decides for the n-th request (from 0): ``(status, code)`` to answer it with
that S3 error, ``None`` to forward it. Policies for the usual faults: ``random_faults`` (throttling
and server errors at a rate, seeded) and ``fail_after_puts`` (an outage that starts mid-run).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import random
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

Fault = Callable[[int, str, str], tuple[int, str] | None]

ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>{message}</Message><RequestId>proxy</RequestId></Error>"
)
FAULT_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
}
# What S3 answers when it throttles or has a bad moment: all worth a retry.
TRANSIENT = ((503, "SlowDown"), (503, "ServiceUnavailable"), (500, "InternalError"))
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


def never(number: int, method: str, path: str) -> None:
    """Forward everything: a healed proxy."""
    return None


def random_faults(rate: float, *, seed: int = 0) -> Fault:
    """Fail a seeded random ``rate`` of requests with one of the transient S3 errors."""
    rng = random.Random(seed)

    def fault(number: int, method: str, path: str) -> tuple[int, str] | None:
        return rng.choice(TRANSIENT) if rng.random() < rate else None

    return fault


def fail_after_puts(num_puts: int, error: tuple[int, str] = (503, "ServiceUnavailable")) -> Fault:
    """Forward requests until ``num_puts`` PUTs went through, then fail every request."""
    forwarded = 0

    def fault(number: int, method: str, path: str) -> tuple[int, str] | None:
        nonlocal forwarded
        if forwarded >= num_puts:
            return error
        forwarded += method == "PUT"
        return None

    return fault


class FaultProxy:
    """A reverse proxy in front of the S3 server that answers some requests with an S3 error.

    Every request is recorded in ``seen`` as (method, path, status answered). ``fault`` may be
    replaced while the proxy runs (``proxy.fault = never`` heals it).
    """

    def __init__(self, upstream: str, fault: Fault) -> None:
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.fault = fault
        self.seen: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue for botocore's PUTs

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _handle(self) -> None:
                body = self._body()
                with proxy._lock:
                    number = len(proxy.seen)
                    decision = proxy.fault(number, self.command, self.path)
                    proxy.seen.append((self.command, self.path, 0))
                if decision is not None:
                    status, code = decision
                    payload = ERROR_XML.format(code=code, message=FAULT_MESSAGES.get(code, code)).encode()
                    # Recorded before answering: the client may look at `seen` as soon as it has the answer.
                    proxy._record(number, status)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    proxy._record(number, response.status)
                    self.send_response(response.status, response.reason)
                    for name, value in response.getheaders():
                        if name.lower() not in HOP_BY_HOP | {"content-length", "server", "date"}:
                            self.send_header(name, value)
                    length = response.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _record(self, number: int, status: int) -> None:
        with self._lock:
            method, path, _ = self.seen[number]
            self.seen[number] = (method, path, status)

    def failed(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return [s for s in self.seen if s[2] >= 500]

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


@contextlib.contextmanager
def proxies(upstream: str) -> Iterator[Callable[[Fault], FaultProxy]]:
    """``start(fault)`` starts a FaultProxy in front of ``upstream``; all of them stop at the end."""
    started: list[FaultProxy] = []

    def start(fault: Fault) -> FaultProxy:
        proxy = FaultProxy(upstream, fault).__enter__()
        started.append(proxy)
        return proxy

    try:
        yield start
    finally:
        for proxy in started:
            proxy.__exit__(None, None, None)
