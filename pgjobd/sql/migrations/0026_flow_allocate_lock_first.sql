-- flow_allocate locks the member's own allocation before it counts the member's running
-- jobs (issue 12). In 0025 it counted first, under the queue's lock but not the row's,
-- and only its final upsert waited for the row: a claim of the member's other loop in
-- flight (job_claim_allocated, which holds the row until it commits) was not in the
-- count, so an allocation that shrank (another member starving) could record `places`
-- below what the member ran once that claim committed, and the other members' counts
-- then left room the member was using: the queue's global_concurrency passed. Now the
-- count is a statement after the row's lock, whose snapshot sees the claim's jobs.
-- flow_allocate is restated from 0025 with only that lock added; any restatement of it
-- starts from here. "{{schema}}" is replaced by the configured schema name.

CREATE OR REPLACE FUNCTION {{schema}}.flow_allocate(
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
    -- The member's own allocation, locked before its jobs are counted: a claim of its
    -- other loop in flight holds it (job_claim_allocated), and the count then sees the
    -- jobs that claim took.
    PERFORM FROM {{schema}}.flow_reservation AS r
    WHERE r.queue = claim_queue AND r.claimer = flow_allocate.claimer AND r.loop = -1
    FOR NO KEY UPDATE;
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
