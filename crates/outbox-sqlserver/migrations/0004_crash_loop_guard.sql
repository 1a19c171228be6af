-- The crash-loop guard (migration 6 of the PostgreSQL backend). `{schema}` is replaced by
-- the configured, validated schema name (bracket-quoted). Batches are separated by lines
-- holding only GO.
--
-- Every outbox claim adds one to a row's count of claims without an outcome and every
-- completion (sent, retry, dead, release) and every replay sets it back to 0. A row
-- that reaches the store's crash-loop limit (5 by default) is not claimed again but
-- moved to Dead by the claim: each relay that took it stopped, crashed or lost its lease
-- before recording anything, the mark of a row that kills whatever publishes it.
--
-- Skipped when the column exists already (a migration rerun by hand). Adding a NOT NULL
-- column with a constant default is a metadata-only change where SQL Server supports it
-- online (Enterprise and Developer editions, Azure SQL); elsewhere it writes the default
-- into every row under a schema-modification lock. No index uses the column.
IF COL_LENGTH(N'{schema}.outbox_messages', N'unfinished_claims') IS NULL
    ALTER TABLE {schema}.outbox_messages ADD
        unfinished_claims int NOT NULL
            CONSTRAINT outbox_messages_unfinished_claims_df DEFAULT 0;
