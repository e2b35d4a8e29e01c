"""``--log-format json`` (or ``SLUICE_LOG_FORMAT=json``): one JSON object per log line, for log shippers.

Keys: ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message`` (arguments applied), ``request_id``
when the record carries one (``extra={"request_id": ...}``: the Check's lines, whose id is Envoy's ``x-request-id``, the
one the engine receives), and ``exception`` with the traceback when there is one."""

from __future__ import annotations

import datetime
import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = str(request_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False)
