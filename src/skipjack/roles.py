"""Least-privilege roles: what a worker role and an enqueue-only role are granted on a
migrated schema (``skipjack roles``).

Three roles keep an installation apart:

- the **owner** migrates: it creates the schema (or is given it with ``CREATE SCHEMA ...
  AUTHORIZATION``) and owns every table, so it alone can alter them;
- a **worker** role runs workers, the dashboard and the operating commands: it reads and
  writes rows of every table, never DDL;
- an **enqueuer** role (a web application) enqueues and reads jobs and waits for their
  results; it cannot claim, change or delete a job.

The grants are statements of ``skipjack.sql.roles``, run by the owner (or a superuser) in one
transaction; running them again changes nothing. Tables added by later migrations are
granted to the worker role by default privileges; run the grants again after an upgrade all
the same, which also covers what the enqueuer needs.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from .errors import ConfigError, SchemaVersionError
from .migrate import pending
from .sql import roles as statements


def _owner(conn: psycopg.Connection[Any], schema: str) -> str:
    """The role owning ``schema``'s tables.

    Raises:
        SchemaVersionError: the schema is missing or has migrations pending.
        ConfigError: the current role is neither that role, a member of it, nor a
            superuser (its grants would do nothing).
    """
    todo = pending(conn, schema)
    row = conn.execute(statements.OWNER, {"schema": schema}).fetchone()
    if todo or row is None:
        raise SchemaVersionError(
            f"schema {schema!r} has migrations pending ({[m.version for m in todo]}): run "
            "`skipjack migrate` as its owner first")
    owner, may_grant = row
    if not may_grant:
        raise ConfigError(f"role {_current(conn)!r} may not grant on schema {schema!r}: run "
                          f"`skipjack roles` as its owner {owner!r} (the role that migrated "
                          "it) or a superuser")
    return str(owner)


def _current(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT current_user").fetchone()
    return str(row[0]) if row else "?"


def _check_role(conn: psycopg.Connection[Any], option: str, role: str, owner: str) -> None:
    """Raises ConfigError: ``role`` does not exist, or is the owner, a member of it, a
    superuser or a CREATEROLE role (it could alter the schema whatever it is granted)."""
    row = conn.execute(statements.ROLE, {"role": role, "owner": owner}).fetchone()
    if row is None:
        raise ConfigError(f"{option}: role {role!r} does not exist (create it first, e.g. "
                          f"CREATE ROLE {sql.Identifier(role).as_string(conn)} LOGIN)")
    if row[0]:
        raise ConfigError(f"{option}: role {role!r} is the schema's owner {owner!r}, a member "
                          "of it, a superuser or may create roles (CREATEROLE): it could alter "
                          "the schema; give it a role of its own")


def grants(conn: psycopg.Connection[Any], schema: str, *, worker: str | None = None,
           enqueuer: str | None = None) -> list[sql.Composed]:
    """The statements that grant ``worker`` and ``enqueuer`` their privileges on ``schema``
    (only reads, to check the schema and the roles).

    Args:
        conn: a connection as the schema's owner, a member of it, or a superuser.
        schema: a migrated skipjack schema.
        worker: the role workers (and the dashboard, and the CLI's operating commands) log in
            as, or None.
        enqueuer: the role of an application that only enqueues and reads jobs, or None.

    Raises:
        SchemaVersionError: the schema is missing or has migrations pending.
        ConfigError: neither role given, or both the same; the current role may not grant on
            the schema; or a role does not exist, is the owner, a member of it, a superuser
            or a CREATEROLE role.
    """
    if worker is None and enqueuer is None:
        raise ConfigError("give a worker role, an enqueuer role, or both")
    if worker is not None and worker == enqueuer:
        raise ConfigError(f"the worker and the enqueuer are both {worker!r}: give each its "
                         "own role (a worker role can already enqueue)")
    owner = _owner(conn, schema)
    names = {"schema": sql.Identifier(schema), "owner": sql.Identifier(owner)}
    out: list[sql.Composed] = []
    for option, role, templates in (("--worker", worker, statements.WORKER),
                                    ("--enqueuer", enqueuer, statements.ENQUEUER)):
        if role is None:
            continue
        _check_role(conn, option, role, owner)
        key = option.removeprefix("--")
        out += [sql.SQL(t).format(**names, **{key: sql.Identifier(role)}) for t in templates]
    return out


def grant(conn: psycopg.Connection[Any], schema: str, *, worker: str | None = None,
          enqueuer: str | None = None) -> list[sql.Composed]:
    """Run ``grants(...)`` in one transaction and commit; returns the statements run.

    Raises:
        SchemaVersionError: as ``grants``.
        ConfigError: as ``grants``.
        psycopg.Error: the database refused a statement (nothing of this call is kept).
    """
    with conn.transaction():
        done = grants(conn, schema, worker=worker, enqueuer=enqueuer)
        for statement in done:
            conn.execute(statement)
    return done


def grants_sql(conn: psycopg.Connection[Any], done: list[sql.Composed]) -> str:
    """The statements ``done`` as one transaction of SQL text, for a DBA to review and
    run."""
    body = [s.as_string(conn) + ";" for s in done]
    return "\n".join(["BEGIN;", *body, "COMMIT;"]) + "\n"


def check_worker(conn: psycopg.Connection[Any], schema: str) -> None:
    """Refuse to run a worker as a role that lacks a worker's privileges on ``schema``.

    Raises:
        ConfigError: naming the role, what it lacks, and how to grant it.
    """
    lacks = conn.execute(statements.WORKER_LACKS, {"schema": schema}).fetchall()
    if lacks:
        missing = ", ".join(f"{privilege} on {table}" for table, privilege in lacks)
        raise ConfigError(f"role {_current(conn)!r} cannot run a worker on schema {schema!r}: "
                          f"it lacks {missing}; give it a worker role's privileges "
                          "(`skipjack roles --worker ROLE`, run by the schema's owner)")
