-- The polling relay's held rows (migration 13 of the PostgreSQL backend). `{schema}` is
-- replaced by the configured, validated schema name (bracket-quoted). Batches are
-- separated by lines holding only GO.
--
-- When a destination (a full queue or stream) refuses a message while others take
-- messages, the dispatcher holds the message: New, uncharged, `visible_at` at
-- 9999-12-31 (past every claim's walk; datetime2 has no infinity) and `held_for` naming
-- the destination, until one held row of that destination, claimed alone as its trial,
-- is confirmed; then the destination's held rows are released (`visible_at = now`,
-- `held_for = NULL`) in chunks. Before this, held rows came back every trial period:
-- each claimed and deferred again.
--
-- A binary collation: destinations are routing keys, compared as the broker compares
-- them (case-sensitively), and listed in one order. Skipped when the column or index
-- exists already (a migration rerun by hand). A nullable column without a default is a
-- metadata-only change.
IF COL_LENGTH(N'{schema}.outbox_messages', N'held_for') IS NULL
    ALTER TABLE {schema}.outbox_messages ADD
        held_for nvarchar(255) COLLATE Latin1_General_BIN2 NULL;
GO

-- The held rows of each destination, oldest first (its trial, its release), and the
-- destinations that hold rows (walked one seek per destination).
IF NOT EXISTS (SELECT 1 FROM sys.indexes
                WHERE name = N'outbox_messages_held_for'
                  AND object_id = OBJECT_ID(N'{schema}.outbox_messages'))
    CREATE INDEX outbox_messages_held_for
        ON {schema}.outbox_messages (held_for, seq)
        WHERE held_for IS NOT NULL;
