"""A lean HTTP/1.1 GET client for probing one engine: a keep-alive connection of its own, reopened when it fails.

Why not aiohttp: at 1000 engines polled every second, aiohttp's request machinery (URL building, auto headers, response
objects, timers) was a third of the probe worker's CPU, more than reading the 54 KB exposition itself (issue 9, item 5;
``bench/results/scale.md``). A probe needs none of it: one GET of a known path on a known ``http://`` host, answered by
an engine's HTTP server.

What it speaks: HTTP/1.1 (and 1.0) responses framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of
the connection; ``Content-Encoding: gzip``/``deflate`` bodies are inflated; a redirect to a path on the same engine is
followed (at most ``MAX_REDIRECTS``; vLLM's Starlette mount once answered ``/metrics`` with a 307 to ``/metrics/``), a
redirect elsewhere is an error. A response whose headers exceed ``MAX_HEADER_BYTES`` or whose body exceeds
``MAX_BODY_BYTES`` is an error, not a memory hazard. A reused connection the server closed while idle (keep-alive
timeouts) is retried once on a fresh one; any other failure closes the connection, and the next GET opens a new one.
"""

from __future__ import annotations

import asyncio
import zlib
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
"""A vLLM V1 exposition is about 57 KB with every bucket; 64 MB is far beyond any engine document."""
MAX_REDIRECTS = 3


class HttpError(Exception):
    """The engine's connection or answer failed (refused, reset, closed early, malformed, too large)."""


class _StaleConnection(HttpError):
    """A reused connection closed before any byte of the answer: the server dropped it while idle."""


class _Response(asyncio.Protocol):
    """One connection; parses one response at a time into ``done`` (status, headers, body)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._done: asyncio.Future[tuple[int, dict[str, str], bytes]] | None = None
        self._head: tuple[int, dict[str, str], bool] | None = None
        self.unclean = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def expect(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[tuple[int, dict[str, str], bytes]]:
        self._done = loop.create_future()
        self._buffer.clear()
        self._head = None
        return self._done

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            self.unclean = True  # bytes nobody asked for: the connection is not reused
            return
        self._buffer += data
        try:
            self._parse(at_eof=False)
        except HttpError as exc:
            self._done.set_exception(exc)

    def eof_received(self) -> bool:
        self._finish_at_close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish_at_close()

    def _finish_at_close(self) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if self._head is None and not self._buffer:  # not a byte of the answer arrived
            self._done.set_exception(_StaleConnection("connection closed before an answer"))
            return
        try:
            self._parse(at_eof=True)
        except HttpError as exc:
            self._done.set_exception(exc)
            return
        if not self._done.done():
            self._done.set_exception(HttpError("connection closed in the middle of an answer"))

    def _parse(self, *, at_eof: bool) -> None:
        assert self._done is not None
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEADER_BYTES:
                    raise HttpError(f"answer headers over {MAX_HEADER_BYTES} bytes")
                return
            self._head = _read_head(bytes(self._buffer[:end]))
            del self._buffer[:end + 4]
        status, headers, until_close = self._head
        if len(self._buffer) > MAX_BODY_BYTES:
            raise HttpError(f"answer body over {MAX_BODY_BYTES} bytes")
        if status < 200 or status in (204, 304):
            body, used = b"", 0
        elif "chunked" in headers.get("transfer-encoding", ""):
            # The last chunk and the trailers end in a blank line: only then is the body worth decoding.
            if not self._buffer.endswith(b"\r\n\r\n"):
                return
            dechunked = _dechunk(self._buffer)
            if dechunked is None:
                return
            body, used = dechunked
        elif not until_close:
            used = _content_length(headers["content-length"])
            if len(self._buffer) < used:
                return
            body = bytes(self._buffer[:used])
        else:
            if not at_eof:
                return
            body, used = bytes(self._buffer), len(self._buffer)
        # Bytes past the answer mean the framing was not what the headers said: the connection is not reused.
        self.unclean = len(self._buffer) > used
        self._done.set_result((status, headers, body))


def _read_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """(status, lower-cased headers, whether the body runs to the end of the connection)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(f"malformed header line: {line[:80]!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    until_close = "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")
    return int(parts[1]), headers, until_close


def _content_length(value: str) -> int:
    if not value.isdigit():
        raise HttpError(f"bad Content-Length {value[:40]!r}")
    length = int(value)
    if length > MAX_BODY_BYTES:
        raise HttpError(f"answer body over {MAX_BODY_BYTES} bytes")
    return length


def _dechunk(buffer: bytearray) -> tuple[bytes, int] | None:
    """The whole body of a chunked answer and the bytes it took, or None while chunks are still coming (trailers are
    read and dropped)."""
    out = bytearray()
    at = 0
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size_text = bytes(buffer[at:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(f"bad chunk size {size_text[:20]!r}") from None
        at = line_end + 2
        if size == 0:
            trailers_end = buffer.find(b"\r\n\r\n", line_end)
            return (bytes(out), trailers_end + 4) if trailers_end >= 0 else None
        if len(buffer) < at + size + 2:
            return None
        out += buffer[at:at + size]
        at += size + 2


class HttpGet:
    """GETs to one ``http://host:port[/prefix]`` over one kept-alive connection. Not for concurrent use: a poller awaits
    each GET before the next."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"an engine URL must be http://host[:port], got {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._authority = parts.netloc
        self._prefix = parts.path.rstrip("/")
        self._connection: _Response | None = None

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of ``GET prefix + path``, within ``timeout`` seconds in all (redirects included). Raises
        ``HttpError`` or ``TimeoutError``; the connection is closed after either."""
        try:
            async with asyncio.timeout(timeout):
                target = self._prefix + path
                for _ in range(MAX_REDIRECTS + 1):
                    status, headers, body = await self._exchange(target)
                    location = headers.get("location")
                    if status not in (301, 302, 303, 307, 308) or not location:
                        return status, _inflate(headers, body)
                    target = self._same_engine_path(location)
                raise HttpError(f"more than {MAX_REDIRECTS} redirects")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._connection is not None and self._connection.transport is not None:
            self._connection.transport.close()
        self._connection = None

    async def _exchange(self, target: str) -> tuple[int, dict[str, str], bytes]:
        reused = self._connection is not None and not self._connection.closed and not self._connection.unclean
        try:
            return await self._once(target)
        except _StaleConnection:
            if not reused:
                raise
            self.close()
            return await self._once(target)

    async def _once(self, target: str) -> tuple[int, dict[str, str], bytes]:
        loop = asyncio.get_running_loop()
        if self._connection is None or self._connection.closed or self._connection.unclean:
            self.close()
            try:
                _, protocol = await loop.create_connection(_Response, self._host, self._port)
            except OSError as exc:
                raise HttpError(f"cannot connect to {self._authority}: {exc.strerror or exc}") from None
            self._connection = protocol
        connection = self._connection
        done = connection.expect(loop)
        assert connection.transport is not None
        connection.transport.write(
            f"GET {target} HTTP/1.1\r\nHost: {self._authority}\r\nAccept: */*\r\nUser-Agent: sluice-probe\r\n\r\n"
            .encode("latin-1"))
        status, headers, body = await done
        if headers.get("connection", "").lower() == "close" or connection.closed or connection.unclean:
            self.close()
        return status, headers, body

    def _same_engine_path(self, location: str) -> str:
        if location.startswith("/"):
            return location
        parts = urlsplit(location)
        if parts.scheme == "http" and parts.netloc == self._authority:
            return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        raise HttpError(f"redirected off the engine, to {location[:120]!r}")


def _inflate(headers: dict[str, str], body: bytes) -> bytes:
    encoding = headers.get("content-encoding", "identity").lower()
    if encoding in ("identity", ""):
        return body
    if encoding in ("gzip", "deflate"):
        try:
            return zlib.decompress(body, 47)  # 47: gzip or zlib header, detected
        except zlib.error as exc:
            raise HttpError(f"bad {encoding} body: {exc}") from None
    raise HttpError(f"unsupported Content-Encoding {encoding!r}")
