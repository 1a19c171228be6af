-- Archive tables for `outbox purge --archive` (migration 4 of the PostgreSQL backend):
-- archived rows are moved here instead of being deleted. `{schema}` is replaced by the
-- configured, validated schema name (bracket-quoted). Batches are separated by lines
-- holding only GO.
--
-- Explicit columns, as in PostgreSQL: the live tables' later columns (order_key,
-- order_hash, claim state, the crash-loop count) are relay internals and not archived.
-- The archive moves are `DELETE ... OUTPUT deleted.* INTO` these tables, so they must
-- have no triggers, CHECK constraints or foreign keys (OUTPUT INTO refuses such targets).
-- IGNORE_DUP_KEY on the keys is PostgreSQL's `ON CONFLICT DO NOTHING`: a row archived
-- twice (the same id enqueued again after its first archiving) is dropped with a
-- warning instead of failing the whole move.

CREATE TABLE {schema}.outbox_messages_archive (
    id                uniqueidentifier NOT NULL,
    seq               bigint           NOT NULL,
    aggregate_type    nvarchar(255)    NOT NULL,
    aggregate_id      nvarchar(max)    NOT NULL,
    aggregate_version bigint           NOT NULL,
    event_type        nvarchar(255)    NOT NULL,
    payload           nvarchar(max)    NOT NULL,
    headers           nvarchar(max)    NOT NULL,
    tenant_id         nvarchar(255)    NULL,
    routing_key       nvarchar(255)    NULL,
    partition_key     nvarchar(255)    NULL,
    occurred_at       datetime2(7)     NOT NULL,
    created_at        datetime2(7)     NOT NULL,
    attempts          int              NOT NULL,
    last_error        nvarchar(max)    NULL,
    sent_at           datetime2(7)     NULL,
    archived_at       datetime2(7)     NOT NULL
        CONSTRAINT outbox_messages_archive_archived_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT outbox_messages_archive_pk PRIMARY KEY NONCLUSTERED (id)
        WITH (IGNORE_DUP_KEY = ON)
);
GO

CREATE CLUSTERED INDEX outbox_messages_archive_created_at
    ON {schema}.outbox_messages_archive (created_at);
GO

CREATE TABLE {schema}.inbox_records_archive (
    message_id   uniqueidentifier NOT NULL,
    consumer     nvarchar(255)    NOT NULL,
    processed_at datetime2(7)     NOT NULL,
    archived_at  datetime2(7)     NOT NULL
        CONSTRAINT inbox_records_archive_archived_df DEFAULT SYSUTCDATETIME(),
    CONSTRAINT inbox_records_archive_pk PRIMARY KEY (message_id, consumer)
        WITH (IGNORE_DUP_KEY = ON)
);
