-- Ordered delivery per partition key. `{schema}` is replaced by the configured,
-- validated schema name (bracket-quoted). Batches are separated by lines holding only GO.

-- The ordering key: the partition key, else the aggregate, encoded like the PostgreSQL
-- backend ('p:' || partition_key, or 'a:' || len(aggregate_type) || ':' || type || ':'
-- || id), except that the length is DATALENGTH / 2, i.e. UTF-16 code units. The prefixes
-- and the length make it injective. Reported by blocked_keys.
ALTER TABLE {schema}.outbox_messages ADD
    order_key AS COALESCE(N'p:' + partition_key,
                          N'a:' + CAST(DATALENGTH(aggregate_type) / 2 AS nvarchar(12)) + N':'
                          + aggregate_type + N':' + aggregate_id) PERSISTED,
    -- The same key hashed (SHA-256): aggregate ids are nvarchar(max), which cannot be an
    -- index key, and the hash compares bytes, not collation-equal text (N'a' = N'A ' in
    -- a case-insensitive collation; their hashes differ). A computed column cannot
    -- reference another, so the expression is repeated.
    order_hash AS CAST(HASHBYTES('SHA2_256',
                       COALESCE(N'p:' + partition_key,
                                N'a:' + CAST(DATALENGTH(aggregate_type) / 2 AS nvarchar(12)) + N':'
                                + aggregate_type + N':' + aggregate_id)) AS binary(32)) PERSISTED,
    -- When the message first failed (Retry or Dead): since then its key has been waiting.
    first_failed_at datetime2(7) NULL;
GO

-- A key's pending (New or Processing) messages in seq order: the ordered claim walks
-- the keys through it (one seek per key), finds each key's head and its run; covers
-- the claimability check.
CREATE INDEX outbox_messages_key_pending
    ON {schema}.outbox_messages (order_hash, seq)
    INCLUDE (status, visible_at, lease_until)
    WHERE status IN (0, 9);
-- Dead messages per key: under OnDead::Block an earlier dead message stops its key.
CREATE INDEX outbox_messages_key_dead
    ON {schema}.outbox_messages (order_hash, seq)
    WHERE status = 3;
