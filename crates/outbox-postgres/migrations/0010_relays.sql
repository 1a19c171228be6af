-- Relay heartbeats, for operators (the dashboard's overview). `{schema}` is replaced by
-- the configured, validated, quoted schema name.
--
-- Each relay process writes its row at every health check (every 5 s by default):
-- `started_at` at its first heartbeat, `last_seen_at` and its state at each one. Rows
-- of relays not heard of for a day are deleted by the heartbeats of the others. Nothing
-- reads this table on the relay's path.
CREATE TABLE IF NOT EXISTS {schema}.outbox_relays (
    relay_id     uuid        PRIMARY KEY,
    host         text        NOT NULL,
    pid          bigint      NOT NULL,
    version      text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now(),
    circuit_open boolean     NOT NULL,
    healthy      boolean     NOT NULL,
    published    bigint      NOT NULL,
    detail       text        NOT NULL DEFAULT ''
);
