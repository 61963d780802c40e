-- The web console's reads made cheap (issue 15): a dead job's error fingerprint kept on
-- its final record, the dead jobs indexed by when they died, and the live counts by
-- queue and state counted in one pass that compares no text. "{{schema}}" is replaced
-- by the configured schema name.

-- The fingerprint of the job's last failed attempt's error (contract §14), written by
-- job_finish with the record: grouping dead jobs by it no longer looks each one up in
-- job_attempt (partitioned by the attempt's day, so a look-up by job id probes every
-- partition). NULL for a job that ended without a failed attempt.
ALTER TABLE {{schema}}.job_history ADD COLUMN fingerprint text;

-- The dead records of before this migration, from their last failed attempt (what
-- job_fingerprint(id) answered): one pass over job_attempt, not a look-up per job.
UPDATE {{schema}}.job_history AS h
SET fingerprint = a.fingerprint
FROM (SELECT DISTINCT ON (x.job_id) x.job_id, x.fingerprint
      FROM {{schema}}.job_attempt AS x
      ORDER BY x.job_id, x.attempt DESC, x.failed_at DESC) AS a
WHERE h.id = a.job_id AND h.state = 'dead' AND a.fingerprint IS NOT NULL;

-- Dead jobs by when they died, with what the dead-job groups read (an index-only scan:
-- history is append-only, so its pages are all-visible once vacuumed). Only dead
-- records are in it: a completion's insert skips it.
CREATE INDEX job_history_dead_at_idx ON {{schema}}.job_history (finished_at)
    INCLUDE (fingerprint, reason, kind, queue) WHERE state = 'dead';

-- job_finish as in 0015 (settle_dependants), and now also: `fingerprints` (NULL: none)
-- go to the records.
-- The completion path passes none; the failure path, the reaper and expiry pass theirs.
DROP FUNCTION {{schema}}.job_finish(anyarray, text[], text[], jsonb[], boolean[]);
CREATE FUNCTION {{schema}}.job_finish(
    jobs         anyarray,
    reasons      text[]    DEFAULT NULL,
    last_errors  text[]    DEFAULT NULL,
    results      jsonb[]   DEFAULT NULL,
    keep         boolean[] DEFAULT NULL,
    fingerprints text[]    DEFAULT NULL
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
        owner, last_error, args, result, depends_on, after_jobs, fingerprint)
    SELECT j.id, now(), j.run_at, j.enqueued_at, j.attempted_at, j.attempt, j.max_attempts,
           j.priority,
           CASE WHEN reasons[j.ordinality] IS NULL THEN 'completed'
                WHEN reasons[j.ordinality] = 'cancelled' THEN 'cancelled'
                ELSE 'dead' END::{{schema}}.job_state,
           reasons[j.ordinality], j.queue, j.kind, j.tenant,
           coalesce(j.unique_key, j.successor_key), j.owner,
           last_errors[j.ordinality], j.args, results[j.ordinality], j.depends_on,
           j.after_jobs, fingerprints[j.ordinality]
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

-- How dead jobs are grouped, by the console and by `dlq list` alike: the fingerprint of
-- the last failed attempt and the reason the job ended, as "<fingerprint>.<reason>"
-- ("none.<reason>" without a fingerprint: expired, dependency_failed). Replaces 0009's
-- (last_error, fingerprint), which keyed on the error text while no fingerprint was
-- recorded.
DROP FUNCTION {{schema}}.dead_group_key(text, text);
CREATE FUNCTION {{schema}}.dead_group_key(fingerprint text, reason text)
RETURNS text
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
AS $$ SELECT coalesce(fingerprint, 'none') || '.' || coalesce(reason, 'none') $$;

-- Live jobs per queue by state (the same columns as 0010's): grouped by (queue, state)
-- first, then spread into columns, so each live row costs one hash look-up instead of
-- six filters (one a cast of the state to text): about half the time on 100,000 jobs.
CREATE OR REPLACE VIEW {{schema}}.queue_depth WITH (security_invoker = true) AS
WITH s AS (
    SELECT j.queue, j.state, count(*) AS n, min(j.run_at) AS oldest
    FROM {{schema}}.job AS j
    GROUP BY j.queue, j.state
)
SELECT s.queue,
       coalesce(sum(s.n) FILTER (WHERE s.state = 'available'), 0)::bigint AS available,
       coalesce(sum(s.n) FILTER (WHERE s.state = 'scheduled'), 0)::bigint AS scheduled,
       coalesce(sum(s.n) FILTER (WHERE s.state = 'running'), 0)::bigint AS running,
       coalesce(sum(s.n) FILTER (WHERE s.state = 'retryable'), 0)::bigint AS retryable,
       min(s.oldest) FILTER (WHERE s.state = 'available') AS oldest_available_at,
       coalesce(sum(s.n) FILTER (WHERE s.state::text = 'blocked'), 0)::bigint AS blocked
FROM s
GROUP BY s.queue;

-- The live jobs per queue by state as the leader last counted them (its queue_stats
-- role, every 5 s: the count it exports as metrics), one row per queue it lists,
-- replaced whole at each count in a fenced transaction. The web console's overview
-- reads this instead of counting every live job on every refresh of every open tab;
-- `pgjobd status` still counts (admin_status_queues). A handful of rows, updated in
-- place (HOT: no indexed column changes).
CREATE TABLE {{schema}}.queue_count (
    queue               text        PRIMARY KEY,
    available           bigint      NOT NULL,
    scheduled           bigint      NOT NULL,
    running             bigint      NOT NULL,
    retryable           bigint      NOT NULL,
    blocked             bigint      NOT NULL,
    oldest_available_at timestamptz,
    counted_at          timestamptz NOT NULL
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.0,
        autovacuum_vacuum_threshold = 1000);
