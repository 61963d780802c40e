-- A queue whose only limit is its global_concurrency claims without the queue's lock
-- while its members' shares stay put (issue 12): standing allocations. Before, every
-- claim of such a queue reserved its places under the queue's lock (flow_reserve) and
-- claimed them in a second round trip (job_claim_reserved): two round trips a claim, one
-- of them serialised fleet-wide, and global_concurrency = 50 on 2 members drained at
-- 0.73-0.81 of per-member limits adding up to 50 (bench/flow.py --parts drain).
--
-- Now each member holds an allocation of the queue's places: a flow_reservation row of
-- claim loop -1, kept until it expires (5 s) and renewed as the member claims.
--   places   what every count of the queue adds for the member (its running jobs are
--            left out of the counts: they are within it);
--   ceiling  what the member's own claims may fill: its running jobs, less the ones
--            whose handlers have ended (`ended`, as job_claim_flow's), stay within it;
--   wanted   what the member would run if it could (its demand, for the fair share).
-- flow_allocate sets them under the queue's lock: the ceiling is the member's demand, at
-- most the room the other members' places and the running jobs of members without an
-- allocation leave, and, while another member wants more than it holds, at most an
-- equal share of the width among the members that want places; `places` is the larger
-- of the ceiling and the member's running jobs, so that a member whose ceiling shrinks
-- below what it runs keeps counting those until its next allocation. job_claim_allocated
-- claims up to the ceiling less the member's running jobs without the queue's lock: it
-- locks the member's own allocation row, so the member's claim loops take turns on it,
-- and a member that deletes the row as expired waits for the claim's commit (its count,
-- a statement later, sees the claim's jobs), or the claim finds the row gone and takes
-- nothing. A running job whose owner has an allocation is counted through it, not by
-- itself; one whose owner has none (a member that died, a member of an earlier release
-- reserving per claim) is counted as before. Every earlier count (flow_reserve's,
-- job_claim_limited's) adds every reservation's places to every running job, the
-- allocations' included: they count a holder's jobs twice, never too few, while a queue
-- changes its claim path. "{{schema}}" is replaced by the configured schema name.

ALTER TABLE {{schema}}.flow_reservation
    DROP CONSTRAINT flow_reservation_places_check,
    ADD CONSTRAINT flow_reservation_places_check CHECK (places >= 0 AND (places > 0 OR loop = -1)),
    ADD COLUMN ceiling integer NOT NULL DEFAULT 0 CHECK (ceiling >= 0),
    ADD COLUMN wanted integer NOT NULL DEFAULT 0 CHECK (wanted >= 0);

-- Member `claimer`'s allocation of queue `claim_queue`'s global_concurrency, made anew
-- for its demand: its running jobs (less `ended`) and `more`. NULLs when the queue is
-- not reservable (job_claim_flow then).
CREATE FUNCTION {{schema}}.flow_allocate(
    claim_queue text, claimer text, ended bigint[], more integer,
    OUT ceiling integer, OUT places integer
)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    width      integer;
    in_use     integer;
    demand     integer;            -- its running jobs and `more`
    others     integer;
    wanting    integer;            -- the other members that want places
    before_me  integer;            -- of those, the ones whose share's remainder is first
    starving   boolean;            -- another member wants more than it holds
    share      integer;
BEGIN
    IF NOT {{schema}}.queue_reservable(claim_queue) THEN
        RETURN;
    END IF;
    PERFORM {{schema}}.flow_lock('queue ' || claim_queue);
    -- From here on: fresh snapshots, taken under the lock.
    IF NOT {{schema}}.queue_reservable(claim_queue) THEN
        RETURN;
    END IF;
    ended := coalesce(ended, '{}');
    -- (Waits for a claim on an expired allocation: then the counts see its jobs.)
    DELETE FROM {{schema}}.flow_reservation AS r
    WHERE r.queue = claim_queue AND r.expires_at < clock_timestamp();
    SELECT q.global_concurrency INTO width FROM {{schema}}.queue AS q
    WHERE q.name = claim_queue;
    -- One statement, one snapshot: a claim's jobs or the allocation they are within.
    SELECT (SELECT count(*) FROM {{schema}}.job AS j
            WHERE j.state = 'running' AND j.queue = claim_queue
              AND j.owner = flow_allocate.claimer AND NOT (j.fence = ANY(ended))),
           (SELECT coalesce(sum(r.places), 0) FROM {{schema}}.flow_reservation AS r
            WHERE r.queue = claim_queue AND NOT (r.claimer = flow_allocate.claimer
                                                 AND r.loop = -1))
           + (SELECT count(*) FROM {{schema}}.job AS j
              WHERE j.state = 'running' AND j.queue = claim_queue
                AND j.owner IS DISTINCT FROM flow_allocate.claimer
                AND NOT EXISTS (SELECT FROM {{schema}}.flow_reservation AS r
                                WHERE r.queue = claim_queue AND r.claimer = j.owner
                                  AND r.loop = -1))
    INTO in_use, others;
    demand := in_use + least(greatest(coalesce(more, 0), 0), width);
    SELECT count(*) FILTER (WHERE r.wanted > 0),
           count(*) FILTER (WHERE r.wanted > 0 AND r.claimer < flow_allocate.claimer),
           coalesce(bool_or(r.wanted > r.ceiling), false)
    INTO wanting, before_me, starving
    FROM {{schema}}.flow_reservation AS r
    WHERE r.queue = claim_queue AND r.loop = -1 AND r.claimer <> flow_allocate.claimer;
    share := width / (wanting + 1)
             + CASE WHEN before_me < width % (wanting + 1) THEN 1 ELSE 0 END;
    ceiling := least(CASE WHEN starving THEN least(demand, share) ELSE demand END,
                     greatest(width - others, 0));
    places := greatest(ceiling, in_use);
    IF places = 0 AND demand = 0 THEN
        DELETE FROM {{schema}}.flow_reservation AS r
        WHERE r.queue = claim_queue AND r.claimer = flow_allocate.claimer AND r.loop = -1;
    ELSE
        INSERT INTO {{schema}}.flow_reservation AS r
            (queue, claimer, loop, places, ceiling, wanted, expires_at)
        VALUES (claim_queue, flow_allocate.claimer, -1, flow_allocate.places,
                flow_allocate.ceiling, demand, clock_timestamp() + interval '5 s')
        ON CONFLICT ON CONSTRAINT flow_reservation_pkey DO UPDATE
        SET places = excluded.places, ceiling = excluded.ceiling, wanted = excluded.wanted,
            expires_at = excluded.expires_at;
    END IF;
END;
$$;

-- job_claim for member `claimer` within its allocation of queue `claim_queue`: up to
-- `wanted` jobs, at most its ceiling less its running jobs (less `ended`), in claim order
-- after (after_priority, after_run_at, after_id) as job_claim's cursor. A row with a NULL
-- id and held_by 'global_concurrency' says the allocation held jobs back (none, or it
-- expired and was deleted: the member allocates again). Nothing if the queue stopped
-- being reservable.
CREATE FUNCTION {{schema}}.job_claim_allocated(
    claim_queue text, wanted integer, claimer text, lease interval, ended bigint[],
    after_priority smallint, after_run_at timestamptz, after_id bigint
)
RETURNS TABLE (id bigint, fence bigint, kind text, queue text, attempt integer,
               max_attempts integer, crashes integer, priority smallint, tenant text,
               enqueued_at timestamptz, scheduled_at timestamptz, args text,
               waited_s float8, depends_on bigint[], after_jobs bigint[],
               blockers_failed integer, trace_context text, held_by text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    allowed integer;
    room    integer;
BEGIN
    IF wanted IS NULL OR wanted < 1 OR NOT {{schema}}.queue_reservable(claim_queue) THEN
        RETURN;
    END IF;
    SELECT r.ceiling INTO allowed FROM {{schema}}.flow_reservation AS r
    WHERE r.queue = claim_queue AND r.claimer = job_claim_allocated.claimer AND r.loop = -1
    FOR NO KEY UPDATE;
    -- A fresh snapshot, after the row's lock: the claims of the member's other loop.
    SELECT coalesce(allowed, 0) - count(*) INTO room FROM {{schema}}.job AS j
    WHERE j.state = 'running' AND j.queue = claim_queue
      AND j.owner = job_claim_allocated.claimer AND NOT (j.fence = ANY(coalesce(ended, '{}')));
    room := greatest(least(room, wanted), 0);
    IF room > 0 THEN
        RETURN QUERY
        WITH picked AS (
            SELECT j.id
            FROM {{schema}}.job AS j
            WHERE j.state = 'available' AND j.queue = claim_queue
              AND (j.priority, j.run_at, j.id) > (coalesce(after_priority, -32768),
                                                  coalesce(after_run_at, '-infinity'),
                                                  coalesce(after_id, 0))
              AND (j.expires_at IS NULL OR j.expires_at > now())  -- expired: the reaper ends it
            ORDER BY j.priority, j.run_at, j.id
            LIMIT room
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {{schema}}.job AS j
        SET state = 'running', attempt = j.attempt + 1,
            fence = nextval('{{schema}}.fence_seq'), owner = job_claim_allocated.claimer,
            attempted_at = now(), lease_expires_at = now() + lease
        WHERE j.id = ANY(ARRAY(SELECT p.id FROM picked AS p))
        RETURNING j.id::bigint, j.fence::bigint, j.kind::text, j.queue::text,
                  j.attempt::integer, j.max_attempts::integer, j.crashes::integer,
                  j.priority::smallint, j.tenant::text, j.enqueued_at::timestamptz,
                  j.run_at::timestamptz, j.args::text,
                  extract(epoch FROM now() - j.run_at)::float8, j.depends_on, j.after_jobs,
                  j.blockers_failed::integer,
                  j.trace_context::text, NULL::text;
    END IF;
    IF room < wanted THEN
        RETURN QUERY SELECT NULL::bigint, NULL::bigint, NULL::text, NULL::text,
                            NULL::integer, NULL::integer, NULL::integer, NULL::smallint,
                            NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::text,
                            NULL::float8, NULL::bigint[], NULL::bigint[], NULL::integer,
                            NULL::text, 'global_concurrency'::text;
    END IF;
END;
$$;
