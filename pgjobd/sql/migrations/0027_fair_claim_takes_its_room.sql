-- A fair claim (strides, under the queue's lock) takes every job it has room for while
-- jobs of its waiting tenants are available (issue 12; found by the fair-share state
-- machine in CI). Its rounds give the room to the tenants of lowest pass; a tenant that
-- comes up short (no more jobs, a full kind) leaves its share to the others in the next
-- round. The tenants are those the queue's last claim left waiting (kept for a second,
-- 0022), and a tenant whose last job a claim took in full is kept though none is left.
-- 0023 ended the rounds at the first that took no job, even when a tenant had come up
-- short in it, and left what 3 rounds did not take: with c kept (no jobs left), a with
-- 1 job and b with 2, a claim of 3 gave a, b and c a slot each (c had none), then the
-- last slot to a (none left), and ended without b's second job. A claim that comes back
-- short is taken for an empty queue by its producer, which waits for a wake-up or its
-- poll. Now a round that took nothing ends them only when no tenant came up short in
-- it, and a fourth round, the last, gives what 3 rounds left to the tenants still
-- waiting in order of pass, each up to its room, until the claim's room is full. A
-- claim is still at most 4 rounds, and comes back short only when the jobs are locked
-- by other claims or held by a limit. Every round now fetches its tenants' jobs in order
-- of pass (0023: by name), so under a kind's limit the lowest pass takes the kind's room
-- first.
-- job_claim_limited (0023's job_claim_flow, renamed by 0024) is restated from 0023 with
-- only the rounds changed; any restatement of it starts from here. "{{schema}}" is
-- replaced by the configured schema name.

CREATE OR REPLACE FUNCTION {{schema}}.job_claim_limited(
    claim_queue text, wanted integer, claimer text, lease interval, ended bigint[]
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
    lk_gc        integer[];         -- least(global_concurrency, breaker_limit)
    lk_half_open boolean[];         -- a half-open breaker: the job taken is its probe
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
    -- Per tenant (tenant_concurrency, fair): coalesce(tenant, '') -> running jobs plus
    -- those this claim takes; -> starts this claim made; the tenants at their cap.
    by_tenant    boolean;
    is_fair      boolean;
    t_used       jsonb := '{}';
    t_started    jsonb := '{}';
    capped       text[] := '{}';
    capped_count integer;
    tenant_held  boolean := false;
    t_name       text;
    -- A fair claim's waiting tenants, and per tenant (same order) its pass, weight, the
    -- room its cap leaves, whether it ran out of jobs this claim.
    waiting      text[] := '{}';
    w_pass       float8[];
    w_weight     integer[];
    w_exhausted  boolean[];
    more         text[];
    next_cursor  text;
    got          integer;
    round        integer;
    vtime        float8;
    -- A round's allocation: tenant, its room, its jobs fetched and taken.
    a_t          text[];
    a_n          integer[];
    a_seen       integer[];
    a_took       integer[];
    came_short   boolean;           -- a tenant of the round had fewer jobs than its room
    leftover     boolean;           -- the last round: what 3 rounds left, in pass order
    -- The waiting tenants as the queue keeps them between claims (see 0022).
    marked       text[];
    rescanned    boolean := false;
    still        text[];
BEGIN
    IF wanted < 1 THEN
        RETURN;
    END IF;
    ended := coalesce(ended, '{}');  -- (a NULL would make every running job uncounted)
    SELECT * INTO q FROM {{schema}}.queue AS x WHERE x.name = claim_queue;
    IF q.paused THEN
        RETURN;
    END IF;
    IF q.flow THEN
        PERFORM {{schema}}.flow_lock('queue ' || claim_queue);
        queue_locked := true;
    END IF;
    -- (An open breaker's kind is not locked: it is skipped, as a kind limited since
    -- this first look is.)
    SELECT coalesce(array_agg(k.name ORDER BY k.name), '{}') INTO locked
    FROM {{schema}}.kind AS k
    WHERE k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL
          OR k.breaker_limit > 0;
    FOREACH kind_name IN ARRAY locked LOOP
        PERFORM {{schema}}.flow_lock('kind ' || kind_name);
    END LOOP;

    -- From here on: fresh snapshots, taken under the locks.
    SELECT * INTO q FROM {{schema}}.queue AS x WHERE x.name = claim_queue;
    IF q.paused OR (q.flow AND NOT queue_locked) THEN
        RETURN;  -- limited since the first look: the next claim takes its lock
    END IF;
    is_fair := coalesce(q.fair, false);  -- (no queue row: not fair)
    by_tenant := q.tenant_concurrency IS NOT NULL OR is_fair;
    SELECT coalesce(array_agg(k.name ORDER BY k.name), '{}'),
           array_agg(least(k.global_concurrency, k.breaker_limit) ORDER BY k.name),
           array_agg(k.rate_limit ORDER BY k.name),
           array_agg(k.rate_window ORDER BY k.name),
           array_agg(coalesce(k.breaker_limit = 1, false) ORDER BY k.name)
    INTO lk, lk_gc, lk_rate, lk_window, lk_half_open
    FROM {{schema}}.kind AS k
    WHERE (k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL
           OR k.breaker_limit IS NOT NULL)
      AND k.name = ANY(locked);
    -- Kinds limited since the first look are not locked: not claimed this time.
    SELECT coalesce(array_agg(k.name), '{}') INTO skip_kinds
    FROM {{schema}}.kind AS k
    WHERE (k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL
           OR k.breaker_limit IS NOT NULL)
      AND k.name <> ALL(locked);
    IF q.global_concurrency IS NOT NULL THEN
        -- Places reserved by claims in flight count as running (see flow_reserve).
        DELETE FROM {{schema}}.flow_reservation AS r
        WHERE r.queue = claim_queue AND r.expires_at < clock_timestamp();
        SELECT (SELECT count(*) FROM {{schema}}.job AS j
                WHERE j.state = 'running' AND j.queue = claim_queue
                  AND NOT (j.fence = ANY(ended) AND j.owner = claimer))
               + (SELECT coalesce(sum(r.places), 0) FROM {{schema}}.flow_reservation AS r
                  WHERE r.queue = claim_queue)
        INTO running;
        gc_room := greatest(q.global_concurrency - running, 0);
        room := least(room, gc_room);
    END IF;
    IF q.tenant_concurrency IS NOT NULL THEN
        -- The queue's running jobs per tenant (bounded by the fleet's concurrency).
        SELECT coalesce(jsonb_object_agg(r.t, r.n), '{}'),
               coalesce(array_agg(r.t) FILTER (WHERE r.n >= q.tenant_concurrency), '{}')
        INTO t_used, capped
        FROM (SELECT coalesce(j.tenant::text, '') AS t, count(*)::integer AS n
              FROM {{schema}}.job AS j
              WHERE j.state = 'running' AND j.queue = claim_queue
                AND NOT (j.fence = ANY(ended) AND j.owner = claimer)
              GROUP BY 1) AS r;
    END IF;
    IF cardinality(lk) > 0 THEN
        lk_room := array_fill(room, ARRAY[cardinality(lk)]);
        lk_by := array_fill(NULL::text, ARRAY[cardinality(lk)]);
        lk_taken := array_fill(0, ARRAY[cardinality(lk)]);
        FOR pos IN 1..cardinality(lk) LOOP
            IF lk_gc[pos] IS NOT NULL AND room > 0 THEN
                -- (A half-open breaker's probe counts until its end is recorded: the
                -- breaker role decides from that record.)
                SELECT count(*) INTO running FROM {{schema}}.job AS j
                WHERE j.state = 'running' AND j.kind = lk[pos]
                  AND (lk_half_open[pos] OR NOT (j.fence = ANY(ended) AND j.owner = claimer));
                IF lk_gc[pos] - running < lk_room[pos] THEN
                    lk_room[pos] := greatest(lk_gc[pos] - running, 0);
                    lk_by[pos] := CASE WHEN lk_half_open[pos] THEN 'kind_circuit_breaker'
                                       ELSE 'kind_global_concurrency' END;
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

    -- Fair share: the room goes to the waiting tenants of lowest pass (stride
    -- scheduling), then each one's jobs are taken in claim order. A tenant that ran out
    -- of jobs (or of room under a kind's limit) leaves its share to the others, for up
    -- to 3 rounds; a fourth gives what is left to the tenants still waiting.
    IF is_fair AND room > 0 THEN
        marked := {{schema}}.fair_tenant_mark(claim_queue);
        IF q.fair_tenants IS NOT NULL
           AND q.fair_tenants_at > clock_timestamp() - interval '1 second' THEN
            -- The tenants the queue's last claim left waiting, and those whose jobs this
            -- claim marked.
            waiting := ARRAY(SELECT DISTINCT w.t FROM unnest(q.fair_tenants || marked) AS w(t)
                             ORDER BY w.t);
        ELSE
            rescanned := true;
            waiting := ARRAY(SELECT f.tenant FROM {{schema}}.job_fair_tenants(
                                 claim_queue, coalesce(q.fair_cursor, ''), NULL, 1000) AS f
                             ORDER BY f.turn);
            IF cardinality(waiting) < 1000 THEN
                -- Round to the start: '' (jobs without a tenant), then up to the cursor.
                IF EXISTS (SELECT FROM {{schema}}.job AS j
                           WHERE j.queue = claim_queue AND j.fair_tenant = ''
                             AND j.state = 'available') THEN
                    waiting := waiting || ''::text;
                END IF;
                IF q.fair_cursor IS NOT NULL THEN
                    more := ARRAY(SELECT f.tenant FROM {{schema}}.job_fair_tenants(
                                      claim_queue, '', q.fair_cursor,
                                      1000 - cardinality(waiting)) AS f
                                  ORDER BY f.turn);
                    waiting := waiting || more;
                END IF;
            END IF;
            IF cardinality(waiting) >= 1000 THEN
                next_cursor := waiting[cardinality(waiting)];
            END IF;
        END IF;
        -- A tenant below the queue's fair_vtime (idle, or new) joins at it.
        SELECT array_agg(greatest(coalesce(p.pass, q.fair_vtime), q.fair_vtime)
                         ORDER BY w.ord),
               array_agg(coalesce(tw.weight, 1) ORDER BY w.ord)
        INTO w_pass, w_weight
        FROM unnest(waiting) WITH ORDINALITY AS w(t, ord)
        LEFT JOIN {{schema}}.fair_pass AS p ON p.queue = claim_queue AND p.tenant = w.t
        LEFT JOIN {{schema}}.tenant_weight AS tw ON tw.tenant = w.t;
        w_exhausted := array_fill(false, ARRAY[cardinality(waiting)]);
        round := 0;
        WHILE room > taken AND round < 4 AND cardinality(waiting) > 0 LOOP
            round := round + 1;
            got := taken;
            came_short := false;
            leftover := round = 4;
            -- Only the (room - taken) lowest passes can win a start: each of them has a
            -- first start that comes before any start of a tenant behind them.
            -- (One statement per round: the room per tenant, then every tenant's jobs.)
            -- The last round gives every tenant still waiting its whole room, lowest
            -- pass first, and stops fetching once the claim's room is full.
            SELECT coalesce(array_agg(x.t ORDER BY x.pass, x.t), '{}'),
                   coalesce(array_agg(x.n ORDER BY x.pass, x.t), '{}')
            INTO a_t, a_n
            FROM (
                WITH candidate AS (
                    SELECT w.t, w.pass + coalesce((t_started ->> w.t)::integer, 0)
                                         ::float8 / w.weight AS pass,
                           w.weight,
                           CASE WHEN q.tenant_concurrency IS NULL THEN room - taken
                                ELSE least(room - taken, q.tenant_concurrency
                                           - coalesce((t_used ->> w.t)::integer, 0))
                           END AS most
                    FROM unnest(waiting, w_pass, w_weight, w_exhausted)
                         AS w(t, pass, weight, exhausted)
                    WHERE NOT w.exhausted
                ), lowest AS (
                    SELECT * FROM candidate WHERE most > 0
                    ORDER BY pass, t LIMIT room - taken
                ), bounded AS (
                    -- With room - taken tenants here, that many first slots come at or
                    -- before the highest pass among them: no later slot can win.
                    SELECT l.t, l.pass, l.weight,
                           CASE WHEN count(*) OVER () < room - taken THEN l.most
                                ELSE least(l.most, 1 + floor((max(l.pass) OVER () - l.pass)
                                                             * l.weight + 1e-9)::integer)
                           END AS most
                    FROM lowest AS l
                ), slot AS (
                    SELECT l.t, l.pass + (s.n - 1)::float8 / l.weight AS at
                    FROM bounded AS l CROSS JOIN LATERAL generate_series(1, l.most) AS s(n)
                )
                SELECT y.t, min(y.at) AS pass, count(*)::integer AS n
                FROM (SELECT s.t, s.at FROM slot AS s ORDER BY s.at, s.t LIMIT room - taken) AS y
                WHERE NOT leftover
                GROUP BY y.t
                UNION ALL
                SELECT c.t, c.pass, c.most FROM candidate AS c WHERE leftover AND c.most > 0
            ) AS x;
            a_seen := array_fill(0, ARRAY[cardinality(a_t)]);
            a_took := a_seen;
            -- Each tenant's jobs in claim order, tenant after tenant (a nested loop).
            FOR c IN
                SELECT a.ord, f.id, f.kind
                FROM unnest(a_t, a_n) WITH ORDINALITY AS a(t, n, ord)
                CROSS JOIN LATERAL (
                    SELECT j.id, j.kind FROM {{schema}}.job AS j
                    WHERE j.queue = claim_queue AND j.fair_tenant = a.t
                      AND j.state = 'available' AND j.kind <> ALL(skip_kinds)
                      AND j.id <> ALL(picked)
                      AND (j.expires_at IS NULL OR j.expires_at > now())
                    ORDER BY j.priority, j.run_at, j.id
                    LIMIT a.n
                    FOR UPDATE SKIP LOCKED
                ) AS f
            LOOP
                EXIT WHEN taken >= room;  -- (the last round only: the others fit the room)
                a_seen[c.ord] := a_seen[c.ord] + 1;
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
                a_took[c.ord] := a_took[c.ord] + 1;
                taken := taken + 1;
            END LOOP;
            FOR pos IN 1..cardinality(a_t) LOOP
                IF a_took[pos] > 0 THEN
                    t_name := a_t[pos];
                    t_used := jsonb_set(t_used, ARRAY[t_name],
                                        to_jsonb(coalesce((t_used ->> t_name)::integer, 0)
                                                 + a_took[pos]));
                    t_started := jsonb_set(t_started, ARRAY[t_name],
                                           to_jsonb(coalesce((t_started ->> t_name)::integer, 0)
                                                    + a_took[pos]));
                END IF;
                -- Fewer jobs than its room (none left, or locked): its share goes to the
                -- others. (Jobs of a kind that filled up meanwhile are fetched again
                -- next round, without that kind.)
                -- (In the last round a tenant the fetch did not reach is marked too:
                -- whether a marked tenant still waits is read from its jobs below.)
                IF a_seen[pos] < a_n[pos] THEN
                    w_exhausted[array_position(waiting, a_t[pos])] := true;
                    came_short := true;
                END IF;
            END LOOP;
            EXIT WHEN taken = got AND NOT came_short;
        END LOOP;
        IF q.tenant_concurrency IS NOT NULL THEN
            capped := ARRAY(SELECT e.key FROM jsonb_each_text(t_used) AS e
                            WHERE e.value::integer >= q.tenant_concurrency);
        END IF;
    END IF;

    -- Candidates: jobs without a group in claim order, and the heads of groups that may
    -- start, in turn from the group after the last one started (round robin); by
    -- priority first. A kind that runs out of room in a pass is skipped by the next, and
    -- so is a tenant at its tenant_concurrency. In a fair queue, the jobs without a
    -- group come from there only if they are not marked yet (their tenant's share went
    -- above), looking no further than the queue's first 1,000 available jobs.
    pass := 0;
    WHILE room > taken AND pass < 3 LOOP
        pass := pass + 1;
        skipped := cardinality(skip_kinds);
        capped_count := cardinality(capped);
        FOR c IN
            SELECT x.id, x.kind, x.group_key, x.turn,
                   CASE WHEN by_tenant
                        THEN coalesce((SELECT t.tenant::text FROM {{schema}}.job AS t
                                       WHERE t.id = x.id), '')
                   END AS tenant
            FROM (
                SELECT f.id, f.kind, f.priority, f.run_at, NULL::text AS group_key,
                       NULL::integer AS turn
                FROM (SELECT j.id, j.kind, j.priority, j.run_at FROM {{schema}}.job AS j
                      WHERE j.state = 'available' AND j.queue = claim_queue
                        AND j.group_key IS NULL AND j.kind <> ALL(skip_kinds)
                        AND j.id <> ALL(picked)
                        AND (j.expires_at IS NULL OR j.expires_at > now())
                        AND coalesce(j.tenant::text, '') <> ALL(capped)
                      ORDER BY j.priority, j.run_at, j.id
                      LIMIT room - taken
                      FOR UPDATE SKIP LOCKED) AS f
                WHERE NOT is_fair
                UNION ALL
                SELECT f.id, f.kind, f.priority, f.run_at, NULL::text, NULL::integer
                FROM (SELECT j.id, j.kind, j.priority, j.run_at FROM {{schema}}.job AS j
                      WHERE j.id IN (SELECT h.id
                                     FROM (SELECT u.id, u.fair_tenant FROM {{schema}}.job AS u
                                           WHERE u.state = 'available'
                                             AND u.queue = claim_queue
                                           ORDER BY u.priority, u.run_at, u.id
                                           LIMIT 1000) AS h
                                     WHERE h.fair_tenant IS NULL)
                        AND j.state = 'available' AND j.group_key IS NULL
                        AND j.kind <> ALL(skip_kinds) AND j.id <> ALL(picked)
                        AND (j.expires_at IS NULL OR j.expires_at > now())
                        AND coalesce(j.tenant::text, '') <> ALL(capped)
                      ORDER BY j.priority, j.run_at, j.id
                      LIMIT room - taken
                      FOR UPDATE SKIP LOCKED) AS f
                WHERE is_fair
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
            IF by_tenant AND c.tenant = ANY(capped) THEN
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
            IF by_tenant THEN
                t_used := jsonb_set(t_used, ARRAY[c.tenant],
                                    to_jsonb(coalesce((t_used ->> c.tenant)::integer, 0) + 1));
                t_started := jsonb_set(t_started, ARRAY[c.tenant],
                                       to_jsonb(coalesce((t_started ->> c.tenant)::integer, 0)
                                                + 1));
                IF (t_used ->> c.tenant)::integer >= q.tenant_concurrency THEN
                    capped := capped || c.tenant;
                END IF;
            END IF;
            taken := taken + 1;
        END LOOP;
        -- No kind or tenant filled up: no more to find.
        EXIT WHEN cardinality(skip_kinds) = skipped AND cardinality(capped) = capped_count;
    END LOOP;

    IF taken > 0 THEN
        -- The start time, read after every check: whatever this claim saw end had ended
        -- before it. (A ring slot free at the earlier `at` is free now too.)
        at := clock_timestamp();
        -- (Planned at each claim, for these ids: see the head of this migration. The
        -- state check guards group heads, picked unlocked; it is written as IS TRUE so
        -- that the planner cannot take it for job_claim_idx's predicate.)
        RETURN QUERY EXECUTE $update$
            UPDATE {{schema}}.job AS j
            SET state = 'running', attempt = j.attempt + 1,
                fence = nextval('{{schema}}.fence_seq'), owner = $2, attempted_at = $3,
                lease_expires_at = $3 + $4
            WHERE j.id = ANY($1) AND (j.state = 'available') IS TRUE
            RETURNING j.id::bigint, j.fence::bigint, j.kind::text, j.queue::text,
                      j.attempt::integer, j.max_attempts::integer, j.crashes::integer,
                      j.priority::smallint, j.tenant::text, j.enqueued_at::timestamptz,
                      j.run_at::timestamptz, j.args::text,
                      extract(epoch FROM $3 - j.run_at)::float8, j.depends_on, j.after_jobs,
                      j.blockers_failed, j.trace_context::text, NULL::text
            $update$
        USING picked, claimer, at, lease;
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
        -- A half-open breaker's probe is taken: no other job of the kind starts until
        -- the breaker role has seen how it ended (at most one was taken: the room of
        -- a half-open kind is 1 less its running jobs).
        FOR pos IN 1..coalesce(cardinality(lk_taken), 0) LOOP
            IF lk_half_open[pos] AND lk_taken[pos] > 0 THEN
                UPDATE {{schema}}.kind AS k
                SET breaker_limit = 0, breaker_at = at, breaker_probe = p.id,
                    breaker_probe_attempt = p.attempt
                FROM (SELECT j.id, j.attempt FROM {{schema}}.job AS j
                      WHERE j.id = ANY(picked) AND j.kind = lk[pos]
                      ORDER BY j.id LIMIT 1) AS p
                WHERE k.name = lk[pos] AND k.breaker_limit = 1;
            END IF;
        END LOOP;
        IF last_group IS NOT NULL THEN
            UPDATE {{schema}}.queue AS x SET group_cursor = last_group
            WHERE x.name = claim_queue;
        END IF;
    END IF;

    IF is_fair AND (taken > 0 OR cardinality(waiting) > 0) THEN
        -- Every start of a tenant advances its pass by 1 / weight, from where it joined.
        INSERT INTO {{schema}}.fair_pass AS p (queue, tenant, pass)
        SELECT claim_queue, s.key,
               greatest(coalesce(o.pass, q.fair_vtime), q.fair_vtime)
               + s.value::float8 / coalesce(tw.weight, 1)
        FROM jsonb_each_text(t_started) AS s
        LEFT JOIN {{schema}}.fair_pass AS o ON o.queue = claim_queue AND o.tenant = s.key
        LEFT JOIN {{schema}}.tenant_weight AS tw ON tw.tenant = s.key
        ORDER BY s.key
        ON CONFLICT (queue, tenant) DO UPDATE SET pass = excluded.pass;
        -- Where the next tenant joins: the lowest pass of the tenants that still wait
        -- (a tenant that came up short and has no available job left does not: the
        -- share it could not use is not banked), or, when none does, the highest pass.
        SELECT coalesce(min(w.pass) FILTER (WHERE w.waits), max(w.pass)),
               coalesce(array_agg(w.t ORDER BY w.t) FILTER (WHERE w.waits), '{}')
        INTO vtime, still
        FROM (SELECT u.t,
                     u.pass + coalesce((t_started ->> u.t)::integer, 0)::float8 / u.weight
                     AS pass,
                     NOT u.exhausted
                     OR EXISTS (SELECT FROM {{schema}}.job AS j
                                WHERE j.queue = claim_queue AND j.fair_tenant = u.t
                                  AND j.state = 'available') AS waits
              FROM unnest(waiting, w_pass, w_weight, w_exhausted)
                   AS u(t, pass, weight, exhausted)) AS w;
        vtime := greatest(q.fair_vtime, coalesce(vtime, q.fair_vtime));
        -- The tenants still waiting are kept for the next claims (not beyond 1,000, when
        -- the claims take turns through them with the cursor); a claim that found them
        -- with the scan starts their second again.
        IF next_cursor IS NOT NULL OR cardinality(still) >= 1000 THEN
            still := NULL;
        END IF;
        UPDATE {{schema}}.queue AS x
        SET fair_vtime = vtime, fair_cursor = next_cursor, fair_tenants = still,
            fair_tenants_at = CASE WHEN rescanned THEN clock_timestamp()
                                   ELSE x.fair_tenants_at END
        WHERE x.name = claim_queue
          AND (rescanned OR (x.fair_vtime, x.fair_cursor, x.fair_tenants)
                            IS DISTINCT FROM (vtime, next_cursor, still));
        -- Below fair_vtime, a pass says nothing more than no row.
        DELETE FROM {{schema}}.fair_pass AS p WHERE p.queue = claim_queue AND p.pass < vtime;
    END IF;

    -- Report the limits that held back a job (those whose room this claim used up),
    -- only when a job was left waiting.
    IF gc_room <= taken AND gc_room < wanted THEN
        held := held || 'global_concurrency'::text;
    END IF;
    IF rate_room <= taken AND rate_room < wanted THEN
        held := held || 'rate_limit'::text;
    END IF;
    IF cardinality(capped) > 0 AND taken < room
       AND EXISTS (SELECT FROM {{schema}}.job AS j
                   WHERE j.state = 'available' AND j.queue = claim_queue
                     AND coalesce(j.tenant::text, '') = ANY(capped)
                     AND j.id <> ALL(picked)) THEN
        held := held || 'tenant_concurrency'::text;
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
