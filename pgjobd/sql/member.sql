-- Fleet presence and declared kinds. "{{schema}}" is the configured schema.

-- name: member_join
-- Idempotent: a start-up that retries it after an answer lost with its connection
-- finds its own row.
-- $1 member id, $2 host, $3 pid, $4 version, $5 queues
INSERT INTO {{schema}}.member (id, host, pid, version, queues)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO NOTHING;

-- name: member_heartbeat
-- Returns false if the member row is gone (removed as long dead by the reaper).
-- $1 member id, $2 queues
UPDATE {{schema}}.member SET heartbeat_at = now(), queues = $2
WHERE id = $1
RETURNING true;

-- name: member_leave
-- $1 member id
DELETE FROM {{schema}}.member WHERE id = $1;

-- name: kind_declare_many
-- Records each kind's effective defaults and fleet-wide limits as this member's
-- handlers declare them, so enqueues that name only the kind land in the right queue
-- and every claim honours the kind's limits (the newest member wins), and the args
-- fields its handler redacts, so that the admin commands mask them.
-- $1 kinds, $2 queues, $3 priorities, $4 max_attempts, $5 timeouts (s),
-- $6 global concurrencies, $7 rate limits (starts), $8 rate windows, $9 redacted fields
-- (a JSON array of names per kind), $10 member id
INSERT INTO {{schema}}.kind AS k (name, queue, priority, max_attempts, timeout_s,
                                  declared_by, updated_at, global_concurrency, rate_limit,
                                  rate_window, redact)
SELECT d.name, d.queue, d.priority, d.max_attempts, d.timeout_s, $10, now(),
       d.global_concurrency, d.rate_limit, d.rate_window,
       ARRAY(SELECT jsonb_array_elements_text(d.redact))
FROM unnest($1::text[], $2::text[], $3::smallint[], $4::integer[], $5::float8[],
            $6::integer[], $7::integer[], $8::interval[], $9::text[]::jsonb[])
     AS d(name, queue, priority, max_attempts, timeout_s, global_concurrency, rate_limit,
          rate_window, redact)
ON CONFLICT (name) DO UPDATE
SET queue = excluded.queue, priority = excluded.priority,
    max_attempts = excluded.max_attempts, timeout_s = excluded.timeout_s,
    declared_by = excluded.declared_by, updated_at = excluded.updated_at,
    global_concurrency = excluded.global_concurrency, rate_limit = excluded.rate_limit,
    rate_window = excluded.rate_window, redact = excluded.redact
WHERE (k.queue, k.priority, k.max_attempts, k.timeout_s, k.global_concurrency,
       k.rate_limit, k.rate_window, k.redact)
      IS DISTINCT FROM (excluded.queue, excluded.priority, excluded.max_attempts,
                        excluded.timeout_s, excluded.global_concurrency,
                        excluded.rate_limit, excluded.rate_window, excluded.redact);

-- name: queue_limits_write
-- Writes the fleet-wide limits of the queues this member serves, as its config says
-- (contract §9: the last member to start or reload wins). Returns, for each queue
-- whose limits this changed from what another member wrote, those previous values,
-- so that the disagreement is logged.
-- $1 queues, $2 global concurrencies, $3 rate limits (starts), $4 rate windows,
-- $5 max depths, $6 member id
WITH given AS (
    SELECT *
    FROM unnest($1::text[], $2::integer[], $3::integer[], $4::interval[], $5::bigint[])
         AS g(name, global_concurrency, rate_limit, rate_window, max_depth)
), before AS (
    SELECT q.name, q.global_concurrency, q.rate_limit, q.rate_window, q.max_depth,
           q.limits_by
    FROM {{schema}}.queue AS q
    WHERE q.name IN (SELECT g.name FROM given AS g)
), written AS (
    INSERT INTO {{schema}}.queue AS q (name, global_concurrency, rate_limit, rate_window,
                                       max_depth, limits_by, limits_at)
    SELECT g.name, g.global_concurrency, g.rate_limit, g.rate_window, g.max_depth, $6, now()
    FROM given AS g
    ORDER BY g.name
    ON CONFLICT (name) DO UPDATE
    SET global_concurrency = excluded.global_concurrency, rate_limit = excluded.rate_limit,
        rate_window = excluded.rate_window, max_depth = excluded.max_depth,
        limits_by = excluded.limits_by, limits_at = excluded.limits_at
    WHERE (q.global_concurrency, q.rate_limit, q.rate_window, q.max_depth)
          IS DISTINCT FROM (excluded.global_concurrency, excluded.rate_limit,
                            excluded.rate_window, excluded.max_depth)
    RETURNING q.name, q.max_depth
)
SELECT b.name, b.global_concurrency, b.rate_limit, b.rate_window, b.max_depth, b.limits_by
FROM before AS b
JOIN written AS w ON w.name = b.name
WHERE b.limits_by IS NOT NULL AND b.limits_by <> $6;

-- name: queue_depth_recount
-- Recounts the depth estimate of the queues with a max_depth among $1 (NULL: all of
-- them): see queue_depth_recount in migration 0007. Returns how many it recounted.
-- $1 queues or NULL
SELECT {{schema}}.queue_depth_recount($1::text[]);

-- name: partitions_ensure
-- Daily job_history / job_attempt partitions from today through today + $1.
-- $1 days ahead
SELECT {{schema}}.partitions_ensure($1);
