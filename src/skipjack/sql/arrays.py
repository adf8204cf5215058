"""Array literals: many values bound as one text parameter."""

from __future__ import annotations

from collections.abc import Iterable


def text_array(items: Iterable[str | None]) -> str:
    """A PostgreSQL array literal of ``items``, bound as one text value and cast in the
    statement (``%(x)s::text[]``, or to ``timestamptz[]`` for ISO 8601 strings). Exact for any
    text (each element is quoted; None is NULL), and far cheaper to bind than a Python list,
    which psycopg adapts element by element."""
    quoted = ("NULL" if i is None else '"' + i.replace("\\", "\\\\").replace('"', '\\"') + '"'
              for i in items)
    return "{" + ",".join(quoted) + "}"


def number_array(items: Iterable[int | float | None]) -> str:
    """A PostgreSQL array literal of finite numbers (None is NULL); see ``text_array``."""
    return "{" + ",".join("NULL" if i is None else repr(float(i)) if isinstance(i, float)
                          else str(int(i)) for i in items) + "}"
