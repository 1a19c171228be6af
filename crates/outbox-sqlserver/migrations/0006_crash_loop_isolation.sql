-- The crash-loop guard isolates before it kills (migration 8 of the PostgreSQL backend).
-- `{schema}` is replaced by the configured, validated schema name (bracket-quoted).
-- Batches are separated by lines holding only GO.
--
-- A row whose last claim ended without an outcome (Processing with an expired lease) is
-- a suspect: claims take it alone, and only such claims alone count toward the
-- crash-loop limit, in `unfinished_alone`. `unfinished_claims` (migration 4) keeps
-- counting every claim without an outcome. Every completion and every replay resets
-- both.
--
-- Skipped when the column exists already (a migration rerun by hand). Adding a NOT NULL
-- column with a constant default is a metadata-only change where SQL Server supports it
-- online (Enterprise and Developer editions, Azure SQL); elsewhere it writes the default
-- into every row under a schema-modification lock. No index uses the column.
IF COL_LENGTH(N'{schema}.outbox_messages', N'unfinished_alone') IS NULL
    ALTER TABLE {schema}.outbox_messages ADD
        unfinished_alone int NOT NULL
            CONSTRAINT outbox_messages_unfinished_alone_df DEFAULT 0;
