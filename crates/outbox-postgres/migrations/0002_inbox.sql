-- Inbox capabilities: version tracking, failure counts and consumer dead letters, and
-- the durable inbox. `{schema}` is replaced by the configured, validated schema name.

-- Last applied aggregate version per consumer and aggregate.
CREATE TABLE IF NOT EXISTS {schema}.inbox_versions (
    consumer       text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);

-- Failures per (message, consumer); a row with dead_at set is a consumer dead letter.
CREATE TABLE IF NOT EXISTS {schema}.inbox_failures (
    message_id      uuid        NOT NULL,
    consumer        text        NOT NULL,
    event_type      text        NOT NULL,
    attempts        integer     NOT NULL,
    last_error      text        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    dead_at         timestamptz,
    payload         bytea,
    headers         jsonb,
    PRIMARY KEY (message_id, consumer)
);
CREATE INDEX IF NOT EXISTS inbox_failures_dead
    ON {schema}.inbox_failures (dead_at) WHERE dead_at IS NOT NULL;

-- The durable inbox: messages stored on delivery, processed by claimers.
-- Status codes as in the outbox: 0 New, 1 Done, 3 Dead, 9 Processing.
CREATE TABLE IF NOT EXISTS {schema}.inbox_messages (
    seq               bigint GENERATED ALWAYS AS IDENTITY,
    id                uuid        PRIMARY KEY,
    event_type        text        NOT NULL,
    source            text,
    aggregate_type    text,
    aggregate_id      text,
    aggregate_version bigint,
    tenant_id         text,
    partition_key     text,
    correlation_id    text,
    causation_id      text,
    occurred_at       timestamptz,
    traceparent       text,
    tracestate        text,
    headers           jsonb       NOT NULL DEFAULT '{}'::jsonb,
    payload           bytea       NOT NULL,
    received_at       timestamptz NOT NULL DEFAULT now(),
    visible_at        timestamptz NOT NULL DEFAULT now(),
    status            smallint    NOT NULL DEFAULT 0 CHECK (status IN (0, 1, 3, 9)),
    attempts          integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error        text,
    lease_until       timestamptz,
    claim_token       uuid,
    processed_at      timestamptz
);
CREATE INDEX IF NOT EXISTS inbox_messages_claim_new
    ON {schema}.inbox_messages (visible_at, seq) WHERE status = 0;
CREATE INDEX IF NOT EXISTS inbox_messages_claim_expired
    ON {schema}.inbox_messages (lease_until) WHERE status = 9;
CREATE INDEX IF NOT EXISTS inbox_messages_done
    ON {schema}.inbox_messages (processed_at) WHERE status = 1;
