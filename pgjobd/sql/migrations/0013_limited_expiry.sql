-- The limited claim path honours `expires_at` as the unlimited one does: a job past it
-- is not started (the reaper ends it dead, reason 'expired'). Through 0012,
-- job_claim_flow and job_group_heads started expired jobs of limited or grouped queues.
-- An expired group head still holds its group's place until the reaper ends it.
-- Same signatures and results as before (grants carry over).
-- "{{schema}}" is replaced by the configured schema name.

CREATE OR REPLACE FUNCTION {{schema}}.job_group_heads(
    claim_queue text, after_key text, upto_key text, wanted integer, skip_kinds text[],
    scan_limit integer
)
RETURNS TABLE (id bigint, kind text, priority smallint, run_at timestamptz, group_key text,
               turn integer)
LANGUAGE sql
STABLE
AS $$
    WITH RECURSIVE keys(g, n) AS (
        (SELECT j.group_key, 1 FROM {{schema}}.job AS j
         WHERE j.queue = claim_queue AND j.group_key > after_key
         ORDER BY j.group_key LIMIT 1)
        UNION ALL
        SELECT (SELECT j.group_key FROM {{schema}}.job AS j
                WHERE j.queue = claim_queue AND j.group_key > k.g
                ORDER BY j.group_key LIMIT 1), k.n + 1
        FROM keys AS k
        WHERE k.g IS NOT NULL AND k.n < scan_limit AND (upto_key IS NULL OR k.g < upto_key)
    )
    SELECT h.id, h.kind, h.priority, h.run_at, k.g, k.n
    FROM keys AS k
    CROSS JOIN LATERAL (
        SELECT j.id, j.state, j.kind, j.priority, j.run_at, j.expires_at
        FROM {{schema}}.job AS j
        WHERE j.queue = claim_queue AND j.group_key = k.g
        ORDER BY j.priority, j.id LIMIT 1
    ) AS h
    WHERE k.g IS NOT NULL AND (upto_key IS NULL OR k.g <= upto_key)
      AND h.state = 'available' AND h.kind <> ALL(skip_kinds)
      AND (h.expires_at IS NULL OR h.expires_at > now())
      AND NOT EXISTS (SELECT FROM {{schema}}.job AS r
                      WHERE r.queue = claim_queue AND r.group_key = k.g
                        AND r.state = 'running')
    -- No ORDER BY: sorting would walk every group before the first row; the walk
    -- yields groups in key order, and `turn` numbers them for the caller.
    LIMIT wanted
$$;

CREATE OR REPLACE FUNCTION {{schema}}.job_claim_flow(
    claim_queue text, wanted integer, claimer text, lease interval
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
    q            record;
    queue_locked boolean := false;
    locked       text[];            -- limited kinds whose locks this claim holds
    lk           text[];            -- limited kinds, their limits, room and use
    lk_gc        integer[];
    lk_rate      integer[];
    lk_window    interval[];
    lk_room      integer[];
    lk_by        text[];
    lk_taken     integer[];
    skip_kinds   text[];
    room         integer := wanted;
    held         text[] := '{}';
    at           timestamptz;
    running      integer;
    free         integer;
    gc_room      integer;
    rate_room    integer;
    picked       bigint[] := '{}';
    picked_groups text[] := '{}';
    taken        integer := 0;
    pos          integer;
    pass         integer;
    skipped      integer;
    c            record;
    last_turn    integer := 0;
    last_group   text;
    kind_name    text;
BEGIN
    IF wanted < 1 THEN
        RETURN;
    END IF;
    SELECT * INTO q FROM {{schema}}.queue AS x WHERE x.name = claim_queue;
    IF q.paused THEN
        RETURN;
    END IF;
    IF q.flow THEN
        PERFORM {{schema}}.flow_lock('queue ' || claim_queue);
        queue_locked := true;
    END IF;
    SELECT coalesce(array_agg(k.name ORDER BY k.name), '{}') INTO locked
    FROM {{schema}}.kind AS k
    WHERE k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL;
    FOREACH kind_name IN ARRAY locked LOOP
        PERFORM {{schema}}.flow_lock('kind ' || kind_name);
    END LOOP;

    -- From here on: fresh snapshots, taken under the locks.
    SELECT * INTO q FROM {{schema}}.queue AS x WHERE x.name = claim_queue;
    IF q.paused OR (q.flow AND NOT queue_locked) THEN
        RETURN;  -- limited since the first look: the next claim takes its lock
    END IF;
    SELECT coalesce(array_agg(k.name ORDER BY k.name), '{}'),
           array_agg(k.global_concurrency ORDER BY k.name),
           array_agg(k.rate_limit ORDER BY k.name),
           array_agg(k.rate_window ORDER BY k.name)
    INTO lk, lk_gc, lk_rate, lk_window
    FROM {{schema}}.kind AS k
    WHERE (k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL)
      AND k.name = ANY(locked);
    -- Kinds limited since the first look are not locked: not claimed this time.
    SELECT coalesce(array_agg(k.name), '{}') INTO skip_kinds
    FROM {{schema}}.kind AS k
    WHERE (k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL)
      AND k.name <> ALL(locked);
    IF q.global_concurrency IS NOT NULL THEN
        SELECT count(*) INTO running FROM {{schema}}.job AS j
        WHERE j.state = 'running' AND j.queue = claim_queue;
        gc_room := greatest(q.global_concurrency - running, 0);
        room := least(room, gc_room);
    END IF;
    IF cardinality(lk) > 0 THEN
        lk_room := array_fill(room, ARRAY[cardinality(lk)]);
        lk_by := array_fill(NULL::text, ARRAY[cardinality(lk)]);
        lk_taken := array_fill(0, ARRAY[cardinality(lk)]);
        FOR pos IN 1..cardinality(lk) LOOP
            IF lk_gc[pos] IS NOT NULL AND room > 0 THEN
                SELECT count(*) INTO running FROM {{schema}}.job AS j
                WHERE j.state = 'running' AND j.kind = lk[pos];
                IF lk_gc[pos] - running < lk_room[pos] THEN
                    lk_room[pos] := greatest(lk_gc[pos] - running, 0);
                    lk_by[pos] := 'kind_global_concurrency';
                END IF;
            END IF;
        END LOOP;
    END IF;
    at := clock_timestamp();
    IF q.rate_limit IS NOT NULL AND room > 0 THEN
        rate_room := {{schema}}.flow_rate_room('queue ' || claim_queue, q.rate_limit,
                                               q.rate_window, at, wanted);
        room := least(room, rate_room);
    END IF;

    IF cardinality(lk) > 0 THEN
        FOR pos IN 1..cardinality(lk) LOOP
            lk_room[pos] := least(lk_room[pos], room);
            IF lk_rate[pos] IS NOT NULL AND lk_room[pos] > 0 THEN
                free := {{schema}}.flow_rate_room('kind ' || lk[pos], lk_rate[pos],
                                                  lk_window[pos], at, lk_room[pos]);
                IF free < lk_room[pos] THEN
                    lk_room[pos] := free;
                    lk_by[pos] := 'kind_rate_limit';
                END IF;
            END IF;
            IF lk_room[pos] = 0 THEN
                skip_kinds := skip_kinds || lk[pos];
            END IF;
        END LOOP;
    END IF;

    -- Candidates: jobs without a group in claim order, and the heads of groups that may
    -- start, in turn from the group after the last one started (round robin); by
    -- priority first. A kind that runs out of room in a pass is skipped by the next.
    pass := 0;
    WHILE room > taken AND pass < 3 LOOP
        pass := pass + 1;
        skipped := cardinality(skip_kinds);
        FOR c IN
            SELECT x.id, x.kind, x.group_key, x.turn
            FROM (
                SELECT f.id, f.kind, f.priority, f.run_at, NULL::text AS group_key,
                       NULL::integer AS turn
                FROM (SELECT j.id, j.kind, j.priority, j.run_at FROM {{schema}}.job AS j
                      WHERE j.state = 'available' AND j.queue = claim_queue
                        AND j.group_key IS NULL AND j.kind <> ALL(skip_kinds)
                        AND j.id <> ALL(picked)
                        AND (j.expires_at IS NULL OR j.expires_at > now())
                      ORDER BY j.priority, j.run_at, j.id
                      LIMIT room - taken
                      FOR UPDATE SKIP LOCKED) AS f
                UNION ALL
                SELECT h.id, h.kind, h.priority, h.run_at, h.group_key, h.turn
                FROM {{schema}}.job_group_heads(claim_queue, coalesce(q.group_cursor, ''),
                                                NULL, room - taken, skip_kinds,
                                                1000) AS h
                WHERE q.grouped AND h.id <> ALL(picked)
                UNION ALL
                SELECT h.id, h.kind, h.priority, h.run_at, h.group_key, h.turn + 1000
                FROM {{schema}}.job_group_heads(claim_queue, '', q.group_cursor,
                                                room - taken, skip_kinds, 1000) AS h
                WHERE q.grouped AND q.group_cursor IS NOT NULL AND h.id <> ALL(picked)
            ) AS x
            ORDER BY x.priority, x.turn NULLS FIRST, x.run_at, x.id
        LOOP
            EXIT WHEN taken >= room;
            CONTINUE WHEN c.group_key IS NOT NULL AND c.group_key = ANY(picked_groups);
            IF c.kind = ANY(skip_kinds) THEN
                CONTINUE;
            END IF;
            pos := array_position(lk, c.kind);
            IF pos IS NOT NULL THEN
                IF lk_room[pos] <= lk_taken[pos] THEN
                    skip_kinds := skip_kinds || c.kind;
                    CONTINUE;
                END IF;
                lk_taken[pos] := lk_taken[pos] + 1;
            END IF;
            picked := picked || c.id;
            IF c.group_key IS NOT NULL THEN
                picked_groups := picked_groups || c.group_key;
                IF c.turn > last_turn THEN
                    last_turn := c.turn;
                    last_group := c.group_key;
                END IF;
            END IF;
            taken := taken + 1;
        END LOOP;
        EXIT WHEN cardinality(skip_kinds) = skipped;  -- no kind filled up: no more to find
    END LOOP;

    IF taken > 0 THEN
        -- The start time, read after every check: whatever this claim saw end had ended
        -- before it. (A ring slot free at the earlier `at` is free now too.)
        at := clock_timestamp();
        RETURN QUERY
        UPDATE {{schema}}.job AS j
        SET state = 'running', attempt = j.attempt + 1,
            fence = nextval('{{schema}}.fence_seq'), owner = claimer, attempted_at = at,
            lease_expires_at = at + lease
        WHERE j.id = ANY(picked) AND j.state = 'available'
        RETURNING j.id::bigint, j.fence::bigint, j.kind::text, j.queue::text,
                  j.attempt::integer, j.max_attempts::integer, j.crashes::integer,
                  j.priority::smallint, j.tenant::text, j.enqueued_at::timestamptz,
                  j.run_at::timestamptz, j.args::text,
                  extract(epoch FROM at - j.run_at)::float8, j.depends_on, j.after_jobs,
                  j.blockers_failed, j.trace_context::text, NULL::text;
        IF q.rate_limit IS NOT NULL THEN
            PERFORM {{schema}}.flow_rate_take('queue ' || claim_queue, q.rate_window, at,
                                              taken);
        END IF;
        FOR pos IN 1..coalesce(cardinality(lk_taken), 0) LOOP
            IF lk_rate[pos] IS NOT NULL AND lk_taken[pos] > 0 THEN
                PERFORM {{schema}}.flow_rate_take('kind ' || lk[pos], lk_window[pos], at,
                                                  lk_taken[pos]);
            END IF;
        END LOOP;
        IF last_group IS NOT NULL THEN
            UPDATE {{schema}}.queue AS x SET group_cursor = last_group
            WHERE x.name = claim_queue;
        END IF;
    END IF;

    -- Report the limits that held back a job (those whose room this claim used up),
    -- only when a job was left waiting.
    IF gc_room <= taken AND gc_room < wanted THEN
        held := held || 'global_concurrency'::text;
    END IF;
    IF rate_room <= taken AND rate_room < wanted THEN
        held := held || 'rate_limit'::text;
    END IF;
    FOR pos IN 1..coalesce(cardinality(lk_by), 0) LOOP
        IF lk_by[pos] IS NOT NULL AND lk_room[pos] <= lk_taken[pos]
           AND NOT lk_by[pos] = ANY(held) THEN
            IF EXISTS (SELECT FROM {{schema}}.job AS j
                       WHERE j.state = 'available' AND j.queue = claim_queue
                         AND j.kind = lk[pos] AND j.id <> ALL(picked)) THEN
                held := held || lk_by[pos];
            END IF;
        END IF;
    END LOOP;
    IF cardinality(held) > 0 AND taken < wanted
       AND EXISTS (SELECT FROM {{schema}}.job AS j
                   WHERE j.state = 'available' AND j.queue = claim_queue
                     AND j.id <> ALL(picked)) THEN
        RETURN QUERY
        SELECT NULL::bigint, NULL::bigint, NULL::text, NULL::text, NULL::integer,
               NULL::integer, NULL::integer, NULL::smallint, NULL::text,
               NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::float8,
               NULL::bigint[], NULL::bigint[], NULL::integer, NULL::text, h
        FROM unnest(held) AS h;
    END IF;
END;
$$;
