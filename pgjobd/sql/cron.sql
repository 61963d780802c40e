-- The cron ticker's statements. "{{schema}}" is the configured schema.
--
-- Fenced like leader.sql's role statements: $1 is the leader's term; a statement
-- changes something only while the term is open, and the ticker runs each in a
-- transaction that commits only if the term still holds then (leader_term_holds).
--
-- The clock is the database's: every statement that needs "now" takes it as
-- coalesce($n::timestamptz, now()), where $n is NULL except in tests.
--
-- A schedule's slots are counted after its anchor, coalesce(last_slot, updated_at):
-- last_slot is the newest slot the ticker dealt with (fired, or skipped under
-- catch_up = 'none'); a NULL last_slot means "fresh", and the anchor is then the time
-- the schedule was created or last changed in schedule or time zone, so that a new or
-- rescheduled entry never fires for its past. Whoever writes cron rows (the sync below,
-- a future admin API) keeps to that: a new schedule, time zone, or a re-enabled row gets
-- last_slot = NULL and updated_at = now.

-- name: cron_sync
-- Makes the 'config' rows match the config file's [[cron]] entries: inserts new ones,
-- updates changed ones (a changed schedule or time zone starts afresh: last_slot NULL),
-- deletes 'config' rows no longer in the file. An 'api' row whose name the file uses is
-- taken over by the file. `enabled` of existing rows is left alone (an admin's pause
-- survives restarts). Returns whether the fence held and what changed.
-- $1 term, $2 names, $3 schedules, $4 time zones, $5 kinds, $6 args (jsonb[]),
-- $7 queues (NULL elements: the kind's), $8 catch-up policies, $9 now override
-- (NULL: now())
WITH fence AS (
    SELECT EXISTS (SELECT FROM {{schema}}.leader AS t
                   WHERE t.term = $1 AND t.resigned_at IS NULL) AS holds
), entry AS (
    SELECT e.*
    FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[], $7::text[],
                $8::text[]) AS e(name, schedule, timezone, kind, args, queue, catch_up)
    WHERE (SELECT holds FROM fence)
), taken_over AS (
    SELECT c.name FROM {{schema}}.cron AS c JOIN entry AS e USING (name)
    WHERE c.source = 'api'
), upserted AS (
    INSERT INTO {{schema}}.cron AS c (name, schedule, timezone, kind, args, queue, catch_up,
                                      source, enabled, last_slot, created_at, updated_at)
    SELECT e.name, e.schedule, e.timezone, e.kind, e.args, e.queue, e.catch_up, 'config',
           true, NULL, coalesce($9::timestamptz, now()), coalesce($9::timestamptz, now())
    FROM entry AS e
    ON CONFLICT (name) DO UPDATE
    SET schedule = excluded.schedule, timezone = excluded.timezone, kind = excluded.kind,
        args = excluded.args, queue = excluded.queue, catch_up = excluded.catch_up,
        source = 'config',
        last_slot = CASE WHEN (c.schedule, c.timezone) = (excluded.schedule, excluded.timezone)
                         THEN c.last_slot END,
        updated_at = excluded.updated_at
    WHERE (c.schedule, c.timezone, c.kind, c.args, c.queue, c.catch_up, c.source)
          IS DISTINCT FROM (excluded.schedule, excluded.timezone, excluded.kind,
                            excluded.args, excluded.queue, excluded.catch_up, 'config')
    RETURNING c.name, c.xmax = 0 AS inserted
), removed AS (
    DELETE FROM {{schema}}.cron AS c
    WHERE c.source = 'config' AND c.name <> ALL ($2::text[])
      AND (SELECT holds FROM fence)
    RETURNING c.name
)
SELECT (SELECT holds FROM fence) AS fence_holds,
       ARRAY(SELECT name FROM upserted WHERE inserted ORDER BY name) AS added,
       ARRAY(SELECT name FROM upserted WHERE NOT inserted ORDER BY name) AS changed,
       ARRAY(SELECT name FROM removed ORDER BY name) AS removed,
       ARRAY(SELECT name FROM taken_over ORDER BY name) AS taken_over;

-- name: cron_due
-- The enabled schedules and the database's now, which every slot decision of the tick
-- uses. Always one row at least: with no schedules, one whose name is NULL.
-- $1 now override (NULL: now())
SELECT t.now, c.name, c.schedule, c.timezone, c.catch_up, c.source, c.last_slot,
       c.updated_at, coalesce(c.last_slot, c.updated_at) AS anchor
FROM (SELECT coalesce($1::timestamptz, now()) AS now) AS t
LEFT JOIN {{schema}}.cron AS c ON c.enabled
ORDER BY c.name;

-- name: cron_fire
-- Moves one schedule's last_slot from what the ticker read to the newest slot it
-- dealt with and, only if that compare-and-set matched, enqueues one job per slot to
-- fire, each with run_at = its slot (so the handler's scheduled_at is the slot) and the
-- unique key cron:<name>:<slot>. Two leaders overlapping on one slot: the second's
-- update waits for the first's row lock, then no longer matches (last_slot moved), so
-- it enqueues nothing; a completed job, which frees its unique key, cannot fire its
-- slot again for the same reason. A schedule edited since it was read (updated_at,
-- schedule, time zone) does not match either: the next tick reads it afresh.
-- Without a queue the kind's declared queue applies (enqueue does that).
-- $1 term, $2 name, $3 last_slot as read (NULL: it was NULL), $4 updated_at as read,
-- $5 schedule as read, $6 time zone as read, $7 new last_slot, $8 slots to fire
-- (timestamptz[], oldest first), $9 their unique keys
WITH advanced AS (
    UPDATE {{schema}}.cron AS c SET last_slot = $7
    WHERE c.name = $2 AND c.enabled
      AND c.last_slot IS NOT DISTINCT FROM $3::timestamptz AND c.updated_at = $4
      AND c.schedule = $5 AND c.timezone = $6
      AND EXISTS (SELECT FROM {{schema}}.leader AS t
                  WHERE t.term = $1 AND t.resigned_at IS NULL)
    RETURNING c.kind, c.args, c.queue
)
SELECT EXISTS (SELECT FROM advanced) AS advanced,
       ARRAY(SELECT {{schema}}.enqueue(a.kind, a.args, queue => a.queue, run_at => s.slot,
                                       unique_key => s.unique_key)
             FROM advanced AS a
             CROSS JOIN unnest($8::timestamptz[], $9::text[]) WITH ORDINALITY
                 AS s(slot, unique_key, ord)
             ORDER BY s.ord) AS job_ids;

-- name: cron_trigger
-- `pgjobd cron trigger NAME`: enqueues one job of the schedule now, outside its slots
-- and without touching last_slot, under a unique key of its own
-- (cron:<name>:trigger:<now>), so it never stands in for, or is blocked by, a slot's job.
-- Not a role statement: not fenced. No row when there is no such schedule.
-- $1 name, $2 now override (NULL: now())
SELECT {{schema}}.enqueue(
           c.kind, c.args, queue => c.queue, run_at => coalesce($2::timestamptz, now()),
           unique_key => 'cron:' || c.name || ':trigger:'
               || to_char(coalesce($2::timestamptz, clock_timestamp()) AT TIME ZONE 'UTC',
                          'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')) AS job_id
FROM {{schema}}.cron AS c
WHERE c.name = $1;
