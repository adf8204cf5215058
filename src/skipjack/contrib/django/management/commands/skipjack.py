"""``manage.py skipjack COMMAND ...``: every ``skipjack`` command (worker, migrate, stats,
jobs, queues, cron, dashboard, ...) with the project's app of ``settings.SKIPJACK``, e.g.
``python manage.py skipjack worker --queue default --concurrency 8``.

``manage.py skipjack`` exits with the command's status (0 on success, 1 or 2 on failure, as
``skipjack`` does). ``call_command("skipjack", "stats")`` returns on success and raises
``CommandError`` (with the status as its ``returncode``) on failure; its output goes to the
``stdout``/``stderr`` given to ``call_command``, and the process's logging is as it was
once it returns."""

from __future__ import annotations

import argparse
import io
import logging
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import IO, Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

# Characters of the command's error output that CommandError's message repeats.
ERROR_TAIL_CHARS = 2000


class Command(BaseCommand):
    help = ("Run a skipjack command with the project's app (settings.SKIPJACK): "
            "`manage.py skipjack --help` lists them.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        """Hand everything after ``skipjack`` to the skipjack command line (its own options
        and help), without Django's option parsing; exits with the command's status.

        Raises:
            SystemExit: always, with the command's exit status.
        """
        self._run(argv[2:], prog=f"{argv[0]} {argv[1]}")

    def handle(self, *args: Any, **options: Any) -> None:
        """For ``call_command("skipjack", "stats")``: returns when the command succeeds.

        Raises:
            CommandError: the command failed; ``returncode`` is its exit status and the
                message ends with what it printed on stderr (the last
                ``ERROR_TAIL_CHARS`` characters).
        """
        out: IO[str] = options.get("stdout") or sys.stdout
        err: IO[str] = options.get("stderr") or sys.stderr
        tail = _Tail(err)
        try:
            with _logging_kept(), redirect_stdout(out), redirect_stderr(tail):
                self._run(list(args), prog="skipjack")
        except SystemExit as exc:
            status = _status(exc.code)
            if status == 0:
                return
            said = tail.text().strip()
            raise CommandError(f"skipjack {shlex.join(args)} failed (exit status {status})"
                               + (f": {said}" if said else ""), returncode=status) from None

    def _run(self, args: list[str], prog: str) -> None:
        from skipjack.cli import run

        from ...application import get_app

        run(args, obj={"app": get_app()}, prog_name=prog)


def _status(code: object) -> int:
    """An exit status from ``SystemExit.code`` (None: 0; a message: 1, as Python does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


class _Tail(io.TextIOBase):
    """A text stream that writes through to ``target`` and keeps the last
    ``ERROR_TAIL_CHARS`` characters written."""

    def __init__(self, target: IO[str]) -> None:
        super().__init__()
        self._target = target
        self._kept = ""

    def write(self, text: str) -> int:
        self._target.write(text)
        self._kept = (self._kept + text)[-ERROR_TAIL_CHARS:]
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def writable(self) -> bool:
        return True

    def text(self) -> str:
        """What was written last (at most ``ERROR_TAIL_CHARS`` characters)."""
        return self._kept


@contextmanager
def _logging_kept() -> Iterator[None]:
    """Restore the root logger's handlers and level when the block ends: the skipjack
    command line sets up logging for a process of its own, not for the caller's."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
