-- Ordered delivery per partition key. `{schema}` is replaced by the configured,
-- validated schema name.

-- The ordering key: the partition key, else the aggregate. The prefixes and the length
-- make the encoding injective ('p:' never equals 'a:', and the type's length says where
-- the type ends). Adding a stored generated column rewrites the table once.
ALTER TABLE {schema}.outbox_messages
    ADD COLUMN IF NOT EXISTS order_key text GENERATED ALWAYS AS (
        COALESCE('p:' || partition_key,
                 'a:' || length(aggregate_type)::text || ':' || aggregate_type || ':' || aggregate_id)
    ) STORED;

-- When the message first failed (Retry or Dead): since then its key has been waiting.
ALTER TABLE {schema}.outbox_messages ADD COLUMN IF NOT EXISTS first_failed_at timestamptz;

-- A key's unfinished messages in seq order: finds a key's head and its run.
CREATE INDEX IF NOT EXISTS outbox_messages_key_unfinished
    ON {schema}.outbox_messages (order_key, seq) WHERE status IN (0, 3, 9);

-- The few rows that can block their key: in flight, dead, or New but possibly not yet
-- visible (retried, replayed or enqueued with a delay). A New row that was never tried
-- and had no delay (visible_at = created_at) is visible and cannot block. Keeps the
-- claim's per-row "is my key blocked?" probe small however long the backlog.
CREATE INDEX IF NOT EXISTS outbox_messages_key_blockers
    ON {schema}.outbox_messages (order_key, seq)
    WHERE status IN (3, 9) OR (status = 0 AND (attempts > 0 OR visible_at > created_at));
