#!/bin/sh
# Install skipjack and skipjack-tools into .venv, lint, type-check and check the import layers,
# then run the test suite against the embedded PostgreSQL 18 and, when it answers, the server
# at 127.0.0.1:5432.
. "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check src tests tools examples
.venv/bin/mypy
.venv/bin/lint-imports --no-cache   # the layers in pyproject.toml: no upward import, no cycle
exec .venv/bin/pytest "$@"
