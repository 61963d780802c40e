-- job_group_heads (migration 0007) without its final ORDER BY: the sort made the loose
-- index scan walk up to scan_limit groups on every grouped claim, however few heads it
-- needed. Same signature and results (the caller orders the heads by `turn`).
-- "{{schema}}" is replaced by the configured schema name.

CREATE OR REPLACE FUNCTION {{schema}}.job_group_heads(
    claim_queue text, after_key text, upto_key text, wanted integer, skip_kinds text[],
    scan_limit integer
)
RETURNS TABLE (id bigint, kind text, priority smallint, run_at timestamptz, group_key text,
               turn integer)
LANGUAGE sql
STABLE
AS $$
    WITH RECURSIVE keys(g, n) AS (
        (SELECT j.group_key, 1 FROM {{schema}}.job AS j
         WHERE j.queue = claim_queue AND j.group_key > after_key
         ORDER BY j.group_key LIMIT 1)
        UNION ALL
        SELECT (SELECT j.group_key FROM {{schema}}.job AS j
                WHERE j.queue = claim_queue AND j.group_key > k.g
                ORDER BY j.group_key LIMIT 1), k.n + 1
        FROM keys AS k
        WHERE k.g IS NOT NULL AND k.n < scan_limit AND (upto_key IS NULL OR k.g < upto_key)
    )
    SELECT h.id, h.kind, h.priority, h.run_at, k.g, k.n
    FROM keys AS k
    CROSS JOIN LATERAL (
        SELECT j.id, j.state, j.kind, j.priority, j.run_at FROM {{schema}}.job AS j
        WHERE j.queue = claim_queue AND j.group_key = k.g
        ORDER BY j.priority, j.id LIMIT 1
    ) AS h
    WHERE k.g IS NOT NULL AND (upto_key IS NULL OR k.g <= upto_key)
      AND h.state = 'available' AND h.kind <> ALL(skip_kinds)
      AND NOT EXISTS (SELECT FROM {{schema}}.job AS r
                      WHERE r.queue = claim_queue AND r.group_key = k.g
                        AND r.state = 'running')
    -- No ORDER BY: sorting would walk every group before the first row; the walk
    -- yields groups in key order, and `turn` numbers them for the caller.
    LIMIT wanted
$$;
