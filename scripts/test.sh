#!/bin/sh
# Install skipjack and skipjack-tools into .venv, lint, type-check and check the import layers,
# then run the test suite against the embedded PostgreSQL 18 and, when it answers, the server
# at 127.0.0.1:5432: in two processes, one for each server's tests (tests/conftest.py);
# arguments go to pytest, so `-n 0` runs it in one.
. "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check src tests tools examples
.venv/bin/mypy
.venv/bin/lint-imports --no-cache   # the layers in pyproject.toml: no upward import, no cycle
exec .venv/bin/pytest -n 2 "$@"
