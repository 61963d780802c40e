-- Queries of the testing kit (pgjobd.testing): what the pytest plugin's drain and
-- assertion helpers read and change in a test's own schema. Never run by the daemon.
-- "{{schema}}" is the configured schema.

-- name: job_due_queues
-- The queues that have available jobs (all of them, or only queue $1).
-- $1 queue (NULL: every queue)
SELECT DISTINCT j.queue
FROM {{schema}}.job AS j
WHERE j.state = 'available' AND ($1::text IS NULL OR j.queue = $1)
ORDER BY j.queue;

-- name: job_fast_forward
-- Makes every waiting job (scheduled: delayed or snoozed; retryable: backing off) due
-- now, so that the next promotion makes it available.
-- $1 queue (NULL: every queue)
UPDATE {{schema}}.job AS j
SET run_at = now()
WHERE j.state IN ('scheduled', 'retryable') AND j.run_at > now()
  AND ($1::text IS NULL OR j.queue = $1);

-- name: job_list_live
-- Live jobs (not final), oldest first, filtered by kind, queue, tenant and args
-- containment (jsonb @>: the job's args hold every key and value given).
-- $1 kind, $2 queue, $3 tenant, $4 args (JSON text) -- each NULL: any
SELECT j.id, j.kind, j.queue, j.state::text AS state, j.args::text AS args, j.priority,
       j.tenant, j.unique_key, j.run_at, j.attempt, j.max_attempts
FROM {{schema}}.job AS j
WHERE ($1::text IS NULL OR j.kind = $1)
  AND ($2::text IS NULL OR j.queue = $2)
  AND ($3::text IS NULL OR j.tenant = $3)
  AND ($4::text IS NULL OR j.args @> $4::text::jsonb)
ORDER BY j.id;
