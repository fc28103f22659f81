"""The service's log: one format for vlserve's and uvicorn's lines (text with the level, or one JSON object a line),
one level for both (settings.log_level), and an access line for every answer that carries its request id, so an id a
client quotes (X-Request-ID, a problem's `request_id`) finds its line."""
from __future__ import annotations

import json
import logging
import logging.config
from datetime import datetime, timezone
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import request_id, sent_path
from .metrics import ANSWERED
from .settings import LOG_FORMATS, LOG_TEXT_FORMAT

# the fields an access line carries beside its message (JSON keys; `extra` of the record)
ACCESS_FIELDS = ("request_id", "client", "method", "path", "endpoint", "status", "duration_ms")
TRACE = 5  # uvicorn's level below DEBUG
access_log = logging.getLogger("vlserve.access")


def level_number(level: str) -> int:
    """A level of settings.LOG_LEVELS (uvicorn's names) as the logging module's number."""
    return TRACE if level == "trace" else logging.getLevelName(level.upper())


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, an access line's fields, and the
    exception's traceback as one string. A handler writes each record in one call under its lock: lines of concurrent
    requests never interleave."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        entry.update({name: getattr(record, name) for name in ACCESS_FIELDS if hasattr(record, name)})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=True, default=str)


class ServerName(logging.Filter):
    """uvicorn writes its server lines ("Started server process", "Uvicorn running on") as the logger uvicorn.error:
    shown as `uvicorn`, so that a line's logger never reads as an error it is not."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def log_config(level: str, fmt: str) -> dict[str, Any]:
    """A logging.config.dictConfig for the server (uvicorn's log_config): every logger writes through one stderr handler
    in `fmt`; uvicorn's own access lines are off (AccessLog writes them with the request id)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(LOG_FORMATS)}")
    logging.addLevelName(TRACE, "TRACE")
    formatter = {"()": JSONFormatter} if fmt == "json" else {"format": LOG_TEXT_FORMAT}
    number = level_number(level)
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vlserve": formatter},
        "filters": {"server_name": {"()": ServerName}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "vlserve", "stream": "ext://sys.stderr",
                                "filters": ["server_name"]}},
        "root": {"handlers": ["stderr"], "level": number},
        "loggers": {name: {"handlers": [], "level": number, "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def configure(level: str, fmt: str) -> dict[str, Any]:
    """Apply log_config now (lines logged while the models load use it too) and return it for uvicorn."""
    config = log_config(level, fmt)
    logging.config.dictConfig(config)
    return config


def error_line(message: str, fmt: str) -> str:
    """The line `vlserve serve` ends with when it cannot serve: `error: ...`, or in the JSON format an object at
    level error (shown whatever the log level: it is the command's message, not a log record)."""
    if fmt != "json":
        return f"error: {message}"
    record = logging.LogRecord("vlserve", logging.ERROR, "", 0, message, None, None)
    return JSONFormatter().format(record)


def _printable(text: str) -> str:
    """A client's string in a log line: control characters (CR, LF, ESC) escaped, so it cannot forge or colour lines."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


class AccessLog:
    """An INFO line for every HTTP answer: client, method, path, status, duration and request id (a client that
    left before its answer: status 499). Outside metrics.MetricsMiddleware, whose count of the answer (route,
    status, seconds) it writes; outside errors.InternalErrors, whose 500 that count already is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.INFO):
            return await self.app(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            endpoint, status, seconds = scope["state"][ANSWERED]
            client = scope.get("client")
            fields = {"request_id": request_id(scope), "client": f"{client[0]}:{client[1]}" if client else "-",
                      "method": _printable(scope["method"][:16]), "path": _printable(sent_path(scope)[:256]),
                      "endpoint": endpoint, "status": status, "duration_ms": round(seconds * 1000, 1)}
            access_log.info("%s %s %s %d %.1f ms request_id=%s", fields["client"], fields["method"], fields["path"],
                            fields["status"], fields["duration_ms"], fields["request_id"], extra=fields)
