-- Outbox and inbox tables. `{schema}` is replaced by the configured, validated schema name.
CREATE TABLE IF NOT EXISTS {schema}.outbox_messages (
    seq               bigint GENERATED ALWAYS AS IDENTITY,
    id                uuid        PRIMARY KEY,
    aggregate_type    text        NOT NULL CHECK (aggregate_type <> ''),
    aggregate_id      text        NOT NULL CHECK (aggregate_id <> ''),
    aggregate_version bigint      NOT NULL DEFAULT 0,
    event_type        text        NOT NULL CHECK (event_type <> ''),
    -- json (not jsonb): validated, and kept byte for byte as the producer wrote it.
    payload           json        NOT NULL,
    headers           jsonb       NOT NULL DEFAULT '{}'::jsonb,
    tenant_id         text,
    routing_key       text,
    partition_key     text,
    occurred_at       timestamptz NOT NULL DEFAULT now(),
    created_at        timestamptz NOT NULL DEFAULT now(),
    visible_at        timestamptz NOT NULL DEFAULT now(),
    status            smallint    NOT NULL DEFAULT 0 CHECK (status IN (0, 1, 3, 9)),
    attempts          integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error        text,
    lease_until       timestamptz,
    claim_token       uuid,
    sent_at           timestamptz
);

-- Claim path 1: New rows in (visible_at, seq) order.
CREATE INDEX IF NOT EXISTS outbox_messages_claim_new
    ON {schema}.outbox_messages (visible_at, seq) WHERE status = 0;
-- Claim path 2: Processing rows whose lease expired.
CREATE INDEX IF NOT EXISTS outbox_messages_claim_expired
    ON {schema}.outbox_messages (lease_until) WHERE status = 9;
-- Dead-letter listing and replay.
CREATE INDEX IF NOT EXISTS outbox_messages_dead
    ON {schema}.outbox_messages (created_at) WHERE status = 3;
-- Retention of sent rows.
CREATE INDEX IF NOT EXISTS outbox_messages_sent
    ON {schema}.outbox_messages (sent_at) WHERE status = 1;

-- Idempotent-consumer records: one row per (message, consumer) whose effects committed.
CREATE TABLE IF NOT EXISTS {schema}.inbox_records (
    message_id   uuid        NOT NULL,
    consumer     text        NOT NULL CHECK (consumer <> ''),
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, consumer)
);
CREATE INDEX IF NOT EXISTS inbox_records_processed_at
    ON {schema}.inbox_records (processed_at);
