"""``manage.py skipjack COMMAND ...``: every ``skipjack`` command (worker, migrate, stats,
jobs, queues, cron, dashboard, ...) with the project's app of ``settings.SKIPJACK``, e.g.
``python manage.py skipjack worker --queue default --concurrency 8``."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = ("Run a skipjack command with the project's app (settings.SKIPJACK): "
            "`manage.py skipjack --help` lists them.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        """Hand everything after ``skipjack`` to the skipjack command line (its own options
        and help), without Django's option parsing."""
        self._run(argv[2:], prog=f"{argv[0]} {argv[1]}")

    def handle(self, *args: Any, **options: Any) -> None:
        """For ``call_command("skipjack", "stats")``."""
        self._run(list(args), prog="skipjack")

    def _run(self, args: list[str], prog: str) -> None:
        from skipjack.cli import run

        from ...application import get_app

        run(args, obj={"app": get_app()}, prog_name=prog)
