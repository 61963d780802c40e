-- The web console's reads (pgjobd/web/reads.py) beyond what admin.sql gives the CLI.
-- "{{schema}}" is the configured schema. Everything here reads; the console's actions
-- are admin.py's (admin.sql), audited as the CLI's are.

-- name: web_job_attempts
-- Every failed attempt of a job, oldest first, in full (the job page).
-- $1 job id
SELECT a.attempt, a.failed_at, a.duration_s, a.member, a.outcome, a.error_class,
       a.error_message, a.traceback, a.fingerprint
FROM {{schema}}.job_attempt AS a
WHERE a.job_id = $1
ORDER BY a.attempt, a.failed_at;

-- name: web_samples
-- The queue samples (roles/samples.py) of the last $1, summed over the queues named in
-- $2 (NULL: all), oldest first, with the database's now.
-- $1 window (interval), $2 queue names (NULL: every queue)
SELECT s.at, sum(s.available)::bigint AS available, sum(s.scheduled)::bigint AS scheduled,
       sum(s.running)::bigint AS running, sum(s.retryable)::bigint AS retryable,
       sum(s.completed)::bigint AS completed, sum(s.dead)::bigint AS dead,
       sum(s.cancelled)::bigint AS cancelled
FROM {{schema}}.queue_sample AS s
WHERE s.at > now() - $1::interval
  AND ($2::text[] IS NULL OR s.queue = ANY($2::text[]))
GROUP BY s.at
ORDER BY s.at;

-- name: web_now
-- The database's clock, which every age on the pages is measured against.
SELECT now();
