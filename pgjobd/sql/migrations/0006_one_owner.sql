-- Schema v6: one home for the rules several statements applied each on their own.
-- "{{schema}}" is replaced by the configured schema name. New functions only: the
-- tables are unchanged.

-- The final records of jobs just deleted from the hot table: the one statement that
-- writes job_history. Every path that finishes a job calls it with the rows its
-- DELETE returned (completion, failure, the reaper, admin cancel). Per job: the reason
-- it ended (NULL: completed; 'cancelled': cancelled; any other: dead), its last error
-- and its result; a NULL array leaves that field NULL for every job. The owner and all
-- else come from the job row. Returns how many records it wrote.
-- `jobs` is declared anyarray (always {{schema}}.job[]) so that the signature names no
-- schema: the member's schema check compares signatures across schema names.
CREATE FUNCTION {{schema}}.job_finish(
    jobs        anyarray,
    reasons     text[]  DEFAULT NULL,
    last_errors text[]  DEFAULT NULL,
    results     jsonb[] DEFAULT NULL
)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    written integer;
BEGIN
    INSERT INTO {{schema}}.job_history (id, finished_at, run_at, enqueued_at, attempted_at,
        attempt, max_attempts, priority, state, reason, queue, kind, tenant, unique_key,
        owner, last_error, args, result)
    SELECT j.id, now(), j.run_at, j.enqueued_at, j.attempted_at, j.attempt, j.max_attempts,
           j.priority,
           CASE WHEN reasons[j.ordinality] IS NULL THEN 'completed'
                WHEN reasons[j.ordinality] = 'cancelled' THEN 'cancelled'
                ELSE 'dead' END::{{schema}}.job_state,
           reasons[j.ordinality], j.queue, j.kind, j.tenant, j.unique_key, j.owner,
           last_errors[j.ordinality], j.args, results[j.ordinality]
    FROM unnest(jobs) WITH ORDINALITY AS j;
    GET DIAGNOSTICS written = ROW_COUNT;
    RETURN written;
END;
$$;

-- Why an attempt that did not complete ends its job, or NULL when the job runs again:
-- the one rule for the completer's failures (job_fail_many) and the reaper's expired
-- leases (job_reap_expired, outcome 'lease_expired'). In order: an admin asked to
-- cancel it; the handler discarded it or its args were invalid; it crashed (or lost
-- its lease) for the max_crashes-th time; a snooze or give-back never ends it; else
-- its attempts are spent. attempt, crashes: the job's, for the attempt that ended.
-- Inlined into the statements that call it (a single SELECT, IMMUTABLE).
CREATE FUNCTION {{schema}}.job_end_reason(
    outcome text, attempt integer, max_attempts integer, crashes integer,
    max_crashes integer, cancel_requested boolean
)
RETURNS text
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN cancel_requested THEN 'cancelled'
        WHEN outcome IN ('discarded', 'invalid_args') THEN outcome
        WHEN outcome IN ('crashed', 'lease_expired') AND crashes + 1 >= max_crashes
            THEN 'worker_crash'
        WHEN outcome IN ('snoozed', 'given_back') THEN NULL
        WHEN attempt >= max_attempts
            THEN CASE WHEN outcome = 'unknown_kind' THEN 'unknown_kind'
                      ELSE 'attempts_exhausted' END
    END
$$;
