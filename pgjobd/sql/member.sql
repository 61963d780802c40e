-- Fleet presence and declared kinds. "{{schema}}" is the configured schema.

-- name: member_join
-- $1 member id, $2 host, $3 pid, $4 version, $5 queues
INSERT INTO {{schema}}.member (id, host, pid, version, queues)
VALUES ($1, $2, $3, $4, $5);

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
-- Records each kind's effective defaults as this member's handlers declare them, so
-- enqueues that name only the kind land in the right queue (the newest member wins),
-- and the args fields its handler redacts, so that the admin commands mask them.
-- $1 kinds, $2 queues, $3 priorities, $4 max_attempts, $5 timeouts (s), $6 redacted
-- fields (a JSON array of names per kind), $7 member id
INSERT INTO {{schema}}.kind AS k (name, queue, priority, max_attempts, timeout_s,
                                  declared_by, updated_at, redact)
SELECT d.name, d.queue, d.priority, d.max_attempts, d.timeout_s, $7, now(),
       ARRAY(SELECT jsonb_array_elements_text(d.redact))
FROM unnest($1::text[], $2::text[], $3::smallint[], $4::integer[], $5::float8[],
            $6::text[]::jsonb[])
     AS d(name, queue, priority, max_attempts, timeout_s, redact)
ON CONFLICT (name) DO UPDATE
SET queue = excluded.queue, priority = excluded.priority,
    max_attempts = excluded.max_attempts, timeout_s = excluded.timeout_s,
    declared_by = excluded.declared_by, updated_at = excluded.updated_at,
    redact = excluded.redact
WHERE (k.queue, k.priority, k.max_attempts, k.timeout_s, k.redact)
      IS DISTINCT FROM (excluded.queue, excluded.priority, excluded.max_attempts,
                        excluded.timeout_s, excluded.redact);

-- name: partitions_ensure
-- Daily job_history / job_attempt partitions from today through today + $1.
-- $1 days ahead
SELECT {{schema}}.partitions_ensure($1);
