"""Privileges for least-privilege roles (``skipjack.roles``): a worker role and an
enqueue-only role, granted on a migrated schema by the role that owns it.

``{worker}``, ``{enqueuer}`` and ``{owner}`` stand for quoted role names; nothing is
interpolated. Neither role gets CREATE on the schema, TRUNCATE, or ownership of anything, so
neither can alter, drop or add tables.
"""

from __future__ import annotations

# Who owns the schema's jobs table (the role that migrated), and whether the current role
# may grant on its behalf (it is that role, a member of it, or a superuser).
OWNER = """
SELECT t.tableowner,
       pg_has_role(current_user, t.tableowner, 'USAGE')
           OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
  FROM pg_tables AS t
 WHERE t.schemaname = %(schema)s AND t.tablename = 'jobs'
"""

# Whether a role exists, and whether it is (or inherits) the owner, is a superuser, or may
# create roles (before PostgreSQL 16 such a role can grant itself the owner): any of these
# could alter the schema whatever is granted to it.
ROLE = """
SELECT pg_has_role(r.rolname, %(owner)s, 'USAGE') OR r.rolsuper OR r.rolcreaterole
  FROM pg_roles AS r WHERE r.rolname = %(role)s
"""

# A worker claims, runs and finishes jobs, enqueues (cron, retries by hand), keeps the
# registry of live workers, the throughput rollup and cron slots, and prunes: every row of
# every table but the migrations, which it only reads (to check the schema's version). Tables
# a later migration adds are granted to it by default.
WORKER = [
    "GRANT USAGE ON SCHEMA {schema} TO {worker}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {worker}",
    "REVOKE INSERT, UPDATE, DELETE ON {schema}.migrations FROM {worker}",
    "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {worker}",
    "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {worker}",
    "ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema}"
    " GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {worker}",
    "ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema}"
    " GRANT USAGE, SELECT ON SEQUENCES TO {worker}",
]

# An enqueuer (a web application, say) inserts jobs and reads them: the enqueue's RETURNING
# and its look-up of held idempotency keys, a handle's result. The one column it may change
# is ``awaited``, which a caller waiting for a job's outcome sets; it can neither claim nor
# change nor delete a job.
ENQUEUER = [
    "GRANT USAGE ON SCHEMA {schema} TO {enqueuer}",
    "GRANT SELECT ON {schema}.migrations TO {enqueuer}",
    "GRANT SELECT, INSERT ON {schema}.jobs TO {enqueuer}",
    "GRANT UPDATE (awaited) ON {schema}.jobs TO {enqueuer}",
    "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {enqueuer}",
]

# What a worker needs and its role lacks (table, privilege), read by a worker as it starts so
# that a role without them (an enqueuer's) is refused at once, rather than retrying claims.
WORKER_LACKS = """
SELECT t.name, t.privilege
  FROM (VALUES ('jobs', 'SELECT'), ('jobs', 'UPDATE'), ('jobs', 'INSERT'), ('jobs', 'DELETE'),
               ('queues', 'SELECT'), ('workers', 'INSERT'), ('workers', 'DELETE'),
               ('cron_slots', 'INSERT'), ('throughput', 'INSERT')) AS t(name, privilege)
 WHERE NOT has_table_privilege(format('%%I.%%I', %(schema)s::text, t.name), t.privilege)
"""
