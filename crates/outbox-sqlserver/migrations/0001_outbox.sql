-- Outbox table and idempotent-consumer records. `{schema}` is replaced by the configured,
-- validated schema name (bracket-quoted). Batches are separated by lines holding only GO.
--
-- Times are datetime2(7) in UTC, always written from SYSUTCDATETIME() (or, for
-- occurred_at, as the producer stated it). Empty-text checks use DATALENGTH because
-- SQL Server compares strings ignoring trailing spaces (N' ' = N'').

CREATE TABLE {schema}.outbox_messages (
    seq               bigint IDENTITY(1, 1) NOT NULL,
    id                uniqueidentifier NOT NULL,
    aggregate_type    nvarchar(255)    NOT NULL,
    aggregate_id      nvarchar(max)    NOT NULL,
    aggregate_version bigint           NOT NULL CONSTRAINT outbox_messages_version_df DEFAULT 0,
    event_type        nvarchar(255)    NOT NULL,
    -- Kept as the producer wrote it. ISJSON over the text wrapped in [ ] accepts every
    -- JSON value, scalars included (ISJSON alone rejects scalars before SQL Server 2022).
    payload           nvarchar(max)    NOT NULL,
    headers           nvarchar(max)    NOT NULL CONSTRAINT outbox_messages_headers_df DEFAULT N'{}',
    tenant_id         nvarchar(255)    NULL,
    routing_key       nvarchar(255)    NULL,
    partition_key     nvarchar(255)    NULL,
    occurred_at       datetime2(7)     NOT NULL CONSTRAINT outbox_messages_occurred_df DEFAULT SYSUTCDATETIME(),
    created_at        datetime2(7)     NOT NULL CONSTRAINT outbox_messages_created_df DEFAULT SYSUTCDATETIME(),
    visible_at        datetime2(7)     NOT NULL CONSTRAINT outbox_messages_visible_df DEFAULT SYSUTCDATETIME(),
    status            smallint         NOT NULL CONSTRAINT outbox_messages_status_df DEFAULT 0,
    attempts          int              NOT NULL CONSTRAINT outbox_messages_attempts_df DEFAULT 0,
    last_error        nvarchar(max)    NULL,
    lease_until       datetime2(7)     NULL,
    claim_token       uniqueidentifier NULL,
    sent_at           datetime2(7)     NULL,
    -- UUIDv7 ids are not ascending in SQL Server's uniqueidentifier order, so the table
    -- is clustered on seq (appends at the end) and the id is a nonclustered key.
    CONSTRAINT outbox_messages_pk PRIMARY KEY NONCLUSTERED (id),
    CONSTRAINT outbox_messages_seq UNIQUE CLUSTERED (seq),
    CONSTRAINT outbox_messages_aggregate_type_ck CHECK (DATALENGTH(aggregate_type) > 0),
    CONSTRAINT outbox_messages_aggregate_id_ck CHECK (DATALENGTH(aggregate_id) > 0),
    CONSTRAINT outbox_messages_event_type_ck CHECK (DATALENGTH(event_type) > 0),
    CONSTRAINT outbox_messages_payload_ck CHECK (ISJSON(N'[' + payload + N']') = 1),
    CONSTRAINT outbox_messages_headers_ck CHECK (ISJSON(headers) = 1),
    CONSTRAINT outbox_messages_status_ck CHECK (status IN (0, 1, 3, 9)),
    CONSTRAINT outbox_messages_attempts_ck CHECK (attempts >= 0)
);
GO

-- Claim path 1: New rows in (visible_at, seq) order.
CREATE INDEX outbox_messages_claim_new
    ON {schema}.outbox_messages (visible_at, seq) WHERE status = 0;
-- Claim path 2: Processing rows whose lease expired.
CREATE INDEX outbox_messages_claim_expired
    ON {schema}.outbox_messages (lease_until) WHERE status = 9;
-- Dead-letter listing and replay.
CREATE INDEX outbox_messages_dead
    ON {schema}.outbox_messages (created_at) WHERE status = 3;
-- Retention of sent rows.
CREATE INDEX outbox_messages_sent
    ON {schema}.outbox_messages (sent_at) WHERE status = 1;
GO

-- Idempotent-consumer records: one row per (message, consumer) whose effects committed.
CREATE TABLE {schema}.inbox_records (
    message_id   uniqueidentifier NOT NULL,
    consumer     nvarchar(255)    NOT NULL,
    processed_at datetime2(7)     NOT NULL CONSTRAINT inbox_records_processed_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT inbox_records_pk PRIMARY KEY (message_id, consumer),
    CONSTRAINT inbox_records_consumer_ck CHECK (DATALENGTH(consumer) > 0)
);
GO

CREATE INDEX inbox_records_processed_at ON {schema}.inbox_records (processed_at);
