"""Fenced statements about a claimed job: its outcome, and the renewal of its lease.

Both match rows on (id, lease_version, state = 'running'): a write whose fencing token is no
longer current changes nothing (see ``skipjack.sql``)."""

from __future__ import annotations

# One statement records a batch of outcomes, given as one JSON array of objects (see
# skipjack.outcome.outcome_params): one text value binds and parses far faster than six
# arrays. A key an object leaves out is read as null: a plain success sends only id,
# lease_version and kind, and delay is read only for a retry or a release.
# kind is one of
#   'complete' -> succeeded;
#   'retry'    -> runnable again after `delay` seconds, or discarded if attempts are used up;
#   'discard'  -> discarded (dead letter) now;
#   'cancel'   -> cancelled now (a cancellation was requested while it ran);
#   'release'  -> runnable after `delay` seconds, the attempt not counted (shutdown, snooze,
#                 or the job's own transaction lost its connection to the database).
# A job runnable later is 'scheduled', one runnable now 'available'. A job whose
# cancellation was requested ends 'cancelled' instead of being retried or released.
# progress is the handler's last progress report, kept when null.
# error is appended to the job's errors; a release whose error is the last one's again (a job
# of a task the worker does not know, released every few seconds for minutes) replaces that
# entry instead, so that it is kept once, with the time of the latest release.
# Times are statement_timestamp(): in a handler's own transaction now() is its start.
# Rows are matched on (id, lease_version, state = 'running'): stale outcomes change nothing
# and are missing from RETURNING, which gives each written job's new state and, for a retry or
# release, its run_at (when it becomes runnable again; NULL for the others, whose timestamp
# would only cost the worker a parse per job).
_RECORD = """
UPDATE {schema}.jobs AS j
   SET state = CASE
                 WHEN o.kind = 'complete' THEN 'succeeded'
                 WHEN o.kind = 'discard' THEN 'discarded'
                 WHEN o.kind = 'cancel' OR j.cancel_requested THEN 'cancelled'
                 WHEN o.kind = 'retry' AND j.attempt >= j.max_attempts THEN 'discarded'
                 WHEN o.delay > 0 THEN 'scheduled'
                 ELSE 'available'
               END,
       attempt = CASE WHEN o.kind = 'release' THEN j.attempt - 1 ELSE j.attempt END,
       run_at = CASE
                  WHEN o.kind = 'retry' AND j.attempt < j.max_attempts
                    THEN statement_timestamp() + make_interval(secs => o.delay)
                  WHEN o.kind = 'release'
                    THEN statement_timestamp() + make_interval(secs => o.delay)
                  ELSE j.run_at
                END,
       finished_at = CASE
                       WHEN o.kind IN ('complete', 'discard', 'cancel') OR j.cancel_requested
                         THEN statement_timestamp()
                       WHEN o.kind = 'retry' AND j.attempt >= j.max_attempts
                         THEN statement_timestamp()
                     END,
       lease_expires_at = NULL,
       worker = CASE
                  WHEN o.kind IN ('complete', 'discard', 'cancel') OR j.cancel_requested
                       OR (o.kind = 'retry' AND j.attempt >= j.max_attempts)
                    THEN j.worker  -- a finished job keeps the worker that ran it last
                END,
       result = o.result::jsonb,
       progress = coalesce(o.progress::jsonb, j.progress),
       errors = CASE WHEN o.error IS NULL THEN j.errors
                     ELSE CASE WHEN o.kind = 'release'
                                    AND j.errors -> -1 ->> 'error' = o.error::jsonb ->> 'error'
                               THEN j.errors - -1 ELSE j.errors END
                          || jsonb_build_array(o.error::jsonb
                          || jsonb_build_object('at', statement_timestamp(), 'worker', j.worker,
                                                'started_at', j.attempted_at))
                END
  FROM {outcomes}
 WHERE {match} j.id = o.id AND j.lease_version = o.lease_version AND j.state = 'running'
RETURNING j.id, j.state, CASE WHEN o.kind IN ('retry', 'release') THEN j.run_at END
"""

# The planner takes a set-returning function such as json_to_recordset for 100 rows, so it
# joined a batch of one to three outcomes to every entry of jobs_running_idx, whose entries of
# jobs that have finished since stay there until a vacuum (a bitmap scan does not mark them
# dead): in W4 of `skipjack bench` run with 30,000 jobs (8 processes of concurrency 1), an
# outcome read about 6,700 such entries and 330 heap pages. A batch of up to FEW_OUTCOMES is
# therefore written by RECORD_OUTCOMES, which looks its rows up by primary key
# (`j.id = ANY(ARRAY(...))`, the ids read from the JSON a second time); a larger one by
# RECORD_MANY_OUTCOMES, the plain join, which for 1,000 outcomes runs in half the time (the
# array is searched once per row read). The ids are not an array parameter of their own:
# a plan made for each execution's array would then cost less than the prepared generic
# plan, and the statement would be planned anew every time (0.18 ms); the array of a
# sub-select is unknown to both plans, so the generic plan is kept.
#
# A batch of PLANNED_OUTCOMES or more is planned at each execution instead (psycopg's
# prepare=False, see skipjack.sql.Queries.prepare_outcomes): a generic plan is made once,
# while the table is small, and kept until the table is next analysed. In the first minute
# of `skipjack bench --only soak` (17,000 jobs/s into a new table, before autovacuum's first
# visit) the plan kept from the first seconds joined each batch to a bitmap scan of
# jobs_running_idx (an estimate of 19 running rows), which by then read 238,290 index
# entries and 10,012 heap pages to find 1,490 running jobs: 80 ms for 968 outcomes, and the
# worker fell 245,000 jobs behind. A plan made for the table's size of the moment looks each
# row up by primary key once the table is large (see tests/test_claim_fencing.py). Planning
# takes 0.09 ms, under 1 us a job from PLANNED_OUTCOMES on; planning every batch of more
# than FEW_OUTCOMES cost W2 about 4% of its jobs a second (50,500 against 52,500 at
# concurrency 10, medians of 3 runs), and a batch in between, should its plan read the
# index, is soon followed by larger ones. The LIMIT of the batch's size (always as many rows
# as the JSON holds) tells a plan made for one execution how many rows a batch under 100
# (the function's own estimate) brings.
FEW_OUTCOMES = 32
PLANNED_OUTCOMES = 100
_OUTCOMES = """json_to_recordset(%(outcomes)s::json)
       AS o(id bigint, lease_version bigint, kind text, delay float8, result text, error text,
            progress text)"""
RECORD_OUTCOMES = _RECORD.replace("{outcomes}", _OUTCOMES).replace(
    "{match}", """j.id = ANY(ARRAY(SELECT (e ->> 'id')::bigint
                           FROM json_array_elements(%(outcomes)s::json) AS e))
   AND""")
RECORD_MANY_OUTCOMES = _RECORD.replace(
    "{outcomes}", f"(SELECT * FROM {_OUTCOMES} LIMIT %(count)s) AS o").replace("{match}", "")

# Renew the leases of a batch of running jobs (fenced), each by the lease (seconds) it was
# claimed with: its own, else its task's (a claim-mode job), else the worker's, already at
# least the claim's min_lease (claim_jobs). It never waits on a row lock (SKIP
# LOCKED): the worker's own completer, a cancel request or a rescuer may hold some of the rows,
# and waiting on them in another order than theirs could deadlock. One row per job still held
# as of the statement's snapshot: cancel_requested is NULL for a job locked by someone else
# (not renewed this time; the next beat tries again). Ids missing from the result lost their
# lease; cancel_requested true tells the worker to stop the handler. Like
# RECORD_MANY_OUTCOMES it joins a whole batch and is planned at each execution
# (PREPARE_HEARTBEAT; 0.15 ms a beat): a plan kept from a small table read every entry of
# jobs_running_idx, 130 ms a beat in the first minute of the soak.
PREPARE_HEARTBEAT = False
HEARTBEAT = """
WITH h AS (
    SELECT j.id, j.lease_version, h.lease FROM {schema}.jobs AS j
      JOIN unnest(%(id)s::bigint[], %(lease_version)s::bigint[], %(lease)s::float8[])
           AS h(id, lease_version, lease)
        ON j.id = h.id AND j.lease_version = h.lease_version
     WHERE j.state = 'running'
), locked AS (
    SELECT j.id, h.lease FROM {schema}.jobs AS j
      JOIN h ON j.id = h.id AND j.lease_version = h.lease_version
     WHERE j.state = 'running'
       FOR NO KEY UPDATE OF j SKIP LOCKED
), renewed AS (
    UPDATE {schema}.jobs AS j
       SET lease_expires_at = now() + make_interval(secs => locked.lease)
      FROM locked WHERE j.id = locked.id
    RETURNING j.id, j.cancel_requested
)
SELECT h.id, renewed.cancel_requested FROM h LEFT JOIN renewed ON renewed.id = h.id
"""
