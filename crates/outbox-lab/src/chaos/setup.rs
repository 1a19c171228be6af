//! The run's tables, queues and stream, and the consumers' login role (on MariaDB also
//! the relays' user): created fresh
//! before the run (an earlier run's are dropped first) and removed after it.

use std::time::Duration;

use anyhow::Context as _;
use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use outboxkit_nats::async_nats::jetstream;
use outboxkit_nats::{NatsPublisher, StreamSetup};

use super::db::{self, Database, Db, Outbox};
use super::injector;
use super::topology::{
    self, DELAYED_EVENT_TYPE, EVENT_TYPE, Names, SIDE_EVENT_TYPE, TransportKind,
};
use crate::common;

/// Drops and recreates the schema (on MariaDB: the database): the outbox and inbox
/// tables (migrations), `orders`, `effects` (no unique constraint: a double effect is a
/// second row), `deliveries`, `audit` (the audit rows the producers write for the orders
/// whose handler swallows an error: see `producers`) and `foreign_messages` (what the
/// foreign producer published: see `foreign`), `side_events` (the side events the
/// producers wrote: see `producers`) and `delayed_events` (the delayed lane's messages:
/// see `delayed`); then the consumers' login (and on MariaDB the
/// relays'), with every privilege on the schema's tables.
pub(crate) async fn database(admin: &Db, outbox: &Outbox, names: &Names) -> anyhow::Result<()> {
    let s = &names.schema;
    let database = admin.database();
    remove_logins(admin, names).await?;
    admin
        .execute_all(&match database {
            Database::Postgres => vec![
                format!("DROP SCHEMA IF EXISTS {s} CASCADE"),
                format!("CREATE SCHEMA {s}"),
            ],
            Database::Mysql => vec![format!("DROP DATABASE IF EXISTS {s}")],
        })
        .await
        .context("create the run's schema")?;
    outbox.migrate().await.context("migrate the run's schema")?;
    admin
        .execute_all(&tables(database, s))
        .await
        .context("create the run's tables")?;
    logins(admin, names).await
}

/// The run's own tables, in `database`'s types.
fn tables(database: Database, s: &str) -> Vec<String> {
    let (uuid, time, text, boolean, now, engine) = match database {
        Database::Postgres => (
            "uuid",
            "timestamptz",
            "text",
            "boolean",
            "clock_timestamp()",
            "",
        ),
        Database::Mysql => (
            "BINARY(16)",
            "DATETIME(6)",
            "VARCHAR(255)",
            "BOOLEAN",
            "CURRENT_TIMESTAMP(6)",
            " ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        ),
    };
    vec![
        format!(
            "CREATE TABLE {s}.orders (
                 id {uuid} PRIMARY KEY,
                 event_id {uuid} NOT NULL UNIQUE,
                 created_at {time} NOT NULL){engine}"
        ),
        format!(
            "CREATE TABLE {s}.effects (
                 event_id {uuid} NOT NULL,
                 order_id {uuid} NOT NULL,
                 consumer {text} NOT NULL,
                 applied_at {time} NOT NULL){engine}"
        ),
        format!("CREATE INDEX effects_event ON {s}.effects (event_id)"),
        format!(
            "CREATE TABLE {s}.deliveries (
                 event_id {uuid} NOT NULL,
                 consumer {text} NOT NULL,
                 redelivered {boolean} NOT NULL,
                 at {time} NOT NULL DEFAULT {now}){engine}"
        ),
        format!(
            "CREATE TABLE {s}.audit (
                 order_id {uuid} PRIMARY KEY,
                 event_id {uuid} NOT NULL UNIQUE){engine}"
        ),
        format!(
            "CREATE TABLE {s}.foreign_messages (
                 id {uuid} PRIMARY KEY,
                 kind {text} NOT NULL,
                 expect {text} NOT NULL CHECK (expect IN ('applied', 'dead letter')),
                 reason {text} NOT NULL,
                 confirmed {boolean} NOT NULL){engine}"
        ),
        format!(
            "CREATE TABLE {s}.side_events (
                 id {uuid} PRIMARY KEY,
                 created_at {time} NOT NULL){engine}"
        ),
        format!(
            "CREATE TABLE {s}.delayed_events (
                 id {uuid} PRIMARY KEY,
                 delay_ms BIGINT NOT NULL,
                 far {boolean} NOT NULL){engine}"
        ),
    ]
}

/// Creates the consumers' login afresh (an earlier run's is dropped first: see
/// [`remove_logins`]), with the harness's URL's password if it has one and every
/// privilege on the schema's tables. On PostgreSQL a role that is not a superuser, so its
/// connection limit holds (the lockout fault sets it to 0). On MariaDB a user
/// `'…'@'%'` (the lockout fault sets its `MAX_USER_CONNECTIONS` to -1), and one more for
/// the relays.
async fn logins(admin: &Db, names: &Names) -> anyhow::Result<()> {
    let s = &names.schema;
    let database = admin.database();
    let password = topology::database_password(database).map(|p| p.replace('\'', "''"));
    let statements = match database {
        Database::Postgres => {
            let role = &names.consumer_role;
            let password = password
                .map(|p| format!(" PASSWORD '{p}'"))
                .unwrap_or_default();
            vec![
                format!("CREATE ROLE {role} LOGIN{password}"),
                format!("GRANT USAGE ON SCHEMA {s} TO {role}"),
                format!("GRANT ALL ON ALL TABLES IN SCHEMA {s} TO {role}"),
                format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA {s} TO {role}"),
            ]
        }
        Database::Mysql => {
            let password = password
                .map(|p| format!(" IDENTIFIED BY '{p}'"))
                .unwrap_or_default();
            [&names.consumer_role, &names.relay_role]
                .into_iter()
                .flat_map(|user| {
                    [
                        format!("CREATE USER '{user}'@'%'{password}"),
                        format!("GRANT ALL ON {s}.* TO '{user}'@'%'"),
                    ]
                })
                .collect()
        }
    };
    admin
        .execute_all(&statements)
        .await
        .with_context(|| format!("create the run's logins ({})", names.consumer_role))
}

/// Drops the run's logins if they exist (their connections ended first; on PostgreSQL
/// the consumers' role's privileges revoked).
async fn remove_logins(admin: &Db, names: &Names) -> anyhow::Result<()> {
    let role = &names.consumer_role;
    match admin.database() {
        Database::Postgres => {
            admin
                .execute(
                    format!(
                        "DO $$ BEGIN
                           IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
                             PERFORM pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}';
                             EXECUTE 'DROP OWNED BY {role}';
                             EXECUTE 'DROP ROLE {role}';
                           END IF;
                         END $$"
                    ),
                    Vec::new(),
                )
                .await
        }
        Database::Mysql => {
            let users = [role.as_str(), names.relay_role.as_str()];
            db::kill_connections(admin, &users).await?;
            admin
                .execute_all(
                    &users
                        .iter()
                        .map(|user| format!("DROP USER IF EXISTS '{user}'@'%'"))
                        .collect::<Vec<_>>(),
                )
                .await
                .map(|()| 0)
        }
    }
    .with_context(|| format!("drop the run's logins ({role})"))?;
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
            // One stream per destination: streams' subjects must not overlap. The
            // delayed lane's messages are kept by the orders' stream, outside the
            // consumers' filter.
            for (stream, event_types) in [
                (&names.stream, &[EVENT_TYPE, DELAYED_EVENT_TYPE][..]),
                (&names.side_stream, &[SIDE_EVENT_TYPE][..]),
            ] {
                publisher
                    .ensure_stream(
                        &StreamSetup::new(stream.as_str())
                            .with_subjects(event_types.iter().map(|t| config.subject_for(t)))
                            .with_duplicate_window(Duration::from_secs(120))
                            .with_replicas(if cluster { 3 } else { 1 }),
                    )
                    .await?;
            }
            publisher.close().await;
            // The side stream is the one the destination-full fault fills.
            let js = jetstream::new(common::nats_connect().await.context("connect to NATS")?);
            injector::add_sentinels(&js, &config.subject_for(SIDE_EVENT_TYPE))
                .await
                .context("the side stream's sentinel messages")?;
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

/// Drops the run's schema (MariaDB: database) and logins.
pub(crate) async fn remove_database(admin: &Db, names: &Names) -> anyhow::Result<()> {
    let s = &names.schema;
    admin
        .execute(
            match admin.database() {
                Database::Postgres => format!("DROP SCHEMA IF EXISTS {s} CASCADE"),
                Database::Mysql => format!("DROP DATABASE IF EXISTS {s}"),
            },
            Vec::new(),
        )
        .await?;
    remove_logins(admin, names).await
}
