"""Loading a config: the file read (or the bundled default, ``controlplane/default.yaml``), parsed, and each engine's
hostname resolved to an address. ``parse_config`` stays pure; this is the I/O around it. A name that does not resolve is
a config problem with its dotted path, and refuses the config (or the reload)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from controlplane.config.check import ConfigError
from controlplane.config.parse import parse_config
from controlplane.config.types import Config, EngineConfig

BUNDLED_CONFIG = "default.yaml"
"""The embedded default (``make run``, ``sluice up`` without a file), package data of ``controlplane``."""


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_engines(config: Config) -> Config:
    """``config`` with every engine's hostname resolved to an address (``loop.getaddrinfo``, all engines at once); raise
    ``ConfigError`` naming each engine whose host does not resolve (``engines[i].url: cannot resolve ...``). An engine
    whose host already is an address is kept as is, so resolving twice costs nothing."""
    loop = asyncio.get_running_loop()

    async def address(engine: EngineConfig) -> str:
        infos = await loop.getaddrinfo(engine.host, engine.port, type=socket.SOCK_STREAM)
        return str(infos[0][4][0])

    named = [(i, e) for i, e in enumerate(config.engines) if e.host and not _is_address(e.host)]
    if not named:
        return config
    answers = await asyncio.gather(*(address(e) for _, e in named), return_exceptions=True)
    engines = list(config.engines)
    problems = []
    for (i, engine), answer in zip(named, answers):
        if isinstance(answer, BaseException):
            if not isinstance(answer, OSError):
                raise answer
            problems.append(f"engines[{i}].url: cannot resolve {engine.host!r}: {answer}")
        else:
            engines[i] = replace(engine, host=answer)
    if problems:
        raise ConfigError(problems)
    return replace(config, engines=tuple(engines))


def read_raw(path: str | None) -> tuple[Any, str]:
    """The YAML mapping at ``path`` (the bundled default when None) and the source name a config keeps."""
    if path is None:
        text = resources.files("controlplane").joinpath(BUNDLED_CONFIG).read_text()
        source = f"bundled:{BUNDLED_CONFIG}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"(file): cannot read {path}: {exc}"]) from None
        source = path
    try:
        return yaml.safe_load(text), source
    except yaml.YAMLError as exc:
        raise ConfigError([f"(yaml): {exc}"]) from None


def load_config(path: str | None) -> Config:
    """Load and validate ``path``, or the bundled embedded default when ``path`` is None. Engine hostnames are not
    resolved: run ``resolve_engines`` on the result (or use ``load_resolved_config``) before anything uses them."""
    raw, source = read_raw(path)
    return parse_config(raw, source)


async def load_resolved_config(path: str | None) -> Config:
    """``load_config`` (the file read in a thread) then ``resolve_engines``: what a control plane runs at start-up and on a
    reload, without blocking its event loop. Raises ``ConfigError``."""
    return await resolve_engines(await asyncio.to_thread(load_config, path))


def resolve_engines_blocking(config: Config) -> Config:
    """``resolve_engines`` for synchronous callers (CLIs before they start anything). Runs the resolution on an event loop
    of its own in a worker thread, so it works whether or not the caller's thread runs a loop."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resolve") as pool:
        return pool.submit(asyncio.run, resolve_engines(config)).result()
