-- Least-privilege group roles for one pgjobd schema, created by `pgjobd migrate --roles`
-- and re-granted by every later migrate while they exist. They are NOLOGIN: grant them
-- to your applications' login roles (GRANT {{schema}}_producer TO app_user).
--   {{schema}}_producer    enqueue (the SQL functions, and the Python client's COPY path)
--                          and read jobs back (Client.job)
--   {{schema}}_readonly    read every pgjobd table (dashboards, `pgjobd status`)
--   {{schema}}_admin       readonly + act on jobs, queues and schedules (the admin CLI)
--   {{schema}}_worker      what `pgjobd run` needs short of owning the schema
--   {{schema}}_maintainer  owns the job tables (job, job_history, job_attempt and the
--                          partitions): never granted to a login. {{schema}}_worker is
--                          NOINHERIT and a member of it, so a worker login does not
--                          hold its rights but may SET ROLE to it: the leader does, for
--                          the three statements that need a table's owner and cannot
--                          run in a function (DETACH PARTITION CONCURRENTLY, REINDEX and
--                          DROP INDEX CONCURRENTLY). See docs/decisions.md, issue 14.
-- Migrations themselves (DDL) need the schema's owner. The privilege matrix these
-- grants must give is tests/integration/test_roles.py's ROLE_MATRIX.

DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['{{schema}}_producer', '{{schema}}_readonly',
                                     '{{schema}}_admin', '{{schema}}_worker',
                                     '{{schema}}_maintainer'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        END IF;
    END LOOP;
    -- Whoever migrates must be able to give the maintainer the tables (and to act as
    -- it in partitions_ensure): a superuser already may.
    IF NOT (SELECT r.rolsuper FROM pg_roles AS r WHERE r.rolname = current_user) THEN
        EXECUTE format('GRANT %I TO %I', '{{schema}}_maintainer', current_user);
    END IF;
END;
$$;
ALTER ROLE {{schema}}_worker NOINHERIT;
GRANT {{schema}}_maintainer TO {{schema}}_worker;

-- The job tables, their partitions (and with them the identity sequence and every
-- index) belong to the maintainer.
ALTER TABLE {{schema}}.job OWNER TO {{schema}}_maintainer;
ALTER TABLE {{schema}}.job_history OWNER TO {{schema}}_maintainer;
ALTER TABLE {{schema}}.job_attempt OWNER TO {{schema}}_maintainer;
DO $$
DECLARE
    part record;
BEGIN
    FOR part IN
        SELECT c.relname FROM pg_inherits AS i
        JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent IN ('{{schema}}.job_history'::regclass,
                              '{{schema}}.job_attempt'::regclass)
          AND c.relowner <> '{{schema}}_maintainer'::regrole
    LOOP
        EXECUTE format('ALTER TABLE %I.%I OWNER TO %I', '{{schema}}', part.relname,
                       '{{schema}}_maintainer');
    END LOOP;
END;
$$;

GRANT USAGE ON SCHEMA {{schema}}
    TO {{schema}}_producer, {{schema}}_readonly, {{schema}}_admin, {{schema}}_worker,
       {{schema}}_maintainer;

-- Functions are executable by PUBLIC unless revoked: grant each to whom calls it.
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {{schema}} FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text, text, integer, interval, text,
                       integer, text, bigint[], timestamptz, interval, interval, bigint[],
                       jsonb),
    {{schema}}.enqueue_many(text[], jsonb[], text[], integer[], timestamptz[], interval[], text[],
                            text[], integer[], text, integer[], text[], text[], timestamptz[],
                            interval[], interval[], text[], jsonb[]),
    -- The client's COPY path admits its batch through this one (max_depth, groups).
    {{schema}}.queue_admit(text[], integer[], boolean[]),
    -- job's CHECK on trace_context (migration 0012), run by whoever writes a job row.
    {{schema}}.job_trace_context_ok(jsonb)
    TO {{schema}}_producer, {{schema}}_admin, {{schema}}_worker;
-- Read into the statements that call them (the COPY path, completion, the reaper,
-- admin cancel), which run with the caller's rights.
GRANT EXECUTE ON FUNCTION
    {{schema}}.job_defaults(text, smallint, integer, text, integer, timestamptz, interval,
                            integer)
    TO {{schema}}_producer, {{schema}}_admin, {{schema}}_worker;
GRANT EXECUTE ON FUNCTION
    {{schema}}.job_move(bigint[], bigint[], text[], text[], jsonb[], boolean[], text[]),
    -- What the members of v0.1.0 call instead, through a rolling upgrade (migration 0020).
    {{schema}}.job_finish(anyarray, text[], text[], jsonb[], boolean[], text[]),
    -- Called by job_move: releases or fails the dependants (migration 0010).
    {{schema}}.job_settle(bigint[], text[]),
    {{schema}}.job_end_reason(text, integer, integer, integer, integer, boolean)
    TO {{schema}}_admin, {{schema}}_worker;
-- The dead-letter list's fingerprints (migration 0010), read with the reader's rights.
GRANT EXECUTE ON FUNCTION {{schema}}.job_fingerprint(bigint)
    TO {{schema}}_readonly, {{schema}}_admin, {{schema}}_worker;
GRANT EXECUTE ON FUNCTION
    {{schema}}.partitions_ensure(integer),
    {{schema}}.partition_drop(text, text)
    TO {{schema}}_worker;
-- Flow control (migration 0007): the limited claim and what it calls (with the
-- worker's rights), and the leader's depth recount.
GRANT EXECUTE ON FUNCTION
    {{schema}}.job_claim_flow(text, integer, text, interval),
    {{schema}}.job_claim_flow(text, integer, text, interval, bigint[]),
    {{schema}}.flow_reserve(text, integer, text, bigint[], smallint),
    {{schema}}.queue_reservable(text),
    {{schema}}.job_group_heads(text, text, text, integer, text[], integer),
    {{schema}}.flow_lock(text),
    {{schema}}.flow_rate_room(text, integer, interval, timestamptz, integer),
    {{schema}}.flow_rate_take(text, interval, timestamptz, integer),
    {{schema}}.queue_depth_recount(text[]),
    {{schema}}.fair_tenant_mark(text),
    {{schema}}.job_fair_tenants(text, text, text, integer),
    -- A queue whose only limit is fair = true (migration 0024).
    {{schema}}.job_claim_limited(text, integer, text, interval, bigint[]),
    {{schema}}.job_claim_fair(text, integer, text, interval),
    {{schema}}.queue_fair_only(text),
    {{schema}}.fair_scan_range(text, integer),
    {{schema}}.fair_tag_fill(text),
    {{schema}}.fair_best_of_tenants(text, bigint[], float8),
    -- A queue whose only limit is its global_concurrency (migration 0025).
    {{schema}}.flow_allocate(text, text, bigint[], integer),
    {{schema}}.job_claim_allocated(text, integer, text, interval, bigint[], smallint,
                                   timestamptz, bigint)
    TO {{schema}}_worker;
-- The dead-job groups' key (migration 0019: `dlq list` and the console), read with the reader's rights.
GRANT EXECUTE ON FUNCTION {{schema}}.dead_group_key(text, text)
    TO {{schema}}_readonly, {{schema}}_admin;
-- The COPY path's round trip before its COPY, and what it calls, with the caller's
-- rights.
GRANT EXECUTE ON FUNCTION
    {{schema}}.job_copy_prepare(text[], text[], integer[], timestamptz[], interval[],
                                integer[], interval[], timestamptz[], integer[], boolean[],
                                integer),
    {{schema}}.queue_admit_needed(boolean)
    TO {{schema}}_producer, {{schema}}_admin, {{schema}}_worker;
-- (Trigger functions need no EXECUTE: a trigger fires whoever writes.)

GRANT SELECT ON {{schema}}.migration, {{schema}}.kind TO {{schema}}_producer;
-- queue_admit_needed, on the COPY path: which queues have a max_depth.
GRANT SELECT (name, max_depth) ON {{schema}}.queue TO {{schema}}_producer;
-- Client.job: the job, its final record and its errors (only its tenant's under --rls).
GRANT SELECT ON {{schema}}.job, {{schema}}.job_history, {{schema}}.job_attempt
    TO {{schema}}_producer;
-- Only the columns the client's COPY path writes: the rest (attempt, owner, fence,
-- lease, enqueued_at...) keep their defaults, which every member can work with.
REVOKE INSERT ON {{schema}}.job FROM {{schema}}_producer;
GRANT INSERT (id, state, queue, kind, priority, run_at, args, max_attempts, tenant, group_key,
               expires_at, trace_context)
    ON {{schema}}.job TO {{schema}}_producer;
GRANT USAGE ON SEQUENCE {{schema}}.job_id_seq TO {{schema}}_producer;

GRANT SELECT ON ALL TABLES IN SCHEMA {{schema}}
    TO {{schema}}_readonly, {{schema}}_admin, {{schema}}_worker;

GRANT INSERT, UPDATE, DELETE ON {{schema}}.job, {{schema}}.queue, {{schema}}.cron
    TO {{schema}}_admin, {{schema}}_worker;
GRANT INSERT ON {{schema}}.job_history, {{schema}}.job_attempt
    TO {{schema}}_admin, {{schema}}_worker;
-- Finishing a job releases its dependants (job_settle, called by job_move).
GRANT DELETE ON {{schema}}.job_dependency TO {{schema}}_admin, {{schema}}_worker;
GRANT INSERT, UPDATE, DELETE ON {{schema}}.member, {{schema}}.leader, {{schema}}.kind
    TO {{schema}}_worker;
-- Flow control: the limited claim's rate log, and the leader's depth recount.
GRANT INSERT, UPDATE, DELETE ON {{schema}}.flow_start, {{schema}}.flow_reservation
    TO {{schema}}_worker;
-- Fair queues (migration 0014): the claims' passes, and the members' [tenants] weights.
GRANT INSERT, UPDATE, DELETE ON {{schema}}.fair_pass, {{schema}}.tenant_weight,
    {{schema}}.fair_finish
    TO {{schema}}_worker;
-- The leader's queue sampler records and trims the console's chart samples.
GRANT INSERT, DELETE ON {{schema}}.queue_sample TO {{schema}}_worker;
-- The leader's queue_stats role publishes its live counts (the console's overview).
GRANT INSERT, UPDATE, DELETE ON {{schema}}.queue_count TO {{schema}}_worker;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {{schema}} TO {{schema}}_admin, {{schema}}_worker;

-- The admin CLI's audit trail, retry/redrive (which move final records back) and scrub
-- (which overwrites payloads and errors in final records).
GRANT INSERT ON {{schema}}.audit TO {{schema}}_admin;
GRANT DELETE ON {{schema}}.job_history TO {{schema}}_admin;
GRANT UPDATE (args, result, last_error) ON {{schema}}.job_history TO {{schema}}_admin;
GRANT UPDATE (error_message, traceback) ON {{schema}}.job_attempt TO {{schema}}_admin;
