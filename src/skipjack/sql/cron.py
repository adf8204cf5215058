"""Statements of the cron scheduler: one ``cron_slots`` row per (schedule, slot)."""

CRON_LAST_SLOT = "SELECT max(slot) FROM {schema}.cron_slots WHERE name = %(name)s"

# Claim a slot; RETURNING is empty when another scheduler already has it.
CRON_CLAIM_SLOT = """
INSERT INTO {schema}.cron_slots (name, slot, status) VALUES (%(name)s, %(slot)s, 'enqueued')
ON CONFLICT DO NOTHING
RETURNING slot
"""

CRON_SET_JOB = """
UPDATE {schema}.cron_slots SET job_id = %(job_id)s WHERE name = %(name)s AND slot = %(slot)s
"""

CRON_MISSED = """
INSERT INTO {schema}.cron_slots (name, slot, status)
SELECT %(name)s, s, 'missed' FROM unnest(%(slots)s::timestamptz[]) AS s
ON CONFLICT DO NOTHING
"""

CRON_LIST = """
SELECT name, max(slot) FILTER (WHERE status = 'enqueued') AS last_enqueued,
       count(*) FILTER (WHERE status = 'missed') AS missed
  FROM {schema}.cron_slots GROUP BY name ORDER BY name
"""
