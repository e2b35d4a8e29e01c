"""The engines' prompt-token counters as a second source of prompt_tokens.py's samples (decision 0002): a request
served without ``usage`` (a client that streams without ``stream_options.include_usage``) teaches the token rule
nothing by itself, but its engine's cumulative prompt-token counter (vLLM ``vllm:prompt_tokens_total``, SGLang's,
llama.cpp's) counted its prompt.

A counter counts every prompt the engine took, so it says something of sluice's estimates only over a stretch where
sluice knows every one of them. A **window** per engine opens at a *quiet* probe (the engine reported nothing running
and nothing waiting, and this replica's ledger holds no ticket on it) and closes at the next quiet probe. In between,
every request the engine took was admitted and released here: the counter's growth is exactly their prompt tokens.
Each release (``released``) must be accounted for by what its Check counted (``served``: characters, messages,
estimate); the closed window is one sample of the average request, ``(sum chars / n, sum messages / n, growth / n)``,
weighted as one sample.

A window says nothing, and is dropped, when any release on its engine is not accounted for (another replica's
release, a reaped or lapsed ticket, an access-log entry without the Check's counts), when a request failed (its
prompt may or may not have been counted), when its requests name more than one model, or when the counter went
backwards or is not reported. Traffic that reaches the engine around the gateway is caught by the fit's outlier
trimming, not here. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core.prompt_tokens import CountedWindow, PromptShape


@dataclass(slots=True)
class _Window:
    opened_at: float
    """The counter's value at the quiet probe that opened it."""
    model: str | None = None
    requests: int = 0
    chars: int = 0
    messages: int = 0
    estimated: int = 0
    unaccounted: int = 0
    """Releases on the engine not (yet) matched by their Check's counts."""
    spoiled: bool = False


class CounterWindows:
    """One open window per engine (module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, _Window] = {}

    def released(self, engine: str) -> None:
        """A ticket on ``engine`` closed; ``served`` accounts for it, or the window is dropped at its close."""
        window = self._open.get(engine)
        if window is not None:
            window.unaccounted += 1

    def served(self, engine: str, model: str, shape: PromptShape, estimated: int, ok: bool) -> None:
        """What the Check counted of a request just released on ``engine`` (its access-log entry); ``ok``: it was
        answered 200 by the engine (anything else: its prompt may or may not be counted, the window says nothing)."""
        window = self._open.get(engine)
        if window is None or window.unaccounted <= 0:
            return
        window.unaccounted -= 1
        if not ok or (window.model is not None and window.model != model):
            window.spoiled = True
            return
        window.model = model
        window.requests += 1
        window.chars += shape.chars
        window.messages += shape.messages
        window.estimated += estimated

    def spoil(self, engine: str) -> None:
        """Something on ``engine`` ended that no count accounts for (a reaped or lapsed ticket)."""
        window = self._open.get(engine)
        if window is not None:
            window.spoiled = True

    def probe(self, engine: str, prompt_tokens_total: float | None, quiet: bool) -> CountedWindow | None:
        """A new probe of ``engine`` landed. At a quiet one the open window closes (returned when it says something) and
        the next opens; a probe without the counter drops the window."""
        if prompt_tokens_total is None:
            self._open.pop(engine, None)
            return None
        if not quiet:
            return None
        window = self._open.get(engine)
        self._open[engine] = _Window(prompt_tokens_total)
        if window is None or window.spoiled or window.unaccounted or not window.requests or window.model is None:
            return None
        growth = prompt_tokens_total - window.opened_at
        if growth <= 0:
            return None
        n = window.requests
        return CountedWindow(window.model, engine, n, window.chars / n, window.messages / n, growth / n,
                             window.estimated / n)

    def forget(self, engine: str) -> None:
        """``engine`` restarted or left: its counter starts again."""
        self._open.pop(engine, None)
