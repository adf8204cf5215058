"""Django integration (extra ``skipjack[django]``, Django 6+ on its psycopg 3 backend).

Add ``"skipjack.contrib.django"`` to ``INSTALLED_APPS`` and, optionally, a ``SKIPJACK``
setting (every key optional)::

    SKIPJACK = {
        "DATABASE": "default",      # the alias of DATABASES holding the jobs
        "SCHEMA": "skipjack",       # the schema of skipjack's tables
        "AUTODISCOVER": "tasks",    # the module imported from every installed app (None: off)
        "POOL_SIZE": 4,             # the app's own connections (reads, result waits)
        "PREPARE": True,            # False behind a pooler without prepared statements
        "MAX_ARGS_BYTES": 1048576,  # see skipjack.App
    }

Then declare tasks on the project's app, ``from skipjack.contrib.django import app``, in a
``tasks.py`` of any installed app. ``manage.py migrate`` also migrates skipjack's schema;
``manage.py skipjack worker`` (and every other ``skipjack`` command) runs with this app.
An enqueue without ``conn`` joins Django's connection: inside ``transaction.atomic()`` the
job commits or rolls back with it. ``transaction="complete"`` handlers run inside
``transaction.atomic()`` on Django's connection, so their ORM writes commit with the fenced
completion, exactly once. ``skipjack.contrib.django.tasks`` is a backend for Django's
own Tasks framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .application import DjangoApp

__all__ = ["DjangoApp", "app"]


def __getattr__(name: str) -> Any:
    """``app``: the project's ``DjangoApp``, made from the settings on first use."""
    if name == "app":
        from .application import get_app
        return get_app()
    if name == "DjangoApp":
        from .application import DjangoApp
        return DjangoApp
    raise AttributeError(name)
