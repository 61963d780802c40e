-- Leadership and the leader's roles. "{{schema}}" is the configured schema.
--
-- The leader is the member whose dedicated session holds the schema's advisory lock,
-- and each time a member wins that lock it begins a term: a row in `leader`, numbered
-- by the database. The term row is the fence. A new term first ends every earlier one
-- (sets its resigned_at: resigned by its leader, or deposed by the next), and every
-- role write runs in a transaction that, as its last statement before COMMIT, takes
-- the role's term row FOR SHARE where it is still open (`leader_term_holds`): no row,
-- and the transaction rolls back. So a deposed leader's write, even one that waited on
-- a lock while the next leader was elected, never commits after the next term began:
-- either it took the share lock first, and the next term's begin waits for its COMMIT,
-- or the next term began first, and it finds its term ended. Backend pids play no part
-- (a new backend may reuse an old leader's pid). The statements below also check the
-- term themselves, which saves a deposed leader useless work.

-- name: leader_try_lock
-- $1, $2 the lock key (signed ints)
SELECT pg_try_advisory_lock($1, $2);

-- name: leader_still_holds
-- On the leader's own session: does it still hold the lock, and is its term still
-- open?
-- $1, $2 the lock key (unsigned), $3 term
SELECT EXISTS (
    SELECT FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.classid::bigint = $1 AND l.objid::bigint = $2
      AND l.objsubid = 2 AND l.pid = pg_backend_pid() AND l.granted
) AND EXISTS (
    SELECT FROM {{schema}}.leader AS t WHERE t.term = $3 AND t.resigned_at IS NULL
);

-- name: leader_term_begin
-- A new term, issued by the database, on the session that has just won the lock. It
-- first ends every earlier term still open, waiting for the role transactions that
-- hold one FOR SHARE (leader_term_holds) to commit: once this returns, no write of an
-- earlier term can commit any more.
-- $1 member id
WITH deposed AS (
    UPDATE {{schema}}.leader SET resigned_at = now() WHERE resigned_at IS NULL
    RETURNING term
)
INSERT INTO {{schema}}.leader (member, backend_pid)
SELECT $1, pg_backend_pid()
FROM (SELECT count(*) FROM deposed) AS d
RETURNING term;

-- name: leader_term_holds
-- The fence of a role write: the last statement of its transaction, before COMMIT.
-- Locks the term's row against being ended until the transaction commits; NULL when
-- the term has ended (the caller rolls back).
-- $1 term
SELECT t.term FROM {{schema}}.leader AS t
WHERE t.term = $1 AND t.resigned_at IS NULL
FOR SHARE;

-- name: leader_term_open
-- For role steps that cannot run in a transaction (DDL ... CONCURRENTLY): is the term
-- still open? Checked just before each such statement; those steps are harmless when
-- a deposed leader's one overlaps the next leader's (see the roles).
-- $1 term
SELECT EXISTS (SELECT FROM {{schema}}.leader AS t WHERE t.term = $1 AND t.resigned_at IS NULL);

-- name: leader_resign
-- Ends the term (waiting for any role transaction that holds it FOR SHARE), frees the
-- lock and tells the candidates at once (they LISTEN on <schema>.leader).
-- $1 term, $2, $3 the lock key (signed ints)
WITH resigned AS (
    UPDATE {{schema}}.leader SET resigned_at = now() WHERE term = $1 AND resigned_at IS NULL
    RETURNING term
)
SELECT (SELECT count(*) FROM resigned), pg_advisory_unlock($2, $3),
       pg_notify('{{schema}}.leader', 'resigned');

-- name: job_reap_expired
-- Takes back running jobs whose lease expired (their member died, hung, or lost the
-- database): available again at once, or ended by job_end_reason's rule (outcome
-- 'lease_expired': dead when the attempt was their last or the lease loss is their
-- max_crashes-th, or cancelled if an admin asked for it). Guarded by
-- the row lock and the state: a completion that got there first wins and this changes
-- nothing for that job.
-- Nothing is reaped before the term has lasted one lease: a new term follows every
-- outage of the leader's session (and so every database outage), and this gives each
-- member a full lease of database time to record outcomes it held through the outage
-- and to renew its leases before anything of its is judged lost. A crashed leader's
-- jobs are still back within its lease + the election (about a second) + a tick.
-- $1 term, $2 lease (interval), $3 limit, $4 queue names, $5 their max_crashes,
-- $6 max_crashes for other queues, $7 the attempts' fingerprint (one for every lost
-- lease, whichever member lost it: fingerprint.LEASE_EXPIRED)
WITH expired AS (
    SELECT j.id, j.fence, j.attempt, j.queue, j.kind, j.owner AS lost_by,
           {{schema}}.job_end_reason('lease_expired', j.attempt, j.max_attempts, j.crashes,
                                     coalesce(qc.max_crashes, $6), j.cancel_requested)
               AS reason
    FROM {{schema}}.job AS j
    LEFT JOIN unnest($4::text[], $5::integer[]) AS qc(name, max_crashes) ON qc.name = j.queue
    WHERE j.state = 'running' AND j.lease_expires_at < now()
      AND EXISTS (SELECT FROM {{schema}}.leader AS t
                  WHERE t.term = $1 AND t.resigned_at IS NULL
                    AND t.elected_at + $2::interval <= now())
    ORDER BY j.lease_expires_at
    LIMIT $3
    FOR UPDATE OF j SKIP LOCKED
), rescued AS (
    UPDATE {{schema}}.job AS j
    SET state = 'available', run_at = now(), owner = NULL, fence = NULL,
        lease_expires_at = NULL, crashes = j.crashes + 1,
        last_error = 'LeaseExpired: member ' || e.lost_by || ' stopped renewing the lease'
    FROM expired AS e
    WHERE j.id = e.id AND e.reason IS NULL
    RETURNING j.id, j.attempt, j.queue, j.kind, e.lost_by
), died AS (
    SELECT e.id, e.attempt, e.queue, e.kind, e.lost_by
    FROM (SELECT array_agg(e.id) AS ids, array_agg(e.fence) AS fences,
                 array_agg(e.reason) AS reasons,
                 array_agg('LeaseExpired: member ' || e.lost_by
                           || ' stopped renewing the lease') AS errors
          FROM expired AS e
          WHERE e.reason IS NOT NULL
          HAVING count(*) > 0) AS a
    CROSS JOIN LATERAL {{schema}}.job_move(a.ids, a.fences, a.reasons, a.errors, NULL, NULL,
                                           array_fill($7::text, ARRAY[cardinality(a.ids)])) AS m
    JOIN expired AS e ON e.id = m.id
), attempts AS (
    INSERT INTO {{schema}}.job_attempt (job_id, attempt, queue, kind, member, outcome,
                                        error_class, error_message, fingerprint)
    SELECT r.id, r.attempt, r.queue, r.kind, r.lost_by, 'lease_expired', 'LeaseExpired',
           'member ' || r.lost_by || ' stopped renewing the lease', $7::text
    FROM (SELECT id, attempt, queue, kind, lost_by FROM rescued
          UNION ALL
          SELECT id, attempt, queue, kind, lost_by FROM died) AS r
), woken AS (
    SELECT pg_notify('{{schema}}.job_ready', q.queue)
    FROM (SELECT DISTINCT queue FROM rescued) AS q
)
SELECT (SELECT count(*) FROM rescued) AS rescued, (SELECT count(*) FROM died) AS died,
       (SELECT count(*) FROM woken) AS queues_woken;

-- name: job_expire
-- Ends jobs not started by their expires_at: dead with reason 'expired' (the claim
-- never takes them; this moves them out of the hot table). A running job has started
-- and is left alone. Fenced by the term like the reaper. Returns how many ended, per
-- queue and kind.
-- $1 term, $2 limit
WITH expired AS (
    SELECT j.id, j.queue, j.kind,
           format('Expired: not started by %s', j.expires_at) AS error,
           -- (a job that failed before it expired keeps its last attempt's fingerprint)
           {{schema}}.job_fingerprint(j.id) AS fingerprint
    FROM {{schema}}.job AS j
    WHERE j.expires_at <= now() AND j.expires_at IS NOT NULL AND j.state <> 'running'
      AND EXISTS (SELECT FROM {{schema}}.leader AS t
                  WHERE t.term = $1 AND t.resigned_at IS NULL)
    ORDER BY j.expires_at
    LIMIT $2
    FOR UPDATE OF j SKIP LOCKED
), died AS (
    SELECT m.id
    FROM (SELECT array_agg(e.id) AS ids, array_agg(e.error) AS errors,
                 array_agg(e.fingerprint) AS fingerprints
          FROM expired AS e
          HAVING count(*) > 0) AS a
    CROSS JOIN LATERAL {{schema}}.job_move(
        a.ids, NULL, array_fill('expired'::text, ARRAY[cardinality(a.ids)]), a.errors, NULL,
        NULL, a.fingerprints) AS m
)
SELECT e.queue, e.kind, count(*) AS expired
FROM died AS d JOIN expired AS e ON e.id = d.id
GROUP BY e.queue, e.kind;

-- name: member_forget_gone
-- Removes member rows whose heartbeat stopped long ago.
-- $1 term, $2 silence (interval)
DELETE FROM {{schema}}.member AS m
WHERE m.heartbeat_at < now() - $2::interval
  AND EXISTS (SELECT FROM {{schema}}.leader AS t WHERE t.term = $1 AND t.resigned_at IS NULL)
RETURNING m.id;

-- name: partition_list
-- The partitions of $1, and whether a concurrent detach of one was left unfinished.
-- $1 parent table (qualified name)
SELECT c.relname AS name, i.inhdetachpending AS detach_pending
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = $1::regclass
ORDER BY c.relname;

-- name: job_next_lease_expiry
-- Seconds until the reaper has something to do: the earliest lease of a running job
-- expires, and the term has lasted one lease (NULL: nothing running).
-- $1 term, $2 lease (interval)
SELECT extract(epoch FROM greatest(
           min(j.lease_expires_at),
           (SELECT t.elected_at + $2::interval FROM {{schema}}.leader AS t WHERE t.term = $1)
       ) - now())::float8
FROM {{schema}}.job AS j
WHERE j.state = 'running'
HAVING count(*) > 0;

-- name: queue_stats_publish
-- For the leader's metrics and the web console's overview: per queue, live jobs by
-- state, the oldest available job's age (s; NULL when none is available), whether it is
-- paused and whether its depth is broken down by tenant (fair or tenant_concurrency:
-- queue_tenant_stats). Lists the queues with live jobs, the paused ones and those named
-- in $1 (the leader's configured queues), and publishes the counts in queue_count (the
-- web console's migration), replacing what the last count wrote. Run inside `fenced`.
-- $1 queue names
WITH live AS (
    SELECT * FROM {{schema}}.queue_depth
), named AS (
    SELECT queue FROM live
    UNION SELECT unnest($1::text[])
    UNION SELECT q.name FROM {{schema}}.queue AS q WHERE q.paused
), counted AS (
    SELECT n.queue,
           coalesce(l.available, 0) AS available,
           coalesce(l.scheduled, 0) AS scheduled,
           coalesce(l.running, 0) AS running,
           coalesce(l.retryable, 0) AS retryable,
           l.oldest_available_at,
           coalesce(q.paused, false) AS paused,
           coalesce(l.blocked, 0) AS blocked,
           coalesce(q.fair OR q.tenant_concurrency IS NOT NULL, false) AS by_tenant
    FROM named AS n
    LEFT JOIN live AS l USING (queue)
    LEFT JOIN {{schema}}.queue AS q ON q.name = n.queue
), gone AS (
    DELETE FROM {{schema}}.queue_count AS c
    WHERE c.queue NOT IN (SELECT queue FROM counted)
), published AS (
    INSERT INTO {{schema}}.queue_count AS c (queue, available, scheduled, running,
        retryable, blocked, oldest_available_at, counted_at)
    SELECT queue, available, scheduled, running, retryable, blocked, oldest_available_at,
           now()
    FROM counted
    ON CONFLICT (queue) DO UPDATE
    SET available = excluded.available, scheduled = excluded.scheduled,
        running = excluded.running, retryable = excluded.retryable,
        blocked = excluded.blocked, oldest_available_at = excluded.oldest_available_at,
        counted_at = excluded.counted_at
)
SELECT c.queue, c.available, c.scheduled, c.running, c.retryable,
       greatest(0, extract(epoch FROM now() - c.oldest_available_at))::float8
           AS oldest_available_age_s,
       c.paused, c.blocked, c.by_tenant
FROM counted AS c
ORDER BY c.queue;

-- name: queue_tenant_stats
-- For the leader's metrics: live jobs by tenant and state of the queues with a
-- tenant_concurrency or fair = true (the others are not broken down: bounded
-- cardinality). Per queue, the $1 tenants with most live jobs (ties by name; '' is the
-- jobs without a tenant), then one row with tenant NULL summing the others. Reads the
-- live rows of those queues (job_claim_idx covers only available ones), read-only.
-- $1 tenants shown per queue
WITH per_tenant AS (
    SELECT j.queue, coalesce(j.tenant::text, '') AS tenant,
           count(*) FILTER (WHERE j.state = 'available') AS available,
           count(*) FILTER (WHERE j.state = 'scheduled') AS scheduled,
           count(*) FILTER (WHERE j.state = 'running') AS running,
           count(*) FILTER (WHERE j.state = 'retryable') AS retryable,
           count(*) FILTER (WHERE j.state::text = 'blocked') AS blocked,
           count(*) AS live
    FROM {{schema}}.job AS j
    WHERE j.queue IN (SELECT q.name FROM {{schema}}.queue AS q
                      WHERE q.fair OR q.tenant_concurrency IS NOT NULL)
    GROUP BY 1, 2
), ranked AS (
    SELECT p.*, row_number() OVER (PARTITION BY p.queue ORDER BY p.live DESC, p.tenant) AS n
    FROM per_tenant AS p
)
SELECT r.queue, CASE WHEN r.n <= $1 THEN r.tenant END AS tenant,
       sum(r.available)::bigint AS available, sum(r.scheduled)::bigint AS scheduled,
       sum(r.running)::bigint AS running, sum(r.retryable)::bigint AS retryable,
       sum(r.blocked)::bigint AS blocked
FROM ranked AS r
GROUP BY 1, 2
ORDER BY 1, 2 NULLS LAST;

-- name: maintainer_role_to_set
-- The role to SET ROLE to for the DDL that needs the job tables' owner and cannot run
-- in a function (DETACH PARTITION, REINDEX and DROP INDEX ... CONCURRENTLY): $1, the
-- schema's <schema>_maintainer, when this session may become it without holding its
-- rights (a worker login: <schema>_worker is NOINHERIT). No row when it needs none
-- (the tables' owner, a superuser) or the role does not exist (no `migrate --roles`).
-- $1 maintainer role name
SELECT r.rolname
FROM pg_roles AS r
WHERE r.rolname = $1 AND pg_has_role(r.oid, 'MEMBER') AND NOT pg_has_role(r.oid, 'USAGE');

-- name: partition_drop
-- Drops a partition the rotator has detached (migration 0007's partition_drop: a
-- SECURITY DEFINER function that drops nothing else); false if it was gone already.
-- $1 parent table name (job_history or job_attempt), $2 partition name
SELECT {{schema}}.partition_drop($1, $2);
-- name: queue_sample_record
-- The sampler role's minute: one queue_sample row per queue (those with live jobs,
-- with jobs finished in the window, paused, or named in $1), with its live depth now
-- and its jobs finished since the previous sample, at most $2 ago (a leader that was
-- away does not pile the gap into one sample). finished_at prunes to the newest
-- partitions and the BRIN index finds the window's pages. Run inside `fenced`.
-- $1 queue names, $2 longest window (interval)
WITH since AS (
    SELECT greatest((SELECT max(s.at) FROM {{schema}}.queue_sample AS s),
                    now() - $2::interval) AS at
), finished AS (
    SELECT h.queue,
           count(*) FILTER (WHERE h.state = 'completed') AS completed,
           count(*) FILTER (WHERE h.state = 'dead') AS dead,
           count(*) FILTER (WHERE h.state = 'cancelled') AS cancelled
    FROM {{schema}}.job_history AS h, since
    WHERE h.finished_at > since.at AND h.finished_at <= now()
    GROUP BY h.queue
), live AS (
    SELECT * FROM {{schema}}.queue_depth
), named AS (
    SELECT queue FROM live
    UNION SELECT queue FROM finished
    UNION SELECT unnest($1::text[])
    UNION SELECT q.name FROM {{schema}}.queue AS q WHERE q.paused
)
INSERT INTO {{schema}}.queue_sample AS s (at, queue, available, scheduled, running,
    retryable, completed, dead, cancelled)
SELECT now(), n.queue, coalesce(l.available, 0), coalesce(l.scheduled, 0),
       coalesce(l.running, 0), coalesce(l.retryable, 0), coalesce(f.completed, 0),
       coalesce(f.dead, 0), coalesce(f.cancelled, 0)
FROM named AS n
LEFT JOIN live AS l USING (queue)
LEFT JOIN finished AS f USING (queue)
ON CONFLICT (queue, at) DO NOTHING;

-- name: queue_sample_trim
-- Deletes the samples older than $1: the table stays at queues x (retention / interval)
-- rows. Run inside `fenced`, with queue_sample_record.
-- $1 retention (interval)
DELETE FROM {{schema}}.queue_sample AS s WHERE s.at < now() - $1::interval;

-- name: job_priorities_age
-- Priority aging (roles/priority_ager.py): in queue $1, the $3 oldest available jobs of
-- each priority below the queue's top one (its smallest priority among available jobs)
-- that have waited $2 since their run_at move up one step. A moved job keeps its run_at,
-- so at its new priority it goes before the newer jobs there. Jobs of ordered groups
-- keep theirs: a group runs in priority order, and aging one member would reorder it.
-- Levels are found by a loose index scan of job_claim_idx (one probe per priority), so
-- a tick costs at most (levels x $3) rows, whatever the backlog. Run inside `fenced`.
-- $1 queue, $2 aging (interval), $3 jobs per priority per tick
WITH RECURSIVE levels(priority, n) AS (
    (SELECT j.priority, 1 FROM {{schema}}.job AS j
     WHERE j.state = 'available' AND j.queue = $1::text
     ORDER BY j.priority LIMIT 1)
    UNION ALL
    SELECT (SELECT j.priority FROM {{schema}}.job AS j
            WHERE j.state = 'available' AND j.queue = $1::text AND j.priority > l.priority
            ORDER BY j.priority LIMIT 1), l.n + 1
    FROM levels AS l
    WHERE l.priority IS NOT NULL
), moved AS (
    SELECT o.id
    FROM levels AS l
    CROSS JOIN LATERAL (
        SELECT j.id FROM {{schema}}.job AS j
        WHERE j.state = 'available' AND j.queue = $1::text AND j.priority = l.priority
          AND j.run_at <= now() - $2::interval AND j.group_key IS NULL
        ORDER BY j.run_at, j.id
        LIMIT $3::integer
        FOR UPDATE SKIP LOCKED
    ) AS o
    WHERE l.priority IS NOT NULL AND l.n > 1
)
UPDATE {{schema}}.job AS j
SET priority = j.priority - 1
FROM moved AS m
WHERE j.id = m.id AND j.state = 'available'
RETURNING j.id;

-- name: kind_breakers_step
-- The circuit breakers' transitions (roles/breaker.py), one row per kind that declares
-- a breaker. Closed (breaker_limit NULL): opens when its failed attempts since both
-- the window's start and the breaker's last change reach breaker_failures (a lost
-- lease is the member's failure, not the kind's: not counted). Open (0, no probe):
-- half-opens (1) once the cool-down has passed. Half-open with its probe taken by a
-- claim (0 and breaker_probe): opens again if that attempt failed, closes if it
-- completed, half-opens again if it ended otherwise (cancelled, snoozed, given back,
-- its lease lost with its member: no verdict). A
-- half-open breaker waiting for its probe (1) is the claims' to change. Each update
-- applies only to the state it was decided on. Run inside `fenced`.
-- Returns each breaker's state after the step (closed, open, half_open), the change
-- made (opened, half_open, closed; NULL: none), the failures counted (while closed)
-- and the probe's id (while one is out or was judged now).
-- $1 now (NULL: the database's)
WITH t AS (
    SELECT coalesce($1::timestamptz, now()) AS now
), b AS (
    SELECT k.name, k.breaker_failures, k.breaker_cooldown, k.breaker_limit, k.breaker_at,
           k.breaker_probe,
           CASE WHEN k.breaker_limit IS NULL THEN (
               SELECT count(*)::integer FROM (
                   SELECT FROM {{schema}}.job_attempt AS a
                   WHERE a.kind = k.name AND a.outcome <> 'lease_expired'
                     AND a.failed_at > greatest(t.now - k.breaker_window,
                                                coalesce(k.breaker_at, '-infinity'))
                   LIMIT k.breaker_failures) AS f)
           END AS failures,
           CASE
               WHEN k.breaker_probe IS NULL THEN NULL
               WHEN EXISTS (SELECT FROM {{schema}}.job_attempt AS a
                            WHERE a.job_id = k.breaker_probe
                              AND a.attempt = k.breaker_probe_attempt
                              AND a.outcome <> 'lease_expired') THEN 'failed'
               WHEN EXISTS (SELECT FROM {{schema}}.job AS j
                            WHERE j.id = k.breaker_probe AND j.state = 'running'
                              AND j.attempt = k.breaker_probe_attempt) THEN 'running'
               WHEN EXISTS (SELECT FROM {{schema}}.job_history AS h
                            WHERE h.id = k.breaker_probe AND h.state = 'completed'
                              AND h.attempt = k.breaker_probe_attempt) THEN 'completed'
               ELSE 'ended'
           END AS probe_outcome
    FROM {{schema}}.kind AS k CROSS JOIN t
    WHERE k.breaker_failures IS NOT NULL
), decided AS (
    SELECT b.*,
           CASE
               WHEN b.breaker_limit IS NULL AND b.failures >= b.breaker_failures
                   THEN 'opened'
               WHEN b.breaker_limit = 0 AND b.breaker_probe IS NULL
                    AND b.breaker_at + b.breaker_cooldown <= t.now THEN 'half_open'
               WHEN b.probe_outcome = 'failed' THEN 'opened'
               WHEN b.probe_outcome = 'completed' THEN 'closed'
               WHEN b.probe_outcome = 'ended' THEN 'half_open'
           END AS change
    FROM b CROSS JOIN t
), changed AS (
    UPDATE {{schema}}.kind AS k
    SET breaker_limit = CASE d.change WHEN 'opened' THEN 0 WHEN 'half_open' THEN 1 END,
        -- A close starts the count of failures, which the database's clock stamps.
        breaker_at = CASE WHEN d.change = 'closed' THEN now() ELSE t.now END,
        breaker_probe = NULL, breaker_probe_attempt = NULL
    FROM decided AS d CROSS JOIN t
    WHERE k.name = d.name AND d.change IS NOT NULL
      AND k.breaker_limit IS NOT DISTINCT FROM d.breaker_limit
      AND k.breaker_probe IS NOT DISTINCT FROM d.breaker_probe
    RETURNING k.name
)
SELECT d.name AS kind,
       CASE WHEN c.name IS NOT NULL
            THEN CASE d.change WHEN 'opened' THEN 'open' ELSE d.change END
            WHEN d.breaker_limit IS NULL THEN 'closed'
            WHEN d.breaker_limit = 1 OR d.breaker_probe IS NOT NULL THEN 'half_open'
            ELSE 'open'
       END AS state,
       CASE WHEN c.name IS NOT NULL THEN d.change END AS change,
       d.failures, d.breaker_probe AS probe
FROM decided AS d
LEFT JOIN changed AS c ON c.name = d.name
ORDER BY d.name;
