-- Queries on jobs, for the client. "{{schema}}" is the configured schema.

-- name: job_enqueue
-- One job through the SQL function; the args travel as JSON text, so the size limit
-- applies to exactly what was sent.
-- $1 kind, $2 args (JSON text), $3 queue, $4 priority, $5 run_at, $6 tenant,
-- $7 unique_key, $8 max_attempts, $9 delay, $10 on_conflict, $11 group_key,
-- $12 depends_on, $13 expires_at, $14 ttl, $15 unique_for, $16 after,
-- $17 trace_context (JSON text)
SELECT {{schema}}.enqueue($1, $2::text::jsonb, $3, $4, $5, $6, $7, $8, $9, $10,
                          octet_length($2::text), $11, $12, $13, $14, $15, $16,
                          $17::text::jsonb);

-- name: job_enqueue_many
-- The args travel as JSON text, so the size limit applies to exactly what was sent.
-- $1 kinds, $2 args (JSON texts), $3 queues, $4 priorities, $5 run_ats, $6 delays,
-- $7 tenants, $8 unique_keys, $9 max_attempts, $10 group_keys, $11 dependencies (array
-- texts), $12 expires_ats, $13 ttls, $14 unique_fors, $15 afters (array texts),
-- $16 trace_contexts (JSON texts), $17 on_conflict
SELECT e.id
FROM {{schema}}.enqueue_many($1, $2::text[]::jsonb[], $3, $4, $5, $6, $7, $8, $9, $17,
                             ARRAY(SELECT octet_length(t) FROM unnest($2::text[]) AS t),
                             $10, $11, $12, $13, $14, $15, $16::text[]::jsonb[]) AS e
ORDER BY e.ord;

-- name: job_copy_prepare
-- What the client's COPY of a batch straight into the job table needs, in one round
-- trip before it, in the same transaction (so this now() is the rows' now()): each
-- distinct set of given options resolved by job_defaults, the batch admitted, its
-- queues woken at commit, its ids drawn in order, and whether row security refuses the
-- session COPY FROM (then job_copy_insert). See the function job_copy_prepare.
-- $1 kinds, $2 queues, $3 priorities, $4 run_ats, $5 delays, $6 max_attempts, $7 ttls,
-- $8 expires_ats (one element per set; NULL: not given), $9 jobs per set, $10 whether
-- any of them has a group, $11 job count
SELECT * FROM {{schema}}.job_copy_prepare($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11);

-- name: job_copy_insert
-- The rows of the client's COPY path, resolved by job_copy_prepare, inserted by a
-- statement instead: for a session that row security applies to (a tenant's producer
-- under `migrate --rls`), which COPY FROM refuses. Its policy checks each row.
-- $1 ids, $2 kinds, $3 args (JSON texts), $4 tenants, $5 group_keys, $6 trace_contexts
-- (JSON texts), $7 states, $8 queues, $9 priorities, $10 run_ats, $11 max_attempts,
-- $12 expires_ats
INSERT INTO {{schema}}.job (id, kind, args, tenant, group_key, trace_context, state, queue,
                            priority, run_at, max_attempts, expires_at)
SELECT u.id, u.kind, u.args::jsonb, u.tenant, u.group_key, u.trace_context::jsonb,
       u.state::{{schema}}.job_state, u.queue, u.priority, u.run_at, u.max_attempts,
       u.expires_at
FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
            $7::text[], $8::text[], $9::smallint[], $10::timestamptz[], $11::integer[],
            $12::timestamptz[])
     AS u(id, kind, args, tenant, group_key, trace_context, state, queue, priority, run_at,
          max_attempts, expires_at);

-- name: job_get
-- A job by id: live from the hot table, else its final record.
-- $1 id
SELECT j.id, j.kind, j.queue, j.state::text AS state, j.attempt, j.max_attempts,
       j.priority, j.args, NULL::jsonb AS result, NULL::text AS reason, j.tenant,
       j.unique_key, j.run_at, j.enqueued_at, NULL::timestamptz AS finished_at,
       j.last_error, coalesce(j.depends_on, '{}') AS depends_on,
       coalesce(j.after_jobs, '{}') AS after, j.expires_at
FROM {{schema}}.job AS j
WHERE j.id = $1
UNION ALL
SELECT h.id, h.kind, h.queue, h.state::text, h.attempt, h.max_attempts, h.priority,
       h.args, h.result, h.reason, h.tenant, h.unique_key, h.run_at, h.enqueued_at,
       h.finished_at, h.last_error, coalesce(h.depends_on, '{}'),
       coalesce(h.after_jobs, '{}'), NULL::timestamptz
FROM {{schema}}.job_history AS h
WHERE h.id = $1
LIMIT 1;

-- name: job_dependants
-- The jobs that wait (or waited) for job $1: through depends_on or after, live or
-- final, oldest first.
-- $1 id
SELECT j.id, 'depends_on' AS edge FROM {{schema}}.job AS j
WHERE j.depends_on @> ARRAY[$1::bigint] AND j.depends_on IS NOT NULL
UNION
SELECT j.id, 'after' FROM {{schema}}.job AS j
WHERE j.after_jobs @> ARRAY[$1::bigint] AND j.after_jobs IS NOT NULL
UNION
SELECT h.id, 'depends_on' FROM {{schema}}.job_history AS h
WHERE h.depends_on @> ARRAY[$1::bigint] AND h.depends_on IS NOT NULL
UNION
SELECT h.id, 'after' FROM {{schema}}.job_history AS h
WHERE h.after_jobs @> ARRAY[$1::bigint] AND h.after_jobs IS NOT NULL
ORDER BY 1;

-- name: job_live_ids
-- Which of jobs $1 are still live. Read by client.wait after it LISTENs on
-- <schema>.job_final: a job seen live here ends in a transaction that commits after
-- that LISTEN, so its end is announced to the waiter.
-- $1 ids
SELECT j.id FROM {{schema}}.job AS j WHERE j.id = ANY($1::bigint[]);

-- name: job_attempt_errors
-- The failed attempts of a job, oldest first.
-- $1 id
SELECT a.attempt, concat_ws(': ', a.error_class, a.error_message) AS error, a.failed_at AS at
FROM {{schema}}.job_attempt AS a
WHERE a.job_id = $1
ORDER BY a.attempt, a.failed_at;

-- name: job_claim
-- Claims up to $2 available jobs of queue $1 for member $3, in claim order: one short
-- transaction. The attempt is counted here, before the handler runs, so a job that
-- kills its worker still uses up attempts. Each claim gets a new fence; the lease
-- comes from the database clock. A paused queue gives nothing. waited_s: due (run_at)
-- to claimed, on the database clock (for pgjobd_job_wait_seconds). Neither does a
-- queue that needs flow control (limits or groups, its own or any kind's, or a kind's
-- circuit breaker that is not closed): that one claims through job_claim_flow, and the
-- producer learns which from queue_flow_get. $5-$7: where the claim starts in claim
-- order, after (priority, run_at, id) (NULLs: the head of the queue): the producer's
-- cursor, so that a claim does not walk again the index entries of the jobs claimed
-- before it (under a held xmin horizon none of them can be skipped without a heap
-- visit; see pgjobd/producer.py, ClaimCursor).
-- $1 queue, $2 limit, $3 member id, $4 lease, $5 priority, $6 run_at, $7 id
WITH picked AS (
    SELECT j.id
    FROM {{schema}}.job AS j
    WHERE j.state = 'available' AND j.queue = $1
      AND (j.priority, j.run_at, j.id) > (coalesce($5::smallint, -32768),
                                          coalesce($6::timestamptz, '-infinity'),
                                          coalesce($7::bigint, 0))
      AND NOT EXISTS (SELECT FROM {{schema}}.queue AS q
                      WHERE q.name = $1 AND (q.paused OR q.flow))
      AND NOT EXISTS (SELECT FROM {{schema}}.kind AS k
                      WHERE k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL
                            OR k.breaker_limit IS NOT NULL)
      AND (j.expires_at IS NULL OR j.expires_at > now())  -- expired: the reaper ends it
    ORDER BY j.priority, j.run_at, j.id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE {{schema}}.job AS j
SET state = 'running', attempt = j.attempt + 1, fence = nextval('{{schema}}.fence_seq'),
    owner = $3, attempted_at = now(), lease_expires_at = now() + $4::interval
-- (By id, not joined: a join's plan follows the LIMIT's estimate, a tenth of the backlog
-- when the LIMIT is a parameter of a generic plan, and then scans the hot table.)
WHERE j.id = ANY(ARRAY(SELECT p.id FROM picked AS p))
RETURNING j.id, j.fence, j.kind, j.queue, j.attempt, j.max_attempts, j.crashes, j.priority,
          j.tenant, j.enqueued_at, j.run_at AS scheduled_at, j.args::text AS args,
          extract(epoch FROM now() - j.run_at)::float8 AS waited_s,
          j.depends_on, j.after_jobs, j.blockers_failed,
          j.trace_context::text AS trace_context;

-- name: job_available_behind
-- Whether a job of queue $1 is available at or before ($2, $3, $4) in claim order: one a
-- producer's claim cursor has passed (a higher priority, a promoted or retried job due
-- earlier, a transaction that committed after a later one, a claim rolled back), or
-- the cursor's own job, available again (the reaper's rescue). Read without locks,
-- beside the claims: under a held xmin horizon this walk from the head reads every
-- index entry claimed since, and the claims after the cursor do not wait for it (see
-- pgjobd/producer.py, ClaimCursor). As job_claim's scan, up to its start (in its
-- order, so that the plan is the claim index's, never a scan of the table).
-- $1 queue, $2 priority, $3 run_at, $4 id
SELECT (SELECT j.id
        FROM {{schema}}.job AS j
        WHERE j.state = 'available' AND j.queue = $1
          AND (j.priority, j.run_at, j.id) <= ($2::smallint, $3::timestamptz, $4::bigint)
          AND (j.expires_at IS NULL OR j.expires_at > now())
        ORDER BY j.priority, j.run_at, j.id
        LIMIT 1) IS NOT NULL AS behind;

-- name: flow_reserve
-- Places for the next claim of member $3's claim loop $5 from queue $1, at most $2,
-- under the queue's global_concurrency (migration 0021): recorded until
-- job_claim_reserved takes them; NULL when the queue is not reservable (it claims
-- through job_claim_flow then).
-- $1 queue, $2 limit, $3 member id, $4 ended fences (as job_claim_flow's), $5 loop
SELECT {{schema}}.flow_reserve($1, $2, $3, $4::bigint[], $5::smallint) AS places;

-- name: job_claim_reserved
-- job_claim for the places flow_reserve granted member $2's claim loop $4 in queue $1:
-- takes up to that many and deletes the reservation in the same statement (one whose
-- reservation was deleted as expired, or holds fewer places, takes nothing). Nothing
-- either if the queue stopped being reservable since (a limit, groups or a pause
-- added). The number of places comes from the caller ($5, what flow_reserve granted),
-- checked against the reservation: a LIMIT read from the reservation is unknown to the
-- planner (see job_claim's update).
-- $1 queue, $2 member id, $3 lease, $4 loop, $5 places granted
WITH reservation AS (
    DELETE FROM {{schema}}.flow_reservation AS r
    WHERE r.queue = $1 AND r.claimer = $2 AND r.loop = $4::smallint
    RETURNING r.places
), picked AS (
    SELECT j.id
    FROM {{schema}}.job AS j
    WHERE j.state = 'available' AND j.queue = $1
      AND {{schema}}.queue_reservable($1)
      AND (SELECT sum(r.places) FROM reservation AS r) >= $5::integer
      AND (j.expires_at IS NULL OR j.expires_at > now())  -- expired: the reaper ends it
    ORDER BY j.priority, j.run_at, j.id
    LIMIT $5::integer
    FOR UPDATE SKIP LOCKED
)
UPDATE {{schema}}.job AS j
SET state = 'running', attempt = j.attempt + 1, fence = nextval('{{schema}}.fence_seq'),
    owner = $2, attempted_at = now(), lease_expires_at = now() + $3::interval
-- (By id, as job_claim's.)
WHERE j.id = ANY(ARRAY(SELECT p.id FROM picked AS p))
RETURNING j.id, j.fence, j.kind, j.queue, j.attempt, j.max_attempts, j.crashes, j.priority,
          j.tenant, j.enqueued_at, j.run_at AS scheduled_at, j.args::text AS args,
          extract(epoch FROM now() - j.run_at)::float8 AS waited_s,
          j.depends_on, j.after_jobs, j.blockers_failed,
          j.trace_context::text AS trace_context;

-- name: job_claim_fair
-- job_claim for a queue whose only limit is fair = true, without the queue's lock: the
-- lowest virtual start tags first (start-time fair queuing, migration 0024). Nothing for
-- any other queue (queue_claim_path_get says which).
-- $1 queue, $2 limit, $3 member id, $4 lease
SELECT c.id, c.fence, c.kind, c.queue, c.attempt, c.max_attempts, c.crashes, c.priority,
       c.tenant, c.enqueued_at, c.scheduled_at, c.args, c.waited_s, c.depends_on,
       c.after_jobs, c.blockers_failed, c.trace_context
FROM {{schema}}.job_claim_fair($1, $2, $3, $4::interval) AS c;

-- name: flow_allocate
-- Member $2's allocation of queue $1's global_concurrency, made anew for its running
-- jobs less $3 (fences of its jobs whose handlers have ended, as job_claim_flow's) and
-- $4 more (migration 0025): (ceiling, places); NULLs when the queue is not reservable
-- (it claims through job_claim_flow then).
-- $1 queue, $2 member id, $3 ended fences, $4 more
SELECT a.ceiling, a.places FROM {{schema}}.flow_allocate($1, $2, $3::bigint[], $4) AS a;

-- name: job_claim_allocated
-- job_claim within member $3's allocation of queue $1 (migration 0025), without the
-- queue's lock: up to $2 jobs, at most the allocation's ceiling less the member's
-- running jobs less $5 (ended fences); a row with a NULL id when the allocation held
-- jobs back. $6-$8: where the claim starts in claim order (job_claim's cursor).
-- $1 queue, $2 limit, $3 member id, $4 lease, $5 ended fences, $6 priority, $7 run_at,
-- $8 id
SELECT c.id, c.fence, c.kind, c.queue, c.attempt, c.max_attempts, c.crashes, c.priority,
       c.tenant, c.enqueued_at, c.scheduled_at, c.args, c.waited_s, c.depends_on,
       c.after_jobs, c.blockers_failed, c.trace_context, c.held_by
FROM {{schema}}.job_claim_allocated($1, $2, $3, $4::interval, $5::bigint[], $6::smallint,
                                    $7::timestamptz, $8::bigint) AS c;

-- name: queue_claim_path_get
-- How queue $1 claims (migration 0025): 'plain' (job_claim), 'allocated' (its only limit
-- a global_concurrency: flow_allocate and job_claim_allocated), 'fair' (its only limit
-- fair = true: job_claim_fair) or 'limited' (job_claim_flow). One read for the
-- producer's choice of statement.
-- $1 queue
SELECT CASE WHEN NOT (coalesce((SELECT q.flow FROM {{schema}}.queue AS q WHERE q.name = $1),
                               false)
                      OR EXISTS (SELECT FROM {{schema}}.kind AS k
                                 WHERE k.global_concurrency IS NOT NULL
                                       OR k.rate_limit IS NOT NULL
                                       OR k.breaker_limit IS NOT NULL)) THEN 'plain'
            WHEN {{schema}}.queue_reservable($1) THEN 'allocated'
            WHEN {{schema}}.queue_fair_only($1) THEN 'fair'
            ELSE 'limited' END AS path;

-- name: job_results
-- The results of jobs $1 (what a job waited for; read when its handler asks):
-- {"id": result} from the latest final record of each, as JSON text (NULL: none found).
-- $1 ids
SELECT jsonb_object_agg(r.id::text, r.result)::text
FROM (SELECT DISTINCT ON (h.id) h.id, h.result
      FROM {{schema}}.job_history AS h
      WHERE h.id = ANY($1::bigint[])
      ORDER BY h.id, h.finished_at DESC) AS r;

-- name: job_claim_flow
-- job_claim for a queue with limits or groups (or while any kind has a limit): see the
-- function in migration 0007 (its result as job_claim's since 0011). Rows with a NULL id
-- name a limit that held jobs back. $5: the fences of this member's jobs whose handlers
-- have ended and whose ends are not recorded yet, which fleet-wide counts of running
-- jobs leave out (migration 0021).
-- $1 queue, $2 limit, $3 member id, $4 lease, $5 ended fences
SELECT c.id, c.fence, c.kind, c.queue, c.attempt, c.max_attempts, c.crashes, c.priority,
       c.tenant, c.enqueued_at, c.scheduled_at, c.args, c.waited_s, c.depends_on,
       c.after_jobs, c.blockers_failed, c.trace_context, c.held_by
FROM {{schema}}.job_claim_flow($1, $2, $3, $4::interval, $5::bigint[]) AS c;

-- name: queue_flow_get
-- Whether queue $1 claims through job_claim_flow (its limits or groups, or any kind's
-- limit or breaker not closed): what the producer checks to choose its claim statement.
-- $1 queue
SELECT coalesce((SELECT q.flow FROM {{schema}}.queue AS q WHERE q.name = $1), false)
       OR EXISTS (SELECT FROM {{schema}}.kind AS k
                  WHERE k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL
                        OR k.breaker_limit IS NOT NULL)
       AS flow;

-- name: queue_room_announce
-- Wakes the producers of queues $1 on the other members, on <schema>.job_room (payload
-- "queue\nmember": the announcing member's own producers ignore it): jobs of these
-- queues (under flow control) just ended, so a fleet-wide limit may have room again.
-- The completer sends it after recording them; nothing else announces room.
-- $1 queues, $2 member id
SELECT pg_notify('{{schema}}.job_room', q.name || E'\n' || $2)
FROM unnest($1::text[]) AS q(name);

-- name: job_promote_due
-- Makes due scheduled and retryable jobs available, wakes their queues' producers
-- fleet-wide, and says how long until the next one is due (NULL: none waiting).
-- $1 limit
WITH due AS (
    SELECT j.id
    FROM {{schema}}.job AS j
    WHERE j.state IN ('scheduled', 'retryable') AND j.run_at <= now()
    ORDER BY j.run_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
), promoted AS (
    UPDATE {{schema}}.job AS j SET state = 'available'
    FROM due WHERE j.id = due.id
    RETURNING j.queue
), woken AS (
    SELECT p.queue, pg_notify('{{schema}}.job_ready', p.queue)
    FROM (SELECT DISTINCT queue FROM promoted) AS p
)
SELECT (SELECT count(*) FROM promoted) AS promoted,
       ARRAY(SELECT w.queue FROM woken AS w) AS queues,
       extract(epoch FROM (
           SELECT min(j.run_at) FROM {{schema}}.job AS j
           WHERE j.state IN ('scheduled', 'retryable')
             AND j.id NOT IN (SELECT due.id FROM due)
       ) - now())::float8 AS next_due_in_s;

-- name: job_complete_many
-- Finishes a batch of completed jobs: moves each from the hot table to its final record
-- (job_move) only where this member's fence still holds (a fence is set only while a
-- job runs). Returns the (id, fence) pairs finished; one missing from the result lost
-- its lease meanwhile.
-- $1 ids, $2 fences, $3 results (JSON text or NULL; a NULL array: none), $4 keep a
-- history record (a NULL array: keep each; job_move reads missing elements as NULL)
SELECT m.id, m.fence
FROM {{schema}}.job_move($1::bigint[], $2::bigint[], NULL, NULL, $3::text[]::jsonb[],
                         $4::boolean[]) AS m;

-- name: job_fail_many
-- Records a batch of attempts that did not complete, fence-checked like completion.
-- Whether a job ends is job_end_reason's rule, decided on the row locked (so that a
-- concurrent change, an admin's cancel or the reaper, is seen by the decision and the
-- write alike). Jobs that do not end (retried, snoozed, or given back) return to the hot
-- table with run_at = now() + delay; the others move to history, dead or cancelled
-- (job_move). Every failed attempt (not a snooze or a give-back) gets one job_attempt
-- row: matched by id and fence, as a batch may hold a stale outcome of the same job.
-- Returns the (id, fence) pairs recorded, each with its reason when it ended (dead:
-- why; or 'cancelled'), else NULL.
-- $1 ids, $2 fences, $3 verdicts, $4 the queues' max_crashes, $5 delays,
-- $6 error classes, $7 error messages, $8 tracebacks, $9 durations (s),
-- $10 keep a history record, $11 error fingerprints, $12 member id
WITH o AS (
    SELECT *
    FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::integer[], $5::interval[],
                $6::text[], $7::text[], $8::text[], $9::float8[], $10::boolean[], $11::text[])
         AS o(id, fence, outcome, max_crashes, delay, error_class, error_message,
              traceback, duration_s, keep, fingerprint)
), decided AS (
    SELECT j.id, o.fence, j.attempt, j.queue, j.kind, o.outcome, o.delay,
           concat_ws(': ', o.error_class, o.error_message) AS error, o.keep, o.fingerprint,
           {{schema}}.job_end_reason(o.outcome, j.attempt, j.max_attempts, j.crashes,
                                     o.max_crashes, j.cancel_requested) AS reason
    FROM {{schema}}.job AS j
    JOIN o ON j.id = o.id AND j.fence = o.fence
    -- A matching fence implies state = 'running' (job_running_holds_lease), and saying
    -- so would invite the planner to scan job_running_idx, whose dead entries from
    -- recently finished jobs it underestimates; "j.id = ANY" makes it look up by key.
    WHERE j.id = ANY($1::bigint[])
    ORDER BY j.id  -- (locked in id order, as admin actions lock theirs)
    FOR UPDATE OF j
), retried AS (
    UPDATE {{schema}}.job AS j
    SET state = CASE d.outcome WHEN 'snoozed' THEN 'scheduled'
                               WHEN 'given_back' THEN 'available'
                               ELSE 'retryable' END::{{schema}}.job_state,
        run_at = now() + d.delay,
        attempt = j.attempt - (d.outcome IN ('snoozed', 'given_back'))::integer,
        crashes = j.crashes + (d.outcome = 'crashed')::integer,
        last_error = CASE WHEN d.outcome IN ('snoozed', 'given_back') THEN j.last_error
                          ELSE d.error END,
        owner = NULL, fence = NULL, lease_expires_at = NULL
    FROM decided AS d
    WHERE j.id = d.id AND j.fence = d.fence AND d.reason IS NULL
    RETURNING j.id, d.fence
), died AS (
    SELECT m.id, m.fence
    FROM (SELECT array_agg(d.id) AS ids, array_agg(d.fence) AS fences,
                 array_agg(d.reason) AS reasons, array_agg(d.error) AS errors,
                 array_agg(d.keep) AS keep, array_agg(d.fingerprint) AS fingerprints
          FROM decided AS d
          WHERE d.reason IS NOT NULL
          HAVING count(*) > 0) AS a
    CROSS JOIN LATERAL {{schema}}.job_move(a.ids, a.fences, a.reasons, a.errors, NULL, a.keep,
                                           a.fingerprints) AS m
), recorded AS (
    SELECT d.id, d.fence, d.attempt, d.queue, d.kind, d.outcome, d.reason
    FROM decided AS d
    JOIN (SELECT r.id, r.fence FROM retried AS r
          UNION ALL
          SELECT x.id, x.fence FROM died AS x) AS w ON w.id = d.id AND w.fence = d.fence
), attempts AS (
    INSERT INTO {{schema}}.job_attempt (job_id, failed_at, duration_s, attempt, queue, kind,
        member, outcome, error_class, error_message, traceback, fingerprint)
    SELECT o.id, now(), o.duration_s, r.attempt, r.queue, r.kind, $12, o.outcome,
           o.error_class, o.error_message, o.traceback, o.fingerprint
    FROM recorded AS r JOIN o ON o.id = r.id AND o.fence = r.fence
    WHERE o.outcome NOT IN ('snoozed', 'given_back')
)
SELECT r.id, r.fence, r.reason FROM recorded AS r;

-- name: job_lease_renew
-- Extends the leases of the jobs this member holds, where its fences still hold. A row
-- another transaction has locked is skipped, not waited for (one locked row must not
-- hold up every renewal of the member): it comes back with renewed = false, neither
-- renewed nor lost. Returns (id, fence) of every attempt that still holds its job, and
-- whether an admin asked to cancel it (a fallback for a missed job_cancel
-- notification); an attempt not returned was lost (its row is gone or re-fenced).
-- $1 member id, $2 ids, $3 fences, $4 lease
WITH held AS (
    SELECT j.id
    FROM {{schema}}.job AS j
    JOIN unnest($2::bigint[], $3::bigint[]) AS h(id, fence) ON j.id = h.id
    WHERE j.id = ANY($2::bigint[]) AND j.fence = h.fence AND j.owner = $1
    FOR UPDATE OF j SKIP LOCKED
), renewed AS (
    UPDATE {{schema}}.job AS j
    SET lease_expires_at = now() + $4::interval
    FROM held
    WHERE j.id = held.id
    RETURNING j.id, j.fence, j.cancel_requested
)
SELECT r.id, r.fence, r.cancel_requested, true AS renewed FROM renewed AS r
UNION ALL
SELECT j.id, j.fence, j.cancel_requested, false
FROM {{schema}}.job AS j
JOIN unnest($2::bigint[], $3::bigint[]) AS h(id, fence) ON j.id = h.id
WHERE j.id = ANY($2::bigint[]) AND j.fence = h.fence AND j.owner = $1
  AND j.id NOT IN (SELECT held.id FROM held);
