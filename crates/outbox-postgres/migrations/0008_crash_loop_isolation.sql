-- The crash-loop guard isolates before it kills. `{schema}` is replaced by the
-- configured, validated schema name.
--
-- A row whose last claim ended without an outcome (Processing with an expired lease) is a
-- suspect: claims take it alone, and only such claims alone count toward the crash-loop
-- limit, in `unfinished_alone`. `unfinished_claims` keeps counting every claim without an
-- outcome. Every completion resets both.
--
-- A constant default adds the column without rewriting the table, and no index uses it,
-- so claims stay heap-only-tuple updates (migration 5).
ALTER TABLE {schema}.outbox_messages
    ADD COLUMN IF NOT EXISTS unfinished_alone integer NOT NULL DEFAULT 0;
