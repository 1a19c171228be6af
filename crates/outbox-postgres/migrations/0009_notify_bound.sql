-- The notification trigger of migration 7, bounded. `{schema}` is replaced by the
-- configured, validated, quoted schema name.
--
-- PostgreSQL keeps every notification until each session listening on its channel has
-- read it, in one queue for the whole cluster (8 GB by default). A session that LISTENs
-- and stops reading (a stuck relay, a client of a pooler that lost it) makes the queue
-- grow until NOTIFY fails with "too many notifications in the NOTIFY queue", and a
-- notification that fails fails the producer's commit. So once the queue is half full
-- the trigger sends nothing: no relay is woken by this commit, but the relays' fallback
-- poll (and the listener's self-checks) still pick the rows up. A producer's commit
-- never fails because of the wake-up.
CREATE OR REPLACE FUNCTION {schema}.outbox_messages_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted) AND pg_notification_queue_usage() < 0.5 THEN
        PERFORM pg_notify('outbox', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END $$;
