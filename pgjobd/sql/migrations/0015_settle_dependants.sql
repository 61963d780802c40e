-- What finishing a job costs when nothing depends on it (issue 11: the one home of
-- history writes must not slow completions down). Through 0014 every finished batch
-- looked its ids up in job_dependency (job_settle); now a job that something depends
-- on says so itself: `has_dependants`, set where an edge to it is made (job_block,
-- job_replace) while the job's row is locked there, so a job finishing at the same
-- time either is deleted first (no edge is made: it is final) or is deleted after and
-- returns the flag. job_finish announces every id on job_final (client.wait) and
-- settles only the flagged ones. Same signatures and results (grants carry over).
-- "{{schema}}" is replaced by the configured schema name.

ALTER TABLE {{schema}}.job ADD COLUMN has_dependants boolean NOT NULL DEFAULT false;
UPDATE {{schema}}.job AS j SET has_dependants = true
WHERE j.id IN (SELECT e.dependency FROM {{schema}}.job_dependency AS e);

-- The end of jobs `ids` for the jobs waiting for them (see 0010); it no longer
-- announces the ids (job_finish does, for every job it finishes).
CREATE OR REPLACE FUNCTION {{schema}}.job_settle(ids bigint[], reasons text[])
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
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 THEN
        RETURN;
    END IF;
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

-- job_finish as in 0010; job_settle only for the jobs something depends on.
CREATE OR REPLACE FUNCTION {{schema}}.job_finish(
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
    written      integer;
    ids          bigint[];
    settled      bigint[];
    settled_why  text[];
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
    SELECT array_agg(j.id ORDER BY j.ordinality),
           array_agg(j.id ORDER BY j.ordinality) FILTER (WHERE j.has_dependants),
           array_agg(reasons[j.ordinality] ORDER BY j.ordinality) FILTER (WHERE j.has_dependants)
    INTO ids, settled, settled_why
    FROM unnest(jobs) WITH ORDINALITY AS j;
    IF ids IS NULL THEN
        RETURN written;
    END IF;
    -- Announced for client.wait. Payloads stay far below NOTIFY's 8000 bytes: 400 ids
    -- of at most 19 digits each.
    FOR pos IN 1..cardinality(ids) BY 400 LOOP
        PERFORM pg_notify('{{schema}}.job_final', array_to_string(ids[pos:pos + 399], ','));
    END LOOP;
    IF settled IS NOT NULL THEN
        PERFORM {{schema}}.job_settle(settled, settled_why);
    END IF;
    RETURN written;
END;
$$;

-- As in 0010, and the dependencies are flagged.
CREATE OR REPLACE FUNCTION {{schema}}.job_block(
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
        UPDATE {{schema}}.job AS j SET has_dependants = true
        WHERE j.id = ANY(live_required || live_after) AND NOT j.has_dependants;
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

-- As in 0010, and a running holder that gets a successor is flagged.
CREATE OR REPLACE FUNCTION {{schema}}.job_replace(
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
    UPDATE {{schema}}.job AS j SET has_dependants = true
    WHERE j.id = holder AND NOT j.has_dependants;
    RETURN successor;
END;
$$;
