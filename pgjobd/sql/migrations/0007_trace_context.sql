-- The W3C trace context of the code that enqueued a job (issue 16): a nullable column,
-- filled by the Python client when OpenTelemetry is in use and by SQL callers through
-- the new last argument of enqueue (trace_context) and enqueue_many (trace_contexts);
-- the worker continues the trace in the span it runs the handler in. An object of the
-- propagation fields ({"traceparent": "00-...", "tracestate": "..."}), small.
--
-- enqueue and enqueue_many are 0006's with that one argument added last, with a
-- default: every earlier call (positional or named) means the same. A new argument
-- makes a new signature, so the old functions are dropped first (a call cannot resolve
-- between two overloads that both take it); their grants are renewed by roles.sql.

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
    new_ids      bigint[];
    was_created  boolean[];
    keys         text[];
    ready_queues text[];
    holder       bigint;
    orphaned     integer[] := '{}';
    pos          integer;
    violated     text;
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
       OR cardinality(trace_contexts) <> n THEN
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

    -- Ids are drawn in input order; job_defaults fills in what is not given.
    BEGIN
        WITH input AS (
            SELECT s.*, nextval('{{schema}}.job_id_seq') AS id
            FROM (
                SELECT u.ord::integer AS ord, u.kind, u.args, d.state, d.queue, d.priority,
                       d.run_at, d.max_attempts, u.tenant, u.unique_key, u.trace_context
                FROM unnest(kinds, args, queues, priorities, run_ats, delays, tenants,
                            unique_keys, max_attempts, trace_contexts)
                     WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, tenant,
                                          unique_key, max_attempts, trace_context, ord)
                LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
                CROSS JOIN LATERAL {{schema}}.job_defaults(
                    k.queue, k.priority, k.max_attempts, u.queue, u.priority, u.run_at,
                    u.delay, u.max_attempts) AS d
                ORDER BY u.ord
            ) AS s
        ), inserted AS (
            INSERT INTO {{schema}}.job AS j (id, state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key, trace_context)
            SELECT i.id, i.state, i.queue, i.kind, i.priority, i.run_at, i.args, i.max_attempts, i.tenant,
                   i.unique_key, i.trace_context
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
                on_conflict, args_sizes[pos], trace_contexts[pos]);
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
                on_conflict, args_sizes[pos], trace_contexts[pos]);
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
    job_id       bigint;
    violated     text;
    deadlocks    integer := 0;
BEGIN
    IF enqueue.on_conflict IS NULL OR enqueue.on_conflict NOT IN ('return', 'raise') THEN
        PERFORM {{schema}}.job_reject('on_conflict', 1, 1, enqueue.on_conflict, NULL, NULL,
                                      NULL, NULL, NULL, NULL);
    END IF;
    IF enqueue.trace_context IS NOT NULL
       AND NOT {{schema}}.job_trace_context_ok(enqueue.trace_context) THEN
        RAISE EXCEPTION 'pgjobd: trace_context must be a JSON object of at most 4096 bytes'
            USING ERRCODE = 'PJ004';
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

    SELECT d.* INTO d
    FROM (SELECT) AS one
    LEFT JOIN {{schema}}.kind AS k ON k.name = enqueue.kind
    CROSS JOIN LATERAL {{schema}}.job_defaults(
        k.queue, k.priority, k.max_attempts, enqueue.queue, enqueue.priority, enqueue.run_at,
        enqueue.delay, enqueue.max_attempts) AS d;
    IF enqueue.unique_key IS NULL THEN
        INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                         max_attempts, tenant, trace_context)
        VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                d.max_attempts, enqueue.tenant, enqueue.trace_context)
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
                                             max_attempts, tenant, unique_key, trace_context)
            VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                    d.max_attempts, enqueue.tenant, enqueue.unique_key, enqueue.trace_context)
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
