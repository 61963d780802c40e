-- Enqueueing from SQL: the one code path every enqueue takes, from Python, from the CLI
-- and from applications in any language, inside the caller's own transaction.
--
-- Errors carry their own SQLSTATEs (class PJ, unused by PostgreSQL):
--   PJ001 args over 64 KiB of JSON text    PJ002 args not a JSON object
--   PJ003 invalid queue name               PJ004 any other invalid option
--   PJ005 duplicate unique_key (only with on_conflict => 'raise')
-- A rejected call raises before writing anything.

-- Bulk enqueue. kinds and args are required and of one length; every other array is
-- either NULL or of that length (a NULL element means "not given"). Returns one row per
-- input position: the job's id, and whether this call created it (false: a live job
-- with the same unique_key already existed, and its id is returned instead).
--
-- The 64 KiB limit applies to the args' JSON text as the caller wrote it. A jsonb value
-- has lost that text, so by default it is measured in PostgreSQL's text form (which
-- adds a space after every ':' and ','); callers that hold the text, like pgjobd's own
-- client, pass its size in args_sizes, measured by the server from the text it received.
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
    args_sizes    integer[]     DEFAULT NULL
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
    again        record;
BEGIN
    IF on_conflict IS NULL OR on_conflict NOT IN ('return', 'raise') THEN
        RAISE EXCEPTION 'pgjobd: on_conflict must be ''return'' or ''raise'', not %',
            coalesce(quote_literal(on_conflict), 'NULL') USING ERRCODE = 'PJ004';
    END IF;
    IF coalesce(cardinality(args), 0) <> n
       OR cardinality(queues) <> n OR cardinality(priorities) <> n
       OR cardinality(run_ats) <> n OR cardinality(delays) <> n
       OR cardinality(tenants) <> n OR cardinality(unique_keys) <> n
       OR cardinality(max_attempts) <> n OR cardinality(args_sizes) <> n THEN
        RAISE EXCEPTION 'pgjobd: enqueue_many arrays differ in length (% kinds, % args)',
            n, coalesce(cardinality(args), 0) USING ERRCODE = 'PJ004';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;

    -- Find the first bad item with cheap tests; build the message for that one only.
    SELECT * INTO problem FROM (
        SELECT u.*, CASE
            WHEN u.kind IS NULL OR length(u.kind) > 128
                 OR u.kind !~ '^[A-Za-z_][A-Za-z0-9_.:-]*$' THEN 'kind'
            WHEN u.args IS NULL OR jsonb_typeof(u.args) <> 'object' THEN 'args_type'
            WHEN coalesce(u.args_size, octet_length(u.args::text)) > 65536 THEN 'args_size'
            WHEN length(u.queue) > 64 OR u.queue !~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' THEN 'queue'
            WHEN u.priority NOT BETWEEN -32768 AND 32767 THEN 'priority'
            WHEN u.delay < interval '0' THEN 'delay'
            WHEN u.delay IS NOT NULL AND u.run_at IS NOT NULL THEN 'delay_and_run_at'
            WHEN u.max_attempts < 1 THEN 'max_attempts'
            WHEN octet_length(u.unique_key) > 512 THEN 'unique_key'
            END AS failed
        FROM unnest(kinds, args, queues, priorities, run_ats, delays, unique_keys,
                    max_attempts, args_sizes)
             WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, unique_key,
                                  max_attempts, args_size, ord)
    ) AS checked
    WHERE checked.failed IS NOT NULL
    ORDER BY checked.ord
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'pgjobd: %', concat(
            CASE WHEN n > 1 THEN format('job %s of %s: ', problem.ord, n) END,
            CASE problem.failed
            WHEN 'kind' THEN format('invalid job kind %s: expected 1-128 characters of '
                'letters, digits, ''_'', ''.'', '':'' and ''-'', starting with a letter '
                'or ''_''', coalesce(quote_literal(problem.kind), 'NULL'))
            WHEN 'args_type' THEN format('args must be a JSON object, not %s',
                coalesce(jsonb_typeof(problem.args), 'NULL'))
            WHEN 'args_size' THEN format('args JSON text is %s bytes, over the 65536-byte '
                'limit', coalesce(problem.args_size, octet_length(problem.args::text)))
            WHEN 'queue' THEN format('invalid queue name %s: expected 1-64 characters of '
                'letters, digits, ''_'', ''.'' and ''-'', starting with a letter or digit',
                quote_literal(problem.queue))
            WHEN 'priority' THEN format('priority %s is out of range (-32768 to 32767)',
                problem.priority)
            WHEN 'delay' THEN format('delay must not be negative, got %s', problem.delay)
            WHEN 'delay_and_run_at' THEN 'give delay or run_at, not both'
            WHEN 'max_attempts' THEN format('max_attempts must be at least 1, got %s',
                problem.max_attempts)
            WHEN 'unique_key' THEN 'unique_key is over 512 bytes'
            END)
            USING ERRCODE = CASE problem.failed
                WHEN 'args_size' THEN 'PJ001'
                WHEN 'args_type' THEN 'PJ002'
                WHEN 'queue' THEN 'PJ003'
                ELSE 'PJ004' END;
    END IF;

    -- Ids are drawn in input order; due jobs are available at once, the rest wait as
    -- scheduled. The kind table supplies the defaults its handlers declared.
    WITH input AS (
        SELECT s.*, nextval('{{schema}}.job_id_seq') AS id
        FROM (
            SELECT u.ord::integer AS ord, u.kind, u.args,
                   coalesce(u.queue, k.queue, 'default') AS queue,
                   coalesce(u.priority, k.priority, 0)::smallint AS priority,
                   coalesce(u.run_at, now() + u.delay, now()) AS run_at,
                   coalesce(u.max_attempts, k.max_attempts, 20) AS max_attempts,
                   u.tenant, u.unique_key
            FROM unnest(kinds, args, queues, priorities, run_ats, delays, tenants,
                        unique_keys, max_attempts)
                 WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, tenant,
                                      unique_key, max_attempts, ord)
            LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
            ORDER BY u.ord
        ) AS s
    ), inserted AS (
        INSERT INTO {{schema}}.job AS j (id, state, queue, kind, priority, run_at, args,
                                         max_attempts, tenant, unique_key)
        SELECT i.id,
               CASE WHEN i.run_at <= now() THEN 'available' ELSE 'scheduled' END
                   ::{{schema}}.job_state,
               i.queue, i.kind, i.priority, i.run_at, i.args, i.max_attempts, i.tenant,
               i.unique_key
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
                RAISE EXCEPTION 'pgjobd: a live job with unique_key % exists: id %',
                    quote_literal(keys[pos]), holder
                    USING ERRCODE = 'PJ005', DETAIL = holder::text;
            END IF;
            new_ids[pos] := holder;
        END LOOP;
        IF cardinality(orphaned) > 0 THEN
            FOR again IN
                SELECT orphaned[r.ord] AS pos, r.id, r.created
                FROM {{schema}}.enqueue_many(
                    ARRAY(SELECT kinds[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT args[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT queues[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT priorities[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT run_ats[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT delays[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT tenants[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT unique_keys[p] FROM unnest(orphaned) AS p),
                    ARRAY(SELECT enqueue_many.max_attempts[p] FROM unnest(orphaned) AS p),
                    on_conflict,
                    ARRAY(SELECT args_sizes[p] FROM unnest(orphaned) AS p)) AS r
            LOOP
                new_ids[again.pos] := again.id;
                was_created[again.pos] := again.created;
            END LOOP;
        END IF;
    END IF;

    RETURN QUERY
    SELECT r.ord::integer, r.id, r.created
    FROM unnest(new_ids, was_created) WITH ORDINALITY AS r(id, created, ord)
    ORDER BY r.ord;
END;
$$;

-- Enqueue one job; returns its id (or, for a duplicate live unique_key, the existing
-- job's id). Without queue, priority or max_attempts, the kind's declared defaults
-- apply, then queue 'default', priority 0, 20 attempts.
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
    on_conflict   text        DEFAULT 'return'
)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT e.id
    FROM {{schema}}.enqueue_many(ARRAY[kind], ARRAY[args], ARRAY[queue], ARRAY[priority],
                                 ARRAY[run_at], ARRAY[delay], ARRAY[tenant],
                                 ARRAY[unique_key], ARRAY[max_attempts], on_conflict) AS e;
$$;

REVOKE ALL ON FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[],
    timestamptz[], interval[], text[], text[], integer[], text, integer[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text,
    text, integer, interval, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.partitions_ensure(integer) FROM PUBLIC;
