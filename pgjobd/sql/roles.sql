-- Least-privilege group roles for one pgjobd schema, created by `pgjobd migrate --roles`
-- and re-granted by every later migrate while they exist. They are NOLOGIN: grant them
-- to your applications' login roles (GRANT {{schema}}_producer TO app_user).
--   {{schema}}_producer  enqueue (the SQL functions, and the Python client's COPY path)
--   {{schema}}_readonly  read every pgjobd table (dashboards, `pgjobd status`)
--   {{schema}}_admin     readonly + act on jobs, queues and schedules (the admin CLI)
--   {{schema}}_worker    what `pgjobd run` needs short of owning the schema
-- Migrations themselves (DDL) need the schema's owner.

DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['{{schema}}_producer', '{{schema}}_readonly',
                                     '{{schema}}_admin', '{{schema}}_worker'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        END IF;
    END LOOP;
END;
$$;

GRANT USAGE ON SCHEMA {{schema}}
    TO {{schema}}_producer, {{schema}}_readonly, {{schema}}_admin, {{schema}}_worker;

GRANT EXECUTE ON FUNCTION
    {{schema}}.enqueue(text, jsonb, text, integer, timestamptz, text, text, integer, interval, text,
                       integer, jsonb),
    {{schema}}.enqueue_many(text[], jsonb[], text[], integer[], timestamptz[], interval[], text[],
                            text[], integer[], text, integer[], jsonb[])
    TO {{schema}}_producer, {{schema}}_admin, {{schema}}_worker;
GRANT SELECT ON {{schema}}.migration, {{schema}}.kind TO {{schema}}_producer;
-- Only the columns the client's COPY path writes: the rest (attempt, owner, fence,
-- lease, enqueued_at...) keep their defaults, which every member can work with.
REVOKE INSERT ON {{schema}}.job FROM {{schema}}_producer;
GRANT INSERT (id, state, queue, kind, priority, run_at, args, max_attempts, tenant,
               trace_context)
    ON {{schema}}.job TO {{schema}}_producer;
GRANT USAGE ON SEQUENCE {{schema}}.job_id_seq TO {{schema}}_producer;

GRANT SELECT ON ALL TABLES IN SCHEMA {{schema}}
    TO {{schema}}_readonly, {{schema}}_admin, {{schema}}_worker;

GRANT INSERT, UPDATE, DELETE ON {{schema}}.job, {{schema}}.queue, {{schema}}.cron
    TO {{schema}}_admin, {{schema}}_worker;
GRANT INSERT ON {{schema}}.job_history, {{schema}}.job_attempt
    TO {{schema}}_admin, {{schema}}_worker;
GRANT INSERT, UPDATE, DELETE ON {{schema}}.member, {{schema}}.leader, {{schema}}.kind
    TO {{schema}}_worker;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {{schema}} TO {{schema}}_admin, {{schema}}_worker;
GRANT EXECUTE ON FUNCTION {{schema}}.partitions_ensure(integer) TO {{schema}}_worker;

-- The admin CLI's audit trail, and retry/redrive, which move final records back.
GRANT INSERT ON {{schema}}.audit TO {{schema}}_admin;
GRANT DELETE ON {{schema}}.job_history TO {{schema}}_admin;
