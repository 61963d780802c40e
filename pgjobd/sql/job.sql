-- Queries on jobs, for the client. "{{schema}}" is the configured schema.

-- name: job_enqueue
-- One job through the SQL function; the args travel as JSON text, so the size limit
-- applies to exactly what was sent.
-- $1 kind, $2 args (JSON text), $3 queue, $4 priority, $5 run_at, $6 tenant,
-- $7 unique_key, $8 max_attempts, $9 delay, $10 on_conflict
SELECT {{schema}}.enqueue($1, $2::text::jsonb, $3, $4, $5, $6, $7, $8, $9, $10,
                          octet_length($2::text));

-- name: job_enqueue_many
-- The args travel as JSON text, so the size limit applies to exactly what was sent.
-- $1 kinds, $2 args (JSON texts), $3 queues, $4 priorities, $5 run_ats, $6 delays,
-- $7 tenants, $8 unique_keys, $9 max_attempts, $10 on_conflict
SELECT e.id
FROM {{schema}}.enqueue_many($1, $2::text[]::jsonb[], $3, $4, $5, $6, $7, $8, $9, $10,
                             ARRAY(SELECT octet_length(t) FROM unnest($2::text[]) AS t)) AS e
ORDER BY e.ord;

-- name: job_copy_prepare
-- Everything a COPY of $1 new jobs needs, in one round trip: the transaction's clock
-- (the same now() the rows' defaults will use), ids drawn in order, and the declared
-- defaults of the kinds in $2.
-- $1 job count, $2 distinct kinds
SELECT now() AS now,
       ARRAY(SELECT nextval('{{schema}}.job_id_seq') FROM generate_series(1, $1)) AS ids,
       ARRAY(SELECT k.name FROM {{schema}}.kind AS k WHERE k.name = ANY($2)) AS kinds,
       ARRAY(SELECT k.queue FROM {{schema}}.kind AS k WHERE k.name = ANY($2)) AS queues,
       ARRAY(SELECT k.priority FROM {{schema}}.kind AS k WHERE k.name = ANY($2)) AS priorities,
       ARRAY(SELECT k.max_attempts FROM {{schema}}.kind AS k WHERE k.name = ANY($2))
           AS max_attempts;

-- name: job_notify_ready
-- One wake-up per queue that received jobs it can run now.
-- $1 queues
SELECT pg_notify('{{schema}}.job_ready', q) FROM unnest($1::text[]) AS q;

-- name: job_get
-- A job by id: live from the hot table, else its final record.
-- $1 id
SELECT j.id, j.kind, j.queue, j.state::text AS state, j.attempt, j.max_attempts,
       j.priority, j.args, NULL::jsonb AS result, NULL::text AS reason, j.tenant,
       j.unique_key, j.run_at, j.enqueued_at, NULL::timestamptz AS finished_at,
       j.last_error
FROM {{schema}}.job AS j
WHERE j.id = $1
UNION ALL
SELECT h.id, h.kind, h.queue, h.state::text, h.attempt, h.max_attempts, h.priority,
       h.args, h.result, h.reason, h.tenant, h.unique_key, h.run_at, h.enqueued_at,
       h.finished_at, h.last_error
FROM {{schema}}.job_history AS h
WHERE h.id = $1
LIMIT 1;

-- name: job_attempt_errors
-- The failed attempts of a job, oldest first.
-- $1 id
SELECT a.attempt, concat_ws(': ', a.error_class, a.error_message) AS error, a.failed_at AS at
FROM {{schema}}.job_attempt AS a
WHERE a.job_id = $1
ORDER BY a.attempt, a.failed_at;
