-- Inbox capabilities: version tracking, failure counts and consumer dead letters, and
-- the durable inbox. `{schema}` is replaced by the configured, validated, backquoted
-- database name.

-- Last applied aggregate version per consumer and aggregate. The aggregate's type and
-- id are bytes (their UTF-8): the key must fit InnoDB's 3,072-byte index limit.
CREATE TABLE IF NOT EXISTS {schema}.inbox_versions (
    consumer       VARCHAR(255)    NOT NULL,
    aggregate_type VARBINARY(512)  NOT NULL,
    aggregate_id   VARBINARY(1024) NOT NULL,
    version        BIGINT          NULL,
    updated_at     DATETIME(6)     NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Failures per (message, consumer); a row with dead_at set is a consumer dead letter.
CREATE TABLE IF NOT EXISTS {schema}.inbox_failures (
    message_id      BINARY(16)   NOT NULL,
    consumer        VARCHAR(255) NOT NULL,
    event_type      TEXT         NOT NULL,
    attempts        INT          NOT NULL,
    last_error      TEXT         NOT NULL,
    first_failed_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_failed_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    dead_at         DATETIME(6)  NULL,
    payload         LONGBLOB     NULL,
    headers         LONGTEXT     NULL,
    PRIMARY KEY (message_id, consumer),
    KEY inbox_failures_dead (dead_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The durable inbox: messages stored on delivery, processed by claimers.
-- Status codes as in the outbox: 0 New, 1 Done, 3 Dead, 9 Processing.
CREATE TABLE IF NOT EXISTS {schema}.inbox_messages (
    id                BINARY(16)   NOT NULL,
    seq               BIGINT       NOT NULL AUTO_INCREMENT,
    event_type        TEXT         NOT NULL,
    source            TEXT         NULL,
    aggregate_type    TEXT         NULL,
    aggregate_id      TEXT         NULL,
    aggregate_version BIGINT       NULL,
    tenant_id         TEXT         NULL,
    partition_key     TEXT         NULL,
    correlation_id    TEXT         NULL,
    causation_id      TEXT         NULL,
    occurred_at       DATETIME(6)  NULL,
    traceparent       TEXT         NULL,
    tracestate        TEXT         NULL,
    headers           LONGTEXT     NOT NULL,
    payload           LONGBLOB     NOT NULL,
    received_at       DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    visible_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    status            SMALLINT     NOT NULL DEFAULT 0,
    attempts          INT          NOT NULL DEFAULT 0,
    last_error        TEXT         NULL,
    lease_until       DATETIME(6)  NULL,
    claim_token       BINARY(16)   NULL,
    completed_token   BINARY(16)   NULL,
    processed_at      DATETIME(6)  NULL,
    phase             SMALLINT AS (CASE WHEN status = 9 THEN 0 ELSE status END) STORED,
    PRIMARY KEY (id),
    UNIQUE KEY inbox_messages_seq (seq),
    KEY inbox_messages_pending (phase, visible_at, seq),
    KEY inbox_messages_done (phase, processed_at),
    KEY inbox_messages_dead (phase, received_at),
    CONSTRAINT inbox_messages_status CHECK (status IN (0, 1, 3, 9))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
