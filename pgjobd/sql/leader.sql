-- Leadership and the leader's roles. "{{schema}}" is the configured schema.
--
-- The leader is the member whose dedicated session holds the schema's advisory lock.
-- Every role statement is fenced: it changes something only while the session the
-- leader believes it holds ($k1, $k2: the lock key as unsigned ints, $pid: that
-- session's backend) still holds the lock, checked in the same statement. A deposed
-- leader's statements change nothing.

-- name: leader_try_lock
-- $1, $2 the lock key (signed ints)
SELECT pg_try_advisory_lock($1, $2);

-- name: leader_still_holds
-- On the leader's own session: does it still hold the lock?
-- $1, $2 the lock key (unsigned)
SELECT EXISTS (
    SELECT FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.classid::bigint = $1 AND l.objid::bigint = $2
      AND l.objsubid = 2 AND l.pid = pg_backend_pid() AND l.granted
);

-- name: leader_term_begin
-- A new term, issued by the database. On the leader's session.
-- $1 member id
INSERT INTO {{schema}}.leader (member, backend_pid) VALUES ($1, pg_backend_pid())
RETURNING term;

-- name: leader_resign
-- Frees the lock and tells the candidates at once (they LISTEN on <schema>.leader).
-- $1 term, $2, $3 the lock key (signed ints)
WITH resigned AS (
    UPDATE {{schema}}.leader SET resigned_at = now() WHERE term = $1 AND resigned_at IS NULL
)
SELECT pg_advisory_unlock($2, $3), pg_notify('{{schema}}.leader', 'resigned');

-- name: job_reap_expired
-- Takes back running jobs whose lease expired (their member died, hung, or lost the
-- database): available again at once, or dead when the attempt was their last or the
-- lease loss is their max_crashes-th, or cancelled if an admin asked for it. Guarded by the row lock and the state: a
-- completion that got there first wins and this changes nothing for that job.
-- $1, $2 lock key (unsigned), $3 leader backend pid, $4 limit, $5 queue names,
-- $6 their max_crashes, $7 max_crashes for other queues
WITH expired AS (
    SELECT j.id, j.owner AS lost_by, j.cancel_requested AS cancelled,
           j.attempt >= j.max_attempts AS spent,
           j.crashes + 1 >= coalesce(qc.max_crashes, $7) AS poisoned
    FROM {{schema}}.job AS j
    LEFT JOIN unnest($5::text[], $6::integer[]) AS qc(name, max_crashes) ON qc.name = j.queue
    WHERE j.state = 'running' AND j.lease_expires_at < now()
      AND EXISTS (SELECT FROM pg_locks AS l
                  WHERE l.locktype = 'advisory' AND l.classid::bigint = $1
                    AND l.objid::bigint = $2 AND l.objsubid = 2 AND l.pid = $3 AND l.granted)
    ORDER BY j.lease_expires_at
    LIMIT $4
    FOR UPDATE OF j SKIP LOCKED
), rescued AS (
    UPDATE {{schema}}.job AS j
    SET state = 'available', run_at = now(), owner = NULL, fence = NULL,
        lease_expires_at = NULL, crashes = j.crashes + 1,
        last_error = 'LeaseExpired: member ' || e.lost_by || ' stopped renewing the lease'
    FROM expired AS e
    WHERE j.id = e.id AND NOT e.spent AND NOT e.poisoned AND NOT e.cancelled
    RETURNING j.id, j.attempt, j.queue, j.kind, e.lost_by
), died AS (
    DELETE FROM {{schema}}.job AS j
    USING expired AS e
    WHERE j.id = e.id AND (e.spent OR e.poisoned OR e.cancelled)
    RETURNING j.*, e.lost_by,
              CASE WHEN e.cancelled THEN 'cancelled'
                   WHEN e.poisoned THEN 'worker_crash'
                   ELSE 'attempts_exhausted' END AS reason
), buried AS (
    INSERT INTO {{schema}}.job_history (id, finished_at, run_at, enqueued_at, attempted_at,
        attempt, max_attempts, priority, state, reason, queue, kind, tenant, unique_key,
        owner, last_error, args)
    SELECT d.id, now(), d.run_at, d.enqueued_at, d.attempted_at, d.attempt, d.max_attempts,
           d.priority,
           CASE WHEN d.reason = 'cancelled' THEN 'cancelled' ELSE 'dead' END
               ::{{schema}}.job_state,
           d.reason, d.queue, d.kind, d.tenant, d.unique_key, d.lost_by,
           'LeaseExpired: member ' || d.lost_by || ' stopped renewing the lease', d.args
    FROM died AS d
), attempts AS (
    INSERT INTO {{schema}}.job_attempt (job_id, attempt, queue, kind, member, outcome,
                                        error_class, error_message)
    SELECT r.id, r.attempt, r.queue, r.kind, r.lost_by, 'lease_expired', 'LeaseExpired',
           'member ' || r.lost_by || ' stopped renewing the lease'
    FROM (SELECT id, attempt, queue, kind, lost_by FROM rescued
          UNION ALL
          SELECT id, attempt, queue, kind, lost_by FROM died) AS r
), woken AS (
    SELECT pg_notify('{{schema}}.job_ready', q.queue)
    FROM (SELECT DISTINCT queue FROM rescued) AS q
)
SELECT (SELECT count(*) FROM rescued) AS rescued, (SELECT count(*) FROM died) AS died,
       (SELECT count(*) FROM woken) AS queues_woken;

-- name: member_forget_gone
-- Removes member rows whose heartbeat stopped long ago.
-- $1, $2 lock key (unsigned), $3 leader backend pid, $4 silence (interval)
DELETE FROM {{schema}}.member AS m
WHERE m.heartbeat_at < now() - $4::interval
  AND EXISTS (SELECT FROM pg_locks AS l
              WHERE l.locktype = 'advisory' AND l.classid::bigint = $1
                AND l.objid::bigint = $2 AND l.objsubid = 2 AND l.pid = $3 AND l.granted)
RETURNING m.id;

-- name: leader_fence_holds
-- For role steps that cannot carry the fence themselves (DDL): is the leader's
-- session still holding the lock?
-- $1, $2 lock key (unsigned), $3 leader backend pid
SELECT EXISTS (SELECT FROM pg_locks AS l
               WHERE l.locktype = 'advisory' AND l.classid::bigint = $1
                 AND l.objid::bigint = $2 AND l.objsubid = 2 AND l.pid = $3 AND l.granted);

-- name: partition_list
-- The partitions of $1, and whether a concurrent detach of one was left unfinished.
-- $1 parent table (qualified name)
SELECT c.relname AS name, i.inhdetachpending AS detach_pending
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
WHERE i.inhparent = $1::regclass
ORDER BY c.relname;

-- name: job_next_lease_expiry
-- Seconds until the earliest lease of a running job expires (NULL: nothing running).
SELECT extract(epoch FROM min(j.lease_expires_at) - now())::float8
FROM {{schema}}.job AS j
WHERE j.state = 'running';

-- name: queue_stats
-- For the leader's metrics: per queue, live jobs by state, the oldest available job's
-- age (s; NULL when none is available) and whether it is paused. Lists the queues with
-- live jobs, the paused ones and those named in $1 (the leader's configured queues).
-- Read-only, so unfenced.
-- $1 queue names
WITH live AS (
    SELECT * FROM {{schema}}.queue_depth
), named AS (
    SELECT queue FROM live
    UNION SELECT unnest($1::text[])
    UNION SELECT q.name FROM {{schema}}.queue AS q WHERE q.paused
)
SELECT n.queue,
       coalesce(l.available, 0) AS available,
       coalesce(l.scheduled, 0) AS scheduled,
       coalesce(l.running, 0) AS running,
       coalesce(l.retryable, 0) AS retryable,
       greatest(0, extract(epoch FROM now() - l.oldest_available_at))::float8
           AS oldest_available_age_s,
       coalesce(q.paused, false) AS paused
FROM named AS n
LEFT JOIN live AS l USING (queue)
LEFT JOIN {{schema}}.queue AS q ON q.name = n.queue
ORDER BY n.queue;
