"""A real socket server on a free loopback port that answers each request with scripted bytes (``Server``, entered with
``async with`` for its base URL; it counts connections and keeps every request line), and ``ok``, a 200 answer with a
Content-Length, for the tests of the probe's HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Script = Callable[[str, int], bytes | None]
"""(request line, how many requests this connection has had) -> bytes to send, or None to close without answering."""


class Server:
    def __init__(self, script: Script, *, close_after_answer: bool = False) -> None:
        self.script = script
        self.close_after_answer = close_after_answer
        self.connections = 0
        self.requests: list[str] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode()
                self.requests.append(line)
                answer = self.script(line, served)
                served += 1
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def ok(body: bytes, *extra: str) -> bytes:
    headers = "".join(f"{h}\r\n" for h in extra)
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body
