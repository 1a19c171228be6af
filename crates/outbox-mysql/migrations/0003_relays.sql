-- Relay heartbeats, for operators (the dashboard's overview). `{schema}` is replaced by
-- the configured, validated, backquoted database name.
--
-- Each relay process writes its row at every health check (every 5 s by default):
-- `started_at` at its first heartbeat, `last_seen_at` and its state at each one. Rows
-- of relays not heard of for a day are deleted by the heartbeats of the others. Nothing
-- reads this table on the relay's path.
CREATE TABLE IF NOT EXISTS {schema}.outbox_relays (
    relay_id     BINARY(16)   NOT NULL,
    host         VARCHAR(255) NOT NULL,
    pid          BIGINT       NOT NULL,
    version      VARCHAR(255) NOT NULL,
    started_at   DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_seen_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    circuit_open BOOLEAN      NOT NULL,
    healthy      BOOLEAN      NOT NULL,
    published    BIGINT       NOT NULL,
    detail       TEXT         NOT NULL,
    PRIMARY KEY (relay_id),
    KEY outbox_relays_last_seen (last_seen_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
