-- Schema v5: enqueue against hostile input, and duplicates during a REINDEX.
-- "{{schema}}" is replaced by the configured schema name.
--
-- Every value a producer may store must be one every reader handles: the members (the
-- claim, the promoter, the reaper), the leader's roles and the admin commands, which
-- read times into Python datetimes (years 1-9999) and subtract them from now(). So:
--   run_at         finite, from 1970-01-01 up to (not including) 9999-01-01 UTC
--   delay          not negative, and now() + delay within that range
--   tenant         1-256 bytes        unique_key   1-512 bytes
--   args           a JSON object of at most 64 KiB of text, nested at most 100 deep
-- (NUL cannot be stored in a text or jsonb value at all: PostgreSQL refuses it with
-- its own error before any pgjobd code runs.) The new rules raise PJ004 like the other
-- invalid options. The table enforces the rules for run_at and tenant too, because the
-- producer role may INSERT (and COPY) those columns directly (roles.sql; unique_key it
-- cannot); rows that broke them before this version are repaired first, so that no
-- later update of such a row fails.
--
-- The unique index on unique_key is rebuilt by the leader's reindexer with REINDEX
-- CONCURRENTLY. While it runs, the "_ccnew"/"_ccold" copy is unique too but is not an
-- ON CONFLICT arbiter, so an enqueue that races another enqueue of the same key raised
-- unique_violation on it. enqueue and enqueue_many now treat that as the duplicate it
-- is; only calls that carry a unique_key pay for the subtransaction that takes.

UPDATE {{schema}}.job
SET run_at = least(greatest(run_at, timestamptz '1970-01-01 00:00:00+00'),
                   timestamptz '9998-12-31 00:00:00+00')
WHERE NOT (run_at >= timestamptz '1970-01-01 00:00:00+00'
           AND run_at < timestamptz '9999-01-01 00:00:00+00');
UPDATE {{schema}}.job
SET tenant = CASE WHEN tenant = '' THEN NULL ELSE left(tenant, 48) || md5(tenant) END
WHERE octet_length(tenant) NOT BETWEEN 1 AND 256;

-- Domains, not table CHECK constraints: an INSERT prepares every CHECK constraint of
-- the table anew each time it runs (about 10 us per single-row enqueue, measured),
-- while a domain's check is part of the statement's cached plan. The column type
-- change rewrites nothing; the view that reads run_at has to be dropped around it.
CREATE DOMAIN {{schema}}.job_time AS timestamptz
    CONSTRAINT job_time_in_range
    CHECK (VALUE >= timestamptz '1970-01-01 00:00:00+00'
           AND VALUE < timestamptz '9999-01-01 00:00:00+00');
CREATE DOMAIN {{schema}}.job_tenant AS text
    CONSTRAINT job_tenant_size CHECK (octet_length(VALUE) BETWEEN 1 AND 256);
DROP VIEW {{schema}}.queue_depth;
ALTER TABLE {{schema}}.job
    ALTER COLUMN run_at TYPE {{schema}}.job_time,
    ALTER COLUMN tenant TYPE {{schema}}.job_tenant;
-- As in 0004.
CREATE VIEW {{schema}}.queue_depth AS
SELECT j.queue,
       count(*) FILTER (WHERE j.state = 'available') AS available,
       count(*) FILTER (WHERE j.state = 'scheduled') AS scheduled,
       count(*) FILTER (WHERE j.state = 'running') AS running,
       count(*) FILTER (WHERE j.state = 'retryable') AS retryable,
       min(j.run_at) FILTER (WHERE j.state = 'available') AS oldest_available_at
FROM {{schema}}.job AS j
GROUP BY j.queue;

DROP FUNCTION {{schema}}.job_problem(text, jsonb, integer, text, integer, interval,
                                     timestamptz, integer, text);
DROP FUNCTION {{schema}}.job_reject(text, integer, integer, text, jsonb, integer, text,
                                    integer, interval, integer);

-- The first rule a job breaks, or NULL. Shared by enqueue and enqueue_many; cheap
-- tests only, the message is built by job_reject for the one job that failed. The
-- WHENs are tested in order: the delay's size is checked before now() + delay, which
-- would otherwise overflow.
CREATE FUNCTION {{schema}}.job_problem(
    kind text, args jsonb, args_size integer, queue text, priority integer,
    delay interval, run_at timestamptz, max_attempts integer, unique_key text, tenant text
)
RETURNS text
LANGUAGE sql
STABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN kind IS NULL OR length(kind) > 128
             OR kind !~ '^[A-Za-z_][A-Za-z0-9_.:-]*$' THEN 'kind'
        WHEN args IS NULL OR jsonb_typeof(args) <> 'object' THEN 'args_type'
        WHEN coalesce(args_size, octet_length(args::text)) > 65536 THEN 'args_size'
        -- A value at level 100 needs at least 206 bytes of JSON text.
        WHEN coalesce(args_size, 65536) >= 200
             AND jsonb_path_exists(args, 'strict $.**{100}') THEN 'args_depth'
        WHEN length(queue) > 64 OR queue !~ '^[A-Za-z0-9][A-Za-z0-9_.-]*$' THEN 'queue'
        WHEN priority NOT BETWEEN -32768 AND 32767 THEN 'priority'
        WHEN delay < interval '0' THEN 'delay'
        WHEN delay IS NOT NULL AND run_at IS NOT NULL THEN 'delay_and_run_at'
        WHEN delay > interval '10000 years'
             OR now() + delay >= timestamptz '9999-01-01 00:00:00+00' THEN 'delay_range'
        WHEN NOT (run_at >= timestamptz '1970-01-01 00:00:00+00'
                  AND run_at < timestamptz '9999-01-01 00:00:00+00') THEN 'run_at'
        WHEN max_attempts < 1 THEN 'max_attempts'
        WHEN octet_length(unique_key) NOT BETWEEN 1 AND 512 THEN 'unique_key'
        WHEN octet_length(tenant) NOT BETWEEN 1 AND 256 THEN 'tenant'
    END
$$;

-- Raises the error for a problem job_problem found in job `item` of `total`
-- ('on_conflict' is checked by the callers and passes the bad value as `kind`).
CREATE FUNCTION {{schema}}.job_reject(
    problem text, item integer, total integer, kind text, args jsonb,
    args_size integer, queue text, priority integer, delay interval, max_attempts integer,
    run_at timestamptz DEFAULT NULL, unique_key text DEFAULT NULL, tenant text DEFAULT NULL
)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'pgjobd: %', concat(
        CASE WHEN total > 1 THEN format('job %s of %s: ', item, total) END,
        CASE problem
        WHEN 'kind' THEN format('invalid job kind %s: expected 1-128 characters of '
            'letters, digits, ''_'', ''.'', '':'' and ''-'', starting with a letter '
            'or ''_''', coalesce(quote_literal(left(kind, 200)), 'NULL'))
        WHEN 'args_type' THEN format('args must be a JSON object, not %s',
            coalesce(jsonb_typeof(args), 'NULL'))
        WHEN 'args_size' THEN format('args JSON text is %s bytes, over the 65536-byte '
            'limit', coalesce(args_size, octet_length(args::text)))
        WHEN 'args_depth' THEN 'args are nested more than 100 levels deep'
        WHEN 'queue' THEN format('invalid queue name %s: expected 1-64 characters of '
            'letters, digits, ''_'', ''.'' and ''-'', starting with a letter or digit',
            quote_literal(left(queue, 200)))
        WHEN 'priority' THEN format('priority %s is out of range (-32768 to 32767)', priority)
        WHEN 'delay' THEN format('delay must not be negative, got %s', delay)
        WHEN 'delay_and_run_at' THEN 'give delay or run_at, not both'
        WHEN 'delay_range' THEN format('delay %s is too long: the job would run on or '
            'after 9999-01-01', delay)
        WHEN 'run_at' THEN format('run_at %s is out of range: expected a time from '
            '1970-01-01 up to (not including) 9999-01-01 UTC', run_at)
        WHEN 'max_attempts' THEN format('max_attempts must be at least 1, got %s',
            max_attempts)
        WHEN 'unique_key' THEN CASE WHEN unique_key = '' THEN 'unique_key must not be empty'
            ELSE format('unique_key is %s bytes, over the 512-byte limit',
                        octet_length(unique_key)) END
        WHEN 'tenant' THEN CASE WHEN tenant = '' THEN 'tenant must not be empty'
            ELSE format('tenant is %s bytes, over the 256-byte limit', octet_length(tenant))
            END
        WHEN 'on_conflict' THEN format('on_conflict must be ''return'' or ''raise'', not %s',
            coalesce(quote_literal(left(kind, 200)), 'NULL'))
        ELSE problem
        END)
        USING ERRCODE = CASE problem
            WHEN 'args_size' THEN 'PJ001'
            WHEN 'args_type' THEN 'PJ002'
            WHEN 'queue' THEN 'PJ003'
            ELSE 'PJ004' END;
END;
$$;

-- Is this unique_violation one of the unique_key index (or of its REINDEX CONCURRENTLY
-- copy), that is: a duplicate key, not an error?
CREATE FUNCTION {{schema}}.job_is_duplicate_key(violated text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
AS $$
    SELECT violated ~ '^job_unique_key_idx(_cc(new|old)[0-9]*)?$'
$$;

-- Bulk enqueue. kinds and args are required and of one length; every other array is
-- either NULL or of that length (a NULL element means "not given"). Returns one row per
-- input position: the job's id, and whether this call created it (false: a live job
-- with the same unique_key already existed, and its id is returned instead).
--
-- The 64 KiB limit applies to the args' JSON text as the caller wrote it. A jsonb value
-- has lost that text, so by default it is measured in PostgreSQL's text form (which
-- adds a space after every ':' and ','); callers that hold the text, like pgjobd's own
-- client, pass its size in args_sizes, measured by the server from the text it received.
CREATE OR REPLACE FUNCTION {{schema}}.enqueue_many(
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
       OR cardinality(max_attempts) <> n OR cardinality(args_sizes) <> n THEN
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

    -- Ids are drawn in input order; due jobs are available at once, the rest wait as
    -- scheduled. The kind table supplies the defaults its handlers declared.
    BEGIN
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
                on_conflict, args_sizes[pos]);
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
                on_conflict, args_sizes[pos]);
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
-- job's id). Without queue, priority or max_attempts, the kind's declared defaults
-- apply, then queue 'default', priority 0, 20 attempts: the rules of enqueue_many, for
-- one row without arrays, which makes a call about three times cheaper.
-- args_size: as in enqueue_many.
CREATE OR REPLACE FUNCTION {{schema}}.enqueue(
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
    args_size     integer     DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    problem      text;
    declared     record;
    due          timestamptz;
    target_queue text;
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

    SELECT k.queue, k.priority, k.max_attempts INTO declared
    FROM {{schema}}.kind AS k WHERE k.name = enqueue.kind;
    due := coalesce(enqueue.run_at, now() + enqueue.delay, now());
    target_queue := coalesce(enqueue.queue, declared.queue, 'default');
    IF enqueue.unique_key IS NULL THEN
        INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                         max_attempts, tenant)
        VALUES (CASE WHEN due <= now() THEN 'available' ELSE 'scheduled' END
                    ::{{schema}}.job_state,
                target_queue, enqueue.kind, coalesce(enqueue.priority, declared.priority, 0),
                due, enqueue.args, coalesce(enqueue.max_attempts, declared.max_attempts, 20),
                enqueue.tenant)
        RETURNING j.id INTO job_id;
        IF due <= now() THEN
            -- Repeats within one transaction are folded into one by PostgreSQL.
            PERFORM pg_notify('{{schema}}.job_ready', target_queue);
        END IF;
        RETURN job_id;
    END IF;
    LOOP
        BEGIN
            INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key)
            VALUES (CASE WHEN due <= now() THEN 'available' ELSE 'scheduled' END
                        ::{{schema}}.job_state,
                    target_queue, enqueue.kind,
                    coalesce(enqueue.priority, declared.priority, 0), due, enqueue.args,
                    coalesce(enqueue.max_attempts, declared.max_attempts, 20),
                    enqueue.tenant, enqueue.unique_key)
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
            IF due <= now() THEN
                PERFORM pg_notify('{{schema}}.job_ready', target_queue);
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

