#!/bin/sh
# Install skipjack and skipjack-tools into .venv, lint and type-check them, and run the test
# suite against the embedded PostgreSQL 18 and, when it answers, the server at 127.0.0.1:5432.
. "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check src tests tools
.venv/bin/mypy
exec .venv/bin/pytest "$@"
