"""A read-only admin of skipjack's jobs (``django.contrib.admin``)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from .models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Jobs, newest first, filtered by state and searched by id, task or idempotency key;
    nothing can be added, changed or deleted here."""

    list_display = ("id", "task", "queue", "state", "attempt", "priority", "run_at",
                    "finished_at")
    list_filter = ("state",)
    search_fields = ("task", "=idempotency_key")
    search_help_text = "A job id, or part of a task name, or an idempotency key."
    show_full_result_count = False  # a count of the whole history would read all of it

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        # the list shows a few columns: args, results and errors can be megabytes a row
        return super().get_queryset(request).defer("args", "result", "errors", "metadata",
                                                   "progress")

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Job],
                           search_term: str) -> tuple[QuerySet[Job], bool]:
        term = search_term.strip()
        if term.isascii() and term.isdigit() and int(term) < 2**63:  # an id: its index
            return queryset.filter(id=int(term)), False
        return super().get_search_results(request, queryset, search_term)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Job._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
