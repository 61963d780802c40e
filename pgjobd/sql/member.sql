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
-- fields its handler redacts, so that the admin commands mask them. A kind's circuit
-- breaker keeps its state while it stays declared; a declaration without one closes it.
-- $1 kinds, $2 queues, $3 priorities, $4 max_attempts, $5 timeouts (s),
-- $6 global concurrencies, $7 rate limits (starts), $8 rate windows, $9 redacted fields
-- (a JSON array of names per kind), $10 breaker failures, $11 breaker windows,
-- $12 breaker cool-downs, $13 member id
INSERT INTO {{schema}}.kind AS k (name, queue, priority, max_attempts, timeout_s,
                                  declared_by, updated_at, global_concurrency, rate_limit,
                                  rate_window, redact, breaker_failures, breaker_window,
                                  breaker_cooldown)
SELECT d.name, d.queue, d.priority, d.max_attempts, d.timeout_s, $13, now(),
       d.global_concurrency, d.rate_limit, d.rate_window,
       ARRAY(SELECT jsonb_array_elements_text(d.redact)),
       d.breaker_failures, d.breaker_window, d.breaker_cooldown
FROM unnest($1::text[], $2::text[], $3::smallint[], $4::integer[], $5::float8[],
            $6::integer[], $7::integer[], $8::interval[], $9::text[]::jsonb[],
            $10::integer[], $11::interval[], $12::interval[])
     AS d(name, queue, priority, max_attempts, timeout_s, global_concurrency, rate_limit,
          rate_window, redact, breaker_failures, breaker_window, breaker_cooldown)
ON CONFLICT (name) DO UPDATE
SET queue = excluded.queue, priority = excluded.priority,
    max_attempts = excluded.max_attempts, timeout_s = excluded.timeout_s,
    declared_by = excluded.declared_by, updated_at = excluded.updated_at,
    global_concurrency = excluded.global_concurrency, rate_limit = excluded.rate_limit,
    rate_window = excluded.rate_window, redact = excluded.redact,
    breaker_failures = excluded.breaker_failures, breaker_window = excluded.breaker_window,
    breaker_cooldown = excluded.breaker_cooldown,
    breaker_limit = CASE WHEN excluded.breaker_failures IS NOT NULL THEN k.breaker_limit END,
    breaker_at = CASE WHEN excluded.breaker_failures IS NOT NULL THEN k.breaker_at END,
    breaker_probe = CASE WHEN excluded.breaker_failures IS NOT NULL THEN k.breaker_probe END,
    breaker_probe_attempt = CASE WHEN excluded.breaker_failures IS NOT NULL
                                 THEN k.breaker_probe_attempt END
WHERE (k.queue, k.priority, k.max_attempts, k.timeout_s, k.global_concurrency,
       k.rate_limit, k.rate_window, k.redact, k.breaker_failures, k.breaker_window,
       k.breaker_cooldown)
      IS DISTINCT FROM (excluded.queue, excluded.priority, excluded.max_attempts,
                        excluded.timeout_s, excluded.global_concurrency,
                        excluded.rate_limit, excluded.rate_window, excluded.redact,
                        excluded.breaker_failures, excluded.breaker_window,
                        excluded.breaker_cooldown);

-- name: queue_limits_write
-- Writes the fleet-wide limits of the queues this member serves, as its config says
-- (contract §9: the last member to start or reload wins). Returns, for each queue
-- whose limits this changed from what another member wrote, those previous values,
-- so that the disagreement is logged. A queue that becomes fair has its live
-- ungrouped jobs marked with their tenant here, in the same statement (fair_tenant:
-- see migration 0014), and its claims mark new ones from the highest id seen now.
-- $1 queues, $2 global concurrencies, $3 rate limits (starts), $4 rate windows,
-- $5 max depths, $6 tenant concurrencies, $7 fair, $8 member id
WITH given AS (
    SELECT *
    FROM unnest($1::text[], $2::integer[], $3::integer[], $4::interval[], $5::bigint[],
                $6::integer[], $7::boolean[])
         AS g(name, global_concurrency, rate_limit, rate_window, max_depth,
              tenant_concurrency, fair)
), before AS (
    SELECT q.name, q.global_concurrency, q.rate_limit, q.rate_window, q.max_depth,
           q.tenant_concurrency, q.fair, q.limits_by
    FROM {{schema}}.queue AS q
    WHERE q.name IN (SELECT g.name FROM given AS g)
), newly_fair AS (
    SELECT g.name FROM given AS g
    WHERE g.fair AND NOT coalesce((SELECT b.fair FROM before AS b WHERE b.name = g.name),
                                  false)
), marked AS (
    -- (EXISTS first: a one-time filter, so no other write reads the job table)
    UPDATE {{schema}}.job AS j SET fair_tenant = coalesce(j.tenant::text, '')
    WHERE EXISTS (SELECT FROM newly_fair) AND j.queue IN (SELECT n.name FROM newly_fair AS n)
      AND j.fair_tenant IS NULL AND j.group_key IS NULL
    RETURNING 1
), written AS (
    -- A queue that becomes fair: its claims mark jobs from the highest id now (and look
    -- again at the 2,000 below it, for transactions still running now).
    INSERT INTO {{schema}}.queue AS q (name, global_concurrency, rate_limit, rate_window,
                                       max_depth, tenant_concurrency, fair, limits_by,
                                       limits_at, fair_scanned, fair_settled, fair_scan_xmax)
    SELECT g.name, g.global_concurrency, g.rate_limit, g.rate_window, g.max_depth,
           g.tenant_concurrency, g.fair, $8, now(), m.top, greatest(m.top - 2000, 0),
           pg_snapshot_xmax(pg_current_snapshot())
    FROM given AS g
    CROSS JOIN (SELECT coalesce(max(j.id), 0) AS top FROM {{schema}}.job AS j) AS m
    ORDER BY g.name
    ON CONFLICT (name) DO UPDATE
    SET global_concurrency = excluded.global_concurrency, rate_limit = excluded.rate_limit,
        rate_window = excluded.rate_window, max_depth = excluded.max_depth,
        tenant_concurrency = excluded.tenant_concurrency, fair = excluded.fair,
        limits_by = excluded.limits_by, limits_at = excluded.limits_at,
        fair_scanned = CASE WHEN excluded.fair AND NOT q.fair THEN excluded.fair_scanned
                            ELSE q.fair_scanned END,
        fair_settled = CASE WHEN excluded.fair AND NOT q.fair THEN excluded.fair_settled
                            ELSE q.fair_settled END,
        fair_scan_xmax = CASE WHEN excluded.fair AND NOT q.fair THEN excluded.fair_scan_xmax
                              ELSE q.fair_scan_xmax END,
        fair_tenants = NULL  -- (the next fair claim finds the waiting tenants anew)
    WHERE (q.global_concurrency, q.rate_limit, q.rate_window, q.max_depth,
           q.tenant_concurrency, q.fair)
          IS DISTINCT FROM (excluded.global_concurrency, excluded.rate_limit,
                            excluded.rate_window, excluded.max_depth,
                            excluded.tenant_concurrency, excluded.fair)
    RETURNING q.name, q.max_depth
)
SELECT b.name, b.global_concurrency, b.rate_limit, b.rate_window, b.max_depth,
       b.tenant_concurrency, b.fair, b.limits_by
FROM before AS b
JOIN written AS w ON w.name = b.name
WHERE b.limits_by IS NOT NULL AND b.limits_by <> $8;

-- name: tenant_weights_write
-- Replaces the fleet's [tenants] weights with this member's (the last writer wins).
-- Returns, for each weight this changed or removed that another member had written,
-- the previous value, so that the disagreement is logged. Fair queues are told when a
-- weight changed.
-- $1 tenants, $2 weights, $3 member id
WITH given AS (
    SELECT * FROM unnest($1::text[], $2::integer[]) AS g(tenant, weight)
), before AS (
    SELECT w.tenant, w.weight, w.weights_by FROM {{schema}}.tenant_weight AS w
), removed AS (
    DELETE FROM {{schema}}.tenant_weight AS w
    WHERE w.tenant NOT IN (SELECT g.tenant FROM given AS g)
    RETURNING w.tenant
), written AS (
    INSERT INTO {{schema}}.tenant_weight AS w (tenant, weight, weights_by, weights_at)
    SELECT g.tenant, g.weight, $3, now() FROM given AS g ORDER BY g.tenant
    ON CONFLICT (tenant) DO UPDATE
    SET weight = excluded.weight, weights_by = excluded.weights_by,
        weights_at = excluded.weights_at
    WHERE w.weight IS DISTINCT FROM excluded.weight
    RETURNING w.tenant
), reweighed AS (
    -- Fair queues claiming by tag re-space the waiting jobs of the tenants whose weight
    -- changed, at their next claim (fair_tag_fill, migration 0024).
    UPDATE {{schema}}.queue AS q SET fair_reweigh = true
    WHERE q.fair AND NOT q.fair_reweigh
      AND (EXISTS (SELECT FROM removed) OR EXISTS (SELECT FROM written))
)
SELECT b.tenant, b.weight, b.weights_by
FROM before AS b
WHERE b.weights_by <> $3
  AND (b.tenant IN (SELECT r.tenant FROM removed AS r)
       OR b.tenant IN (SELECT x.tenant FROM written AS x))
ORDER BY b.tenant;

-- name: queue_depth_recount
-- Recounts the depth estimate of the queues with a max_depth among $1 (NULL: all of
-- them): see queue_depth_recount in migration 0007. Returns how many it recounted.
-- $1 queues or NULL
SELECT {{schema}}.queue_depth_recount($1::text[]);

-- name: partitions_ensure
-- Daily job_history / job_attempt partitions from today through today + $1.
-- $1 days ahead
SELECT {{schema}}.partitions_ensure($1);
