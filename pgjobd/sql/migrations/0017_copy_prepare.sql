-- The client's COPY path writes straight into the job table again, with no staging
-- table: one round trip before the COPY resolves the batch's options with job_defaults,
-- admits it, wakes its queues and draws its ids. That round trip is this function, not
-- a statement, so that its plans are made once per session: planned on every call, as a
-- statement with array parameters is, it cost a small batch more server time than the
-- COPY path before issue 11 (bench/enqueue.py). It runs with the caller's rights (as
-- the statement did): row_security_active must answer for the caller.
--
-- Each element of the given_* arrays is one distinct set of given options in the batch
-- (NULL: not given), given_jobs how many of the batch's jobs have it and given_grouped
-- whether any of them has a group; job_count is the batch's size. Returns, per set, the
-- options job_defaults gives it (and expires_at from a ttl, as enqueue_many makes it),
-- job_count ids drawn in order, and whether row security applies to the caller's
-- writes to the job table (then PostgreSQL refuses COPY FROM, and the client inserts
-- the same rows with a statement). queue_admit refuses the whole batch, before anything
-- is written, when a queue is full. The wake-ups are delivered at commit: only if the
-- COPY is.
CREATE FUNCTION {{schema}}.job_copy_prepare(
    given_kinds text[], given_queues text[], given_priorities integer[],
    given_run_ats timestamptz[], given_delays interval[], given_max_attempts integer[],
    given_ttls interval[], given_expires_ats timestamptz[], given_jobs integer[],
    given_grouped boolean[], job_count integer,
    OUT states text[], OUT queues text[], OUT priorities smallint[],
    OUT run_ats timestamptz[], OUT max_attempts integer[], OUT expires_ats timestamptz[],
    OUT ids bigint[], OUT row_security boolean
)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    SELECT array_agg(d.state::text ORDER BY u.ord), array_agg(d.queue ORDER BY u.ord),
           array_agg(d.priority ORDER BY u.ord), array_agg(d.run_at ORDER BY u.ord),
           array_agg(d.max_attempts ORDER BY u.ord),
           array_agg(coalesce(u.expires_at, now() + u.ttl) ORDER BY u.ord)
    INTO states, queues, priorities, run_ats, max_attempts, expires_ats
    FROM unnest(given_kinds, given_queues, given_priorities, given_run_ats, given_delays,
                given_max_attempts, given_ttls, given_expires_ats)
         WITH ORDINALITY AS u(kind, queue, priority, run_at, delay, attempts, ttl,
                              expires_at, ord)
    LEFT JOIN {{schema}}.kind AS k ON k.name = u.kind
    CROSS JOIN LATERAL {{schema}}.job_defaults(
        k.queue, k.priority, k.max_attempts, u.queue, u.priority, u.run_at, u.delay,
        u.attempts) AS d;
    IF {{schema}}.queue_admit_needed(true = ANY(given_grouped)) THEN
        PERFORM {{schema}}.queue_admit(array_agg(a.queue), array_agg(a.n), array_agg(a.g))
        FROM (SELECT s.queue, sum(s.n)::integer AS n, bool_or(s.g) AS g
              FROM unnest(queues, given_jobs, given_grouped) AS s(queue, n, g)
              GROUP BY s.queue) AS a;
    END IF;
    PERFORM pg_notify('{{schema}}.job_ready', w.queue)
    FROM (SELECT DISTINCT s.queue FROM unnest(queues, states) AS s(queue, state)
          WHERE s.state = 'available') AS w;
    ids := ARRAY(SELECT nextval('{{schema}}.job_id_seq') FROM generate_series(1, job_count));
    row_security := row_security_active('{{schema}}.job');
END;
$$;
