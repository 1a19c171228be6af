-- The polling relay's held rows. `{schema}` is replaced by the configured, validated,
-- backquoted database name.
--
-- When a destination (a full queue or stream) refuses a message while others take
-- messages, the dispatcher holds the message: New, uncharged, `visible_at` at
-- 9999-12-31 (past every claim's walk of the pending index; DATETIME has no infinity)
-- and `held_for` naming the destination, until one held row of that destination,
-- claimed alone as its trial, is confirmed; then the destination's held rows are
-- released (`visible_at = NOW(6)`, `held_for = NULL`) in chunks. Before this, held rows
-- came back every trial period: each claimed and deferred again.
--
-- One statement, so that it is applied whole or not at all (MySQL 8's atomic DDL; an
-- instant ADD COLUMN). The key serves a destination's trial and release (its rows in
-- `seq` order) and the list of destinations (a loose index scan).
ALTER TABLE {schema}.outbox_messages
    ADD COLUMN held_for VARCHAR(255) NULL,
    ADD KEY outbox_messages_held_for (held_for, seq);
