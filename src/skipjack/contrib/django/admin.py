"""A read-only admin of skipjack's jobs (``django.contrib.admin``)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Jobs, newest first, filtered by state and searched by id, task or idempotency key;
    nothing can be added, changed or deleted here."""

    list_display = ("id", "task", "queue", "state", "attempt", "priority", "run_at",
                    "finished_at")
    list_filter = ("state",)
    search_fields = ("=id", "task", "=idempotency_key")
    show_full_result_count = False  # a count of the whole history would read all of it

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Job._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
