"""``--log-format json``: a record becomes one JSON line, carrying the request id the Check's lines pass."""

from __future__ import annotations

import json
import logging
import sys

from sluice.cli import _setup_logging
from sluice.logfmt import JsonFormatter


def _record(**extra: object) -> logging.LogRecord:
    logger = logging.getLogger("sluice.test")
    return logger.makeRecord("sluice.test", logging.WARNING, __file__, 1, "Check %s: %s", ("req-1", "admit"), None,
                             extra=extra)


def test_a_record_is_one_json_line_with_its_request_id() -> None:
    line = JsonFormatter().format(_record(request_id="9b2c-req"))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["logger"] == "sluice.test"
    assert entry["message"] == "Check req-1: admit"
    assert entry["request_id"] == "9b2c-req"
    assert entry["time"].endswith("+00:00")
    assert "request_id" not in json.loads(JsonFormatter().format(_record()))


def test_an_exception_stays_on_the_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("x").makeRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exception"]


def test_the_cli_option_installs_the_formatter(monkeypatch: object) -> None:
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        _setup_logging(False, "json")
        assert any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    finally:
        root.handlers[:] = saved
