-- Inbox capabilities: version tracking, failure counts and consumer dead letters, and
-- the durable inbox. `{schema}` is replaced by the configured, validated schema name
-- (bracket-quoted). Batches are separated by lines holding only GO.

-- Last applied aggregate version per consumer and aggregate. Aggregate ids have no
-- length limit, which an index key (at most 900 bytes clustered) cannot hold, so the
-- key is a SHA-256 of the length-prefixed triple (unambiguous: the lengths say where
-- each part ends); lookups compare the text columns too.
CREATE TABLE {schema}.inbox_versions (
    consumer       nvarchar(255) NOT NULL,
    aggregate_type nvarchar(255) NOT NULL,
    aggregate_id   nvarchar(max) NOT NULL,
    key_hash       AS CAST(HASHBYTES('SHA2_256',
                       CAST(DATALENGTH(consumer) AS nvarchar(12)) + N':' + consumer + N':'
                       + CAST(DATALENGTH(aggregate_type) AS nvarchar(12)) + N':' + aggregate_type
                       + N':' + aggregate_id) AS binary(32)) PERSISTED NOT NULL,
    version        bigint        NULL,
    updated_at     datetime2(7)  NOT NULL CONSTRAINT inbox_versions_updated_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT inbox_versions_pk PRIMARY KEY (key_hash)
);
GO

-- Failures per (message, consumer); a row with dead_at set is a consumer dead letter.
CREATE TABLE {schema}.inbox_failures (
    message_id      uniqueidentifier NOT NULL,
    consumer        nvarchar(255)    NOT NULL,
    event_type      nvarchar(max)    NOT NULL,
    attempts        int              NOT NULL,
    last_error      nvarchar(max)    NOT NULL,
    first_failed_at datetime2(7)     NOT NULL CONSTRAINT inbox_failures_first_df DEFAULT SYSUTCDATETIME(),
    last_failed_at  datetime2(7)     NOT NULL CONSTRAINT inbox_failures_last_df DEFAULT SYSUTCDATETIME(),
    dead_at         datetime2(7)     NULL,
    payload         varbinary(max)   NULL,
    headers         nvarchar(max)    NULL,
    CONSTRAINT inbox_failures_pk PRIMARY KEY (message_id, consumer)
);
GO

CREATE INDEX inbox_failures_dead
    ON {schema}.inbox_failures (dead_at) WHERE dead_at IS NOT NULL;
GO

-- The durable inbox: messages stored on delivery, processed by claimers.
-- Status codes as in the outbox: 0 New, 1 Done, 3 Dead, 9 Processing.
CREATE TABLE {schema}.inbox_messages (
    seq               bigint IDENTITY(1, 1) NOT NULL,
    id                uniqueidentifier NOT NULL,
    event_type        nvarchar(max)    NOT NULL,
    source            nvarchar(max)    NULL,
    aggregate_type    nvarchar(max)    NULL,
    aggregate_id      nvarchar(max)    NULL,
    aggregate_version bigint           NULL,
    tenant_id         nvarchar(max)    NULL,
    partition_key     nvarchar(max)    NULL,
    correlation_id    nvarchar(max)    NULL,
    causation_id      nvarchar(max)    NULL,
    occurred_at       datetime2(7)     NULL,
    traceparent       nvarchar(max)    NULL,
    tracestate        nvarchar(max)    NULL,
    headers           nvarchar(max)    NOT NULL CONSTRAINT inbox_messages_headers_df DEFAULT N'{}',
    payload           varbinary(max)   NOT NULL,
    received_at       datetime2(7)     NOT NULL CONSTRAINT inbox_messages_received_df DEFAULT SYSUTCDATETIME(),
    visible_at        datetime2(7)     NOT NULL CONSTRAINT inbox_messages_visible_df DEFAULT SYSUTCDATETIME(),
    status            smallint         NOT NULL CONSTRAINT inbox_messages_status_df DEFAULT 0,
    attempts          int              NOT NULL CONSTRAINT inbox_messages_attempts_df DEFAULT 0,
    last_error        nvarchar(max)    NULL,
    lease_until       datetime2(7)     NULL,
    claim_token       uniqueidentifier NULL,
    processed_at      datetime2(7)     NULL,
    CONSTRAINT inbox_messages_pk PRIMARY KEY NONCLUSTERED (id),
    CONSTRAINT inbox_messages_seq UNIQUE CLUSTERED (seq),
    CONSTRAINT inbox_messages_headers_ck CHECK (ISJSON(headers) = 1),
    CONSTRAINT inbox_messages_status_ck CHECK (status IN (0, 1, 3, 9)),
    CONSTRAINT inbox_messages_attempts_ck CHECK (attempts >= 0)
);
GO

CREATE INDEX inbox_messages_claim_new
    ON {schema}.inbox_messages (visible_at, seq) WHERE status = 0;
CREATE INDEX inbox_messages_claim_expired
    ON {schema}.inbox_messages (lease_until) WHERE status = 9;
CREATE INDEX inbox_messages_done
    ON {schema}.inbox_messages (processed_at) WHERE status = 1;
