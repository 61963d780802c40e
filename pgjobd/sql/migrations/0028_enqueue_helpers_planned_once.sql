-- Every enqueue called two SQL-language helpers that PostgreSQL (before 18) planned again
-- in each transaction, a third of the statement's server time (issue 17, target 4: an
-- enqueue is one transaction). A SQL function that is not inlined into its caller keeps
-- its plan only for the query that calls it; plpgsql's "simple" expressions are made
-- again in each transaction, and so is the plan of a SQL function they call.
-- - job_lifecycle_problem was declared IMMUTABLE, but format() of an interval depends on
--   IntervalStyle (STABLE), so it was never inlined. Declared STABLE, as its body is, it
--   is inlined into enqueue's expression and into enqueue_many's query.
-- - queue_admit_needed reads the queue table (a subquery), which no SQL function can be
--   inlined with. In plpgsql its statement's plan is kept for the session.
-- What each returns is unchanged. "{{schema}}" is replaced by the configured schema name.

ALTER FUNCTION {{schema}}.job_lifecycle_problem(text, timestamptz, interval, interval, text)
    STABLE;

CREATE OR REPLACE FUNCTION {{schema}}.queue_admit_needed(any_grouped boolean)
RETURNS boolean
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    RETURN any_grouped
           OR EXISTS (SELECT FROM {{schema}}.queue AS q WHERE q.max_depth IS NOT NULL);
END;
$$;
