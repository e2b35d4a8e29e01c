"""The probe's HTTP client (``controlplane/observe/httpget.py``) against a real socket server that answers each request
with scripted bytes: the framings engines use, keep-alive, a server that drops idle connections, redirects, limits."""

from __future__ import annotations

import asyncio
import gzip

import pytest

from controlplane.observe import httpget
from controlplane.observe.httpget import HttpError, HttpGet
from tests.unit.scriptedhttp import Server, ok


async def test_content_length_answers_reuse_one_connection() -> None:
    server = Server(lambda line, n: ok(f"answer {n} to {line}".encode()))
    async with server as url:
        client = HttpGet(url + "/prefix/")
        assert await client.get("/metrics", 1.0) == (200, b"answer 0 to GET /prefix/metrics HTTP/1.1")
        assert await client.get("/v1/models", 1.0) == (200, b"answer 1 to GET /prefix/v1/models HTTP/1.1")
        assert server.connections == 1
        client.close()


async def test_chunked_and_close_delimited_bodies() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n"
    async with Server(lambda line, n: chunked) as url:
        client = HttpGet(url)
        assert await client.get("/a", 1.0) == (200, b"hello world")
        assert await client.get("/b", 1.0) == (200, b"hello world")
        client.close()
    until_close = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nto the end"
    server = Server(lambda line, n: until_close, close_after_answer=True)
    async with server as url:
        client = HttpGet(url)
        assert await client.get("/a", 1.0) == (200, b"to the end")
        assert await client.get("/a", 1.0) == (200, b"to the end")
        assert server.connections == 2


async def test_a_connection_the_server_dropped_while_idle_is_retried_once_on_a_fresh_one() -> None:
    server = Server(lambda line, n: ok(b"x") if n == 0 else None)  # answers once a connection, then hangs up
    async with server as url:
        client = HttpGet(url)
        for _ in range(3):
            assert await client.get("/metrics", 1.0) == (200, b"x")
        assert server.connections == 3
        client.close()


async def test_a_fresh_connection_closed_without_an_answer_is_an_error() -> None:
    async with Server(lambda line, n: None) as url:
        with pytest.raises(HttpError, match="closed before an answer"):
            await HttpGet(url).get("/metrics", 1.0)


async def test_status_and_empty_answers_keep_the_connection() -> None:
    answers = {0: b"HTTP/1.1 204 No Content\r\n\r\n", 1: b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno!"}
    server = Server(lambda line, n: answers.get(n, ok(b"last")))
    async with server as url:
        client = HttpGet(url)
        assert await client.get("/a", 1.0) == (204, b"")
        assert await client.get("/b", 1.0) == (404, b"no!")
        assert await client.get("/c", 1.0) == (200, b"last")
        assert server.connections == 1
        client.close()


async def test_redirects_on_the_engine_are_followed_and_others_refused() -> None:
    def script(line: str, n: int) -> bytes:
        if line.startswith("GET /metrics "):
            return b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /metrics/\r\nContent-Length: 0\r\n\r\n"
        if line.startswith("GET /away "):
            return b"HTTP/1.1 302 Found\r\nLocation: http://example.invalid/x\r\nContent-Length: 0\r\n\r\n"
        if line.startswith("GET /loop "):
            return b"HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\n\r\n"
        return ok(b"the text")

    server = Server(script)
    async with server as url:
        client = HttpGet(url)
        assert await client.get("/metrics", 1.0) == (200, b"the text")
        with pytest.raises(HttpError, match="redirected off the engine"):
            await client.get("/away", 1.0)
        with pytest.raises(HttpError, match="redirects"):
            await client.get("/loop", 1.0)
        assert await client.get("/metrics", 1.0) == (200, b"the text")


async def test_gzip_bodies_are_inflated() -> None:
    body = gzip.compress(b"vllm:num_requests_running 3\n")
    async with Server(lambda line, n: ok(body, "Content-Encoding: gzip")) as url:
        client = HttpGet(url)
        assert await client.get("/metrics", 1.0) == (200, b"vllm:num_requests_running 3\n")
        client.close()


async def test_a_silent_engine_times_out_and_the_next_get_uses_a_new_connection() -> None:
    calls: list[int] = []

    def script(line: str, n: int) -> bytes:
        calls.append(n)
        return ok(b"late") if len(calls) > 1 else b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"  # 4 of 10 bytes

    server = Server(script)
    async with server as url:
        client = HttpGet(url)
        with pytest.raises(TimeoutError):
            await client.get("/metrics", 0.2)
        assert await client.get("/metrics", 1.0) == (200, b"late")
        assert server.connections == 2
        client.close()


async def test_oversized_or_malformed_answers_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpget, "MAX_BODY_BYTES", 100)
    answers = {
        "/big": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n",
        "/bad": b"SMTP ready\r\n\r\n",
        "/length": b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
    }
    async with Server(lambda line, n: answers[line.split()[1]]) as url:
        client = HttpGet(url)
        with pytest.raises(HttpError, match="over 100 bytes"):
            await client.get("/big", 1.0)
        with pytest.raises(HttpError, match="status line"):
            await client.get("/bad", 1.0)
        with pytest.raises(HttpError, match="Content-Length"):
            await client.get("/length", 1.0)


async def test_a_refused_connection_is_an_error_naming_the_engine() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(HttpError, match=f"cannot connect to 127.0.0.1:{port}"):
        await HttpGet(f"http://127.0.0.1:{port}").get("/metrics", 1.0)


def test_only_plain_http_engine_urls() -> None:
    with pytest.raises(ValueError, match="http://"):
        HttpGet("https://engine:8000")
