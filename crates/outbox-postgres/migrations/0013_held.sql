-- The polling relay's held rows. `{schema}` is replaced by the configured, validated,
-- quoted schema name.
--
-- When a destination (a full queue or stream) refuses a message while others take
-- messages, the dispatcher holds the message: New, uncharged, `visible_at` at
-- 9999-12-31 (out of every claim's walk of the pending index; not 'infinity', which
-- clients cannot decode as a time) and `held_for` naming the
-- destination, until one held row of that destination, claimed alone as its trial, is
-- confirmed; then the destination's held rows are released (`visible_at = now()`,
-- `held_for = NULL`) in chunks. Before this, held rows came back every trial period
-- (`visible_at = next trial`): each one claimed and deferred again, two index-changing
-- updates per held row per trial period.
--
-- A constant (NULL) default adds the column without rewriting the table. Rows that are
-- not held keep `held_for` NULL, so claims and completions, which write NULL over NULL,
-- stay heap-only-tuple updates (migration 5).
ALTER TABLE {schema}.outbox_messages ADD COLUMN IF NOT EXISTS held_for text;

-- The held rows of each destination, oldest first (its trial, its release), and the
-- destinations that hold rows (walked one probe per destination).
CREATE INDEX IF NOT EXISTS outbox_messages_held_for
    ON {schema}.outbox_messages (held_for, seq) WHERE held_for IS NOT NULL;
