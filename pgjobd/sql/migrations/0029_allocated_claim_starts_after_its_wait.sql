-- job_claim_allocated starts its jobs at the time it read after its checks, as
-- the limited claim has since migration 0007, not at its transaction's start (issue 12).
-- It waits for the lock of the member's allocation row, which the member's other claim
-- loop or its renewal (flow_allocate, itself waiting for the queue's lock) may hold, and
-- decides after the wait, on fresh snapshots. now() is from before that wait, so a job
-- it took in a place that another member's job left during the wait was recorded as
-- started before that job ended: attempted_at told a start the claim had not made, and
-- the race test's ledger of starts and ends saw the width passed (CI, once, in
-- test_global_concurrency_is_never_exceeded_by_racing_claimers[queue-allocating]). Which
-- jobs a claim takes is unchanged; its lease runs from the same time.
-- job_claim_allocated is restated from 0025 with only its start time changed; any
-- restatement of it starts from here. "{{schema}}" is replaced by the configured schema
-- name.

CREATE OR REPLACE FUNCTION {{schema}}.job_claim_allocated(
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
    allowed    integer;
    room       integer;
    claimed_at timestamptz;
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
        -- The start time, read after the row's lock and the count: whatever this claim
        -- saw end had ended before it.
        claimed_at := clock_timestamp();
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
            attempted_at = claimed_at, lease_expires_at = claimed_at + lease
        WHERE j.id = ANY(ARRAY(SELECT p.id FROM picked AS p))
        RETURNING j.id::bigint, j.fence::bigint, j.kind::text, j.queue::text,
                  j.attempt::integer, j.max_attempts::integer, j.crashes::integer,
                  j.priority::smallint, j.tenant::text, j.enqueued_at::timestamptz,
                  j.run_at::timestamptz, j.args::text,
                  extract(epoch FROM claimed_at - j.run_at)::float8, j.depends_on,
                  j.after_jobs,
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

