-- Archive tables for `outbox purge --archive`: purged rows are moved here instead of
-- being deleted. `{schema}` is replaced by the configured, validated schema name.
-- Explicit columns (not LIKE): later columns of the live tables (order_key, claim
-- state) are relay internals and are not archived.

CREATE TABLE IF NOT EXISTS {schema}.outbox_messages_archive (
    id                uuid        PRIMARY KEY,
    seq               bigint      NOT NULL,
    aggregate_type    text        NOT NULL,
    aggregate_id      text        NOT NULL,
    aggregate_version bigint      NOT NULL,
    event_type        text        NOT NULL,
    payload           json        NOT NULL,
    headers           jsonb       NOT NULL,
    tenant_id         text,
    routing_key       text,
    partition_key     text,
    occurred_at       timestamptz NOT NULL,
    created_at        timestamptz NOT NULL,
    attempts          integer     NOT NULL,
    last_error        text,
    sent_at           timestamptz,
    archived_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS outbox_messages_archive_created_at
    ON {schema}.outbox_messages_archive (created_at);

CREATE TABLE IF NOT EXISTS {schema}.inbox_records_archive (
    message_id   uuid        NOT NULL,
    consumer     text        NOT NULL,
    processed_at timestamptz NOT NULL,
    archived_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, consumer)
);
