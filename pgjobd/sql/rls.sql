-- Row-level security by tenant, turned on by `pgjobd migrate --rls` (which needs the
-- roles of roles.sql) and renewed by every later migrate while it is on.
--
-- Producer and readonly sessions see, and write, only the jobs of the tenant their
-- session names (SET pgjobd.tenant = 'acme'; Client.connect(..., tenant="acme")); a
-- session that names none sees only jobs without a tenant. It fails closed: a
-- dashboard that must see every tenant logs in with {{schema}}_admin. The worker, admin
-- and maintainer roles see every row. The SQL enqueue functions run as their owner,
-- which row security does not restrict: for them, the job_tenant_guard trigger
-- (migration 0007) gives a job the session's tenant and refuses any other.
--
-- Policies and the row-security flag are not part of the objects `migrate` compares
-- with the migrations, like privileges: this file owns them.

ALTER TABLE {{schema}}.job ENABLE ROW LEVEL SECURITY;
ALTER TABLE {{schema}}.job_history ENABLE ROW LEVEL SECURITY;
ALTER TABLE {{schema}}.job_attempt ENABLE ROW LEVEL SECURITY;

DROP POLICY IF EXISTS tenant_rows ON {{schema}}.job;
CREATE POLICY tenant_rows ON {{schema}}.job
    TO {{schema}}_producer, {{schema}}_readonly
    USING (tenant IS NOT DISTINCT FROM nullif(current_setting('pgjobd.tenant', true), ''))
    WITH CHECK (tenant IS NOT DISTINCT FROM nullif(current_setting('pgjobd.tenant', true), ''));

DROP POLICY IF EXISTS tenant_rows ON {{schema}}.job_history;
CREATE POLICY tenant_rows ON {{schema}}.job_history
    TO {{schema}}_producer, {{schema}}_readonly
    USING (tenant IS NOT DISTINCT FROM nullif(current_setting('pgjobd.tenant', true), ''));

-- Attempts carry no tenant: an attempt is visible when its job is (in either table; the
-- look-ups are themselves under the policies above).
DROP POLICY IF EXISTS tenant_rows ON {{schema}}.job_attempt;
CREATE POLICY tenant_rows ON {{schema}}.job_attempt
    TO {{schema}}_producer, {{schema}}_readonly
    USING (EXISTS (SELECT FROM {{schema}}.job AS j WHERE j.id = job_id)
           OR EXISTS (SELECT FROM {{schema}}.job_history AS h WHERE h.id = job_id));

DROP POLICY IF EXISTS every_row ON {{schema}}.job;
CREATE POLICY every_row ON {{schema}}.job
    TO {{schema}}_worker, {{schema}}_admin, {{schema}}_maintainer
    USING (true) WITH CHECK (true);
DROP POLICY IF EXISTS every_row ON {{schema}}.job_history;
CREATE POLICY every_row ON {{schema}}.job_history
    TO {{schema}}_worker, {{schema}}_admin, {{schema}}_maintainer
    USING (true) WITH CHECK (true);
DROP POLICY IF EXISTS every_row ON {{schema}}.job_attempt;
CREATE POLICY every_row ON {{schema}}.job_attempt
    TO {{schema}}_worker, {{schema}}_admin, {{schema}}_maintainer
    USING (true) WITH CHECK (true);
