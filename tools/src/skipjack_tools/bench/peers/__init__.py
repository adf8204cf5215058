"""The peers of ``skipjack bench --compare``: other PostgreSQL queues for Python.

Each peer runs in a virtualenv of its own under ``~/.cache/skipjack-bench/venvs/NAME``
(created on first use with ``python -m venv`` and pip), through a driver script of ours in
this folder that uses only the peer's public API and prints its figures as JSON.
"""
