-- Ordered delivery per partition key. `{schema}` is replaced by the configured,
-- validated schema name.

-- The ordering key: the partition key, else the aggregate. The prefixes and the length
-- make the encoding injective ('p:' never equals 'a:', and the type's length says where
-- the type ends). Byte order (COLLATE "C"), so the relay's round-robin cursor compares
-- keys as the database does. Adding a stored generated column rewrites the table once.
ALTER TABLE {schema}.outbox_messages
    ADD COLUMN IF NOT EXISTS order_key text COLLATE "C" GENERATED ALWAYS AS (
        COALESCE('p:' || partition_key,
                 'a:' || length(aggregate_type)::text || ':' || aggregate_type || ':' || aggregate_id)
    ) STORED;

-- When the message first failed (Retry or Dead): since then its key has been waiting.
ALTER TABLE {schema}.outbox_messages ADD COLUMN IF NOT EXISTS first_failed_at timestamptz;

-- Pending (New or Processing) messages per key in seq order: the ordered claim walks the
-- distinct keys of this index and finds each key's head and run in it.
CREATE INDEX IF NOT EXISTS outbox_messages_key_pending
    ON {schema}.outbox_messages (order_key, seq) WHERE status IN (0, 9);
-- Dead messages per key: under OnDead::Block an earlier dead message stops its key.
CREATE INDEX IF NOT EXISTS outbox_messages_key_dead
    ON {schema}.outbox_messages (order_key, seq) WHERE status = 3;
