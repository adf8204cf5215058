# Sourced by the scripts beside it: make .venv with skipjack and skipjack-tools (the demo,
# chaos and the benchmarks, in tools/) installed, on Python 3.11+ (3.12+ where present).
set -e
cd "$(dirname "$0")/.."
# Django 6 (tests/django_project) needs Python 3.12+: take one where the machine has it (on
# PATH or under pyenv), else python3 (the Django tests are then skipped, saying why).
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    for candidate in python3.12 python3.13 "$HOME"/.pyenv/versions/3.12*/bin/python \
            "$HOME"/.pyenv/versions/3.13*/bin/python; do
        if "$candidate" -c 'import ssl, sqlite3' >/dev/null 2>&1; then
            PYTHON=$candidate
            break
        fi
    done
fi
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "skipjack needs Python 3.11 or newer (set PYTHON=...)")'
wanted=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -x .venv/bin/python ] && [ "$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$wanted" ]; then
    rm -rf .venv  # made with another Python
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# One pip command for both, so that the local skipjack satisfies skipjack-tools' dependency.
# SKIPJACK_VENV_EXTRAS names skipjack's extras to add (default: test; empty: none).
extras="${SKIPJACK_VENV_EXTRAS-test}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -e ".${extras:+[$extras]}" -e ./tools
