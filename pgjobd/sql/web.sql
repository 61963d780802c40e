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

-- name: web_dead_groups
-- Dead jobs that died within $1, grouped as `dlq list` groups them: by the fingerprint
-- of the last failed attempt and the reason (dead_group_key, migration 0015). The
-- biggest group first, each with its kinds and queues, when it first and last died,
-- and its newest job's id and error. The groups are counted from the dead jobs' index
-- alone (job_history_dead_at_idx: an index-only scan of the window), aggregated by
-- (fingerprint, reason, kind, queue) first so that only those few rows are sorted for
-- the arrays; only each shown group's newest record is read from the table (its
-- finished_at names its partition).
-- $1 window (interval), $2 how many groups
WITH per AS (
    SELECT h.fingerprint, h.reason, h.kind, h.queue, count(*) AS jobs,
           min(h.finished_at) AS first_at, max(h.finished_at) AS last_at
    FROM {{schema}}.job_history AS h
    WHERE h.state = 'dead' AND h.finished_at > now() - $1::interval
    GROUP BY 1, 2, 3, 4
), groups AS (
    SELECT p.fingerprint, p.reason, sum(p.jobs)::bigint AS jobs,
           array_agg(DISTINCT p.kind ORDER BY p.kind) AS kinds,
           array_agg(DISTINCT p.queue ORDER BY p.queue) AS queues,
           min(p.first_at) AS first_at, max(p.last_at) AS last_at
    FROM per AS p
    GROUP BY p.fingerprint, p.reason
    ORDER BY jobs DESC, last_at DESC
    LIMIT $2
)
SELECT {{schema}}.dead_group_key(g.fingerprint, g.reason) AS key, g.fingerprint, g.reason,
       g.jobs, g.kinds, g.queues, g.first_at, g.last_at, n.last_error AS error,
       n.id AS newest_id
FROM groups AS g
CROSS JOIN LATERAL (
    SELECT h.id, h.last_error
    FROM {{schema}}.job_history AS h
    WHERE h.state = 'dead' AND h.finished_at = g.last_at
      AND h.fingerprint IS NOT DISTINCT FROM g.fingerprint
      AND h.reason IS NOT DISTINCT FROM g.reason
    ORDER BY h.id DESC
    LIMIT 1
) AS n
ORDER BY g.jobs DESC, g.last_at DESC;

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
