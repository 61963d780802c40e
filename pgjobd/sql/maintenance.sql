-- The leader's maintenance of the hot table: the reindexer and the horizon watchdog.
-- "{{schema}}" is the configured schema. The reindexer's DDL (REINDEX/DROP INDEX
-- CONCURRENTLY) cannot run in a transaction block, so it cannot be fenced by
-- `leader_term_holds`: it checks `leader_term_open` (leader.sql) just before each
-- statement. Everything here is a
-- read of the catalogs and statistics views.

-- name: index_build_in_progress
-- Is some session building or rebuilding an index of $1 right now (a REINDEX by a
-- deposed leader still running, an operator's CREATE INDEX CONCURRENTLY)? Its
-- half-built index looks exactly like an interrupted run's leftover: leave it alone.
-- $1 table (qualified name)
SELECT EXISTS (SELECT FROM pg_stat_progress_create_index AS p
               WHERE p.relid = $1::regclass AND p.pid <> pg_backend_pid());

-- name: index_leftover_list
-- Invalid indexes an interrupted REINDEX CONCURRENTLY left on $1: the new copy
-- (<index>_ccnew[N], interrupted before the swap) or the old one (<index>_ccold[N],
-- after it). Other invalid indexes are not ours to drop.
-- $1 table (qualified name)
SELECT format('%I.%I', n.nspname, c.relname) AS qualified, c.relname AS name
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE i.indrelid = $1::regclass AND NOT i.indisvalid
  AND c.relname ~ '_cc(new|old)[0-9]*$'
ORDER BY c.relname;

-- name: index_size_list
-- The B-tree indexes of $1 (leftovers excluded; only $2 unless it is NULL) with what
-- the bloat estimate needs: their size on disk, their entry count as of the last
-- VACUUM, ANALYZE or build (reltuples, -1 when never measured), and the key width per
-- entry from the column statistics (avg_width; for columns without statistics the
-- type's length, or 32 bytes for variable-length types). NULL key_width for expression
-- indexes: no estimate. `measured_at` is the table's last (auto)vacuum or analyze
-- (NULL since a crash reset the statistics), `at` the database's now.
-- $1 table (qualified name), $2 index name (NULL: every index)
SELECT format('%I.%I', n.nspname, c.relname) AS qualified, c.relname AS name,
       i.indisvalid AS valid, pg_relation_size(c.oid) AS bytes, c.reltuples AS entries,
       current_setting('block_size')::integer AS block_size,
       CASE WHEN i.indexprs IS NULL THEN (
           SELECT sum(coalesce(s.avg_width, CASE WHEN t.typlen > 0 THEN t.typlen ELSE 32 END))
           FROM unnest(i.indkey::int2[]) AS k(attnum)
           JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
           JOIN pg_type AS t ON t.oid = a.atttypid
           LEFT JOIN pg_stats AS s
               ON s.schemaname = tn.nspname AND s.tablename = tc.relname
              AND s.attname = a.attname AND NOT s.inherited
       ) END::integer AS key_width,
       greatest(st.last_vacuum, st.last_autovacuum, st.last_analyze, st.last_autoanalyze)
           AS measured_at,
       now() AS at
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_am AS am ON am.oid = c.relam
JOIN pg_class AS tc ON tc.oid = i.indrelid
JOIN pg_namespace AS tn ON tn.oid = tc.relnamespace
LEFT JOIN pg_stat_all_tables AS st ON st.relid = i.indrelid
WHERE i.indrelid = $1::regclass AND am.amname = 'btree'
  AND c.relname !~ '_cc(new|old)[0-9]*$'
  AND ($2::text IS NULL OR c.relname = $2)
ORDER BY c.relname;

-- name: horizon_holders
-- Who holds back vacuum in this database, oldest first: backends with a snapshot or
-- a transaction id (walsenders carry their standby's hot_standby_feedback), prepared
-- transactions, and replication slots with an xmin. xmin_age counts transactions since
-- the oldest xid each one pins; xact_age_s is how long its transaction has been open
-- (a slot has none). VACUUM workers are left out (other vacuums ignore their xmin),
-- and so is this session. Without pg_read_all_stats (or pg_monitor), other roles'
-- sessions show no xmin and so are invisible here.
-- $1 how many, $2 now override (NULL: now())
SELECT h.*
FROM (
    SELECT 'backend' AS source, a.pid, a.application_name AS name, a.usename AS owner,
           a.state, a.backend_type,
           greatest(age(a.backend_xid), age(a.backend_xmin)) AS xmin_age,
           extract(epoch FROM coalesce($2::timestamptz, now()) - a.xact_start)::float8
               AS xact_age_s,
           a.xact_start, a.query_start, a.state_change, left(a.query, 200) AS query
    FROM pg_stat_activity AS a
    WHERE (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
      AND a.pid <> pg_backend_pid()
      AND (a.datname = current_database() OR a.backend_type = 'walsender')
      AND NOT (a.backend_type = 'autovacuum worker' AND a.query LIKE 'autovacuum: VACUUM%')
    UNION ALL
    SELECT 'prepared_xact', NULL, p.gid, p.owner::text, 'prepared', NULL,
           age(p.transaction),
           extract(epoch FROM coalesce($2::timestamptz, now()) - p.prepared)::float8,
           p.prepared, NULL, NULL, NULL
    FROM pg_prepared_xacts AS p
    WHERE p.database = current_database()
    UNION ALL
    SELECT 'replication_slot', s.active_pid, s.slot_name::text, NULL,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.slot_type,
           age(s.xmin), NULL, NULL, NULL, NULL, NULL
    FROM pg_replication_slots AS s
    WHERE s.xmin IS NOT NULL AND (s.database IS NULL OR s.database = current_database())
) AS h
ORDER BY h.xmin_age DESC, h.xact_age_s DESC NULLS LAST
LIMIT $1;

-- name: horizon_table_stats
-- The hot table's row counts and vacuum history, and the database's wraparound ages.
-- next_xid is the xid the next transaction will get (64-bit): the watchdog's clock for
-- turning an xmin into how long ago it was current.
-- $1 table (qualified name), $2 now override (NULL: now())
SELECT coalesce($2::timestamptz, now()) AS at,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS next_xid,
       d.wraparound_age, d.multixact_age,
       s.n_live_tup AS live_rows, s.n_dead_tup AS dead_rows,
       s.last_vacuum, s.last_autovacuum, s.autovacuum_count,
       s.vacuum_count + s.autovacuum_count AS vacuum_count
FROM (SELECT age(datfrozenxid) AS wraparound_age, mxid_age(datminmxid) AS multixact_age
      FROM pg_database WHERE datname = current_database()) AS d
LEFT JOIN pg_stat_user_tables AS s ON s.relid = $1::regclass;

-- name: backend_pid
-- The server process of this session (asyncpg's get_server_pid is the pooler's own
-- behind PgBouncer); for backend_stop.
-- (no parameters)
SELECT pg_backend_pid();

-- name: backend_stop
-- Ends one of this member's own sessions whose statement was abandoned (a REINDEX the
-- reindexer was cancelled in): the statement stops, and the session is not reused.
-- $1 backend pid
SELECT pg_terminate_backend($1);
