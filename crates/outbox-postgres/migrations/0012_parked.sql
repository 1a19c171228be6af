-- The WAL relay's parked rows, indexed. `{schema}` is replaced by the configured,
-- validated, quoted schema name.
--
-- The WAL relay parks what it cannot publish now (docs/wal.md, Parking): the row is
-- Processing without a claim token, and a sweeper publishes it once it is due. The
-- sweeper found parked rows with `WHERE status = 9 ORDER BY seq LIMIT 10000`, which no
-- index serves since migration 5 (a sequential scan and a sort of the whole table), and
-- never looked past those 10,000 rows.
--
-- Now a key's first parked row (its head) carries `parked_until`: when it is due by the
-- database's clock, or 'infinity' while a destination's circuit holds it (`parked_for`
-- then names the circuit). Rows parked behind their key's head carry neither: they go
-- with their head, and the sweeper flags the next one when the head leaves. The sweeper
-- walks due heads in `parked_until` order, finds an open circuit's trial by its own
-- lookup, and the stream asks whether a key has a head before it publishes the key's
-- next message.
--
-- Only the WAL relay writes these columns: the polling relay's claims and releases
-- leave them alone and stay heap-only-tuple updates (migration 5). Constant (NULL)
-- defaults add the columns without rewriting the table.
ALTER TABLE {schema}.outbox_messages ADD COLUMN IF NOT EXISTS parked_until timestamptz;
ALTER TABLE {schema}.outbox_messages ADD COLUMN IF NOT EXISTS parked_for text;

-- Rows a WAL relay parked before this migration (Processing, no claim token): each
-- key's first one is its head, due when its lease said.
UPDATE {schema}.outbox_messages AS m
   SET parked_until = COALESCE(m.lease_until, now())
  FROM (SELECT DISTINCT ON (order_key) id FROM {schema}.outbox_messages
         WHERE status = 9 AND claim_token IS NULL ORDER BY order_key, seq) AS h
 WHERE m.id = h.id;

-- Due heads in the order they came due (the sweeper's walk, `/healthz`'s stuck check).
CREATE INDEX IF NOT EXISTS outbox_messages_parked_due
    ON {schema}.outbox_messages (parked_until, seq) WHERE phase = 0 AND parked_until IS NOT NULL;
-- Whether a key has parked rows (its next message is parked behind them).
CREATE INDEX IF NOT EXISTS outbox_messages_parked_key
    ON {schema}.outbox_messages (order_key) WHERE phase = 0 AND parked_until IS NOT NULL;
-- The heads each open circuit holds, oldest first (its trial, its release).
CREATE INDEX IF NOT EXISTS outbox_messages_parked_for
    ON {schema}.outbox_messages (parked_for, seq) WHERE phase = 0 AND parked_for IS NOT NULL;
