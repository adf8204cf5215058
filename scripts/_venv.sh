# Sourced by the scripts beside it: make .venv with skipjack and skipjack-tools (the demo,
# chaos and the benchmarks, in tools/) installed, on Python 3.11+.
set -e
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "skipjack needs Python 3.11 or newer (set PYTHON=...)")'
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# One pip command for both, so that the local skipjack satisfies skipjack-tools' dependency.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" -e ./tools
