-- skipjack schema, version 5: a rollup of finished jobs per minute, for the dashboard's
-- throughput and start-latency charts, so that no page counts the history.

-- Finished jobs per minute (UTC, by finished_at), queue and final state. `started` counts the
-- jobs among them whose last attempt started at or after its run_at; latency_sum and
-- latency_max are that attempt's seconds from run_at (when the job became runnable) to its
-- start. Written only by ROLLUP_THROUGHPUT (workers' maintenance); rows older than eight days
-- are deleted by it.
CREATE TABLE {schema}.throughput (
    minute      timestamptz      NOT NULL,
    queue       text             NOT NULL,
    state       text             NOT NULL,
    jobs        bigint           NOT NULL,
    started     bigint           NOT NULL,
    latency_sum double precision NOT NULL,
    latency_max double precision,
    PRIMARY KEY (minute, queue, state)
);

-- How far the rollup has read: every job with finished_at < through is counted. One row; its
-- row lock (taken with SKIP LOCKED) lets one rollup run at a time among many workers.
CREATE TABLE {schema}.throughput_watermark (
    only_row boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    through  timestamptz NOT NULL
);
INSERT INTO {schema}.throughput_watermark (through) VALUES (now() - interval '1 day');

-- The dashboard lists a queue's dead letter newest first (by id): this index serves that
-- order directly, where jobs_discarded_idx (queue, finished_at) would have the whole dead
-- letter of the queue sorted, and the primary key would be read backwards through the
-- history of every queue when this one has few discarded jobs.
CREATE INDEX jobs_discarded_id_idx ON {schema}.jobs (queue, id) WHERE state = 'discarded';
