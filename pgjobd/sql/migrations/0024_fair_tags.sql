-- A queue whose only limit is `fair = true` claims without its lock (issue 12): start-time
-- fair queuing. Before, every fair claim decided the tenants' shares under the queue's
-- lock (stride scheduling in job_claim_flow): one claim at a time fleet-wide, ~130 µs of
-- server time a job against ~24 for an unfair claim, and a fair drain at 0.43-0.55 of
-- the same drain without fairness (docs/decisions.md). Now each available job of such a
-- queue carries a virtual start tag (job.fair_tag), and claims take the lowest tags
-- FOR UPDATE SKIP LOCKED from an index, as an unfair claim takes the head of its queue.
--
-- Tags are given out by fair_tag_fill, by whichever claim of the queue gets its lock
-- without waiting (the others claim what is tagged already): a tenant's k-th job of a
-- fill is tagged base + (k - 1) / weight, base the larger of the queue's virtual time
-- (fair_clock: the lowest tag still waiting) and the tenant's finish tag
-- (fair_finish: its last tag + 1 / weight). A tenant that floods gets tags far ahead, so
-- a tenant that starts waiting is tagged at the clock and starts within about one job
-- per waiting tenant; idle time is not banked (a finish below the clock counts as the
-- clock, and is deleted). A job that comes back (a retry or snooze coming due, a
-- promotion, a rescue) lost its tag when it was claimed: it is tagged again as it
-- arrives, after its tenant's waiting jobs; one that was never marked (an admin's retry
-- from the final records, an id the look back missed) is found by a sweep of the
-- queue's first 1,000 available jobs once a second. A tag below the clock (left by a
-- claim of another path, when the queue had other limits then) is stale: claims pass
-- it by and the sweep tags the job again. New weights re-space the tags of the tenants
-- whose weight changed, from each one's first waiting tag (fair_reweigh, set by the
-- weights' write). Within a tenant, jobs start in priority order: a claim that took a
-- tenant's lowest tags runs that tenant's best jobs (priority, run_at, id) and hands the
-- tags it did not use to the jobs it passed over, so the tenant's share is unchanged.
--
-- A fair queue with other limits (global or tenant concurrency, a rate limit, groups, a
-- limited kind) keeps stride scheduling under the lock: job_claim_flow is renamed
-- job_claim_limited (any restatement starts from 0023's body under that name), and
-- job_claim_flow dispatches. "{{schema}}" is replaced by the configured schema name.

ALTER TABLE {{schema}}.job ADD COLUMN fair_tag double precision;
CREATE INDEX job_fair_tag_idx ON {{schema}}.job (queue, fair_tag, id)
    WHERE fair_tag IS NOT NULL AND state = 'available';
-- Marked jobs that are available without a tag: new ones marked while scheduled, and
-- those that came back. (Jobs that were never marked are found by id, as before.)
CREATE INDEX job_fair_untagged_idx ON {{schema}}.job (queue, id)
    WHERE fair_tenant IS NOT NULL AND fair_tag IS NULL AND state = 'available';

ALTER TABLE {{schema}}.queue
    ADD COLUMN fair_clock double precision NOT NULL DEFAULT 0,
    ADD COLUMN fair_reweigh boolean NOT NULL DEFAULT false,
    ADD COLUMN fair_swept_at timestamptz;

-- Per tenant of a tagged fair queue: the tag its next job would get at the earliest,
-- the weight its waiting jobs were tagged with, and where its new jobs that a fill
-- passed over (beyond the 500 a tenant gets per fill) resume.
CREATE TABLE {{schema}}.fair_finish (
    queue         text             NOT NULL,
    tenant        text             NOT NULL,
    finish        double precision NOT NULL,
    weight        integer          NOT NULL,
    backlog_from  bigint,
    PRIMARY KEY (queue, tenant)
);

-- Whether queue q claims through job_claim_fair: fair, and no other limit of its own or
-- of any kind (as queue_reservable, for a global_concurrency).
CREATE FUNCTION {{schema}}.queue_fair_only(q text)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (SELECT FROM {{schema}}.queue AS x
                   WHERE x.name = q AND NOT x.paused AND x.fair
                     AND x.global_concurrency IS NULL AND x.rate_limit IS NULL
                     AND NOT x.grouped AND x.tenant_concurrency IS NULL)
           AND NOT EXISTS (SELECT FROM {{schema}}.kind AS k
                           WHERE k.global_concurrency IS NOT NULL
                              OR k.rate_limit IS NOT NULL OR k.breaker_limit IS NOT NULL)
$$;

-- The ids a fair queue's marking looks at next, (low, top], at most `span` new ones,
-- recorded on the queue row (fair_tenant_mark of 0022, its range alone; NULLs: the job
-- table is empty).
CREATE FUNCTION {{schema}}.fair_scan_range(
    claim_queue text, span integer, OUT low bigint, OUT top bigint
)
LANGUAGE plpgsql
AS $$
DECLARE
    q          record;
    snap_xmin  xid8;
    snap_xmax  xid8;
    settled    bigint;
    scanned    bigint;
BEGIN
    SELECT x.fair_scanned, x.fair_settled, x.fair_scan_xmax INTO q
    FROM {{schema}}.queue AS x WHERE x.name = claim_queue;
    -- One snapshot: every id at or below `top` was drawn by a transaction that had
    -- begun writing before it (but see 0014), so that had an id below snap_xmax.
    SELECT (SELECT max(j.id) FROM {{schema}}.job AS j),
           pg_snapshot_xmin(pg_current_snapshot()), pg_snapshot_xmax(pg_current_snapshot())
    INTO top, snap_xmin, snap_xmax;
    IF top IS NULL THEN
        RETURN;
    END IF;
    settled := coalesce(q.fair_settled, 0);
    IF q.fair_scan_xmax IS NOT NULL AND snap_xmin >= q.fair_scan_xmax THEN
        settled := greatest(settled, q.fair_scanned);
    END IF;
    settled := greatest(settled, coalesce(q.fair_scanned, top) - 2000);
    scanned := greatest(coalesce(q.fair_scanned, 0), settled);
    -- The span counts from the first id present above the mark: no row in between
    -- is visible, so only running transactions' ids can be there (looked at again as
    -- above).
    scanned := greatest(scanned, coalesce((SELECT min(j.id) FROM {{schema}}.job AS j
                                           WHERE j.id > scanned), top) - 1);
    top := least(top, scanned + span);
    low := settled - 100;
    -- Unchanged marks keep the queue row (and the snapshot bound of when they moved: a
    -- later one would only settle later).
    IF top > coalesce(q.fair_scanned, -1) OR settled IS DISTINCT FROM q.fair_settled
       OR q.fair_scan_xmax IS NULL THEN
        UPDATE {{schema}}.queue AS x
        SET fair_scanned = greatest(top, x.fair_scanned), fair_settled = settled,
            fair_scan_xmax = snap_xmax
        WHERE x.name = claim_queue;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION {{schema}}.fair_tenant_mark(claim_queue text)
RETURNS text[]
LANGUAGE plpgsql
AS $$
DECLARE
    r        record;
    tenants  text[];
BEGIN
    SELECT * INTO r FROM {{schema}}.fair_scan_range(claim_queue, 10000);
    IF r.top IS NULL THEN
        RETURN '{}';
    END IF;
    WITH marked AS (
        UPDATE {{schema}}.job AS j SET fair_tenant = coalesce(j.tenant::text, '')
        WHERE j.id > r.low AND j.id <= r.top AND j.queue = claim_queue
          AND j.fair_tenant IS NULL AND j.group_key IS NULL
        RETURNING j.fair_tenant
    )
    SELECT coalesce(array_agg(DISTINCT m.fair_tenant), '{}') INTO tenants FROM marked AS m;
    RETURN tenants;
END;
$$;

-- Tags what arrived in fair queue `claim_queue` since the last fill (see the head of
-- this migration); the caller holds the queue's lock. New jobs are found by id, as the
-- marking of 0014 finds them, 2,000 ids a fill; each tenant gets at most 500 of them
-- marked and tagged a fill, in id order, and the rest of a tenant's burst is read from
-- where it stopped (fair_finish.backlog_from) by later fills, once fewer than half of
-- its tagged jobs are left: a fill that tags far ahead of the claims only delays the
-- next arrivals (measured: a job behind a 100,000-job burst waited 1.5-2 s when each
-- fill tagged 10,000). At most 2,000 jobs that came back a fill.
-- Once a second the fill also tags the unmarked jobs among the queue's first 1,000
-- available (claim order): ids a transaction drew and committed too late for the look
-- back (see 0014), which nothing else would find.
CREATE FUNCTION {{schema}}.fair_tag_fill(claim_queue text)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    q           record;
    r           record;
    clock       float8;
    per_tenant  constant integer := 500;
    sweep       boolean;
BEGIN
    SELECT x.fair_clock, x.fair_reweigh, x.fair_swept_at INTO q FROM {{schema}}.queue AS x
    WHERE x.name = claim_queue;
    -- The virtual time: the lowest tag still waiting; when none waits, the highest
    -- finish (everything tagged has started). Never backwards.
    clock := greatest(q.fair_clock,
                      coalesce((SELECT j.fair_tag FROM {{schema}}.job AS j
                                WHERE j.queue = claim_queue AND j.state = 'available'
                                  AND j.fair_tag >= q.fair_clock
                                ORDER BY j.fair_tag LIMIT 1),
                               (SELECT max(f.finish) FROM {{schema}}.fair_finish AS f
                                WHERE f.queue = claim_queue),
                               q.fair_clock));
    IF q.fair_reweigh THEN
        -- Tenants whose weight changed: their waiting jobs re-spaced by the new weight
        -- from their first waiting tag, in the same order.
        WITH changed AS (
            SELECT f.tenant, coalesce(w.weight, 1) AS weight
            FROM {{schema}}.fair_finish AS f
            LEFT JOIN {{schema}}.tenant_weight AS w ON w.tenant = f.tenant
            WHERE f.queue = claim_queue AND f.weight <> coalesce(w.weight, 1)
        ), respaced AS (
            SELECT j.id, c.tenant, c.weight,
                   min(j.fair_tag) OVER (PARTITION BY c.tenant)
                   + (row_number() OVER (PARTITION BY c.tenant ORDER BY j.fair_tag, j.id)
                      - 1)::float8 / c.weight AS tag
            FROM changed AS c
            JOIN {{schema}}.job AS j
              ON j.queue = claim_queue AND j.fair_tenant = c.tenant
             AND j.state = 'available' AND j.fair_tag >= clock
        ), moved AS (
            UPDATE {{schema}}.job AS j SET fair_tag = s.tag
            FROM respaced AS s
            WHERE j.id = s.id AND (j.state = 'available') IS TRUE
            RETURNING s.tenant, s.weight, s.tag
        )
        UPDATE {{schema}}.fair_finish AS f
        SET weight = c.weight,
            finish = coalesce((SELECT max(m.tag) + 1.0 / c.weight FROM moved AS m
                               WHERE m.tenant = c.tenant), f.finish)
        FROM changed AS c
        WHERE f.queue = claim_queue AND f.tenant = c.tenant;
        UPDATE {{schema}}.queue AS x SET fair_reweigh = false WHERE x.name = claim_queue;
    END IF;

    sweep := q.fair_swept_at IS NULL OR q.fair_swept_at < clock_timestamp() - interval '1 second';
    SELECT * INTO r FROM {{schema}}.fair_scan_range(claim_queue, 2000);
    WITH backlogged AS (
        SELECT f.tenant, f.backlog_from, (f.finish - clock) * f.weight < per_tenant / 2 AS due
        FROM {{schema}}.fair_finish AS f
        WHERE f.queue = claim_queue AND f.backlog_from IS NOT NULL
    ), fresh AS (
        -- New ungrouped jobs (a tenant with a backlog: from there, below).
        SELECT j.id, coalesce(j.tenant::text, '') AS tenant, j.priority, j.run_at,
               j.state = 'available' AS ready,
               row_number() OVER (PARTITION BY coalesce(j.tenant::text, '') ORDER BY j.id)
               AS n
        FROM {{schema}}.job AS j
        WHERE r.top IS NOT NULL AND j.id > r.low AND j.id <= r.top
          AND j.queue = claim_queue AND j.fair_tenant IS NULL AND j.group_key IS NULL
          AND coalesce(j.tenant::text, '') NOT IN (SELECT b.tenant FROM backlogged AS b)
    ), behind AS (
        SELECT x.id, b.tenant, x.priority, x.run_at, x.ready,
               row_number() OVER (PARTITION BY b.tenant ORDER BY x.id) AS n
        FROM backlogged AS b
        CROSS JOIN LATERAL (
            -- (Only once fewer than half of its tagged jobs are left waiting: a fill
            -- that tags far ahead of the claims only delays the next arrivals. At most
            -- 4,000 ids a fill: the plan may read all of them, whatever the LIMIT.)
            SELECT j.id, j.priority, j.run_at, j.state = 'available' AS ready
            FROM {{schema}}.job AS j
            WHERE b.due AND j.id >= b.backlog_from AND j.id < b.backlog_from + 4 * per_tenant
              AND j.queue = claim_queue
              AND j.fair_tenant IS NULL AND j.group_key IS NULL
              AND coalesce(j.tenant::text, '') = b.tenant
            ORDER BY j.id
            LIMIT per_tenant + 1
        ) AS x
    ), found AS (
        SELECT * FROM fresh UNION ALL SELECT * FROM behind
    ), held AS (
        -- Where each tenant with more than its share of the fill resumes: its next job,
        -- or the end of the ids its backlog's read covered, if more were drawn since.
        SELECT f.tenant, f.id FROM found AS f WHERE f.n = per_tenant + 1
        UNION ALL
        SELECT b.tenant, b.backlog_from + 4 * per_tenant FROM backlogged AS b
        WHERE b.due AND b.backlog_from + 4 * per_tenant <= r.top
          AND NOT EXISTS (SELECT FROM found AS f
                          WHERE f.tenant = b.tenant AND f.n = per_tenant + 1)
    ), arrived AS (
        SELECT f.id, f.tenant, f.priority, f.run_at, f.ready FROM found AS f
        WHERE f.n <= per_tenant
        UNION ALL
        -- Marked jobs available without a tag (come back, or promoted)...
        SELECT u.id, u.fair_tenant, u.priority, u.run_at, true
        FROM (SELECT j.id, j.fair_tenant, j.priority, j.run_at FROM {{schema}}.job AS j
              WHERE j.queue = claim_queue AND j.fair_tenant IS NOT NULL
                AND j.fair_tag IS NULL AND j.state = 'available'
              ORDER BY j.id LIMIT 2000) AS u
        UNION ALL
        -- ...and, once a second, stale tags (claims pass them by: they only come of a
        -- change of the queue's limits, and the index below the clock holds the entries
        -- of every job claimed since the last vacuum)...
        SELECT s.id, s.fair_tenant, s.priority, s.run_at, true
        FROM (SELECT j.id, j.fair_tenant, j.priority, j.run_at FROM {{schema}}.job AS j
              WHERE sweep AND j.queue = claim_queue AND j.fair_tag < clock
                AND j.state = 'available'
              ORDER BY j.fair_tag LIMIT 10000) AS s
        UNION ALL
        -- ...and jobs the look back missed (not those the ranges above read: their ids
        -- are past `low`, or their tenant's backlog reads them).
        SELECT h.id, h.tenant, h.priority, h.run_at, true
        FROM (SELECT j.id, coalesce(j.tenant::text, '') AS tenant, j.priority, j.run_at,
                     j.fair_tenant, j.group_key
              FROM {{schema}}.job AS j
              WHERE sweep AND j.queue = claim_queue AND j.state = 'available'
              ORDER BY j.priority, j.run_at, j.id LIMIT 1000) AS h
        WHERE h.fair_tenant IS NULL AND h.group_key IS NULL
          AND (r.top IS NULL OR h.id <= r.low)
          AND h.tenant NOT IN (SELECT b.tenant FROM backlogged AS b)
    ), ranked AS (
        SELECT a.id, a.tenant, a.ready,
               row_number() OVER (PARTITION BY a.tenant, a.ready
                                  ORDER BY a.priority, a.run_at, a.id) AS k
        FROM arrived AS a
    ), tagged AS (
        SELECT k.id, k.tenant, coalesce(w.weight, 1) AS weight,
               CASE WHEN k.ready
                    THEN greatest(coalesce(f.finish, clock), clock)
                         + (k.k - 1)::float8 / coalesce(w.weight, 1)
               END AS tag
        FROM ranked AS k
        LEFT JOIN {{schema}}.fair_finish AS f ON f.queue = claim_queue AND f.tenant = k.tenant
        LEFT JOIN {{schema}}.tenant_weight AS w ON w.tenant = k.tenant
    ), written AS (
        -- (A job claimed meanwhile by another path is marked, not tagged.)
        UPDATE {{schema}}.job AS j
        SET fair_tenant = t.tenant,
            fair_tag = CASE WHEN j.state = 'available' THEN t.tag END
        FROM tagged AS t
        WHERE j.id = t.id
        RETURNING t.tenant, t.weight, t.tag
    ), finished AS (
        SELECT w.tenant, max(w.tag) + 1.0 / w.weight AS finish, w.weight
        FROM written AS w WHERE w.tag IS NOT NULL
        GROUP BY w.tenant, w.weight
    ), touched AS (
        SELECT f.tenant FROM finished AS f
        UNION SELECT h.tenant FROM held AS h
        UNION SELECT b.tenant FROM backlogged AS b WHERE b.due
    )
    INSERT INTO {{schema}}.fair_finish AS f (queue, tenant, finish, weight, backlog_from)
    SELECT claim_queue, t.tenant, coalesce(d.finish, clock),
           coalesce(d.weight, o.weight, w.weight, 1),
           CASE WHEN b.due IS FALSE THEN b.backlog_from ELSE h.id END
    FROM touched AS t
    LEFT JOIN finished AS d ON d.tenant = t.tenant
    LEFT JOIN held AS h ON h.tenant = t.tenant
    LEFT JOIN backlogged AS b ON b.tenant = t.tenant
    LEFT JOIN {{schema}}.fair_finish AS o ON o.queue = claim_queue AND o.tenant = t.tenant
    LEFT JOIN {{schema}}.tenant_weight AS w ON w.tenant = t.tenant
    ORDER BY t.tenant
    ON CONFLICT (queue, tenant) DO UPDATE
    SET finish = greatest(f.finish, excluded.finish), weight = excluded.weight,
        backlog_from = excluded.backlog_from;

    IF sweep THEN
        UPDATE {{schema}}.queue AS x SET fair_swept_at = clock_timestamp()
        WHERE x.name = claim_queue;
    END IF;
    IF clock > q.fair_clock THEN
        -- Below the clock, a finish says nothing more than no row (unless its tenant
        -- still has a backlog to read).
        DELETE FROM {{schema}}.fair_finish AS f
        WHERE f.queue = claim_queue AND f.finish < clock AND f.backlog_from IS NULL;
        UPDATE {{schema}}.queue AS x SET fair_clock = clock WHERE x.name = claim_queue;
    END IF;
END;
$$;

-- job_claim for a queue whose only limit is fair = true (queue_fair_only; nothing for
-- any other queue): the lowest tags first, each tenant's jobs in priority order (see
-- the head of this migration). The claim that gets the queue's lock without waiting
-- tags what arrived first; the others do not wait for it.
CREATE FUNCTION {{schema}}.job_claim_fair(
    claim_queue text, wanted integer, claimer text, lease interval
)
RETURNS TABLE (id bigint, fence bigint, kind text, queue text, attempt integer,
               max_attempts integer, crashes integer, priority smallint, tenant text,
               enqueued_at timestamptz, scheduled_at timestamptz, args text,
               waited_s float8, depends_on bigint[], after_jobs bigint[],
               blockers_failed integer, trace_context text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    clock    float8;
    picked   bigint[];
    at       timestamptz;
BEGIN
    IF wanted IS NULL OR wanted < 1 OR NOT {{schema}}.queue_fair_only(claim_queue) THEN
        RETURN;
    END IF;
    IF pg_try_advisory_xact_lock(1885825539, hashtext('{{schema}} queue ' || claim_queue)) THEN
        PERFORM {{schema}}.fair_tag_fill(claim_queue);
    END IF;
    SELECT x.fair_clock INTO clock FROM {{schema}}.queue AS x WHERE x.name = claim_queue;
    picked := ARRAY(SELECT j.id FROM {{schema}}.job AS j
                    WHERE j.queue = claim_queue AND j.state = 'available'
                      AND j.fair_tag >= clock
                      AND (j.expires_at IS NULL OR j.expires_at > now())
                    ORDER BY j.fair_tag, j.id
                    LIMIT wanted
                    FOR UPDATE SKIP LOCKED);
    IF cardinality(picked) = 0 THEN
        RETURN;
    END IF;
    -- Several priorities waiting: each tenant runs its best jobs in the places its
    -- tags won, and the jobs passed over take the tags of those run in their stead.
    IF (SELECT j.priority FROM {{schema}}.job AS j
        WHERE j.queue = claim_queue AND j.state = 'available'
        ORDER BY j.priority LIMIT 1)
       IS DISTINCT FROM
       (SELECT j.priority FROM {{schema}}.job AS j
        WHERE j.queue = claim_queue AND j.state = 'available'
        ORDER BY j.priority DESC LIMIT 1) THEN
        picked := {{schema}}.fair_best_of_tenants(claim_queue, picked, clock);
    END IF;
    at := clock_timestamp();
    -- (Planned at each claim, by id: see migration 0023.)
    RETURN QUERY EXECUTE $update$
        UPDATE {{schema}}.job AS j
        SET state = 'running', attempt = j.attempt + 1,
            fence = nextval('{{schema}}.fence_seq'), owner = $2, attempted_at = $3,
            lease_expires_at = $3 + $4, fair_tag = NULL
        WHERE j.id = ANY($1) AND (j.state = 'available') IS TRUE
        RETURNING j.id::bigint, j.fence::bigint, j.kind::text, j.queue::text,
                  j.attempt::integer, j.max_attempts::integer, j.crashes::integer,
                  j.priority::smallint, j.tenant::text, j.enqueued_at::timestamptz,
                  j.run_at::timestamptz, j.args::text,
                  extract(epoch FROM $3 - j.run_at)::float8, j.depends_on, j.after_jobs,
                  j.blockers_failed, j.trace_context::text
        $update$
    USING picked, claimer, at, lease;
END;
$$;

-- Of the jobs `picked` (locked, the lowest tags), the ones to run: per tenant, as many
-- of its best available jobs (priority, run_at, id) as it has picked; a picked job left
-- waiting takes the tag of a job run in its stead (lowest to lowest), so the tenant
-- holds the same tags as before less those of the jobs it ran.
CREATE FUNCTION {{schema}}.fair_best_of_tenants(
    claim_queue text, picked bigint[], clock float8
)
RETURNS bigint[]
LANGUAGE sql
AS $$
    WITH p AS (
        SELECT j.id, j.fair_tenant AS tenant, j.fair_tag AS tag
        FROM {{schema}}.job AS j WHERE j.id = ANY(picked)
    ), c AS (
        SELECT p.tenant, count(*)::integer AS n FROM p GROUP BY p.tenant
    ), best AS (
        SELECT b.id, c.tenant, b.fair_tag AS tag
        FROM c
        CROSS JOIN LATERAL (
            SELECT j.id, j.fair_tag FROM {{schema}}.job AS j
            WHERE j.queue = claim_queue AND j.fair_tenant = c.tenant
              AND j.state = 'available' AND j.fair_tag >= clock
              AND (j.expires_at IS NULL OR j.expires_at > now())
            ORDER BY j.priority, j.run_at, j.id
            LIMIT c.n
            FOR UPDATE SKIP LOCKED
        ) AS b
    ), others AS (
        -- Picked and not among the best, by tag: the first of them fill the tenant's
        -- places the best did not (jobs it could not lock), the rest wait.
        SELECT p.id, p.tenant,
               row_number() OVER (PARTITION BY p.tenant ORDER BY p.tag, p.id) AS k,
               c.n - (SELECT count(*) FROM best AS b WHERE b.tenant = p.tenant) AS spare
        FROM p JOIN c ON c.tenant = p.tenant
        WHERE p.id NOT IN (SELECT b.id FROM best AS b)
    ), passed AS (
        SELECT o.id, o.tenant, row_number() OVER (PARTITION BY o.tenant ORDER BY o.k) AS k
        FROM others AS o WHERE o.k > o.spare
    ), incoming AS (
        SELECT b.id, b.tenant, b.tag,
               row_number() OVER (PARTITION BY b.tenant ORDER BY b.tag, b.id) AS k
        FROM best AS b WHERE b.id NOT IN (SELECT p.id FROM p)
    ), handed AS (
        UPDATE {{schema}}.job AS j SET fair_tag = i.tag
        FROM passed AS s JOIN incoming AS i ON i.tenant = s.tenant AND i.k = s.k
        WHERE j.id = s.id
        RETURNING j.id
    )
    SELECT ARRAY(SELECT b.id FROM best AS b
                 UNION ALL
                 SELECT o.id FROM others AS o WHERE o.k <= o.spare)
$$;

ALTER FUNCTION {{schema}}.job_claim_flow(text, integer, text, interval, bigint[])
    RENAME TO job_claim_limited;

-- job_claim_flow of 0021: the claim of a queue with limits or groups; a queue whose
-- only limit is fair = true claims through job_claim_fair (held_by always NULL).
CREATE FUNCTION {{schema}}.job_claim_flow(
    claim_queue text, wanted integer, claimer text, lease interval, ended bigint[]
)
RETURNS TABLE (id bigint, fence bigint, kind text, queue text, attempt integer,
               max_attempts integer, crashes integer, priority smallint, tenant text,
               enqueued_at timestamptz, scheduled_at timestamptz, args text,
               waited_s float8, depends_on bigint[], after_jobs bigint[],
               blockers_failed integer, trace_context text, held_by text)
LANGUAGE plpgsql
AS $$
BEGIN
    IF {{schema}}.queue_fair_only(claim_queue) THEN
        RETURN QUERY SELECT c.*, NULL::text
                     FROM {{schema}}.job_claim_fair(claim_queue, wanted, claimer, lease) AS c;
    ELSE
        RETURN QUERY SELECT c.*
                     FROM {{schema}}.job_claim_limited(claim_queue, wanted, claimer, lease,
                                                       ended) AS c;
    END IF;
END;
$$;
