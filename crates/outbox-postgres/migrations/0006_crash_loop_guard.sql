-- The crash-loop guard. `{schema}` is replaced by the configured, validated schema name.
--
-- Every claim adds one to a row's count of claims without an outcome and every
-- completion (sent, retry, dead, release) sets it back to 0. A row that reaches the
-- store's crash-loop limit (5 by default) is not claimed again but moved to Dead by the
-- claim: each relay that took it stopped, crashed or lost its lease before recording
-- anything, the mark of a row that kills whatever publishes it.
--
-- A constant default adds the column without rewriting the table, and no index uses it,
-- so claims stay heap-only-tuple updates (migration 5).
ALTER TABLE {schema}.outbox_messages
    ADD COLUMN IF NOT EXISTS unfinished_claims integer NOT NULL DEFAULT 0;
