-- Live jobs per queue by state, and when the oldest available job became due: what
-- `pgjobd status` shows and what the leader exports as metrics, defined once.
CREATE VIEW {{schema}}.queue_depth AS
SELECT j.queue,
       count(*) FILTER (WHERE j.state = 'available') AS available,
       count(*) FILTER (WHERE j.state = 'scheduled') AS scheduled,
       count(*) FILTER (WHERE j.state = 'running') AS running,
       count(*) FILTER (WHERE j.state = 'retryable') AS retryable,
       min(j.run_at) FILTER (WHERE j.state = 'available') AS oldest_available_at
FROM {{schema}}.job AS j
GROUP BY j.queue;
