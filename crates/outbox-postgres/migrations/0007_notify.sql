-- Push wake-up of relays. `{schema}` is replaced by the configured, validated, quoted
-- schema name.
--
-- After every statement that inserts into outbox_messages, the database itself sends
-- NOTIFY on the channel `outbox` with the schema's name as payload, so producers in any
-- language wake the relays that LISTEN on it. PostgreSQL delivers a transaction's
-- notifications at commit and folds identical ones into one, so a transaction sends one
-- notification per schema, however many rows and statements it inserts. A statement
-- that inserts no row sends nothing (the trigger fires for it, the WHEN of a statement
-- trigger cannot see rows: the function checks the transition table).
--
-- The channel name is fixed (a schema name of up to 63 bytes would not fit a
-- channel name with a prefix); listeners filter on the payload.
CREATE OR REPLACE FUNCTION {schema}.outbox_messages_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted) THEN
        PERFORM pg_notify('outbox', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS outbox_messages_notify ON {schema}.outbox_messages;
CREATE TRIGGER outbox_messages_notify
    AFTER INSERT ON {schema}.outbox_messages
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.outbox_messages_notify();
