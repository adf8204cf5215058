"""The Django application config: migrates skipjack's schema after ``manage.py migrate`` and
imports every installed app's task module."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class SkipjackConfig(AppConfig):
    """``skipjack.contrib.django`` in ``INSTALLED_APPS``."""

    name = "skipjack.contrib.django"
    label = "skipjack"
    verbose_name = "skipjack jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from .application import autodiscover, get_app, register_backend_tasks

        post_migrate.connect(_migrate, sender=self, dispatch_uid="skipjack-migrate")
        get_app()  # the settings are checked now, not at the first enqueue
        autodiscover()
        register_backend_tasks()


def _migrate(sender: AppConfig, using: str = "default", verbosity: int = 1,
             **kwargs: Any) -> None:
    """After ``manage.py migrate`` (and a test database's creation) on skipjack's alias:
    apply skipjack's own migrations (numbered SQL, under an advisory lock; a schema already
    up to date is only read)."""
    from .application import get_app

    app = get_app()
    if using != app.alias:
        return
    applied = app.migrate_django()
    if applied and verbosity >= 1:
        print(f"  Applied skipjack migrations {applied} to schema {app.schema!r}")
