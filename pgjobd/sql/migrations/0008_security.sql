-- Schema v7: what least privilege, tenants and the audit trail need (issue 14).
-- "{{schema}}" is replaced by the configured schema name. Expand only: a function
-- replaced with the same signature, new functions, a trigger and a nullable column.

-- partitions_ensure as in 0001, except that a partition it creates takes its parent's
-- owner. `migrate --roles` makes the job tables the <schema>_maintainer role's, so that
-- a worker login can detach and drop expired partitions (see roles.sql); a partition
-- owned by whoever happened to create it could not be detached by that role.
CREATE OR REPLACE FUNCTION {{schema}}.partitions_ensure(days_ahead integer)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    day date;
    parent text;
    partition text;
    parent_owner name;
    created integer := 0;
BEGIN
    IF days_ahead IS NULL OR days_ahead < 0 OR days_ahead > 366 THEN
        RAISE EXCEPTION 'pgjobd: partitions_ensure: days_ahead must be from 0 to 366, got %',
            days_ahead USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR day IN
        SELECT d::date FROM generate_series((now() AT TIME ZONE 'UTC')::date,
                                            (now() AT TIME ZONE 'UTC')::date + days_ahead,
                                            interval '1 day') AS d
    LOOP
        FOREACH parent IN ARRAY ARRAY['job_history', 'job_attempt'] LOOP
            partition := parent || '_p' || to_char(day, 'YYYYMMDD');
            CONTINUE WHEN to_regclass(format('%I.%I', '{{schema}}', partition)) IS NOT NULL;
            BEGIN
                EXECUTE format(
                    'CREATE TABLE %I.%I PARTITION OF %I.%I FOR VALUES FROM (%L) TO (%L)',
                    '{{schema}}', partition, '{{schema}}', parent,
                    day::timestamp AT TIME ZONE 'UTC',
                    (day + 1)::timestamp AT TIME ZONE 'UTC');
                created := created + 1;
            EXCEPTION WHEN duplicate_table THEN
                CONTINUE;  -- another session created it first
            END;
            SELECT pg_get_userbyid(c.relowner) INTO parent_owner
            FROM pg_class AS c WHERE c.oid = format('%I.%I', '{{schema}}', parent)::regclass;
            IF parent_owner <> current_user THEN
                EXECUTE format('ALTER TABLE %I.%I OWNER TO %I', '{{schema}}', partition,
                               parent_owner);
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END;
$$;

-- Drops one partition of job_history or job_attempt that the partition rotator has
-- already detached (ALTER TABLE ... DETACH PARTITION CONCURRENTLY, which cannot run in
-- a function: the rotator runs it as <schema>_maintainer). Nothing else: the name must
-- be <parent>_pYYYYMMDD, the table a former partition of that parent in this schema,
-- and no longer attached. Returns false when there is no such table (dropped already).
-- SECURITY DEFINER, so that the leader needs no right to drop tables itself.
CREATE FUNCTION {{schema}}.partition_drop(parent text, partition text)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    detached boolean;
BEGIN
    IF parent IS NULL OR parent NOT IN ('job_history', 'job_attempt') THEN
        RAISE EXCEPTION 'pgjobd: partition_drop: parent must be job_history or job_attempt, '
            'got %', quote_nullable(parent) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF partition IS NULL OR partition !~ ('^' || parent || '_p[0-9]{8}$') THEN
        RAISE EXCEPTION 'pgjobd: partition_drop: % is not a partition name of %',
            quote_nullable(partition), parent USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT NOT c.relispartition INTO detached
    FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = '{{schema}}' AND c.relname = partition AND c.relkind = 'r';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT detached THEN
        RAISE EXCEPTION 'pgjobd: partition_drop: %.% is still attached; detach it first',
            '{{schema}}', partition USING ERRCODE = 'object_in_use';
    END IF;
    EXECUTE format('DROP TABLE %I.%I', '{{schema}}', partition);
    RETURN true;
END;
$$;

-- The tenant of a session that names one (SET pgjobd.tenant = 'acme', or
-- Client.connect(..., tenant="acme")): a job it enqueues without a tenant gets that
-- one, and a job for another tenant is refused. Every enqueue path inserts into the
-- hot table (the SQL functions, which run as their owner, and the client's COPY path),
-- so the rule lives here rather than in each of them. Sessions without a tenant (the
-- daemon, admins) are not affected: the trigger's WHEN skips them without a call.
CREATE FUNCTION {{schema}}.job_tenant_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    session_tenant text := current_setting('pgjobd.tenant', true);
BEGIN
    IF NEW.tenant IS NULL THEN
        NEW.tenant := session_tenant;
    ELSIF NEW.tenant <> session_tenant THEN
        RAISE EXCEPTION 'pgjobd: this session enqueues for tenant %, not %',
            quote_literal(session_tenant), quote_literal(NEW.tenant)
            USING ERRCODE = 'PJ007';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER job_tenant_guard
    BEFORE INSERT ON {{schema}}.job
    FOR EACH ROW
    WHEN (coalesce(current_setting('pgjobd.tenant', true), '') <> '')
    EXECUTE FUNCTION {{schema}}.job_tenant_guard();

-- The action's arguments as its caller gave them (filters, ids, the queue...), next to
-- what it did (detail). NULL in rows written before v7.
ALTER TABLE {{schema}}.audit ADD COLUMN arguments jsonb
    CONSTRAINT audit_arguments_is_object CHECK (jsonb_typeof(arguments) = 'object');

-- `pgjobd status` and the leader's metrics read the queue depth through this view: with
-- security_invoker, the reader's row security applies to it (a view otherwise reads as
-- its owner, whom row security does not restrict), so a tenant's session counts only
-- its own jobs under `migrate --rls`.
ALTER VIEW {{schema}}.queue_depth SET (security_invoker = true);

-- The args fields each kind's handler declares secret (@job(redact=[...])), recorded
-- with its other defaults by the fleet, so that the admin commands mask them. NULL for
-- kinds declared before v7, or by an older member.
ALTER TABLE {{schema}}.kind ADD COLUMN redact text[];
