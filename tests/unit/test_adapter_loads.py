"""Dynamic LoRA loading's choices (core/adapterloads.py): where an adapter no engine lists is loaded, what is unloaded
to make room, the per-engine rate limit; and the ``adapters`` keys that configure it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, cast

import pytest

from controlplane.config import ConfigError, parse_config
from controlplane.core.adapterloads import LoadBook, plan_load
from controlplane.core.adapters import AdapterPolicy
from controlplane.core.decide import decide
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet
from controlplane.core.model import Reason, Verdict
from controlplane.core.policy import Policy
from tests.unit.test_adapters import BASE, ask

ON = Policy(default_max_tokens=100, adapters=AdapterPolicy(
    dynamic_loading=True, base_models={"sql": BASE, "chat": BASE, "code": BASE},
    paths={"sql": "/loras/sql", "chat": "/loras/chat", "code": "/loras/code"}, loads_per_minute=2))
ALL = frozenset({"fast", "slow", "e"})


def view(name: str, *, listed: tuple[str, ...] = (), running: int = 0, decode: float = 20.0, slots: int = 2,
         stale: bool = False) -> EngineView:
    models = (ServedModel(BASE, 32_768), *(ServedModel(a, None, BASE) for a in listed))
    return EngineView(name=name, url=f"http://{name}", max_num_seqs=4, models=models,
                      sample=EngineSample(0.0, running=running, waiting=0, kv_usage=0.0, kv_capacity_tokens=100_000),
                      last_ok_at=0.0, stale=stale, max_loras=slots, anchor_prefill_tokens_per_s=1000.0,
                      anchor_decode_tokens_per_s=decode)


def test_an_adapter_is_loaded_where_its_request_would_finish_soonest() -> None:
    plan = plan_load("sql", Fleet((view("slow", decode=10.0), view("fast", decode=40.0))), ON, ALL, LoadBook(), 0.0)
    assert plan is not None and (plan.engine, plan.path, plan.base, plan.unload) == ("fast", "/loras/sql", BASE, None)


@pytest.mark.parametrize(("policy", "engines", "loadable", "why"), [
    (Policy(adapters=replace(ON.adapters, dynamic_loading=False)), (view("e"),), ALL, "off"),
    (ON, (view("e", listed=("sql",)),), ALL, "listed already"),
    (ON, (view("e"),), frozenset(), "no engine allows runtime loading"),
    (ON, (view("e", stale=True),), ALL, "stale engines only"),
], ids=["off", "listed", "not-loadable", "stale"])
def test_nothing_is_loaded(policy: Policy, engines: tuple[EngineView, ...], loadable: frozenset[str],
                           why: str) -> None:
    assert plan_load("sql", Fleet(engines), policy, loadable, LoadBook(), 0.0) is None, why
    assert plan_load("unconfigured", Fleet(engines), ON, loadable, LoadBook(), 0.0) is None


def test_a_full_engine_unloads_its_least_recently_used_adapter_that_sluice_loaded() -> None:
    book = LoadBook()
    for adapter in ("chat", "code"):
        book.note_load("e", adapter, 0.0)
    e = view("e", listed=("chat", "code"))
    f = Fleet((e,), adapters={"chat": BASE, "code": BASE}, adapter_recent={"e": ("code", "chat")})
    plan = plan_load("sql", f, ON, ALL, book, 100.0)
    assert plan is not None and plan.unload == "chat"  # code was admitted more recently
    book.note_unload("e", "chat")
    assert book.loaded("e") == {"code"}
    # Listed at start (not loaded by sluice): never unloaded.
    assert plan_load("sql", f, ON, ALL, LoadBook(), 100.0).unload is None  # type: ignore[union-attr]


def test_loads_per_engine_are_rate_limited_over_a_minute() -> None:
    book = LoadBook()
    f = Fleet((view("e"),))
    book.note_load("e", "chat", 0.0)
    book.note_load("e", "code", 10.0)
    assert plan_load("sql", f, ON, ALL, book, 59.0) is None  # two in the last minute: the limit
    assert plan_load("sql", f, ON, ALL, book, 60.5) is not None  # the first left the window


def test_a_loadable_adapter_nobody_lists_is_shed_for_now_not_refused() -> None:
    d = decide(ask("sql"), Fleet((view("e"),)), ON, now=0.0)
    assert d.verdict is Verdict.SHED and d.reason is Reason.NO_READY_ENGINE and d.retry_after_s
    refused = decide(ask("sql"), Fleet((view("e"),)), Policy(default_max_tokens=100), now=0.0)
    assert refused.reason is Reason.UNKNOWN_MODEL


def test_configuration_names_paths_of_adapters_with_a_base() -> None:
    engines = [{"name": "e", "url": "http://127.0.0.1:1", "runtime_lora_updating": True}]
    config = parse_config({"engines": engines, "adapters": {
        "dynamic_loading": True, "loads_per_minute": 3, "models": {"sql": BASE}, "paths": {"sql": "/loras/sql"}}})
    ap = config.policy.adapters
    assert ap.dynamic_loading and ap.loads_per_minute == 3 and dict(ap.paths) == {"sql": "/loras/sql"}
    assert config.engines[0].runtime_lora_updating
    with pytest.raises(ConfigError, match="adapters.paths.chat: needs its base model"):
        parse_config({"engines": engines, "adapters": {"paths": {"chat": "/loras/chat"}}})
    with pytest.raises(ConfigError, match="adapters.loads_per_minute"):
        parse_config({"engines": engines, "adapters": {"loads_per_minute": 0}})
    with pytest.raises(ConfigError, match="adapters.load_timeout_seconds: must stay 20 s below"):
        parse_config({"engines": engines, "adapters": {"dynamic_loading": True, "load_timeout_seconds": 290}})


def test_a_runtime_load_is_listed_until_the_engines_own_list_says_otherwise() -> None:
    """``EnginePoller.set_runtime_model``: a loaded adapter is listed at once; a view from before the engine listed it
    (the probe worker's) keeps it; once a listing shows it, the engine's list alone counts (an engine that lost it
    later drops it); an unload hides it the same way. A listing asked for after the load wins outright."""
    from controlplane.observe.poller import EnginePoller

    config = parse_config({"engines": [{"name": "e", "url": "http://127.0.0.1:1"}]})
    clock = [10.0]
    poller = EnginePoller(config.engines[0], config.observe, on_probe=lambda view, rates: None,
                          clock=lambda: clock[0])
    plain = view("e")
    poller.adopt(plain)
    poller.set_runtime_model("sql", ServedModel("sql", None, BASE))
    assert poller.latest.serves("sql")
    poller.adopt(plain)  # the worker's view, from before the load
    assert poller.latest.serves("sql")
    poller.adopt(view("e", listed=("sql",)))  # the engine lists it: its list is the truth from now on
    poller.adopt(plain)
    assert not poller.latest.serves("sql")
    poller.adopt(view("e", listed=("chat",)))
    poller.set_runtime_model("chat", None)
    assert not poller.latest.serves("chat")
    poller.adopt(view("e", listed=("chat",)))  # still listed by a view from before the unload
    assert not poller.latest.serves("chat")
    clock[0] = 20.0
    asked_after = poller._with_runtime(view("e", listed=("chat",)), listed_since=15.0)
    assert asked_after.serves("chat")  # a listing asked for after the unload is the truth


class _OneEngine:
    """What AdapterLoader reads of the observation: one engine ``e`` (1 adapter slot, ``chat`` listed) at ``url``."""

    def __init__(self, url: str) -> None:
        self.view = replace(view("e", listed=("chat",), slots=1), url=url)
        self.noted: list[tuple[str, bool]] = []

    def serves(self, model: str) -> bool:
        return self.view.serves(model)

    def fleet(self, now: float) -> Fleet:
        return Fleet((self.view,))

    def view_of(self, name: str, now: float) -> EngineView | None:
        return self.view

    def note_adapter(self, engine: str, adapter: str, model: ServedModel | None) -> None:
        self.noted.append((adapter, model is not None))
        kept = tuple(m for m in self.view.models if m.model_id != adapter)
        self.view = replace(self.view, models=(*kept, model) if model is not None else kept)


async def test_concurrent_loads_book_the_rate_limit_and_the_victim_when_planned() -> None:
    """Two Checks for two adapters nobody lists arrive together; the engine takes one load a minute and has one adapter
    slot, holding ``chat`` (loaded by sluice, idle). The first plan books the minute's load and unlists ``chat`` at once,
    so the second finds no engine to load on: one unload of ``chat`` and one load reach the engine, not two of each."""
    from aiohttp import web

    from controlplane.core.admission import AdmissionCore
    from controlplane.core.ledger import Ledger
    from controlplane.metrics import SluiceMetrics
    from controlplane.observe.adapterloader import AdapterLoader

    posts: list[tuple[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        posts.append((request.path.rsplit("/", 1)[1].split("_")[0], (await request.json())["lora_name"]))
        await asyncio.sleep(0.05)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", handle)
    app.router.add_post("/v1/unload_lora_adapter", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        config = parse_config({"engines": [{"name": "e", "url": f"http://127.0.0.1:{port}",
                                            "runtime_lora_updating": True}]})
        core = AdmissionCore(replace(ON, adapters=replace(ON.adapters, loads_per_minute=1)), Ledger(600))
        observation = _OneEngine(f"http://127.0.0.1:{port}")
        loader = AdapterLoader(config, core, cast(Any, observation), SluiceMetrics(), lambda: 100.0)
        loader.book.note_load("e", "chat", 0.0)  # sluice loaded chat there long ago
        await asyncio.gather(loader.ensure("sql"), loader.ensure("code"))
    finally:
        await runner.cleanup()
    assert sorted(posts) == [("load", "sql"), ("unload", "chat")] or sorted(posts) == [("load", "code"),
                                                                                       ("unload", "chat")]
    assert ("chat", False) in observation.noted
