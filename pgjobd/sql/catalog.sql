-- What `pgjobd migrate` compares to find missing, altered and foreign objects in a
-- pgjobd schema (pgjobd/migrate.py): one row per object, its definition as PostgreSQL
-- prints it. Run with search_path = pg_catalog, so that every name of the schema comes
-- out qualified. Partitions, and what PostgreSQL clones onto them (indexes, constraints,
-- triggers), are left out: the partition rotator adds and drops them every day.
-- Privileges are left out too: `migrate --roles` owns them.

-- name: catalog_relations
-- Tables, views, sequences and foreign tables.
-- $1 schema name
SELECT c.relname AS name, c.relkind::text AS kind, c.relpersistence::text AS persistence,
       coalesce(array_to_string(c.reloptions, ','), '') AS options,
       coalesce(pg_get_partkeydef(c.oid), '') AS partition_key,
       CASE WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid) ELSE '' END AS view_def,
       CASE WHEN s.seqrelid IS NULL THEN ''
            ELSE format('%s increment %s minimum %s maximum %s cache %s%s',
                        format_type(s.seqtypid, NULL), s.seqincrement, s.seqmin, s.seqmax,
                        s.seqcache, CASE WHEN s.seqcycle THEN ' cycle' ELSE '' END)
       END AS sequence
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_sequence AS s ON s.seqrelid = c.oid
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f') AND NOT c.relispartition;

-- name: catalog_columns
-- The columns of those tables and views.
-- $1 schema name
SELECT c.relname AS relation, a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, coalesce(pg_get_expr(d.adbin, d.adrelid), '') AS default_expr,
       a.attidentity::text AS identity, a.attgenerated::text AS generated
FROM pg_attribute AS a
JOIN pg_class AS c ON c.oid = a.attrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'f') AND NOT c.relispartition
  AND a.attnum > 0 AND NOT a.attisdropped;

-- name: catalog_indexes
-- Indexes, without the invalid copies an interrupted REINDEX CONCURRENTLY leaves.
-- $1 schema name
SELECT t.relname AS relation, i.relname AS name, pg_get_indexdef(i.oid) AS definition
FROM pg_index AS x
JOIN pg_class AS i ON i.oid = x.indexrelid
JOIN pg_class AS t ON t.oid = x.indrelid
JOIN pg_namespace AS n ON n.oid = t.relnamespace
WHERE n.nspname = $1 AND NOT t.relispartition AND i.relname !~ '_cc(new|old)[0-9]*$';

-- name: catalog_constraints
-- Table constraints (domain constraints are part of catalog_types).
-- $1 schema name
SELECT t.relname AS relation, co.conname AS name, pg_get_constraintdef(co.oid) AS definition
FROM pg_constraint AS co
JOIN pg_class AS t ON t.oid = co.conrelid
JOIN pg_namespace AS n ON n.oid = t.relnamespace
WHERE n.nspname = $1 AND NOT t.relispartition;

-- name: catalog_triggers
-- User-visible triggers (not the internal ones behind foreign keys).
-- $1 schema name
SELECT c.relname AS relation, tg.tgname AS name, pg_get_triggerdef(tg.oid) AS definition
FROM pg_trigger AS tg
JOIN pg_class AS c ON c.oid = tg.tgrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND NOT tg.tgisinternal AND NOT c.relispartition;

-- name: catalog_functions
-- Functions and procedures, by name and argument types; the body is compared whole.
-- $1 schema name
SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')' AS name,
       p.prokind::text AS kind, pg_get_function_arguments(p.oid) AS arguments,
       coalesce(pg_get_function_result(p.oid), '') AS result, l.lanname AS language,
       p.prosecdef AS security_definer, p.provolatile::text AS volatility,
       p.proisstrict AS strict, coalesce(array_to_string(p.proconfig, ','), '') AS config,
       p.prosrc AS body
FROM pg_proc AS p
JOIN pg_namespace AS n ON n.oid = p.pronamespace
JOIN pg_language AS l ON l.oid = p.prolang
WHERE n.nspname = $1;

-- name: catalog_types
-- Enums (their labels in order), domains, standalone composite types and ranges; not
-- the row types of tables nor array types.
-- $1 schema name
SELECT t.typname AS name, t.typtype::text AS kind,
       CASE t.typtype
           WHEN 'e' THEN (SELECT string_agg(quote_literal(e.enumlabel), ', '
                                            ORDER BY e.enumsortorder)
                          FROM pg_enum AS e WHERE e.enumtypid = t.oid)
           WHEN 'd' THEN format_type(t.typbasetype, t.typtypmod)
                         || CASE WHEN t.typnotnull THEN ' NOT NULL' ELSE '' END
                         || coalesce((SELECT ' ' || string_agg(pg_get_constraintdef(c.oid), ' '
                                                               ORDER BY c.conname)
                                      FROM pg_constraint AS c WHERE c.contypid = t.oid), '')
           WHEN 'c' THEN (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid,
                                                                            a.atttypmod),
                                            ', ' ORDER BY a.attnum)
                          FROM pg_attribute AS a
                          WHERE a.attrelid = t.typrelid AND a.attnum > 0
                            AND NOT a.attisdropped)
           ELSE ''
       END AS definition
FROM pg_type AS t
JOIN pg_namespace AS n ON n.oid = t.typnamespace
LEFT JOIN pg_class AS r ON r.oid = t.typrelid
WHERE n.nspname = $1 AND t.typtype IN ('e', 'd', 'c', 'r', 'm')
  AND (t.typtype <> 'c' OR r.relkind = 'c');
