#!/bin/sh
# Install skipjack into .venv and run the webhook demo on the embedded PostgreSQL
# (or on $SKIPJACK_DATABASE_URL / $DATABASE_URL when set). Extra arguments go to `skipjack demo`.
# It installs what the demo needs only (skipjack and its tools), not the test tools.
SKIPJACK_VENV_EXTRAS="" . "$(dirname "$0")/_venv.sh"
exec .venv/bin/skipjack demo "$@"
