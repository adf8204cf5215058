-- skipjack schema, version 3: a wakeup never fails a transaction.

-- PostgreSQL keeps every notification in one queue, shared by all databases of the server
-- (max_notify_queue_pages of 8 kB on PostgreSQL 17+, 8 GB before), until every listening
-- session has read it; a session that LISTENs reads nothing while it stays in a transaction.
-- When the queue is full, PostgreSQL refuses, at commit, every transaction that sent a
-- NOTIFY: an enqueue, a staging, a rescue would fail with it. Wakeups are only an
-- optimisation (workers also poll every poll_interval), so skipjack sends a NOTIFY only while
-- may_notify() says the queue is less than notify_queue_limit() full; otherwise the wakeup is
-- skipped. Calling pg_notification_queue_usage() also lets PostgreSQL reclaim the space of
-- notifications every listener has read (by itself it does that only when a transaction that
-- sent notifications commits, which a full queue prevents), so the queue drains again once
-- the stuck session ends.
--
-- The check is not atomic with the commit: the notification enters the queue at commit, and
-- other sessions (of any application) may add theirs in between. A transaction is still
-- refused if, between its check and its commit, the remaining half of the queue fills up, or
-- if it alone sends more than that half. With the limit at half the queue this is practically
-- impossible for short transactions; a transaction that enqueues and then stays open for long
-- while another application floods a small queue can still be refused.
CREATE FUNCTION {schema}.notify_queue_limit() RETURNS double precision
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 0.5::double precision $$;

CREATE FUNCTION {schema}.may_notify() RETURNS boolean
    LANGUAGE sql VOLATILE PARALLEL RESTRICTED AS $$
    SELECT pg_notification_queue_usage() < {schema}.notify_queue_limit()
$$;

-- Wake workers only for jobs that are available now, and only while the queue has room. The
-- queue is checked only when there is something to send.
CREATE OR REPLACE FUNCTION {schema}.notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queues text[];
BEGIN
    SELECT array_agg(DISTINCT queue) INTO queues FROM new_jobs WHERE state = 'available';
    IF queues IS NOT NULL AND {schema}.may_notify() THEN
        PERFORM pg_notify(TG_ARGV[0], q) FROM unnest(queues) AS q;
    END IF;
    RETURN NULL;
END
$$;
