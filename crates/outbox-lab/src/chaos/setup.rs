//! The run's tables, queues and stream, and the consumers' login role: created fresh
//! before the run (an earlier run's are dropped first) and removed after it.

use std::time::Duration;

use anyhow::Context as _;
use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use outbox_postgres::PgOutbox;
use sqlx::{AssertSqlSafe, PgPool};
use transport_nats::async_nats::jetstream;
use transport_nats::{NatsPublisher, StreamSetup};

use super::topology::{self, EVENT_TYPE, Names, SIDE_EVENT_TYPE, TransportKind};
use crate::common;

/// Drops and recreates the schema: the outbox and inbox tables (migrations), `orders`,
/// `effects` (no unique constraint: a double effect is a second row), `deliveries`,
/// `audit` (the audit rows the producers write for the orders whose handler swallows an
/// error: see `producers`) and `foreign_messages` (what the foreign producer published:
/// see `foreign`) and `side_events` (the side events the producers wrote: see
/// `producers`); then the consumers' role, with every privilege on the schema's tables.
pub(crate) async fn database(
    admin: &PgPool,
    outbox: &PgOutbox,
    names: &Names,
) -> anyhow::Result<()> {
    let s = &names.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {s} CASCADE; CREATE SCHEMA {s};"
    )))
    .execute(admin)
    .await
    .context("create the run's schema")?;
    outbox.migrate().await.context("migrate the run's schema")?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {s}.orders (
             id uuid PRIMARY KEY,
             event_id uuid NOT NULL UNIQUE,
             created_at timestamptz NOT NULL);
         CREATE TABLE {s}.effects (
             event_id uuid NOT NULL,
             order_id uuid NOT NULL,
             consumer text NOT NULL,
             applied_at timestamptz NOT NULL);
         CREATE INDEX effects_event ON {s}.effects (event_id);
         CREATE TABLE {s}.deliveries (
             event_id uuid NOT NULL,
             consumer text NOT NULL,
             redelivered boolean NOT NULL,
             at timestamptz NOT NULL DEFAULT clock_timestamp());
         CREATE TABLE {s}.audit (
             order_id uuid PRIMARY KEY,
             event_id uuid NOT NULL UNIQUE);
         CREATE TABLE {s}.foreign_messages (
             id uuid PRIMARY KEY,
             kind text NOT NULL,
             expect text NOT NULL CHECK (expect IN ('applied', 'dead letter')),
             reason text NOT NULL,
             confirmed boolean NOT NULL);
         CREATE TABLE {s}.side_events (
             id uuid PRIMARY KEY,
             created_at timestamptz NOT NULL);"
    )))
    .execute(admin)
    .await
    .context("create the run's tables")?;
    consumer_role(admin, names).await
}

/// Creates the consumers' login role afresh (an earlier run's is dropped first): not a
/// superuser, so its connection limit holds (the lockout fault sets it to 0), with
/// `DATABASE_URL`'s password if it has one, and every privilege on the schema's tables
/// and sequences.
async fn consumer_role(admin: &PgPool, names: &Names) -> anyhow::Result<()> {
    remove_consumer_role(admin, names).await?;
    let (s, role) = (&names.schema, &names.consumer_role);
    let password = topology::database_password()
        .map(|p| format!(" PASSWORD '{}'", p.replace('\'', "''")))
        .unwrap_or_default();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN{password};
         GRANT USAGE ON SCHEMA {s} TO {role};
         GRANT ALL ON ALL TABLES IN SCHEMA {s} TO {role};
         GRANT ALL ON ALL SEQUENCES IN SCHEMA {s} TO {role};"
    )))
    .execute(admin)
    .await
    .with_context(|| format!("create the consumers' role {role}"))?;
    Ok(())
}

/// Drops the consumers' role if it exists (its connections terminated, its privileges
/// revoked).
async fn remove_consumer_role(admin: &PgPool, names: &Names) -> anyhow::Result<()> {
    let role = &names.consumer_role;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DO $$ BEGIN
           IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
             PERFORM pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';
             EXECUTE 'DROP OWNED BY {role}';
             EXECUTE 'DROP ROLE {role}';
           END IF;
         END $$"
    )))
    .execute(admin)
    .await
    .with_context(|| format!("drop the consumers' role {role}"))?;
    Ok(())
}

/// Declares the broker side before any process starts: RabbitMQ's exchange, the
/// consumers' quorum queue, the audit queue, the overflow queue (held full by the
/// queue-full fault) and the side queue (held full by the destination-full fault); or
/// the NATS streams (the consumers' and the side events'; 3 replicas on the `cluster`)
/// and the durable consumer (`batched`: the consumers' `ack_wait`). What an earlier run
/// left is deleted first.
pub(crate) async fn broker(
    transport: TransportKind,
    names: &Names,
    batched: bool,
    cluster: bool,
) -> anyhow::Result<()> {
    remove_broker(transport, names).await?;
    match transport {
        TransportKind::Rabbit => {
            topology::rabbit_consumer(names)?.declare().await.context(
                "declare the exchange and the consumers' quorum queue (is RabbitMQ up?)",
            )?;
            let conn = common::amqp_connect().await?;
            let ch = conn.create_channel().await?;
            // On the clusters every queue is a quorum queue: a classic queue lives on one
            // node, and while that node is down what only it would take is unroutable.
            let mut arguments = FieldTable::default();
            if cluster {
                arguments.insert(
                    "x-queue-type".into(),
                    lapin::types::AMQPValue::LongString("quorum".into()),
                );
            }
            for (queue, key) in [
                (&names.audit_queue, "#"),
                (&names.overflow_queue, "#"),
                (&names.side_queue, SIDE_EVENT_TYPE),
            ] {
                ch.queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    arguments.clone(),
                )
                .await?;
                ch.queue_bind(
                    queue.as_str().into(),
                    names.exchange.as_str().into(),
                    key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            }
            conn.close(200, "declared".into()).await?;
        }
        TransportKind::Nats => {
            let config = topology::nats_config(names, "chaos-harness")?;
            let publisher = NatsPublisher::connect(config.clone())
                .await
                .context("connect to NATS (is it running with JetStream?)")?;
            // One stream per destination: streams' subjects must not overlap.
            for (stream, event_type) in [
                (&names.stream, EVENT_TYPE),
                (&names.side_stream, SIDE_EVENT_TYPE),
            ] {
                publisher
                    .ensure_stream(
                        &StreamSetup::new(stream.as_str())
                            .with_subject(config.subject_for(event_type))
                            .with_duplicate_window(Duration::from_secs(120))
                            .with_replicas(if cluster { 3 } else { 1 }),
                    )
                    .await?;
            }
            publisher.close().await;
            topology::nats_consumer(names, "chaos-harness", batched)?
                .declare()
                .await
                .context("create the durable consumer")?;
        }
    }
    Ok(())
}

/// Deletes the run's queues and exchange, or its streams.
pub(crate) async fn remove_broker(transport: TransportKind, names: &Names) -> anyhow::Result<()> {
    match transport {
        TransportKind::Rabbit => {
            let conn = common::amqp_connect()
                .await
                .context("connect to RabbitMQ")?;
            let ch = conn.create_channel().await?;
            for queue in [
                &names.queue,
                &names.audit_queue,
                &names.overflow_queue,
                &names.side_queue,
            ] {
                ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await?;
            }
            ch.exchange_delete(
                names.exchange.as_str().into(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await?;
            conn.close(200, "removed".into()).await?;
        }
        TransportKind::Nats => {
            let client = common::nats_connect().await.context("connect to NATS")?;
            let js = jetstream::new(client);
            for stream in [&names.stream, &names.side_stream] {
                if let Err(e) = js.delete_stream(stream).await {
                    let missing = matches!(
                        e.kind(),
                        jetstream::context::DeleteStreamErrorKind::JetStream(ref js)
                            if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
                    );
                    if !missing {
                        return Err(e).with_context(|| format!("delete the run's stream {stream}"));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Drops the run's schema and the consumers' role.
pub(crate) async fn remove_database(admin: &PgPool, names: &Names) -> anyhow::Result<()> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {} CASCADE",
        names.schema
    )))
    .execute(admin)
    .await?;
    remove_consumer_role(admin, names).await
}
