-- skipjack schema, version 4: job metadata (a trace context), and the live worker registry.

-- Text entries that hooks attach to the jobs of an enqueue call, e.g. the W3C trace context
-- of the span that enqueued them (see skipjack.hooks); NULL for most jobs. Adding a
-- nullable column without a default rewrites nothing.
ALTER TABLE {schema}.jobs ADD COLUMN metadata jsonb;

-- Each running worker keeps a row here, refreshed by its maintenance thread; a row whose
-- expires_at passed belongs to a worker that stopped without saying so (killed, cut off) and
-- is removed by any other worker. Only for people: recovery depends on leases, never on
-- this table.
CREATE TABLE {schema}.workers (
    name        text PRIMARY KEY,
    host        text NOT NULL,
    pid         integer NOT NULL,
    version     text NOT NULL,
    queues      text[] NOT NULL,
    concurrency integer NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    last_seen   timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    running     integer NOT NULL DEFAULT 0,
    stats       jsonb NOT NULL DEFAULT '{{}}'
);

-- The dead letter by queue, newest first: its size per queue (metrics) and its listing stay
-- cheap however much succeeded history the table holds.
CREATE INDEX jobs_discarded_idx ON {schema}.jobs (queue, finished_at) WHERE state = 'discarded';
