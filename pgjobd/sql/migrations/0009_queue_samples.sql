-- Queue samples: what the web console's charts draw (issue 15). The leader's sampler
-- role (pgjobd/roles/samples.py) writes one row per queue every minute: the queue's
-- live depth by state at that moment, and how many of its jobs finished completed,
-- dead and cancelled since the previous sample. The same role deletes rows older than
-- its retention (24 h), so the table holds at most queues x 1,440 rows. Written by the
-- fleet's leader, so the charts show the whole fleet and survive restarts.
CREATE TABLE {{schema}}.queue_sample (
    at          timestamptz NOT NULL,
    queue       text        NOT NULL,
    available   integer     NOT NULL,
    scheduled   integer     NOT NULL,
    running     integer     NOT NULL,
    retryable   integer     NOT NULL,
    completed   integer     NOT NULL,  -- finished completed in (previous sample, at]
    dead        integer     NOT NULL,  -- finished dead in the same window
    cancelled   integer     NOT NULL,
    PRIMARY KEY (queue, at)
);
CREATE INDEX queue_sample_at_idx ON {{schema}}.queue_sample (at);

-- How the console groups dead jobs: one key per kind of failure. Today it is the
-- error class and message the job died with (job_history.last_error, "Class: message");
-- once attempts carry an error fingerprint, a later migration redefines this function
-- to prefer it, and every statement that groups dead jobs follows.
-- fingerprint is the last attempt's fingerprint (NULL while none is recorded).
CREATE FUNCTION {{schema}}.dead_group_key(last_error text, fingerprint text DEFAULT NULL)
RETURNS text
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
AS $$ SELECT coalesce(fingerprint, md5(coalesce(last_error, ''))) $$;
