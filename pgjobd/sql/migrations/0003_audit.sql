-- Schema v3: the admin audit trail, and an index for `pgjobd status`.
-- "{{schema}}" is replaced by the configured schema name.

-- One row per admin action (the CLI, Client.cancel/retry), written in the same
-- transaction as the action itself: an action that rolled back left no row, and a row
-- means the action happened. Append-only: updates, deletes and TRUNCATE are refused
-- (the schema's owner may ALTER TABLE ... DISABLE TRIGGER USER to prune old rows).
CREATE TABLE {{schema}}.audit (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    db_role     text        NOT NULL DEFAULT current_user,  -- who, as PostgreSQL knows it
    os_user     text,                                       -- who, as the client said ($USER)
    action      text        NOT NULL,  -- jobs.cancel, jobs.retry, queues.pause, ...
    target      text,                  -- the queue or cron schedule acted on
    job_ids     bigint[]    NOT NULL DEFAULT '{}',  -- the jobs acted on
    detail      jsonb       NOT NULL DEFAULT '{}'
        CONSTRAINT audit_detail_is_object CHECK (jsonb_typeof(detail) = 'object')
);
CREATE INDEX audit_at_idx ON {{schema}}.audit (at);

CREATE FUNCTION {{schema}}.audit_append_only()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'pgjobd: %.audit is append-only (% refused)', TG_TABLE_SCHEMA, TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER audit_no_update_or_delete
    BEFORE UPDATE OR DELETE ON {{schema}}.audit
    FOR EACH ROW EXECUTE FUNCTION {{schema}}.audit_append_only();
CREATE TRIGGER audit_no_truncate
    BEFORE TRUNCATE ON {{schema}}.audit
    FOR EACH STATEMENT EXECUTE FUNCTION {{schema}}.audit_append_only();

-- `pgjobd status` counts what finished in the last minute (throughput) and hour (dead
-- jobs) per queue. job_history had no index on finished_at, so that was a scan of the
-- whole of today's partition. A BRIN index is a few pages per partition and costs the
-- statements that finish jobs next to nothing (rows arrive in finished_at order; new
-- page ranges stay unsummarized, and unsummarized ranges are simply read), unlike a
-- btree on the hottest insert path.
CREATE INDEX job_history_finished_brin_idx ON {{schema}}.job_history
    USING brin (finished_at);
