-- Ending a job in one statement (issue 11): job_move deletes jobs from the hot table by
-- id (fence-checked where a fence is given), writes their final records, announces them
-- on job_final and settles the dependants of those something depends on. Every path
-- that ends jobs calls it: completion, failure, the reaper, expiry, admin cancel
-- (named statements), and dependency failure, born-dead and a replaced successor (the
-- functions restated below, each from its last definition, 0015). It replaces
-- job_finish's interface, an array of whole job rows built by the caller's
-- DELETE ... RETURNING and unnested again (about 6 us of server CPU per job).
--
-- job_finish stays, unchanged (0019's), for the members of v0.1.0 only: their
-- statements call it, and a fleet keeps them running on this schema through a rolling
-- upgrade (tests/e2e/test_upgrade.py). Nothing of this release calls it; it can go in
-- the first migration after a release that no longer supports rolling from v0.1.0.
-- "{{schema}}" is replaced by the configured schema name.

-- Ends the jobs `ids` that are still in the hot table and, where `fences` gives one
-- (not NULL), still hold that fence. Per job, by position: its reason (NULL: completed;
-- 'cancelled'; else dead, why), its last error (NULL: the job's own), its result,
-- whether to keep a final record (NULL: keep), its error fingerprint. NULL arrays mean
-- NULL for every job. Returns (id, fence) of each job it ended: one left out was gone
-- or re-fenced. Every job it ends is announced on job_final (payload: ids joined by
-- ',', at most 400 to a notification; client.wait listens), kept or not, and those
-- flagged has_dependants are settled (job_settle). A caller that decides the reasons
-- from a job's row locks the row first (FOR UPDATE), so that the decision and the move
-- see the same version of it.
CREATE FUNCTION {{schema}}.job_move(
    ids          bigint[],
    fences       bigint[]  DEFAULT NULL,
    reasons      text[]    DEFAULT NULL,
    last_errors  text[]    DEFAULT NULL,
    results      jsonb[]   DEFAULT NULL,
    keep         boolean[] DEFAULT NULL,
    fingerprints text[]    DEFAULT NULL
)
RETURNS TABLE (id bigint, fence bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH moved AS (
        DELETE FROM {{schema}}.job AS j
        USING unnest(ids, fences, reasons, last_errors, results, keep, fingerprints)
              WITH ORDINALITY AS m(id, fence, reason, last_error, result, keep, fingerprint, n)
        -- "j.id = ANY" makes the planner look the jobs up by key (see job_complete_many).
        WHERE j.id = ANY(ids) AND j.id = m.id AND (m.fence IS NULL OR j.fence = m.fence)
        RETURNING j.id, j.fence, j.has_dependants, m.n, m.reason, m.keep, j.run_at,
                  j.enqueued_at, j.attempted_at, j.attempt, j.max_attempts, j.priority,
                  j.queue, j.kind, j.tenant, coalesce(j.unique_key, j.successor_key) AS key,
                  j.owner, coalesce(m.last_error, j.last_error) AS last_error, j.args,
                  m.result, j.depends_on, j.after_jobs, m.fingerprint
    ), recorded AS (
        INSERT INTO {{schema}}.job_history (id, finished_at, run_at, enqueued_at,
            attempted_at, attempt, max_attempts, priority, state, reason, queue, kind, tenant,
            unique_key, owner, last_error, args, result, depends_on, after_jobs, fingerprint)
        SELECT x.id, now(), x.run_at, x.enqueued_at, x.attempted_at, x.attempt,
               x.max_attempts, x.priority,
               CASE WHEN x.reason IS NULL THEN 'completed'
                    WHEN x.reason = 'cancelled' THEN 'cancelled'
                    ELSE 'dead' END::{{schema}}.job_state,
               x.reason, x.queue, x.kind, x.tenant, x.key, x.owner, x.last_error, x.args,
               x.result, x.depends_on, x.after_jobs, x.fingerprint
        FROM moved AS x
        WHERE x.keep IS DISTINCT FROM false
    ), announced AS (
        -- Payloads stay far below NOTIFY's 8000 bytes: 400 ids of at most 19 digits.
        SELECT pg_notify('{{schema}}.job_final', string_agg(x.id::text, ',' ORDER BY x.n))
        FROM moved AS x
        GROUP BY (x.n - 1) / 400
    ), settled AS (
        SELECT {{schema}}.job_settle(array_agg(x.id ORDER BY x.n),
                                     array_agg(x.reason ORDER BY x.n))
        FROM moved AS x
        WHERE x.has_dependants
        HAVING count(*) > 0
    )
    SELECT x.id, x.fence
    FROM moved AS x
    -- (A SELECT in WITH runs only when read: these two are read once, first.)
    WHERE (SELECT count(*) FROM announced) >= 0 AND (SELECT count(*) FROM settled) >= 0;
END;
$$;

-- The end of jobs `ids` for the jobs waiting for them, as in 0015; the dependants it
-- fails are ended by job_move.
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
    dead_ids     bigint[];
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

    SELECT array_agg(t.id ORDER BY t.id),
           array_agg(format('DependencyFailed: job %s, which it depends on, ended %s',
                            t.culprit, coalesce(r.reason, 'dead')) ORDER BY t.id)
    INTO dead_ids, dead_errors
    FROM unnest(dependants, doomed, culprits) AS t(id, doomed, culprit)
    JOIN {{schema}}.job AS j ON j.id = t.id AND j.state = 'blocked'
    LEFT JOIN unnest(ids, reasons) AS r(id, reason) ON r.id = t.culprit
    WHERE t.doomed;

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

    IF dead_ids IS NOT NULL THEN
        PERFORM {{schema}}.job_move(
            dead_ids, NULL,
            array_fill('dependency_failed'::text, ARRAY[cardinality(dead_ids)]), dead_errors);
    END IF;
END;
$$;

-- As in 0015; a job born dead is ended by job_move.
CREATE OR REPLACE FUNCTION {{schema}}.job_block(
    job_id bigint, live_required bigint[], live_after bigint[], doomed boolean,
    after_failed integer, culprit bigint, state text, queue text
)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    waits     integer := coalesce(cardinality(live_required), 0)
                         + coalesce(cardinality(live_after), 0);
BEGIN
    IF doomed THEN
        PERFORM {{schema}}.job_move(ARRAY[job_block.job_id], NULL, ARRAY['dependency_failed'],
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

-- As in 0015; the successor a new holder replaces is ended (cancelled) by job_move.
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
    cancelled bigint;
BEGIN
    IF holder_state <> 'running' THEN
        UPDATE {{schema}}.job AS j
        SET args = job_replace.args, run_at = job_replace.run_at,
            priority = job_replace.priority, expires_at = job_replace.expires_at,
            state = CASE WHEN j.state::text = 'blocked' THEN j.state
                         ELSE job_replace.state::{{schema}}.job_state END
        WHERE j.id = holder;
        SELECT m.id INTO cancelled
        FROM {{schema}}.job_move(
            ARRAY(SELECT j.id FROM {{schema}}.job AS j
                  WHERE j.successor_key = job_replace.unique_key),
            NULL, ARRAY['cancelled'], ARRAY[format('Replaced: job %s took its args', holder)]
        ) AS m;
        IF cancelled IS NOT NULL THEN
            DELETE FROM {{schema}}.job_dependency AS e WHERE e.dependant = cancelled;
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
