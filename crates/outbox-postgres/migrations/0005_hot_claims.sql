-- Claims as heap-only-tuple (HOT) updates. `{schema}` is replaced by the configured,
-- validated schema name.
--
-- PostgreSQL can update a row in place, without a new entry in any index and with only
-- the changed bytes in the WAL, when the update changes no column that an index uses
-- (as key, expression or predicate) and the new version fits on the same page. A claim
-- (New -> Processing) changes status, lease_until, claim_token and attempts. Before this
-- migration every partial index filtered on `status` and one indexed `lease_until`, so
-- each claim wrote a whole new row version and three index entries.
--
-- Now the partial indexes filter on `phase`: the status with Processing folded into New
-- (0 pending, 1 sent or done, 3 dead), which a claim leaves unchanged. The claim finds
-- expired leases through the pending index (their visible_at has passed; the lease is
-- checked on the row) instead of an index on lease_until. Pages are filled only to half
-- at insert (fillfactor 50) so that the rows' claimed versions fit beside them, even when
-- one claim takes a whole page of a backlog (a claimed version is 24 bytes longer, so on
-- a page packed to the limit the last one may not fit and is an ordinary update). The
-- price is space: rows waiting for retention take up to twice the pages.
--
-- Adding a stored generated column rewrites each table once.

ALTER TABLE {schema}.outbox_messages
    ADD COLUMN IF NOT EXISTS phase smallint
        GENERATED ALWAYS AS (CASE WHEN status = 9 THEN 0 ELSE status END) STORED;
ALTER TABLE {schema}.outbox_messages SET (fillfactor = 50);

DROP INDEX IF EXISTS {schema}.outbox_messages_claim_new;
DROP INDEX IF EXISTS {schema}.outbox_messages_claim_expired;
DROP INDEX IF EXISTS {schema}.outbox_messages_dead;
DROP INDEX IF EXISTS {schema}.outbox_messages_sent;
DROP INDEX IF EXISTS {schema}.outbox_messages_key_pending;
DROP INDEX IF EXISTS {schema}.outbox_messages_key_dead;

-- The claim path: pending (New or Processing) rows in (visible_at, seq) order.
CREATE INDEX IF NOT EXISTS outbox_messages_pending
    ON {schema}.outbox_messages (visible_at, seq) WHERE phase = 0;
-- Dead-letter listing and replay.
CREATE INDEX IF NOT EXISTS outbox_messages_dead
    ON {schema}.outbox_messages (created_at) WHERE phase = 3;
-- Retention of sent rows.
CREATE INDEX IF NOT EXISTS outbox_messages_sent
    ON {schema}.outbox_messages (sent_at) WHERE phase = 1;
-- Ordered delivery: pending messages per key in seq order, and dead ones.
CREATE INDEX IF NOT EXISTS outbox_messages_key_pending
    ON {schema}.outbox_messages (order_key, seq) WHERE phase = 0;
CREATE INDEX IF NOT EXISTS outbox_messages_key_dead
    ON {schema}.outbox_messages (order_key, seq) WHERE phase = 3;

-- The durable inbox is claimed by the same statement.
ALTER TABLE {schema}.inbox_messages
    ADD COLUMN IF NOT EXISTS phase smallint
        GENERATED ALWAYS AS (CASE WHEN status = 9 THEN 0 ELSE status END) STORED;
ALTER TABLE {schema}.inbox_messages SET (fillfactor = 50);

DROP INDEX IF EXISTS {schema}.inbox_messages_claim_new;
DROP INDEX IF EXISTS {schema}.inbox_messages_claim_expired;
DROP INDEX IF EXISTS {schema}.inbox_messages_done;

CREATE INDEX IF NOT EXISTS inbox_messages_pending
    ON {schema}.inbox_messages (visible_at, seq) WHERE phase = 0;
CREATE INDEX IF NOT EXISTS inbox_messages_done
    ON {schema}.inbox_messages (processed_at) WHERE phase = 1;
-- Consumer dead letters of the durable inbox (listing and replay).
CREATE INDEX IF NOT EXISTS inbox_messages_dead
    ON {schema}.inbox_messages (received_at) WHERE phase = 3;
