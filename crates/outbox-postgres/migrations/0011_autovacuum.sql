-- Autovacuum settings for the two claimed tables. `{schema}` is replaced by the
-- configured, validated, quoted schema name.
--
-- A completed row leaves a dead version and a dead entry in the pending index behind;
-- until VACUUM removes them, scans pass over them (the claim floor keeps the claim's
-- walk short, the health check and `outbox stats` still walk). PostgreSQL's default
-- vacuums a table once its dead rows reach 20% of its size plus 50: with sent rows kept
-- for a day, a table of 10 million rows waits for 2 million dead ones. Here a fixed
-- threshold of 10,000 dead rows, whatever the table's size, and an ANALYZE every 2%
-- of changed rows, so the planner's picture of the pending rows stays current.
--
-- These are storage parameters of the tables (`\d+` shows them; an operator may change
-- them with ALTER TABLE). They take effect only where autovacuum runs
-- (`autovacuum = on`, PostgreSQL's default). Nothing vacuums past a transaction that
-- holds the xmin horizon back: the relay reports the oldest one (docs/operations.md).
ALTER TABLE {schema}.outbox_messages SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0.02
);
ALTER TABLE {schema}.inbox_messages SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_scale_factor = 0.02
);
