-- The admin operations (pgjobd/admin.py: the CLI's status, jobs, queues, dlq and cron
-- commands, and Client.cancel/retry). "{{schema}}" is the configured schema.
--
-- Every action runs in one transaction together with its admin_audit_insert row.
-- Actions on jobs by id first lock the live rows (admin_jobs_lock_live), then look the
-- rest up in history with a fresh snapshot (admin_jobs_final_states), so a job finishing
-- meanwhile is seen in its final state rather than taken for an unknown id.

-- name: admin_audit_insert
-- $1 who ($USER of the client, or the console's token name; may be NULL), $2 action,
-- $3 target (queue or cron name, or NULL), $4 job ids, $5 detail (JSON object text:
-- what it did), $6 arguments (JSON object text: what the caller asked for)
INSERT INTO {{schema}}.audit (os_user, action, target, job_ids, detail, arguments)
VALUES ($1, $2, $3, coalesce($4::bigint[], '{}'), coalesce($5::text::jsonb, '{}'),
        coalesce($6::text::jsonb, '{}'))
RETURNING id;

-- name: admin_role_missing
-- Before an admin action: the role it needs ($1, <schema>_admin) and this session's
-- user, when the session holds neither that role's rights nor the schema's owner's (a
-- superuser holds every role's). No row when it may act, or when the role does not
-- exist (no `migrate --roles`: the database's own privileges decide).
-- $1 admin role name, $2 schema
SELECT r.rolname AS role, current_user AS login
FROM pg_roles AS r
WHERE r.rolname = $1 AND NOT pg_has_role(r.oid, 'USAGE')
  AND NOT EXISTS (SELECT FROM pg_namespace AS n
                  WHERE n.nspname = $2 AND pg_has_role(n.nspowner, 'USAGE'));

-- name: admin_status_members
-- Live members (heartbeat within $1), oldest first, with the database's now.
-- $1 liveness (interval)
SELECT m.id, m.host, m.pid, m.version, m.started_at, m.heartbeat_at, m.queues,
       extract(epoch FROM now() - m.started_at)::float8 AS uptime_s
FROM {{schema}}.member AS m
WHERE m.heartbeat_at > now() - $1::interval
ORDER BY m.started_at, m.id;

-- name: admin_status_leader
-- The newest term whose session still holds the leader lock (as leader.sql's fenced
-- statements check it), or no row when nobody leads.
-- $1, $2 the leader lock key (unsigned)
SELECT l.term, l.member
FROM {{schema}}.leader AS l
WHERE l.resigned_at IS NULL
  AND EXISTS (SELECT FROM pg_locks AS pl
              WHERE pl.locktype = 'advisory' AND pl.classid::bigint = $1
                AND pl.objid::bigint = $2 AND pl.objsubid = 2
                AND pl.pid = l.backend_pid AND pl.granted)
ORDER BY l.term DESC
LIMIT 1;

-- name: admin_status_breakers
-- The kinds that declare a circuit breaker, with its state (closed, open, half_open),
-- when that state began, and the probe job while one runs.
SELECT k.name AS kind,
       CASE WHEN k.breaker_limit IS NULL THEN 'closed'
            WHEN k.breaker_limit = 1 OR k.breaker_probe IS NOT NULL THEN 'half_open'
            ELSE 'open' END AS state,
       k.breaker_at AS since, k.breaker_failures AS failures,
       extract(epoch FROM k.breaker_window)::float8 AS window_s,
       extract(epoch FROM k.breaker_cooldown)::float8 AS cooldown_s,
       k.breaker_probe AS probe
FROM {{schema}}.kind AS k
WHERE k.breaker_failures IS NOT NULL
ORDER BY k.name;

-- name: admin_status_queues
-- Per queue: live counts by state, the oldest available job's age (s, NULL when none
-- is available), paused, dead jobs of the last hour and completions per second over
-- the last minute, and its fleet-wide limits (migration 0007; NULL: none). Lists every
-- queue that has live jobs, is served by a live member (heartbeat within $1), finished
-- jobs in the last hour (dead ones, completed ones in the last minute, or any by the
-- leader's samples), or is paused.
-- With $2, the live counts are the leader's last published ones (queue_count, migration
-- 0019) when they are at most $2 old, and counted_at says when they were counted; else
-- (and always without $2, as `pgjobd status`) every live job is counted now and
-- counted_at is NULL. The count is not started when the published counts are used.
-- $1 liveness (interval), $2 published counts at most this old (NULL: count now)
WITH published AS (
    SELECT c.queue, c.available, c.scheduled, c.running, c.retryable,
           c.oldest_available_at, c.blocked, c.counted_at
    FROM {{schema}}.queue_count AS c
    WHERE $2::interval IS NOT NULL
      AND c.counted_at = (SELECT max(x.counted_at) FROM {{schema}}.queue_count AS x)
      AND c.counted_at > now() - $2::interval
), live AS (
    SELECT * FROM published
    UNION ALL
    SELECT d.queue, d.available, d.scheduled, d.running, d.retryable,
           d.oldest_available_at, d.blocked, NULL::timestamptz
    FROM {{schema}}.queue_depth AS d
    WHERE NOT EXISTS (SELECT FROM published)
), died AS (
    -- Only the dead records of the hour, from their own index (job_history_dead_at_idx,
    -- migration 0019), not every record of the hour.
    SELECT h.queue, count(*) AS dead_last_hour
    FROM {{schema}}.job_history AS h
    WHERE h.state = 'dead' AND h.finished_at > now() - interval '1 hour'
    GROUP BY h.queue
), completed AS (
    -- finished_at prunes to the newest partition; the BRIN index on finished_at
    -- (0003_audit.sql) finds the last minute's pages in it.
    SELECT h.queue, count(*) AS completed_last_minute
    FROM {{schema}}.job_history AS h
    WHERE h.state = 'completed' AND h.finished_at > now() - interval '60 seconds'
    GROUP BY h.queue
), finished AS (
    SELECT queue, coalesce(d.dead_last_hour, 0) AS dead_last_hour,
           coalesce(c.completed_last_minute, 0) AS completed_last_minute
    FROM died AS d FULL JOIN completed AS c USING (queue)
), served AS (
    SELECT DISTINCT unnest(m.queues) AS queue
    FROM {{schema}}.member AS m
    WHERE m.heartbeat_at > now() - $1::interval
), named AS (
    SELECT queue FROM live
    UNION SELECT queue FROM served
    UNION SELECT queue FROM finished
    -- (the queues that finished any job in the hour, by the leader's samples: cheaper
    -- than reading the hour's records for their queue names)
    UNION SELECT s.queue FROM {{schema}}.queue_sample AS s
          WHERE s.at > now() - interval '1 hour' AND s.completed + s.dead + s.cancelled > 0
    UNION SELECT q.name FROM {{schema}}.queue AS q WHERE q.paused
)
SELECT n.queue,
       coalesce(l.available, 0) AS available,
       coalesce(l.scheduled, 0) AS scheduled,
       coalesce(l.running, 0) AS running,
       coalesce(l.retryable, 0) AS retryable,
       -- (greatest() would turn "none available", a NULL, into 0)
       CASE WHEN l.oldest_available_at IS NOT NULL
            THEN greatest(0, extract(epoch FROM now() - l.oldest_available_at))::float8
       END AS oldest_available_age_s,
       coalesce(q.paused, false) AS paused,
       coalesce(f.dead_last_hour, 0) AS dead_last_hour,
       coalesce(f.completed_last_minute, 0) / 60.0::float8 AS throughput_per_s,
       q.global_concurrency, q.rate_limit, q.rate_window, q.max_depth,
       coalesce(l.blocked, 0) AS blocked, q.tenant_concurrency,
       coalesce(q.fair, false) AS fair,
       (SELECT max(p.counted_at) FROM published AS p) AS counted_at
FROM named AS n
LEFT JOIN live AS l USING (queue)
LEFT JOIN finished AS f USING (queue)
LEFT JOIN {{schema}}.queue AS q ON q.name = n.queue
ORDER BY n.queue;

-- name: admin_jobs_list
-- Jobs newest (highest id) first: live ones from the hot table when $5, final ones from
-- history when $6 (a false flag skips that table without reading it). $8 pages by key
-- (ids below the previous page's last). Each branch takes its own newest $4 in id order
-- (a backward scan of the hot table's primary key, and a Merge Append of the backward
-- scans of history's per-partition id indexes), so a page costs the same however deep
-- it is: nothing is sorted but the 2 x $4 rows of the two branches. States are compared
-- as the enum (the planner knows how common each is; of `state::text` it knows nothing,
-- guesses "rare", and reads all of history instead of its newest rows).
-- $1 states (text[], NULL: any), $2 queue (NULL: any), $3 kind (NULL: any), $4 limit,
-- $5 include live jobs, $6 include final jobs, $7 tenant (NULL: any), $8 only ids below
-- this (NULL: from the newest)
SELECT x.*
FROM (
    (SELECT j.id, j.state::text AS state, j.queue, j.kind, j.attempt, j.max_attempts,
            j.priority, j.run_at::timestamptz AS run_at, j.enqueued_at,
            NULL::timestamptz AS finished_at, NULL::text AS reason, j.last_error,
            j.cancel_requested, j.tenant::text AS tenant
     FROM {{schema}}.job AS j
     WHERE $5::boolean
       AND ($1::text[] IS NULL OR j.state = ANY($1::text[]::{{schema}}.job_state[]))
       AND ($2::text IS NULL OR j.queue = $2::text)
       AND ($3::text IS NULL OR j.kind = $3::text)
       AND ($7::text IS NULL OR j.tenant::text = $7::text)
       AND ($8::bigint IS NULL OR j.id < $8::bigint)
     ORDER BY j.id DESC
     LIMIT $4)
    UNION ALL
    (SELECT h.id, h.state::text, h.queue, h.kind, h.attempt, h.max_attempts, h.priority,
            h.run_at, h.enqueued_at, h.finished_at, h.reason, h.last_error, false, h.tenant
     FROM {{schema}}.job_history AS h
     WHERE $6::boolean
       AND ($1::text[] IS NULL OR h.state = ANY($1::text[]::{{schema}}.job_state[]))
       AND ($2::text IS NULL OR h.queue = $2::text)
       AND ($3::text IS NULL OR h.kind = $3::text)
       AND ($7::text IS NULL OR h.tenant = $7::text)
       AND ($8::bigint IS NULL OR h.id < $8::bigint)
     ORDER BY h.id DESC
     LIMIT $4)
) AS x
ORDER BY x.id DESC
LIMIT $4;

-- name: admin_jobs_lock_live
-- Locks the live jobs among $1 (in id order: two admins never deadlock) and gives each
-- one's state; ids not returned are not live.
-- $1 ids
SELECT j.id, j.state::text AS state
FROM {{schema}}.job AS j
WHERE j.id = ANY($1::bigint[])
ORDER BY j.id
FOR UPDATE;

-- name: admin_jobs_final_states
-- The final records among $1 (one per job).
-- $1 ids
SELECT DISTINCT ON (h.id) h.id, h.state::text AS state, h.unique_key
FROM {{schema}}.job_history AS h
WHERE h.id = ANY($1::bigint[])
ORDER BY h.id, h.finished_at DESC;

-- name: admin_jobs_cancel
-- Cancels jobs this transaction has locked: pending ones ($1) move to history as
-- cancelled (reason 'cancelled') in this statement; running ones ($2) get
-- cancel_requested, and each is announced on <schema>.job_cancel (payload: the id) so
-- its member can set the handler's ctx.cancelled at once.
-- $1 ids of pending jobs, $2 ids of running jobs
WITH cancelled AS (
    SELECT m.id
    -- (Locked already; FOR UPDATE keeps the state read here the one job_move deletes
    -- even for a caller that did not lock them.)
    FROM (SELECT array_agg(p.id) AS ids
          FROM (SELECT j.id FROM {{schema}}.job AS j
                WHERE j.id = ANY($1::bigint[]) AND j.state <> 'running'
                FOR UPDATE) AS p
          HAVING count(*) > 0) AS a
    CROSS JOIN LATERAL {{schema}}.job_move(
        a.ids, NULL, array_fill('cancelled'::text, ARRAY[cardinality(a.ids)])) AS m
), flagged AS (
    UPDATE {{schema}}.job AS j SET cancel_requested = true
    -- (IS TRUE: a state check the planner cannot take for job_running_idx's predicate,
    -- which with statistics taken on an empty table it would read whole for the ids;
    -- see migration 0023.)
    WHERE j.id = ANY($2::bigint[]) AND (j.state = 'running') IS TRUE
    RETURNING j.id
), announced AS (
    SELECT pg_notify('{{schema}}.job_cancel', f.id::text) FROM flagged AS f
)
SELECT ARRAY(SELECT c.id FROM cancelled AS c ORDER BY c.id) AS cancelled,
       ARRAY(SELECT f.id FROM flagged AS f ORDER BY f.id) AS flagged,
       (SELECT count(*) FROM announced) AS announced;

-- name: admin_jobs_make_available
-- Makes scheduled and retryable jobs among $1 (locked by this transaction) available
-- now, and wakes their queues' producers.
-- $1 ids
WITH made AS (
    UPDATE {{schema}}.job AS j SET state = 'available', run_at = now()
    -- (IS TRUE: not job_due_idx's predicate, as in admin_jobs_cancel.)
    WHERE j.id = ANY($1::bigint[]) AND (j.state IN ('scheduled', 'retryable')) IS TRUE
    RETURNING j.id, j.queue
), woken AS (
    SELECT pg_notify('{{schema}}.job_ready', q.queue)
    FROM (SELECT DISTINCT m.queue FROM made AS m) AS q
)
SELECT ARRAY(SELECT m.id FROM made AS m ORDER BY m.id) AS ids,
       (SELECT count(*) FROM woken) AS queues_woken;

-- name: admin_jobs_revive
-- Puts finished jobs (final records among $1) back in the hot table as available now,
-- under the same id, deleting their final record in the same statement: a job has one
-- final record again once it finishes. Attempts are kept (job_attempt rows stay
-- numbered); max_attempts is raised to attempt + 1 if they were spent. A job whose
-- unique_key a live job holds is not revived: its id comes back in `blocked`.
-- $1 ids
WITH picked AS (
    SELECT DISTINCT ON (h.id) h.id, h.unique_key
    FROM {{schema}}.job_history AS h
    WHERE h.id = ANY($1::bigint[])
    ORDER BY h.id
), blocked AS (
    SELECT p.id FROM picked AS p
    WHERE p.unique_key IS NOT NULL
      AND (EXISTS (SELECT FROM {{schema}}.job AS j WHERE j.unique_key = p.unique_key)
           OR EXISTS (SELECT FROM picked AS o WHERE o.unique_key = p.unique_key
                                                AND o.id > p.id))
), moved AS (
    DELETE FROM {{schema}}.job_history AS h
    USING picked AS p
    WHERE h.id = ANY($1::bigint[]) AND h.id = p.id
      AND p.id NOT IN (SELECT b.id FROM blocked AS b)
    RETURNING h.*
), revived AS (
    INSERT INTO {{schema}}.job (id, run_at, enqueued_at, attempted_at, attempt,
        max_attempts, priority, state, queue, kind, tenant, unique_key, last_error, args)
    SELECT m.id, now(), m.enqueued_at, m.attempted_at, m.attempt,
           greatest(m.max_attempts, m.attempt + 1), m.priority, 'available', m.queue,
           m.kind, m.tenant, m.unique_key, m.last_error, m.args
    FROM moved AS m
    RETURNING id, queue
), woken AS (
    SELECT pg_notify('{{schema}}.job_ready', q.queue)
    FROM (SELECT DISTINCT r.queue FROM revived AS r) AS q
)
SELECT ARRAY(SELECT r.id FROM revived AS r ORDER BY r.id) AS ids,
       ARRAY(SELECT b.id FROM blocked AS b ORDER BY b.id) AS blocked,
       (SELECT count(*) FROM woken) AS queues_woken;

-- name: admin_dlq_list
-- Dead jobs, most recently dead first, with the args fields their kind redacts, each
-- with the fingerprint of its last failed attempt (job_history.fingerprint, migration
-- 0019; NULL: it ended without one, e.g. expired or dependency_failed).
-- $1 kind (NULL: any), $2 queue (NULL: any), $3 dead since (NULL: ever), $4 limit,
-- $5 fingerprint (NULL: any)
SELECT h.id, h.kind, h.queue, h.attempt, h.max_attempts, h.reason, h.finished_at,
       h.enqueued_at, h.last_error, h.args::text AS args,
       (SELECT k.redact FROM {{schema}}.kind AS k WHERE k.name = h.kind) AS redact,
       h.fingerprint
FROM {{schema}}.job_history AS h
WHERE h.state = 'dead'
  AND ($1::text IS NULL OR h.kind = $1::text)
  AND ($2::text IS NULL OR h.queue = $2::text)
  AND ($3::timestamptz IS NULL OR h.finished_at >= $3::timestamptz)
  AND ($5::text IS NULL OR h.fingerprint = $5::text)
ORDER BY h.finished_at DESC, h.id DESC
LIMIT $4;

-- name: admin_dlq_groups
-- Every matching dead job, grouped by the fingerprint of its last failed attempt and
-- the reason it ended (job_history.fingerprint, migration 0019; the group's key is
-- dead_group_key): how many, of which kinds and queues, when the first and the latest
-- died, and the latest one's id and error. Largest groups first, at most $4. `dlq list`
-- and the web console's dead jobs page (over its window) read this one statement. The
-- groups are counted from the dead jobs' index alone (job_history_dead_at_idx: an
-- index-only scan), by (fingerprint, reason, kind, queue) first so that only those few
-- rows are sorted for the arrays; only each group's latest record is read from the
-- table, for its error (its finished_at names its partition).
-- $1 kind (NULL: any), $2 queue (NULL: any), $3 dead since (NULL: ever), $4 at most this
-- many groups (NULL: all)
WITH per AS (
    SELECT h.fingerprint, h.reason, h.kind, h.queue, count(*) AS jobs,
           min(h.finished_at) AS first_at, max(h.finished_at) AS last_at
    FROM {{schema}}.job_history AS h
    WHERE h.state = 'dead'
      AND ($1::text IS NULL OR h.kind = $1::text)
      AND ($2::text IS NULL OR h.queue = $2::text)
      AND ($3::timestamptz IS NULL OR h.finished_at >= $3::timestamptz)
    GROUP BY 1, 2, 3, 4
), groups AS (
    SELECT p.fingerprint, p.reason, sum(p.jobs)::bigint AS jobs,
           array_agg(DISTINCT p.kind ORDER BY p.kind) AS kinds,
           array_agg(DISTINCT p.queue ORDER BY p.queue) AS queues,
           min(p.first_at) AS first_at, max(p.last_at) AS last_dead_at
    FROM per AS p
    GROUP BY p.fingerprint, p.reason
    ORDER BY jobs DESC, last_dead_at DESC
    LIMIT $4
)
SELECT g.fingerprint, g.reason, g.jobs, g.kinds, g.last_dead_at, n.last_error,
       {{schema}}.dead_group_key(g.fingerprint, g.reason) AS key, g.queues, g.first_at,
       n.id AS newest_id
FROM groups AS g
CROSS JOIN LATERAL (
    SELECT h.id, h.last_error
    FROM {{schema}}.job_history AS h
    WHERE h.state = 'dead' AND h.finished_at = g.last_dead_at
      AND h.fingerprint IS NOT DISTINCT FROM g.fingerprint
      AND h.reason IS NOT DISTINCT FROM g.reason
      AND ($1::text IS NULL OR h.kind = $1::text)
      AND ($2::text IS NULL OR h.queue = $2::text)
    ORDER BY h.id DESC
    LIMIT 1
) AS n
ORDER BY g.jobs DESC, g.last_dead_at DESC;

-- name: admin_dlq_ids
-- The dead jobs a redrive takes (then admin_jobs_revive, in the same transaction).
-- $1 kind (NULL: any), $2 queue (NULL: any), $3 dead since (NULL: ever), $4 fingerprint
-- of the last failed attempt (NULL: any)
SELECT h.id
FROM {{schema}}.job_history AS h
WHERE h.state = 'dead'
  AND ($1::text IS NULL OR h.kind = $1::text)
  AND ($2::text IS NULL OR h.queue = $2::text)
  AND ($3::timestamptz IS NULL OR h.finished_at >= $3::timestamptz)
  AND ($4::text IS NULL OR h.fingerprint = $4::text)
ORDER BY h.id;

-- name: admin_dlq_group_ids
-- The dead jobs of one group (admin_dlq_groups' key: dead_group_key, migration 0019:
-- fingerprint and reason) that died within $2, for a redrive of the group.
-- $1 group key, $2 window (interval)
SELECT h.id
FROM {{schema}}.job_history AS h
WHERE h.state = 'dead' AND h.finished_at > now() - $2::interval
  AND {{schema}}.dead_group_key(h.fingerprint, h.reason) = $1::text
ORDER BY h.id;

-- name: admin_queue_set_paused
-- Pauses or resumes a queue fleet-wide: upserts its `queue` row and announces the
-- change on <schema>.queue_control (payload: the queue name; members re-read the row).
-- A resumed queue's producers are also woken on <schema>.job_ready. Notifications go
-- out at commit.
-- $1 queue, $2 paused, $3 updated_by
WITH previous AS (
    SELECT q.paused FROM {{schema}}.queue AS q WHERE q.name = $1::text
), upserted AS (
    INSERT INTO {{schema}}.queue AS q (name, paused, updated_at, updated_by)
    VALUES ($1::text, $2::boolean, now(), $3::text)
    ON CONFLICT (name) DO UPDATE
    SET paused = excluded.paused, updated_at = excluded.updated_at,
        updated_by = excluded.updated_by
    RETURNING q.paused
)
SELECT coalesce((SELECT p.paused FROM previous AS p), false) AS was_paused,
       (SELECT u.paused FROM upserted AS u) AS paused,
       pg_notify('{{schema}}.queue_control', $1::text) IS NULL AS announced,
       CASE WHEN NOT $2::boolean THEN pg_notify('{{schema}}.job_ready', $1::text) END
           IS NULL AS woken;

-- name: admin_cron_list
-- Every schedule by name, and the database's now (one row with a NULL name when there
-- are none).
SELECT t.now, c.name, c.schedule, c.timezone, c.kind, c.queue, c.catch_up, c.enabled,
       c.source, c.last_slot, c.args::text AS args, c.updated_at
FROM (SELECT now() AS now) AS t
LEFT JOIN {{schema}}.cron AS c ON true
ORDER BY c.name;

-- name: admin_scrub_live
-- The live jobs a scrub would match (it refuses to run while there are any): of tenant
-- $1 and/or kind $2 (NULL: any), enqueued before $3 (NULL: ever). At most 20.
-- $1 tenant, $2 kind, $3 before
SELECT j.id
FROM {{schema}}.job AS j
WHERE ($1::text IS NULL OR j.tenant = $1::text)
  AND ($2::text IS NULL OR j.kind = $2::text)
  AND ($3::timestamptz IS NULL OR j.enqueued_at < $3::timestamptz)
ORDER BY j.id
LIMIT 20;

-- name: admin_scrub
-- Overwrites the payloads of final jobs of tenant $1 and/or kind $2 (NULL: any) that
-- finished before $3 (NULL: ever): args, result (when there is one) and error texts
-- become {"scrubbed": true} in job_history, and in job_attempt the errors and
-- tracebacks of their attempts. Rows scrubbed before are left as they are.
-- $1 tenant, $2 kind, $3 before
WITH marker AS (
    SELECT '{"scrubbed": true}'::jsonb AS json, '{"scrubbed": true}'::text AS text
), scrubbed AS (
    UPDATE {{schema}}.job_history AS h
    SET args = m.json,
        result = CASE WHEN h.result IS NULL THEN NULL ELSE m.json END,
        last_error = CASE WHEN h.last_error IS NULL THEN NULL ELSE m.text END
    FROM marker AS m
    WHERE ($1::text IS NULL OR h.tenant = $1::text)
      AND ($2::text IS NULL OR h.kind = $2::text)
      AND ($3::timestamptz IS NULL OR h.finished_at < $3::timestamptz)
      AND h.args <> m.json
    RETURNING h.id
), attempts AS (
    UPDATE {{schema}}.job_attempt AS a
    SET error_message = CASE WHEN a.error_message IS NULL THEN NULL ELSE m.text END,
        traceback = CASE WHEN a.traceback IS NULL THEN NULL ELSE m.text END
    FROM marker AS m
    WHERE a.job_id IN (SELECT s.id FROM scrubbed AS s)
    RETURNING a.job_id
)
SELECT ARRAY(SELECT s.id FROM scrubbed AS s ORDER BY s.id) AS ids,
       (SELECT count(*) FROM attempts) AS attempts;

-- name: admin_kind_redact
-- The args fields kind $1's handler redacts (@job(redact=...)); no row or NULL: none.
-- $1 kind
SELECT k.redact FROM {{schema}}.kind AS k WHERE k.name = $1;
