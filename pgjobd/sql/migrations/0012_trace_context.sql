-- The W3C trace context of the code that enqueued a job (issue 16): a nullable column,
-- filled by the Python client when OpenTelemetry is in use and by SQL callers through
-- the new last argument of enqueue (trace_context) and enqueue_many (trace_contexts);
-- the worker continues the trace in the span it runs the handler in. An object of the
-- propagation fields ({"traceparent": "00-...", "tracestate": "..."}), small.
--
-- enqueue and enqueue_many are 0010's (lifecycle) with that one argument added last,
-- with a default: every earlier call (positional or named) means the same. A new
-- argument makes a new signature, so 0010's functions are dropped first (a call cannot
-- resolve between two overloads that both take it); roles.sql grants the new ones.
-- A replacing enqueue's successor job (on_conflict 'replace' of a running holder) is
-- written by 0010's job_replace and carries no trace context.
--
-- job_claim_flow is 0007's with the columns job_claim returns since 0010 (what the
-- job waited for) and the trace context, before held_by: a flow-claimed job gets the
-- same ClaimedJob as one claimed by job_claim. A new result type needs a DROP too.

-- What a stored trace context may be: an object, at most 4 KiB of JSON text.
CREATE FUNCTION {{schema}}.job_trace_context_ok(trace_context jsonb)
RETURNS boolean
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
AS $$
    SELECT jsonb_typeof(trace_context) = 'object' AND octet_length(trace_context::text) <= 4096
$$;

ALTER TABLE {{schema}}.job ADD COLUMN trace_context jsonb
    CONSTRAINT job_trace_context_ok
        CHECK (trace_context IS NULL OR {{schema}}.job_trace_context_ok(trace_context));

DROP FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[], timestamptz[],
    interval[], text[], text[], integer[], text, integer[], text[], text[], timestamptz[],
    interval[], interval[], text[]);
DROP FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text, text,
    integer, interval, text, integer, text, bigint[], timestamptz, interval, interval,
    bigint[]);
DROP FUNCTION {{schema}}.job_claim_flow(text, integer, text, interval);

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
    group_keys    text[]        DEFAULT NULL,
    dependencies  text[]        DEFAULT NULL,
    expires_ats   timestamptz[] DEFAULT NULL,
    ttls          interval[]    DEFAULT NULL,
    unique_fors   interval[]    DEFAULT NULL,
    afters        text[]        DEFAULT NULL,
    trace_contexts jsonb[]      DEFAULT NULL
)
RETURNS TABLE (ord integer, id bigint, created boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n            integer := coalesce(cardinality(kinds), 0);
    problem      record;
    lifecycle    text;
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
    IF on_conflict IS NULL OR on_conflict NOT IN ('return', 'raise', 'replace') THEN
        PERFORM {{schema}}.job_reject(
            {{schema}}.job_lifecycle_problem(on_conflict, NULL, NULL, NULL, NULL), 1, 1,
            on_conflict, NULL, NULL, NULL, NULL, NULL, NULL);
    END IF;
    IF coalesce(cardinality(args), 0) <> n
       OR cardinality(queues) <> n OR cardinality(priorities) <> n
       OR cardinality(run_ats) <> n OR cardinality(delays) <> n
       OR cardinality(tenants) <> n OR cardinality(unique_keys) <> n
       OR cardinality(max_attempts) <> n OR cardinality(args_sizes) <> n
       OR cardinality(group_keys) <> n OR cardinality(dependencies) <> n OR cardinality(expires_ats) <> n
       OR cardinality(ttls) <> n OR cardinality(unique_fors) <> n
       OR cardinality(afters) <> n OR cardinality(trace_contexts) <> n THEN
        RAISE EXCEPTION 'pgjobd: enqueue_many arrays differ in length (% kinds, % args)',
            n, coalesce(cardinality(args), 0) USING ERRCODE = 'PJ004';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;
    SELECT u.ord INTO pos
    FROM unnest(trace_contexts) WITH ORDINALITY AS u(trace_context, ord)
    WHERE u.trace_context IS NOT NULL AND NOT {{schema}}.job_trace_context_ok(u.trace_context)
    ORDER BY u.ord LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgjobd: job % of %: trace_context must be a JSON object of at most '
            '4096 bytes', pos, n USING ERRCODE = 'PJ004';
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
    SELECT format('job %s of %s: %s', u.ord, n, u.problem) INTO lifecycle
    FROM (SELECT l.ord, {{schema}}.job_lifecycle_problem(on_conflict, l.expires_at, l.ttl,
                                                         l.unique_for, l.unique_key) AS problem
          FROM unnest(expires_ats, ttls, unique_fors, unique_keys)
               WITH ORDINALITY AS l(expires_at, ttl, unique_for, unique_key, ord)) AS u
    WHERE u.problem IS NOT NULL
    ORDER BY u.ord
    LIMIT 1;
    IF lifecycle IS NOT NULL THEN
        RAISE EXCEPTION 'pgjobd: %', CASE WHEN n > 1 THEN lifecycle
                                          ELSE regexp_replace(lifecycle, '^job 1 of 1: ', '') END
            USING ERRCODE = 'PJ004';
    END IF;
    -- Groups and max_depth as in 0007 (flow control).
    SELECT g.key, g.ord INTO bad_group
    FROM unnest(group_keys) WITH ORDINALITY AS g(key, ord)
    WHERE octet_length(g.key) NOT BETWEEN 1 AND 512
    ORDER BY g.ord LIMIT 1;
    IF FOUND THEN
        PERFORM {{schema}}.job_reject_group_key(bad_group.key, bad_group.ord::integer, n);
    END IF;

    -- (an array of NULLs gives nothing: the client passes one column per option)
    IF on_conflict = 'replace'
       OR EXISTS (SELECT FROM unnest(dependencies) AS x WHERE x IS NOT NULL)
       OR EXISTS (SELECT FROM unnest(afters) AS x WHERE x IS NOT NULL)
       OR EXISTS (SELECT FROM unnest(unique_fors) AS x WHERE x IS NOT NULL) THEN
        -- Unknown dependency ids, for the whole batch at once, naming the job.
        SELECT u.ord::integer, x.id INTO pos, holder
        FROM unnest(coalesce(dependencies, array_fill(NULL::text, ARRAY[n])),
                    coalesce(afters, array_fill(NULL::text, ARRAY[n])))
             WITH ORDINALITY AS u(deps, aft, ord)
        CROSS JOIN LATERAL unnest(coalesce(u.deps::bigint[], '{}')
                                  || coalesce(u.aft::bigint[], '{}')) AS x(id)
        WHERE NOT EXISTS (SELECT FROM {{schema}}.job AS j WHERE j.id = x.id)
          AND NOT EXISTS (SELECT FROM {{schema}}.job_history AS h WHERE h.id = x.id)
        ORDER BY u.ord
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'pgjobd: job % of %: dependency % names no job (ids must be of '
                'jobs already enqueued)', pos, n, coalesce(holder::text, 'NULL')
                USING ERRCODE = 'PJ008', DETAIL = coalesce(holder::text, 'NULL');
        END IF;
        new_ids := array_fill(NULL::bigint, ARRAY[n]);
        was_created := array_fill(NULL::boolean, ARRAY[n]);
        FOR pos IN 1..n LOOP
            new_ids[pos] := {{schema}}.enqueue(
                kinds[pos], args[pos], queues[pos], priorities[pos], run_ats[pos],
                tenants[pos], unique_keys[pos], enqueue_many.max_attempts[pos], delays[pos],
                on_conflict, args_sizes[pos], group_keys[pos], dependencies[pos]::bigint[],
                expires_ats[pos], ttls[pos], unique_fors[pos], afters[pos]::bigint[],
                trace_contexts[pos]);
            was_created[pos] := new_ids[pos] = currval('{{schema}}.job_id_seq');
        END LOOP;
        RETURN QUERY
        SELECT r.ord::integer, r.id, r.created
        FROM unnest(new_ids, was_created) WITH ORDINALITY AS r(id, created, ord)
        ORDER BY r.ord;
        RETURN;
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
                       d.run_at, d.max_attempts, u.tenant, u.unique_key, u.group_key,
                       coalesce(u.expires_at, now() + u.ttl) AS expires_at, u.trace_context
                FROM unnest(kinds, args, queues, priorities, run_ats, delays, tenants,
                            unique_keys, max_attempts, group_keys, expires_ats, ttls,
                            trace_contexts)
                     WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, tenant,
                                          unique_key, max_attempts, group_key, expires_at, ttl,
                                          trace_context, ord)
                LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
                CROSS JOIN LATERAL {{schema}}.job_defaults(
                    k.queue, k.priority, k.max_attempts, u.queue, u.priority, u.run_at,
                    u.delay, u.max_attempts) AS d
                ORDER BY u.ord
            ) AS s
        ), inserted AS (
            INSERT INTO {{schema}}.job AS j (id, state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key, group_key,
                                             expires_at, trace_context)
            SELECT i.id, i.state, i.queue, i.kind, i.priority, i.run_at, i.args, i.max_attempts,
                   i.tenant, i.unique_key, i.group_key, i.expires_at, i.trace_context
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
        -- As in 0006: enqueue the batch's jobs one by one.
        new_ids := array_fill(NULL::bigint, ARRAY[n]);
        was_created := array_fill(NULL::boolean, ARRAY[n]);
        FOR pos IN 1..n LOOP
            new_ids[pos] := {{schema}}.enqueue(
                kinds[pos], args[pos], queues[pos], priorities[pos], run_ats[pos],
                tenants[pos], unique_keys[pos], enqueue_many.max_attempts[pos], delays[pos],
                on_conflict, args_sizes[pos], group_keys[pos], NULL, expires_ats[pos],
                ttls[pos], trace_context => trace_contexts[pos]);
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
                on_conflict, args_sizes[pos], group_keys[pos], NULL, expires_ats[pos],
                ttls[pos], trace_context => trace_contexts[pos]);
            was_created[pos] := true;
        END LOOP;
    END IF;

    RETURN QUERY
    SELECT r.ord::integer, r.id, r.created
    FROM unnest(new_ids, was_created) WITH ORDINALITY AS r(id, created, ord)
    ORDER BY r.ord;
END;
$$;

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
    group_key     text        DEFAULT NULL,
    depends_on    bigint[]    DEFAULT NULL,
    expires_at    timestamptz DEFAULT NULL,
    ttl           interval    DEFAULT NULL,
    unique_for    interval    DEFAULT NULL,
    after         bigint[]    DEFAULT NULL,
    trace_context jsonb       DEFAULT NULL
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
    w            record;
    h            record;
    job_id       bigint;
    prior        bigint;
    violated     text;
    deadlocks    integer := 0;
    expiry       timestamptz;
    waits        boolean := depends_on IS NOT NULL OR after IS NOT NULL;
BEGIN
    problem := {{schema}}.job_lifecycle_problem(enqueue.on_conflict, enqueue.expires_at,
                                                enqueue.ttl, enqueue.unique_for,
                                                enqueue.unique_key);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'pgjobd: %', problem USING ERRCODE = 'PJ004';
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
    IF enqueue.trace_context IS NOT NULL
       AND NOT {{schema}}.job_trace_context_ok(enqueue.trace_context) THEN
        RAISE EXCEPTION 'pgjobd: trace_context must be a JSON object of at most 4096 bytes'
            USING ERRCODE = 'PJ004';
    END IF;
    IF octet_length(enqueue.group_key) NOT BETWEEN 1 AND 512 THEN
        PERFORM {{schema}}.job_reject_group_key(enqueue.group_key, 1, 1);
    END IF;
    expiry := coalesce(enqueue.expires_at, now() + enqueue.ttl);

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
    IF waits THEN
        SELECT * INTO w FROM {{schema}}.job_wait_for(enqueue.depends_on, enqueue.after);
    END IF;
    IF enqueue.unique_key IS NULL THEN
        INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                         max_attempts, tenant, group_key, expires_at,
                                         depends_on, after_jobs, trace_context)
        VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                d.max_attempts, enqueue.tenant, enqueue.group_key, expiry,
                enqueue.depends_on, enqueue.after, enqueue.trace_context)
        RETURNING j.id INTO job_id;
        IF waits THEN
            RETURN {{schema}}.job_block(job_id, w.live_required, w.live_after, w.doomed,
                                            w.after_failed, w.culprit, d.state::text,
                                            d.queue);
        END IF;
        IF d.state = 'available' THEN
            -- Repeats within one transaction are folded into one by PostgreSQL.
            PERFORM pg_notify('{{schema}}.job_ready', d.queue);
        END IF;
        RETURN job_id;
    END IF;
    LOOP
        IF enqueue.on_conflict = 'replace' THEN
            -- The holder, locked: a claim skips it meanwhile, and a claim that got
            -- there first is seen as running once it commits.
            SELECT j.id, j.state::text AS state INTO h
            FROM {{schema}}.job AS j WHERE j.unique_key = enqueue.unique_key FOR UPDATE;
            IF FOUND THEN
                RETURN {{schema}}.job_replace(h.id, h.state, enqueue.kind, enqueue.args,
                                              d.queue, d.priority, d.run_at, d.state::text,
                                              d.max_attempts, enqueue.tenant,
                                              enqueue.unique_key, expiry, enqueue.group_key);
            END IF;
        END IF;
        BEGIN
            INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key, group_key,
                                             expires_at, depends_on, after_jobs,
                                             trace_context)
            VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                    d.max_attempts, enqueue.tenant, enqueue.unique_key, enqueue.group_key,
                    expiry, enqueue.depends_on, enqueue.after, enqueue.trace_context)
            ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO NOTHING
            RETURNING j.id INTO job_id;
        EXCEPTION WHEN unique_violation OR deadlock_detected THEN
            -- A REINDEX CONCURRENTLY of the unique_key index is under way (see 0006).
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
            IF enqueue.unique_for IS NOT NULL THEN
                SELECT h.id INTO prior FROM {{schema}}.job_history AS h
                WHERE h.unique_key = enqueue.unique_key AND h.state = 'completed'
                  AND h.finished_at > now() - enqueue.unique_for
                ORDER BY h.finished_at DESC
                LIMIT 1;
                IF FOUND THEN
                    DELETE FROM {{schema}}.job AS j WHERE j.id = job_id;
                    IF enqueue.on_conflict = 'raise' THEN
                        PERFORM {{schema}}.job_reject_duplicate(enqueue.unique_key, prior);
                    END IF;
                    RETURN prior;
                END IF;
            END IF;
            IF waits THEN
                RETURN {{schema}}.job_block(job_id, w.live_required, w.live_after, w.doomed,
                                            w.after_failed, w.culprit, d.state::text,
                                            d.queue);
            END IF;
            IF d.state = 'available' THEN
                PERFORM pg_notify('{{schema}}.job_ready', d.queue);
            END IF;
            RETURN job_id;
        END IF;
        IF enqueue.on_conflict = 'replace' THEN
            CONTINUE;  -- a holder appeared: lock it and replace (above)
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
            RAISE EXCEPTION 'pgjobd: could not serialize access: a concurrent transaction '
                'holds unique_key %', quote_literal(enqueue.unique_key)
                USING ERRCODE = 'serialization_failure';
        END IF;
        -- The holder finished between the conflict and the look-up: insert again.
    END LOOP;
END;
$$;

CREATE FUNCTION {{schema}}.job_claim_flow(
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

REVOKE ALL ON FUNCTION {{schema}}.job_trace_context_ok(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[],
    timestamptz[], interval[], text[], text[], integer[], text, integer[], text[], text[],
    timestamptz[], interval[], interval[], text[], jsonb[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text,
    text, integer, interval, text, integer, text, bigint[], timestamptz, interval, interval,
    bigint[], jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.job_claim_flow(text, integer, text, interval) FROM PUBLIC;
