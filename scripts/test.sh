#!/bin/sh
# Install skipjack into .venv, lint and type-check it, and run the test suite against the
# embedded PostgreSQL 18 and, when it answers, the server at 127.0.0.1:5432.
. "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check src tests
.venv/bin/mypy
exec .venv/bin/pytest "$@"
