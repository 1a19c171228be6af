-- Relay heartbeats, for operators (migration 10 of the PostgreSQL backend). `{schema}`
-- is replaced by the configured, validated schema name (bracket-quoted). Batches are
-- separated by lines holding only GO.
--
-- Each relay process writes its row at every health check (every 5 s by default):
-- `started_at` at its first heartbeat, `last_seen_at` and its state at each one. Rows
-- of relays not heard of for a day are deleted by the heartbeats of the others. Nothing
-- reads this table on the relay's path.
IF OBJECT_ID(N'{schema}.outbox_relays', N'U') IS NULL
    CREATE TABLE {schema}.outbox_relays (
        relay_id     uniqueidentifier NOT NULL,
        host         nvarchar(255)    NOT NULL,
        pid          bigint           NOT NULL,
        version      nvarchar(64)     NOT NULL,
        started_at   datetime2(7)     NOT NULL,
        last_seen_at datetime2(7)     NOT NULL,
        circuit_open bit              NOT NULL,
        healthy      bit              NOT NULL,
        published    bigint           NOT NULL,
        detail       nvarchar(1000)   NOT NULL,
        CONSTRAINT outbox_relays_pk PRIMARY KEY (relay_id)
    );
