-- Schema v7: flow control across the fleet (issue 12). "{{schema}}" is replaced by the
-- configured schema name. Expand only: new nullable columns, new tables and functions,
-- and enqueue / enqueue_many replaced (as in 0006) with one new argument each, last.
--
-- The unlimited claim (job_claim in sql/job.sql) stays the statement it was; it only
-- refuses queues that need this path (queue.flow, or any kind with a limit), which
-- then claim through job_claim_flow below. Nothing here changes the statements that
-- finish jobs: a limit counts running rows when it decides, so whatever ends a job
-- (completion, failure, the reaper, an admin) frees its place by ending it.

-- Ordered groups: jobs with one group_key in one queue run one at a time, in
-- (priority, id) order. The check is NOT VALID only to spare the hot table a scan: the
-- column is new, so no row can break it.
ALTER TABLE {{schema}}.job ADD COLUMN group_key text;
ALTER TABLE {{schema}}.job ADD CONSTRAINT job_group_key_valid
    CHECK (octet_length(group_key) BETWEEN 1 AND 512) NOT VALID;
-- Every live job of every group, in group order: finds each group's head. Partial, so
-- jobs without a group (the unlimited path's) add nothing to it.
CREATE INDEX job_group_idx ON {{schema}}.job (queue, group_key, priority, id)
    WHERE group_key IS NOT NULL;
-- At most one running job per group, whatever happens: the backstop of the claim's
-- check, and the index that check probes.
CREATE UNIQUE INDEX job_group_running_idx ON {{schema}}.job (queue, group_key)
    WHERE state = 'running' AND group_key IS NOT NULL;

-- Fleet-wide limits per queue, as the member that started or reloaded last wrote them
-- (limits_by, limits_at). rate_limit starts per rate_window. grouped: the queue has
-- held a grouped job (set by enqueue, never cleared). flow: the queue claims through
-- job_claim_flow. group_cursor: the last group a claim started, so groups take turns.
-- depth_base: live jobs at the last recount minus the enqueues counted by then
-- (queue_enqueued), see queue_admit.
ALTER TABLE {{schema}}.queue
    ADD COLUMN global_concurrency integer CONSTRAINT queue_global_concurrency_valid
        CHECK (global_concurrency >= 1),
    ADD COLUMN rate_limit integer CONSTRAINT queue_rate_limit_valid CHECK (rate_limit >= 1),
    ADD COLUMN rate_window interval,
    ADD COLUMN max_depth bigint CONSTRAINT queue_max_depth_valid CHECK (max_depth >= 1),
    ADD COLUMN grouped boolean NOT NULL DEFAULT false,
    ADD COLUMN group_cursor text,
    ADD COLUMN depth_base bigint NOT NULL DEFAULT 0,
    ADD COLUMN depth_counted_at timestamptz,
    ADD COLUMN limits_by text,
    ADD COLUMN limits_at timestamptz,
    ADD COLUMN flow boolean NOT NULL
        GENERATED ALWAYS AS (global_concurrency IS NOT NULL OR rate_limit IS NOT NULL
                             OR grouped) STORED,
    ADD CONSTRAINT queue_rate_window_valid
        CHECK ((rate_limit IS NULL) = (rate_window IS NULL) AND rate_window > interval '0');

-- Fleet-wide limits per kind, declared by the handlers (@job(global_concurrency=,
-- rate_limit=)) through kind_declare_many: the newest declaring member wins.
ALTER TABLE {{schema}}.kind
    ADD COLUMN global_concurrency integer CONSTRAINT kind_global_concurrency_valid
        CHECK (global_concurrency >= 1),
    ADD COLUMN rate_limit integer CONSTRAINT kind_rate_limit_valid CHECK (rate_limit >= 1),
    ADD COLUMN rate_window interval,
    ADD CONSTRAINT kind_rate_window_valid
        CHECK ((rate_limit IS NULL) = (rate_window IS NULL) AND rate_window > interval '0');
-- The unlimited claim asks "does any kind have a limit?" on every call.
CREATE INDEX kind_limited_idx ON {{schema}}.kind (name)
    WHERE global_concurrency IS NOT NULL OR rate_limit IS NOT NULL;

-- Rate limits: per limited scope ('queue NAME' or 'kind NAME'), a ring of exactly
-- rate_limit slots holding the times of the latest starts. A start takes a slot whose
-- time is at least rate_window old and writes its own time there, so any window of
-- that length holds at most rate_limit starts (a sliding log of the last N starts).
-- Times are clock_timestamp() taken under the scope's lock: the database's clock.
CREATE TABLE {{schema}}.flow_start (
    scope       text        NOT NULL,
    slot        integer     NOT NULL,
    started_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, slot)
);
CREATE INDEX flow_start_oldest_idx ON {{schema}}.flow_start (scope, started_at);

-- max_depth: jobs enqueued into queues that have one, counted in 8 shards per queue
-- (by server process) so that concurrent enqueuers seldom wait on one row. Only ever
-- added to; queue.depth_base is rebased against them at each recount.
CREATE TABLE {{schema}}.queue_enqueued (
    queue       text        NOT NULL,
    shard       smallint    NOT NULL,
    added       bigint      NOT NULL,
    PRIMARY KEY (queue, shard)
);

-- The advisory lock that serialises the claims of one limited scope ('queue NAME',
-- 'kind NAME'): the purpose constant of pgjobd/lock_keys.py FLOW, and a hash.
CREATE FUNCTION {{schema}}.flow_lock(scope text)
RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_advisory_xact_lock(1885825539, hashtext('{{schema}} ' || scope))
$$;

-- How many of `wanted` starts the rate limit of `scope` (n per win) admits at `at`.
-- Keeps the ring at n slots: a raised limit adds free slots, a lowered one drops the
-- slots past n (so a lowered limit holds fully one window after the change).
CREATE FUNCTION {{schema}}.flow_rate_room(
    scope text, n integer, win interval, at timestamptz, wanted integer
)
RETURNS integer
LANGUAGE plpgsql
-- The ring's oldest slots in index order, however fresh the table's statistics: a
-- bitmap scan would read every slot of the ring to find `wanted` of them.
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
#variable_conflict use_column
DECLARE
    top  integer;
    room integer;
BEGIN
    SELECT s.slot INTO top FROM {{schema}}.flow_start AS s
    WHERE s.scope = flow_rate_room.scope ORDER BY s.slot DESC LIMIT 1;
    IF top IS NULL OR top < n - 1 THEN
        INSERT INTO {{schema}}.flow_start (scope, slot, started_at)
        SELECT flow_rate_room.scope, g, '-infinity'
        FROM generate_series(coalesce(top + 1, 0), n - 1) AS g;
    ELSIF top > n - 1 THEN
        DELETE FROM {{schema}}.flow_start AS s
        WHERE s.scope = flow_rate_room.scope AND s.slot >= n;
    END IF;
    SELECT count(*) INTO room FROM (
        SELECT FROM {{schema}}.flow_start AS s
        WHERE s.scope = flow_rate_room.scope AND s.started_at <= at - win
        ORDER BY s.started_at
        LIMIT wanted
    ) AS free;
    RETURN room;
END;
$$;

-- Records `taken` starts at `at` in the ring of `scope` (after flow_rate_room admitted
-- them, under the same lock): the oldest free slots take the new time.
CREATE FUNCTION {{schema}}.flow_rate_take(scope text, win interval, at timestamptz, taken integer)
RETURNS void
LANGUAGE sql
SET enable_bitmapscan = off  -- (as in flow_rate_room)
SET enable_sort = off
AS $$
    UPDATE {{schema}}.flow_start AS s SET started_at = at
    WHERE s.scope = flow_rate_take.scope
      AND s.slot = ANY(ARRAY(SELECT f.slot FROM {{schema}}.flow_start AS f
                             WHERE f.scope = flow_rate_take.scope
                               AND f.started_at <= at - win
                             ORDER BY f.started_at
                             LIMIT taken))
$$;

-- The heads of the groups of a queue that may start now, in group-key order from just
-- after `after_key` (through `upto_key` when given): a group's head is its first live
-- job in (priority, id) order, whatever its state, so a retrying or scheduled head
-- keeps its place; it may start when it is available, no job of its group runs, and
-- its kind is not in `skip_kinds`. Looks at no more than `scan_limit` groups; walks
-- job_group_idx one group at a time (a loose index scan), so a group's backlog is
-- never read past its head.
CREATE FUNCTION {{schema}}.job_group_heads(
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
        SELECT j.id, j.state, j.kind, j.priority, j.run_at FROM {{schema}}.job AS j
        WHERE j.queue = claim_queue AND j.group_key = k.g
        ORDER BY j.priority, j.id LIMIT 1
    ) AS h
    WHERE k.g IS NOT NULL AND (upto_key IS NULL OR k.g <= upto_key)
      AND h.state = 'available' AND h.kind <> ALL(skip_kinds)
      AND NOT EXISTS (SELECT FROM {{schema}}.job AS r
                      WHERE r.queue = claim_queue AND r.group_key = k.g
                        AND r.state = 'running')
    ORDER BY k.n
    LIMIT wanted
$$;

-- The claim of a queue with limits or groups, or of any queue while some kind has a
-- limit. The same result as job_claim (sql/job.sql), plus rows with a NULL id naming,
-- in held_by, each limit that held back a job this claim could otherwise have taken:
-- global_concurrency, rate_limit, kind_global_concurrency, kind_rate_limit.
--
-- Every decision is serialised per limited scope by flow_lock: first the queue's (when
-- it has limits or groups), then every limited kind's, in name order. Under READ
-- COMMITTED each statement here takes a fresh snapshot, so once the locks are held it
-- sees every claim the previous holder committed; it counts running rows (a crashed
-- member's jobs stay running until the reaper ends their lease) and takes only the
-- room left. The locks are held to the end of the claim's transaction: one statement.
CREATE FUNCTION {{schema}}.job_claim_flow(
    claim_queue text, wanted integer, claimer text, lease interval
)
RETURNS TABLE (id bigint, fence bigint, kind text, queue text, attempt integer,
               max_attempts integer, crashes integer, priority smallint, tenant text,
               enqueued_at timestamptz, scheduled_at timestamptz, args text,
               waited_s float8, held_by text)
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
                  extract(epoch FROM at - j.run_at)::float8, NULL::text;
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
               NULL::timestamptz, NULL::timestamptz, NULL::text, NULL::float8, h
        FROM unnest(held) AS h;
    END IF;
END;
$$;

-- The depth estimate of queues with a max_depth (all of them when `names` is NULL),
-- counted afresh: live jobs now, minus the enqueues counted by now, in one snapshot.
-- Run by the leader every few seconds, and by a member that sets a max_depth.
CREATE FUNCTION {{schema}}.queue_depth_recount(names text[] DEFAULT NULL)
RETURNS integer
LANGUAGE sql
AS $$
    WITH counted AS (
        UPDATE {{schema}}.queue AS q
        SET depth_base = (SELECT count(*) FROM {{schema}}.job AS j WHERE j.queue = q.name)
                       - coalesce((SELECT sum(e.added) FROM {{schema}}.queue_enqueued AS e
                                   WHERE e.queue = q.name), 0),
            depth_counted_at = now()
        WHERE q.max_depth IS NOT NULL AND (names IS NULL OR q.name = ANY(names))
        RETURNING 1
    )
    SELECT count(*)::integer FROM counted
$$;

-- Admits jobs about to be enqueued: `counts[i]` jobs into `queues[i]` (distinct), of
-- which some have a group when `grouped[i]`. A queue's first grouped job marks it
-- grouped (it then claims through job_claim_flow). A queue with a max_depth refuses
-- (SQLSTATE PJ006, and the caller's statement fails: nothing is written) when its
-- depth estimate would pass max_depth. The estimate is the live jobs at the last
-- recount plus every enqueue counted since: never less than the true depth, except by
-- what concurrent enqueues into other shards have not committed yet; more than it by
-- the jobs finished since that recount.
CREATE FUNCTION {{schema}}.queue_admit(queues text[], counts integer[], grouped boolean[])
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    r      record;
    depth  bigint;
BEGIN
    FOR r IN
        SELECT a.queue FROM unnest(queues, grouped) AS a(queue, g)
        WHERE a.g AND NOT EXISTS (SELECT FROM {{schema}}.queue AS q
                                  WHERE q.name = a.queue AND q.grouped)
        ORDER BY a.queue
    LOOP
        INSERT INTO {{schema}}.queue AS q (name, grouped) VALUES (r.queue, true)
        ON CONFLICT (name) DO UPDATE SET grouped = true;
    END LOOP;
    FOR r IN
        SELECT q.name, q.max_depth, a.n
        FROM unnest(queues, counts) AS a(queue, n)
        JOIN {{schema}}.queue AS q ON q.name = a.queue
        WHERE q.max_depth IS NOT NULL
        ORDER BY q.name
    LOOP
        INSERT INTO {{schema}}.queue_enqueued AS e (queue, shard, added)
        VALUES (r.name, pg_backend_pid() % 8, r.n)
        ON CONFLICT (queue, shard) DO UPDATE SET added = e.added + excluded.added;
        SELECT q.depth_base + (SELECT sum(e.added) FROM {{schema}}.queue_enqueued AS e
                               WHERE e.queue = q.name)
        INTO depth
        FROM {{schema}}.queue AS q WHERE q.name = r.name;
        IF depth > r.max_depth THEN
            RAISE EXCEPTION 'pgjobd: queue % is full: max_depth is %, and it holds about % '
                'live jobs', quote_literal(r.name), r.max_depth, depth - r.n
                USING ERRCODE = 'PJ006',
                      HINT = 'wait for the queue to drain, or raise its max_depth';
        END IF;
    END LOOP;
END;
$$;

-- Does this enqueue need queue_admit: a grouped job, or any queue with a max_depth?
-- (One probe of the small queue table.)
CREATE FUNCTION {{schema}}.queue_admit_needed(any_grouped boolean)
RETURNS boolean
LANGUAGE sql
STABLE
AS $$
    SELECT any_grouped
           OR EXISTS (SELECT FROM {{schema}}.queue AS q WHERE q.max_depth IS NOT NULL)
$$;

-- A group_key that breaks its rule (1-512 bytes), in job `item` of `total`.
CREATE FUNCTION {{schema}}.job_reject_group_key(group_key text, item integer, total integer)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'pgjobd: %', concat(
        CASE WHEN total > 1 THEN format('job %s of %s: ', item, total) END,
        CASE WHEN group_key = '' THEN 'group_key must not be empty'
             ELSE format('group_key is %s bytes, over the 512-byte limit',
                         octet_length(group_key)) END)
        USING ERRCODE = 'PJ004';
END;
$$;

-- enqueue_many and enqueue as in 0006, with one new argument each, last: the job's
-- group (group_keys / group_key), validated, admitted by queue_admit (max_depth, and
-- marking the queue grouped) and stored. The old signatures are dropped, not
-- overloaded, so that every existing call (positional or named) resolves to these.
DROP FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[], timestamptz[],
                                      interval[], text[], text[], integer[], text, integer[]);
DROP FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text, text, integer,
                                 interval, text, integer);

CREATE FUNCTION {{schema}}.enqueue_many(
    kinds         text[],
    args          jsonb[],
    queues        text[]        DEFAULT NULL,
    priorities    integer[]     DEFAULT NULL,
    run_ats       timestamptz[] DEFAULT NULL,
    delays        interval[]    DEFAULT NULL,
    tenants       text[]        DEFAULT NULL,
    unique_keys   text[]        DEFAULT NULL,
    max_attempts  integer[]     DEFAULT NULL,
    on_conflict   text          DEFAULT 'return',
    args_sizes    integer[]     DEFAULT NULL,
    group_keys    text[]        DEFAULT NULL
)
RETURNS TABLE (ord integer, id bigint, created boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n            integer := coalesce(cardinality(kinds), 0);
    problem      record;
    new_ids      bigint[];
    was_created  boolean[];
    keys         text[];
    ready_queues text[];
    holder       bigint;
    orphaned     integer[] := '{}';
    pos          integer;
    violated     text;
    bad_group    record;
BEGIN
    IF on_conflict IS NULL OR on_conflict NOT IN ('return', 'raise') THEN
        PERFORM {{schema}}.job_reject('on_conflict', 1, 1, on_conflict, NULL, NULL, NULL,
                                      NULL, NULL, NULL);
    END IF;
    IF coalesce(cardinality(args), 0) <> n
       OR cardinality(queues) <> n OR cardinality(priorities) <> n
       OR cardinality(run_ats) <> n OR cardinality(delays) <> n
       OR cardinality(tenants) <> n OR cardinality(unique_keys) <> n
       OR cardinality(max_attempts) <> n OR cardinality(args_sizes) <> n
       OR cardinality(group_keys) <> n THEN
        RAISE EXCEPTION 'pgjobd: enqueue_many arrays differ in length (% kinds, % args)',
            n, coalesce(cardinality(args), 0) USING ERRCODE = 'PJ004';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    SELECT u.*, {{schema}}.job_problem(u.kind, u.args, u.args_size, u.queue, u.priority,
                                       u.delay, u.run_at, u.max_attempts, u.unique_key,
                                       u.tenant) AS failed
    INTO problem
    FROM unnest(kinds, args, queues, priorities, run_ats, delays, unique_keys, max_attempts,
                args_sizes, tenants)
         WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, unique_key,
                              max_attempts, args_size, tenant, ord)
    WHERE {{schema}}.job_problem(u.kind, u.args, u.args_size, u.queue, u.priority, u.delay,
                                 u.run_at, u.max_attempts, u.unique_key, u.tenant) IS NOT NULL
    ORDER BY u.ord
    LIMIT 1;
    IF FOUND THEN
        PERFORM {{schema}}.job_reject(problem.failed, problem.ord::integer, n, problem.kind,
                                      problem.args, problem.args_size, problem.queue,
                                      problem.priority, problem.delay, problem.max_attempts,
                                      problem.run_at, problem.unique_key, problem.tenant);
    END IF;
    SELECT g.key, g.ord INTO bad_group
    FROM unnest(group_keys) WITH ORDINALITY AS g(key, ord)
    WHERE octet_length(g.key) NOT BETWEEN 1 AND 512
    ORDER BY g.ord LIMIT 1;
    IF FOUND THEN
        PERFORM {{schema}}.job_reject_group_key(bad_group.key, bad_group.ord::integer, n);
    END IF;
    IF {{schema}}.queue_admit_needed(group_keys IS NOT NULL) THEN
        PERFORM {{schema}}.queue_admit(array_agg(a.queue), array_agg(a.n), array_agg(a.grouped))
        FROM (
            SELECT d.queue, count(*)::integer AS n, bool_or(u.group_key IS NOT NULL) AS grouped
            FROM unnest(kinds, queues, group_keys) AS u(kind, queue, group_key)
            LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
            CROSS JOIN LATERAL {{schema}}.job_defaults(
                k.queue, NULL, NULL, u.queue, NULL, NULL, NULL, NULL) AS d
            GROUP BY d.queue
        ) AS a;
    END IF;

    -- Ids are drawn in input order; job_defaults fills in what is not given.
    BEGIN
        WITH input AS (
            SELECT s.*, nextval('{{schema}}.job_id_seq') AS id
            FROM (
                SELECT u.ord::integer AS ord, u.kind, u.args, d.state, d.queue, d.priority,
                       d.run_at, d.max_attempts, u.tenant, u.unique_key, u.group_key
                FROM unnest(kinds, args, queues, priorities, run_ats, delays, tenants,
                            unique_keys, max_attempts, group_keys)
                     WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, tenant,
                                          unique_key, max_attempts, group_key, ord)
                LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
                CROSS JOIN LATERAL {{schema}}.job_defaults(
                    k.queue, k.priority, k.max_attempts, u.queue, u.priority, u.run_at,
                    u.delay, u.max_attempts) AS d
                ORDER BY u.ord
            ) AS s
        ), inserted AS (
            INSERT INTO {{schema}}.job AS j (id, state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key, group_key)
            SELECT i.id, i.state, i.queue, i.kind, i.priority, i.run_at, i.args, i.max_attempts, i.tenant,
                   i.unique_key, i.group_key
            FROM input AS i
            ORDER BY i.ord
            ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO NOTHING
            RETURNING j.id, j.queue, j.state
        )
        SELECT array_agg(i.id ORDER BY i.ord),
               array_agg(ins.id IS NOT NULL ORDER BY i.ord),
               array_agg(i.unique_key ORDER BY i.ord),
               ARRAY(SELECT DISTINCT x.queue FROM inserted AS x WHERE x.state = 'available')
        INTO new_ids, was_created, keys, ready_queues
        FROM input AS i
        LEFT JOIN inserted AS ins ON ins.id = i.id;
    EXCEPTION WHEN unique_violation OR deadlock_detected THEN
        GET STACKED DIAGNOSTICS violated = CONSTRAINT_NAME;
        IF SQLSTATE = '23505' AND NOT {{schema}}.job_is_duplicate_key(violated) THEN
            RAISE;
        END IF;
        -- A duplicate key the arbiter index did not catch (a REINDEX CONCURRENTLY is
        -- under way), or a deadlock with another batch inserting the same keys in
        -- another order: nothing of the batch was written; enqueue its jobs one by one,
        -- each of which tolerates both. A job was created by its call exactly when the
        -- id returned is the id that call drew.
        new_ids := array_fill(NULL::bigint, ARRAY[n]);
        was_created := array_fill(NULL::boolean, ARRAY[n]);
        FOR pos IN 1..n LOOP
            new_ids[pos] := {{schema}}.enqueue(
                kinds[pos], args[pos], queues[pos], priorities[pos], run_ats[pos],
                tenants[pos], unique_keys[pos], enqueue_many.max_attempts[pos], delays[pos],
                on_conflict, args_sizes[pos], group_keys[pos]);
            was_created[pos] := new_ids[pos] = currval('{{schema}}.job_id_seq');
        END LOOP;
        RETURN QUERY
        SELECT r.ord::integer, r.id, r.created
        FROM unnest(new_ids, was_created) WITH ORDINALITY AS r(id, created, ord)
        ORDER BY r.ord;
        RETURN;
    END;

    -- One wake-up per queue per statement, not per row.
    PERFORM pg_notify('{{schema}}.job_ready', q) FROM unnest(ready_queues) AS q;

    IF false = ANY(was_created) THEN
        FOR pos IN 1..n LOOP
            CONTINUE WHEN was_created[pos];
            -- The job holding this key: live from before, or enqueued earlier in this batch.
            SELECT j.id INTO holder FROM {{schema}}.job AS j WHERE j.unique_key = keys[pos];
            IF NOT FOUND THEN
                -- It finished between our insert and this look-up: enqueue again below.
                orphaned := orphaned || pos;
                CONTINUE;
            END IF;
            IF on_conflict = 'raise' THEN
                PERFORM {{schema}}.job_reject_duplicate(keys[pos], holder);
            END IF;
            new_ids[pos] := holder;
        END LOOP;
        -- Their holders finished between our insert and the look-up: enqueue them now.
        FOREACH pos IN ARRAY orphaned LOOP
            new_ids[pos] := {{schema}}.enqueue(
                kinds[pos], args[pos], queues[pos], priorities[pos], run_ats[pos],
                tenants[pos], unique_keys[pos], enqueue_many.max_attempts[pos], delays[pos],
                on_conflict, args_sizes[pos], group_keys[pos]);
            was_created[pos] := true;
        END LOOP;
    END IF;

    RETURN QUERY
    SELECT r.ord::integer, r.id, r.created
    FROM unnest(new_ids, was_created) WITH ORDINALITY AS r(id, created, ord)
    ORDER BY r.ord;
END;
$$;

-- Enqueue one job; returns its id (or, for a duplicate live unique_key, the existing
-- job's id). What is not given comes from job_defaults, as in enqueue_many: this is
-- its one-row path without arrays, which makes a call about three times cheaper.
-- args_size: as in enqueue_many.
CREATE FUNCTION {{schema}}.enqueue(
    kind          text,
    args          jsonb       DEFAULT '{}'::jsonb,
    queue         text        DEFAULT NULL,
    priority      integer     DEFAULT NULL,
    run_at        timestamptz DEFAULT NULL,
    tenant        text        DEFAULT NULL,
    unique_key    text        DEFAULT NULL,
    max_attempts  integer     DEFAULT NULL,
    delay         interval    DEFAULT NULL,
    on_conflict   text        DEFAULT 'return',
    args_size     integer     DEFAULT NULL,
    group_key     text        DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    problem      text;
    d            record;
    job_id       bigint;
    violated     text;
    deadlocks    integer := 0;
BEGIN
    IF enqueue.on_conflict IS NULL OR enqueue.on_conflict NOT IN ('return', 'raise') THEN
        PERFORM {{schema}}.job_reject('on_conflict', 1, 1, enqueue.on_conflict, NULL, NULL,
                                      NULL, NULL, NULL, NULL);
    END IF;
    problem := {{schema}}.job_problem(enqueue.kind, enqueue.args, enqueue.args_size,
                                      enqueue.queue, enqueue.priority, enqueue.delay,
                                      enqueue.run_at, enqueue.max_attempts, enqueue.unique_key,
                                      enqueue.tenant);
    IF problem IS NOT NULL THEN
        PERFORM {{schema}}.job_reject(problem, 1, 1, enqueue.kind, enqueue.args,
                                      enqueue.args_size, enqueue.queue, enqueue.priority,
                                      enqueue.delay, enqueue.max_attempts, enqueue.run_at,
                                      enqueue.unique_key, enqueue.tenant);
    END IF;
    IF octet_length(enqueue.group_key) NOT BETWEEN 1 AND 512 THEN
        PERFORM {{schema}}.job_reject_group_key(enqueue.group_key, 1, 1);
    END IF;

    SELECT d.* INTO d
    FROM (SELECT) AS one
    LEFT JOIN {{schema}}.kind AS k ON k.name = enqueue.kind
    CROSS JOIN LATERAL {{schema}}.job_defaults(
        k.queue, k.priority, k.max_attempts, enqueue.queue, enqueue.priority, enqueue.run_at,
        enqueue.delay, enqueue.max_attempts) AS d;
    IF {{schema}}.queue_admit_needed(enqueue.group_key IS NOT NULL) THEN
        PERFORM {{schema}}.queue_admit(ARRAY[d.queue], ARRAY[1],
                                       ARRAY[enqueue.group_key IS NOT NULL]);
    END IF;
    IF enqueue.unique_key IS NULL THEN
        INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                         max_attempts, tenant, group_key)
        VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                d.max_attempts, enqueue.tenant, enqueue.group_key)
        RETURNING j.id INTO job_id;
        IF d.state = 'available' THEN
            -- Repeats within one transaction are folded into one by PostgreSQL.
            PERFORM pg_notify('{{schema}}.job_ready', d.queue);
        END IF;
        RETURN job_id;
    END IF;
    LOOP
        BEGIN
            INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key, group_key)
            VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                    d.max_attempts, enqueue.tenant, enqueue.unique_key, enqueue.group_key)
            ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO NOTHING
            RETURNING j.id INTO job_id;
        EXCEPTION WHEN unique_violation OR deadlock_detected THEN
            -- A REINDEX CONCURRENTLY of the unique_key index is under way: its copy is
            -- unique but not an arbiter, so a duplicate raises there, and two inserts of
            -- one key can deadlock across the two indexes. Both are a duplicate key:
            -- look up the holder (the deadlock's other party may have won).
            GET STACKED DIAGNOSTICS violated = CONSTRAINT_NAME;
            IF SQLSTATE = '23505' AND NOT {{schema}}.job_is_duplicate_key(violated) THEN
                RAISE;
            END IF;
            IF SQLSTATE = '40P01' THEN
                deadlocks := deadlocks + 1;
                IF deadlocks > 3 THEN
                    RAISE;
                END IF;
            END IF;
            job_id := NULL;
        END;
        IF job_id IS NOT NULL THEN
            IF d.state = 'available' THEN
                PERFORM pg_notify('{{schema}}.job_ready', d.queue);
            END IF;
            RETURN job_id;
        END IF;
        SELECT j.id INTO job_id FROM {{schema}}.job AS j
        WHERE j.unique_key = enqueue.unique_key;
        IF FOUND THEN
            IF enqueue.on_conflict = 'raise' THEN
                PERFORM {{schema}}.job_reject_duplicate(enqueue.unique_key, job_id);
            END IF;
            RETURN job_id;
        END IF;
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- The holder committed after this transaction's snapshot was taken, so no
            -- look-up here can see it: retrying the insert would spin.
            RAISE EXCEPTION 'pgjobd: could not serialize access: a concurrent transaction '
                'holds unique_key %', quote_literal(enqueue.unique_key)
                USING ERRCODE = 'serialization_failure';
        END IF;
        -- The holder finished between the conflict and the look-up: insert again.
    END LOOP;
END;
$$;


REVOKE ALL ON FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[],
    timestamptz[], interval[], text[], text[], integer[], text, integer[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text,
    text, integer, interval, text, integer, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.queue_admit(text[], integer[], boolean[]) FROM PUBLIC;
