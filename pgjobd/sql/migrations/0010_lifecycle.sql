-- Schema v8: the job lifecycle (issue 13). "{{schema}}" is the configured schema name.
--   dependencies: enqueue(depends_on => ids) blocks a job until every listed job has
--     completed; one that ends dead or cancelled ends it dead ('dependency_failed').
--     enqueue(after => ids) blocks it until every listed job has ended, whatever the
--     end (a batch's callback; the successor of a running job under debounce).
--   expiry: enqueue(expires_at => t | ttl => d): never started after t; ended 'expired'.
--   debounce: on_conflict => 'replace'; uniqueness windows: unique_for => d.
--   waiting: every finished job is announced on <schema>.job_final (payload: ids).
-- New SQLSTATE: PJ008 a dependency id that names no job.
--
-- Expand only: the previous release's daemon and client keep working on this schema.
-- The new enum value is not used by anything this file creates (PostgreSQL refuses a
-- value in the transaction that added it): checks compare the state as text, and the
-- functions that name 'blocked' are PL/pgSQL, parsed when first run.
ALTER TYPE {{schema}}.job_state ADD VALUE IF NOT EXISTS 'blocked' AFTER 'retryable';

-- blockers: dependencies (and `after` jobs) not ended yet; the job is 'blocked' while it
-- is above 0. blockers_failed: `after` jobs that ended dead or cancelled (a batch
-- callback's failed count). successor_key: the unique_key a job takes when the running
-- job that holds it ends (debounce of a running job); it is held by no live job meanwhile.
ALTER TABLE {{schema}}.job
    ADD COLUMN blockers        integer NOT NULL DEFAULT 0,
    ADD COLUMN blockers_failed integer NOT NULL DEFAULT 0,
    ADD COLUMN expires_at      timestamptz,
    ADD COLUMN depends_on      bigint[],
    ADD COLUMN after_jobs      bigint[],
    ADD COLUMN successor_key   text,
    ADD CONSTRAINT job_blockers_valid CHECK (blockers >= 0 AND blockers_failed >= 0);
ALTER TABLE {{schema}}.job DROP CONSTRAINT job_state_is_live;
ALTER TABLE {{schema}}.job ADD CONSTRAINT job_state_is_live
    CHECK (state::text IN ('scheduled', 'available', 'running', 'retryable', 'blocked'))
    NOT VALID;
ALTER TABLE {{schema}}.job VALIDATE CONSTRAINT job_state_is_live;

ALTER TABLE {{schema}}.job_history
    ADD COLUMN depends_on   bigint[],
    ADD COLUMN after_jobs   bigint[];
ALTER TABLE {{schema}}.job_history DROP CONSTRAINT job_history_reason_valid;
ALTER TABLE {{schema}}.job_history ADD CONSTRAINT job_history_reason_valid CHECK (
    (state = 'completed' AND reason IS NULL)
    OR (state <> 'completed' AND reason IN ('attempts_exhausted', 'discarded',
        'worker_crash', 'invalid_args', 'unknown_kind', 'expired', 'cancelled',
        'dependency_failed')));

-- The sweep of expired jobs (the leader's reaper) and the claim's check.
CREATE INDEX job_expires_idx ON {{schema}}.job (expires_at) WHERE expires_at IS NOT NULL;
-- At most one successor per key.
CREATE UNIQUE INDEX job_successor_key_idx ON {{schema}}.job (successor_key)
    WHERE successor_key IS NOT NULL;
-- A job's dependants, for `jobs show` (the edges below are gone once a job has ended).
CREATE INDEX job_depends_on_idx ON {{schema}}.job USING gin (depends_on)
    WHERE depends_on IS NOT NULL;
CREATE INDEX job_after_jobs_idx ON {{schema}}.job USING gin (after_jobs)
    WHERE after_jobs IS NOT NULL;
CREATE INDEX job_history_depends_on_idx ON {{schema}}.job_history USING gin (depends_on)
    WHERE depends_on IS NOT NULL;
CREATE INDEX job_history_after_jobs_idx ON {{schema}}.job_history USING gin (after_jobs)
    WHERE after_jobs IS NOT NULL;
-- unique_for: completed jobs by key, newest first.
CREATE INDEX job_history_unique_key_idx ON {{schema}}.job_history (unique_key, finished_at)
    WHERE unique_key IS NOT NULL AND state = 'completed';

-- One row per (live dependency, blocked job): what the dependency's end releases. A
-- row is deleted by the statement that finishes its dependency (job_settle), so the
-- table holds only edges still to fire, and a fan-in of n jobs costs n index look-ups
-- and one counter update per finishing batch, never a scan of the dependant's list.
-- requires: a depends_on edge (a failed end dooms the dependant); else an `after` edge.
CREATE TABLE {{schema}}.job_dependency (
    dependency bigint  NOT NULL,
    dependant  bigint  NOT NULL,
    requires   boolean NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 1000);
CREATE INDEX job_dependency_dependency_idx ON {{schema}}.job_dependency (dependency);

-- Live jobs per queue by state, now with the blocked ones (a last column: CREATE OR
-- REPLACE VIEW may only add columns at the end).
CREATE OR REPLACE VIEW {{schema}}.queue_depth WITH (security_invoker = true) AS
SELECT j.queue,
       count(*) FILTER (WHERE j.state = 'available') AS available,
       count(*) FILTER (WHERE j.state = 'scheduled') AS scheduled,
       count(*) FILTER (WHERE j.state = 'running') AS running,
       count(*) FILTER (WHERE j.state = 'retryable') AS retryable,
       min(j.run_at) FILTER (WHERE j.state = 'available') AS oldest_available_at,
       count(*) FILTER (WHERE j.state::text = 'blocked') AS blocked
FROM {{schema}}.job AS j
GROUP BY j.queue;

-- What the end of jobs `ids` (each with its reason: NULL completed, else dead or
-- cancelled) does to the jobs waiting for them, in the finishing transaction:
-- announces the ids on <schema>.job_final (client.wait); deletes their edges; a
-- dependant with a failed depends_on edge ends dead ('dependency_failed', through
-- job_finish, and so on down its own dependants); the others count down, and those
-- with nothing left to wait for become available (or scheduled, when their run_at is
-- ahead), taking their successor_key as unique_key, and their queues are woken.
-- Dependants are locked in id order, so two finishing batches do not deadlock on them.
CREATE FUNCTION {{schema}}.job_settle(ids bigint[], reasons text[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    dependants   bigint[];
    ended        integer[];
    failed       integer[];
    doomed       boolean[];
    culprits     bigint[];
    dead_jobs    {{schema}}.job[];
    dead_reasons text[];
    dead_errors  text[];
    ready_queues text[];
    chunk        text;
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    -- Payloads stay far below NOTIFY's 8000 bytes: 400 ids of at most 19 digits.
    FOR chunk IN
        SELECT string_agg(u.id::text, ',') FROM unnest(ids) WITH ORDINALITY AS u(id, n)
        GROUP BY (u.n - 1) / 400
    LOOP
        PERFORM pg_notify('{{schema}}.job_final', chunk);
    END LOOP;

    WITH gone AS (
        DELETE FROM {{schema}}.job_dependency AS e
        WHERE e.dependency = ANY(ids)
        RETURNING e.dependency, e.dependant, e.requires
    ), tally AS (
        SELECT g.dependant, count(*)::integer AS ended,
               count(*) FILTER (WHERE r.reason IS NOT NULL)::integer AS failed,
               bool_or(g.requires AND r.reason IS NOT NULL) AS doomed,
               min(g.dependency) FILTER (WHERE g.requires AND r.reason IS NOT NULL) AS culprit
        FROM gone AS g
        JOIN unnest(ids, reasons) AS r(id, reason) ON r.id = g.dependency
        GROUP BY g.dependant
    )
    SELECT array_agg(t.dependant ORDER BY t.dependant), array_agg(t.ended ORDER BY t.dependant),
           array_agg(t.failed ORDER BY t.dependant), array_agg(t.doomed ORDER BY t.dependant),
           array_agg(t.culprit ORDER BY t.dependant)
    INTO dependants, ended, failed, doomed, culprits
    FROM tally AS t;
    IF dependants IS NULL THEN
        RETURN;
    END IF;

    PERFORM FROM {{schema}}.job AS j WHERE j.id = ANY(dependants) ORDER BY j.id FOR UPDATE;

    WITH died AS (
        DELETE FROM {{schema}}.job AS j
        USING unnest(dependants, doomed, culprits) AS t(id, doomed, culprit)
        WHERE j.id = t.id AND t.doomed AND j.state = 'blocked'
        RETURNING j AS job, t.culprit
    )
    SELECT array_agg(d.job), array_agg('dependency_failed'::text),
           array_agg(format('DependencyFailed: job %s, which it depends on, ended %s',
                            d.culprit, coalesce(r.reason, 'dead')))
    INTO dead_jobs, dead_reasons, dead_errors
    FROM died AS d
    LEFT JOIN unnest(ids, reasons) AS r(id, reason) ON r.id = d.culprit;

    WITH released AS (
        UPDATE {{schema}}.job AS j
        SET blockers = j.blockers - t.ended,
            blockers_failed = j.blockers_failed + t.failed,
            state = CASE WHEN j.blockers - t.ended > 0 THEN j.state
                         WHEN j.run_at <= now() THEN 'available'
                         ELSE 'scheduled' END::{{schema}}.job_state,
            unique_key = CASE WHEN j.blockers - t.ended > 0 THEN j.unique_key
                              ELSE coalesce(j.unique_key, j.successor_key) END,
            successor_key = CASE WHEN j.blockers - t.ended > 0 THEN j.successor_key END
        FROM unnest(dependants, ended, failed, doomed) AS t(id, ended, failed, doomed)
        WHERE j.id = t.id AND NOT t.doomed AND j.state = 'blocked'
        RETURNING j.queue, j.state
    )
    SELECT array_agg(DISTINCT r.queue) FILTER (WHERE r.state = 'available')
    INTO ready_queues
    FROM released AS r;
    PERFORM pg_notify('{{schema}}.job_ready', q) FROM unnest(ready_queues) AS q;

    IF dead_jobs IS NOT NULL THEN
        PERFORM {{schema}}.job_finish(dead_jobs, dead_reasons, dead_errors);
    END IF;
END;
$$;

-- job_finish as in 0006, and now also: the lists of dependencies go to history with
-- the job; `keep` (NULL: all) says which jobs get a history record (a queue's
-- `history` setting), and every job passed is settled (job_settle), kept or not.
DROP FUNCTION {{schema}}.job_finish(anyarray, text[], text[], jsonb[]);
CREATE FUNCTION {{schema}}.job_finish(
    jobs        anyarray,
    reasons     text[]    DEFAULT NULL,
    last_errors text[]    DEFAULT NULL,
    results     jsonb[]   DEFAULT NULL,
    keep        boolean[] DEFAULT NULL
)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    written integer;
    ids     bigint[];
BEGIN
    INSERT INTO {{schema}}.job_history (id, finished_at, run_at, enqueued_at, attempted_at,
        attempt, max_attempts, priority, state, reason, queue, kind, tenant, unique_key,
        owner, last_error, args, result, depends_on, after_jobs)
    SELECT j.id, now(), j.run_at, j.enqueued_at, j.attempted_at, j.attempt, j.max_attempts,
           j.priority,
           CASE WHEN reasons[j.ordinality] IS NULL THEN 'completed'
                WHEN reasons[j.ordinality] = 'cancelled' THEN 'cancelled'
                ELSE 'dead' END::{{schema}}.job_state,
           reasons[j.ordinality], j.queue, j.kind, j.tenant,
           coalesce(j.unique_key, j.successor_key), j.owner,
           last_errors[j.ordinality], j.args, results[j.ordinality], j.depends_on,
           j.after_jobs
    FROM unnest(jobs) WITH ORDINALITY AS j
    WHERE keep[j.ordinality] IS DISTINCT FROM false;
    GET DIAGNOSTICS written = ROW_COUNT;
    SELECT array_agg(j.id ORDER BY j.ordinality) INTO ids
    FROM unnest(jobs) WITH ORDINALITY AS j;
    PERFORM {{schema}}.job_settle(ids, reasons);
    RETURN written;
END;
$$;

-- What a new job waits for: its depends_on and after jobs are looked up (the live ones
-- locked FOR KEY SHARE, so none can end before this transaction's edges are visible to
-- the statement that ends it), else found in history (the latest record per id); an id
-- found in neither raises PJ008. Returns the live ones, whether a depends_on job has
-- already failed (the new job is then born dead), and how many `after` jobs have.
CREATE FUNCTION {{schema}}.job_wait_for(depends_on bigint[], after bigint[])
RETURNS TABLE (live_required bigint[], live_after bigint[], doomed boolean,
               after_failed integer, culprit bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    wanted  bigint[] := ARRAY(SELECT DISTINCT x FROM unnest(coalesce(depends_on, '{}')
                                                            || coalesce(after, '{}')) AS x
                              ORDER BY x);
    live    bigint[];
    ended   record;
    missing bigint[];
BEGIN
    IF array_position(wanted, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'pgjobd: a dependency id is NULL' USING ERRCODE = 'PJ008';
    END IF;
    SELECT array_agg(l.id ORDER BY l.id) INTO live
    FROM (SELECT j.id FROM {{schema}}.job AS j WHERE j.id = ANY(wanted)
          ORDER BY j.id FOR KEY SHARE) AS l;
    live := coalesce(live, '{}');
    SELECT array_agg(w) INTO missing
    FROM unnest(wanted) AS w
    WHERE w <> ALL(live)
      AND NOT EXISTS (SELECT FROM {{schema}}.job_history AS h WHERE h.id = w);
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'pgjobd: dependency % names no job (ids must be of jobs already '
            'enqueued)', array_to_string(missing[1:10], ', ')
            USING ERRCODE = 'PJ008', DETAIL = array_to_string(missing, ',');
    END IF;
    live_required := ARRAY(SELECT x FROM unnest(depends_on) AS x WHERE x = ANY(live));
    live_after := ARRAY(SELECT x FROM unnest(after) AS x WHERE x = ANY(live));
    doomed := false;
    after_failed := 0;
    FOR ended IN
        SELECT DISTINCT ON (h.id) h.id, h.state::text AS state
        FROM {{schema}}.job_history AS h
        WHERE h.id = ANY(wanted) AND h.id <> ALL(live)
        ORDER BY h.id, h.finished_at DESC
    LOOP
        IF ended.state <> 'completed' THEN
            IF ended.id = ANY(depends_on) AND NOT doomed THEN
                doomed := true;
                culprit := ended.id;
            END IF;
            IF ended.id = ANY(after) THEN
                after_failed := after_failed + 1;
            END IF;
        END IF;
    END LOOP;
    RETURN NEXT;
END;
$$;

-- The fingerprint of a job's last failed attempt's error (NULL: none), for the
-- dead-letter views (admin.sql).
CREATE FUNCTION {{schema}}.job_fingerprint(job_id bigint)
RETURNS text
LANGUAGE sql
STABLE
AS $$
    SELECT a.fingerprint FROM {{schema}}.job_attempt AS a
    WHERE a.job_id = job_fingerprint.job_id
    ORDER BY a.attempt DESC, a.failed_at DESC
    LIMIT 1
$$;

-- The lifecycle options' first problem, as a full message (NULL: none).
CREATE FUNCTION {{schema}}.job_lifecycle_problem(
    on_conflict text, expires_at timestamptz, ttl interval, unique_for interval,
    unique_key text
)
RETURNS text
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT CASE
        WHEN on_conflict IS NULL OR on_conflict NOT IN ('return', 'raise', 'replace')
            THEN format('on_conflict must be ''return'', ''raise'' or ''replace'', not %s',
                        coalesce(quote_literal(left(on_conflict, 200)), 'NULL'))
        WHEN expires_at IS NOT NULL AND ttl IS NOT NULL
            THEN 'give expires_at or ttl, not both'
        WHEN ttl <= interval '0' THEN format('ttl must be positive, got %s', ttl)
        WHEN ttl > interval '10000 years' THEN format('ttl %s is too long', ttl)
        WHEN unique_for <= interval '0'
            THEN format('unique_for must be positive, got %s', unique_for)
        WHEN unique_for IS NOT NULL AND unique_key IS NULL
            THEN 'unique_for needs a unique_key'
        WHEN on_conflict = 'replace' AND unique_key IS NULL
            THEN 'on_conflict ''replace'' needs a unique_key'
    END
$$;

-- Bulk enqueue: as in 0007 (flow control), plus one array per new option (each NULL or of the kinds'
-- length): dependencies and afters hold each job's ids as array text ('{1,2}'), like
-- enqueue's depends_on and after; expires_ats, ttls, unique_fors as enqueue's. A batch
-- that uses dependencies, unique_for or on_conflict 'replace' is enqueued job by job
-- through enqueue (in input order, in this transaction).
DROP FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[], timestamptz[],
                                      interval[], text[], text[], integer[], text, integer[],
                                      text[]);
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
    afters        text[]        DEFAULT NULL
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
       OR cardinality(afters) <> n THEN
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
                expires_ats[pos], ttls[pos], unique_fors[pos], afters[pos]::bigint[]);
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
                       coalesce(u.expires_at, now() + u.ttl) AS expires_at
                FROM unnest(kinds, args, queues, priorities, run_ats, delays, tenants,
                            unique_keys, max_attempts, group_keys, expires_ats, ttls)
                     WITH ORDINALITY AS u(kind, args, queue, priority, run_at, delay, tenant,
                                          unique_key, max_attempts, group_key, expires_at, ttl,
                                          ord)
                LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
                CROSS JOIN LATERAL {{schema}}.job_defaults(
                    k.queue, k.priority, k.max_attempts, u.queue, u.priority, u.run_at,
                    u.delay, u.max_attempts) AS d
                ORDER BY u.ord
            ) AS s
        ), inserted AS (
            INSERT INTO {{schema}}.job AS j (id, state, queue, kind, priority, run_at, args,
                                             max_attempts, tenant, unique_key, group_key,
                                             expires_at)
            SELECT i.id, i.state, i.queue, i.kind, i.priority, i.run_at, i.args, i.max_attempts,
                   i.tenant, i.unique_key, i.group_key, i.expires_at
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
                ttls[pos]);
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
                ttls[pos]);
            was_created[pos] := true;
        END LOOP;
    END IF;

    RETURN QUERY
    SELECT r.ord::integer, r.id, r.created
    FROM unnest(new_ids, was_created) WITH ORDINALITY AS r(id, created, ord)
    ORDER BY r.ord;
END;
$$;

-- Enqueue one job: as in 0007 (flow control), plus
--   depends_on: ids of jobs that must complete first (blocked until then; dead with
--     'dependency_failed' if one ends dead or cancelled; PJ008 for an unknown id);
--   after: ids of jobs that must end first, whatever their end (blockers_failed counts
--     those that failed);
--   expires_at or ttl (from now): not started by then, the job ends dead ('expired');
--   on_conflict => 'replace': a live job holding unique_key that is not running takes
--     this call's args, run time and priority, and its id is returned; if it is running,
--     this job is enqueued to run after it (its successor: blocked on it, holding the
--     key as successor_key until it ends; a successor already there is replaced
--     alike). Decided under the holder's row lock, which the claim skips (SKIP LOCKED).
--   unique_for: the unique_key also matches a job that completed within this window;
--     its id is returned (checked after the insert, so a holder completing meanwhile is
--     seen either as live or as completed).
DROP FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text, text,
                                 integer, interval, text, integer, text);
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
    after         bigint[]    DEFAULT NULL
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
                                         depends_on, after_jobs)
        VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                d.max_attempts, enqueue.tenant, enqueue.group_key, expiry,
                enqueue.depends_on, enqueue.after)
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
                                             expires_at, depends_on, after_jobs)
            VALUES (d.state, d.queue, enqueue.kind, d.priority, d.run_at, enqueue.args,
                    d.max_attempts, enqueue.tenant, enqueue.unique_key, enqueue.group_key,
                    expiry, enqueue.depends_on, enqueue.after)
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

-- The edges of a job just inserted (job_id) to what it waits for (w, from
-- job_wait_for): blocked on the live ones; dead at once if a depends_on job had already
-- failed; else, with nothing live to wait for, left in the state it was inserted in
-- (`state`, whose queue is woken if available). Returns job_id.
CREATE FUNCTION {{schema}}.job_block(
    job_id bigint, live_required bigint[], live_after bigint[], doomed boolean,
    after_failed integer, culprit bigint, state text, queue text
)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    born_dead {{schema}}.job[];
    waits     integer := coalesce(cardinality(live_required), 0)
                         + coalesce(cardinality(live_after), 0);
BEGIN
    IF doomed THEN
        WITH gone AS (
            DELETE FROM {{schema}}.job AS j WHERE j.id = job_block.job_id RETURNING j
        )
        SELECT array_agg(g.j) INTO born_dead FROM gone AS g;
        PERFORM {{schema}}.job_finish(born_dead, ARRAY['dependency_failed'],
            ARRAY[format('DependencyFailed: job %s, which it depends on, had already failed',
                         culprit)]);
        RETURN job_id;
    END IF;
    IF waits > 0 THEN
        INSERT INTO {{schema}}.job_dependency (dependency, dependant, requires)
        SELECT x, job_block.job_id, true FROM unnest(live_required) AS x
        UNION ALL
        SELECT x, job_block.job_id, false FROM unnest(live_after) AS x;
        UPDATE {{schema}}.job AS j
        SET state = 'blocked', blockers = waits, blockers_failed = job_block.after_failed
        WHERE j.id = job_block.job_id;
        RETURN job_id;
    END IF;
    IF job_block.after_failed > 0 THEN
        UPDATE {{schema}}.job AS j SET blockers_failed = job_block.after_failed
        WHERE j.id = job_block.job_id;
    END IF;
    IF job_block.state = 'available' THEN
        PERFORM pg_notify('{{schema}}.job_ready', job_block.queue);
    END IF;
    RETURN job_id;
END;
$$;

-- on_conflict => 'replace' for the live job `holder` (locked by the caller) in state
-- `holder_state`: a job not running takes the new args, run time and priority (a
-- blocked one stays blocked), and a successor it had is cancelled (its run would now
-- repeat the holder's); a running one gets a successor, or its successor is replaced.
-- Returns the id of the job that now carries the new args.
CREATE FUNCTION {{schema}}.job_replace(
    holder bigint, holder_state text, kind text, args jsonb, queue text, priority smallint,
    run_at timestamptz, state text, max_attempts integer, tenant text, unique_key text,
    expires_at timestamptz, group_key text DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    successor bigint;
    cancelled {{schema}}.job[];
BEGIN
    IF holder_state <> 'running' THEN
        UPDATE {{schema}}.job AS j
        SET args = job_replace.args, run_at = job_replace.run_at,
            priority = job_replace.priority, expires_at = job_replace.expires_at,
            state = CASE WHEN j.state::text = 'blocked' THEN j.state
                         ELSE job_replace.state::{{schema}}.job_state END
        WHERE j.id = holder;
        WITH gone AS (
            DELETE FROM {{schema}}.job AS j
            WHERE j.successor_key = job_replace.unique_key
            RETURNING j
        )
        SELECT array_agg(g.j) INTO cancelled FROM gone AS g;
        IF cancelled IS NOT NULL THEN
            DELETE FROM {{schema}}.job_dependency AS e WHERE e.dependant = cancelled[1].id;
            PERFORM {{schema}}.job_finish(cancelled, ARRAY['cancelled'],
                ARRAY[format('Replaced: job %s took its args', holder)]);
        END IF;
        IF holder_state <> 'blocked' AND job_replace.state = 'available' THEN
            PERFORM pg_notify('{{schema}}.job_ready', job_replace.queue);
        END IF;
        RETURN holder;
    END IF;
    SELECT j.id INTO successor FROM {{schema}}.job AS j
    WHERE j.successor_key = job_replace.unique_key FOR UPDATE;
    IF FOUND THEN
        UPDATE {{schema}}.job AS j
        SET args = job_replace.args, run_at = job_replace.run_at,
            priority = job_replace.priority, expires_at = job_replace.expires_at
        WHERE j.id = successor;
        RETURN successor;
    END IF;
    INSERT INTO {{schema}}.job AS j (state, queue, kind, priority, run_at, args, max_attempts,
                                     tenant, successor_key, expires_at, after_jobs, blockers,
                                     group_key)
    VALUES ('blocked', job_replace.queue, job_replace.kind, job_replace.priority,
            job_replace.run_at, job_replace.args, job_replace.max_attempts, job_replace.tenant,
            job_replace.unique_key, job_replace.expires_at, ARRAY[holder], 1,
            job_replace.group_key)
    RETURNING j.id INTO successor;
    INSERT INTO {{schema}}.job_dependency (dependency, dependant, requires)
    VALUES (holder, successor, false);
    RETURN successor;
END;
$$;

REVOKE ALL ON FUNCTION {{schema}}.enqueue_many(text[], jsonb[], text[], integer[],
    timestamptz[], interval[], text[], text[], integer[], text, integer[], text[], text[],
    timestamptz[], interval[], interval[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text,
    text, integer, interval, text, integer, text, bigint[], timestamptz, interval, interval,
    bigint[]) FROM PUBLIC;
