"""``skipjack worker --reload``, for development: the worker runs in a child process that is
stopped and started again whenever a Python file under the watched directories changes.

The watching is watchfiles' (``pip install 'skipjack[reload]'``): changes are batched for
1.6 s, files under ``.git``, ``__pycache__``, ``.venv`` and the like are ignored, and only
``*.py``, ``*.pyx`` and ``*.pyd`` files count. A restart sends the worker SIGINT, which stops
it as SIGTERM would (its running jobs get ``--grace`` to finish, then are released), and
SIGKILLs it if it is still running 5 s after that grace. Jobs of a killed worker are rescued
after their lease, as always. SIGTERM or SIGINT to the watching process stops both.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
from collections.abc import Sequence

from .errors import ConfigError

log = logging.getLogger("skipjack.reload")

STOP_MARGIN = 5.0  # seconds past the worker's grace before a restart SIGKILLs it


def without_reload(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--reload`` and ``--reload-dir DIR`` (or ``--reload-dir=DIR``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--reload":
            pass
        elif arg == "--reload-dir":
            skip = True
        elif not arg.startswith("--reload-dir="):
            out.append(arg)
    return out


def run(command: list[str], paths: Sequence[str], *, grace: float) -> int:
    """Run ``command`` (a worker's full command line, without ``--reload``) and run it
    again whenever a Python file under ``paths`` changes, until SIGTERM or SIGINT.

    Args:
        command: the program and its arguments.
        paths: directories to watch (recursively).
        grace: the worker's shutdown grace, in seconds.

    Returns:
        The number of restarts.

    Raises:
        ConfigError: watchfiles is not installed, or a path is not a directory.
    """
    try:
        import watchfiles
    except ModuleNotFoundError as exc:
        if exc.name != "watchfiles":
            raise
        raise ConfigError("--reload needs watchfiles: pip install 'skipjack[reload]'") from None
    for path in paths:
        if not os.path.isdir(path):
            raise ConfigError(f"--reload-dir: {path!r} is not a directory")
    # the worker's own command must not watch too, whatever the environment says
    os.environ["SKIPJACK_WORKER_RELOAD"] = "false"

    def changed(changes: set[tuple[watchfiles.Change, str]]) -> None:
        names = sorted({os.path.relpath(path) for _, path in changes})
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        log.info("changed: %s; restarting the worker", shown)

    log.info("watching %s for changes to Python files", ", ".join(map(str, paths)))
    return watchfiles.run_process(*paths, target=shlex.join(command), target_type="command",
                                  watch_filter=watchfiles.PythonFilter(), callback=changed,
                                  sigint_timeout=math.ceil(grace + STOP_MARGIN))
