-- Outbox tables. `{schema}` is replaced by the configured, validated, backquoted
-- database name. InnoDB, utf8mb4 with a binary collation (names compare by code point,
-- case-sensitively, as on PostgreSQL), DATETIME(6) in UTC (every connection runs with
-- time_zone = '+00:00'; every time comes from NOW(6)), ids as BINARY(16) (UUIDv7 in
-- big-endian byte order: the clustered primary key grows at its end).
CREATE TABLE IF NOT EXISTS {schema}.outbox_messages (
    id                BINARY(16)   NOT NULL,
    seq               BIGINT       NOT NULL AUTO_INCREMENT,
    aggregate_type    VARCHAR(255) NOT NULL,
    aggregate_id      VARCHAR(1024) NOT NULL,
    aggregate_version BIGINT       NOT NULL DEFAULT 0,
    event_type        VARCHAR(255) NOT NULL,
    -- Text checked as JSON (not MySQL's binary JSON type): kept byte for byte as the
    -- producer wrote it.
    payload           LONGTEXT     NOT NULL,
    headers           LONGTEXT     NOT NULL,
    tenant_id         VARCHAR(255) NULL,
    routing_key       VARCHAR(255) NULL,
    partition_key     VARCHAR(255) NULL,
    occurred_at       DATETIME(6)  NOT NULL,
    created_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    visible_at        DATETIME(6)  NOT NULL,
    status            SMALLINT     NOT NULL DEFAULT 0,
    attempts          INT          NOT NULL DEFAULT 0,
    last_error        TEXT         NULL,
    lease_until       DATETIME(6)  NULL,
    claim_token       BINARY(16)   NULL,
    -- The token of the claim whose completion was applied last: how a batch completion
    -- that matched fewer rows than it carried finds out which ones were fenced.
    completed_token   BINARY(16)   NULL,
    sent_at           DATETIME(6)  NULL,
    first_failed_at   DATETIME(6)  NULL,
    -- Crash-loop guard: claims without an outcome, and those of them alone.
    unfinished_claims INT          NOT NULL DEFAULT 0,
    unfinished_alone  INT          NOT NULL DEFAULT 0,
    -- The status with Processing folded into New (0 pending, 1 sent, 3 dead): a claim
    -- leaves it (and so every index below) unchanged.
    phase             SMALLINT AS (CASE WHEN status = 9 THEN 0 ELSE status END) STORED,
    -- The ordering key: the partition key, else the aggregate (the prefixes and the
    -- byte length make the encoding injective). Binary, so keys compare byte by byte
    -- as the relay's round-robin cursor does, with no collation or trailing-space rule.
    order_key         VARBINARY(1300) AS (CAST(COALESCE(CONCAT('p:', partition_key),
                          CONCAT('a:', LENGTH(aggregate_type), ':', aggregate_type, ':', aggregate_id))
                          AS BINARY)) STORED,
    PRIMARY KEY (id),
    UNIQUE KEY outbox_messages_seq (seq),
    -- The claim path: pending rows in (visible_at, seq) order.
    KEY outbox_messages_pending (phase, visible_at, seq),
    -- Ordered delivery: rows per key in seq order (pending and dead).
    KEY outbox_messages_key (phase, order_key, seq),
    -- Dead-letter listing and replay.
    KEY outbox_messages_created (phase, created_at, seq),
    -- Retention of sent rows.
    KEY outbox_messages_sent (phase, sent_at, seq),
    CONSTRAINT outbox_messages_status CHECK (status IN (0, 1, 3, 9)),
    CONSTRAINT outbox_messages_attempts CHECK (attempts >= 0),
    CONSTRAINT outbox_messages_names CHECK (aggregate_type <> '' AND aggregate_id <> '' AND event_type <> ''),
    CONSTRAINT outbox_messages_payload CHECK (JSON_VALID(payload)),
    CONSTRAINT outbox_messages_headers CHECK (JSON_VALID(headers))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Idempotent-consumer records: one row per (message, consumer) whose effects committed.
CREATE TABLE IF NOT EXISTS {schema}.inbox_records (
    message_id   BINARY(16)   NOT NULL,
    consumer     VARCHAR(255) NOT NULL,
    processed_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (message_id, consumer),
    KEY inbox_records_processed_at (processed_at),
    CONSTRAINT inbox_records_consumer CHECK (consumer <> '')
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Archive tables for `outbox purge --archive`: purged rows are moved here.
CREATE TABLE IF NOT EXISTS {schema}.outbox_messages_archive (
    id                BINARY(16)    NOT NULL,
    seq               BIGINT        NOT NULL,
    aggregate_type    VARCHAR(255)  NOT NULL,
    aggregate_id      VARCHAR(1024) NOT NULL,
    aggregate_version BIGINT        NOT NULL,
    event_type        VARCHAR(255)  NOT NULL,
    payload           LONGTEXT      NOT NULL,
    headers           LONGTEXT      NOT NULL,
    tenant_id         VARCHAR(255)  NULL,
    routing_key       VARCHAR(255)  NULL,
    partition_key     VARCHAR(255)  NULL,
    occurred_at       DATETIME(6)   NOT NULL,
    created_at        DATETIME(6)   NOT NULL,
    attempts          INT           NOT NULL,
    last_error        TEXT          NULL,
    sent_at           DATETIME(6)   NULL,
    archived_at       DATETIME(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (id),
    KEY outbox_messages_archive_created_at (created_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS {schema}.inbox_records_archive (
    message_id   BINARY(16)   NOT NULL,
    consumer     VARCHAR(255) NOT NULL,
    processed_at DATETIME(6)  NOT NULL,
    archived_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (message_id, consumer)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
