//! What the chaos harness and its consumer processes agree on: the transport, the
//! consumer mode, the names of the tables, queues and stream, and how the consumers
//! connect. Used by both binaries (`chaos` and `chaos-consumer`).

pub(crate) use outboxkit_core::TransportKind;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use outboxkit_nats::{NatsConfig, NatsConsumer, NatsConsumerConfig};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig};
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;

use super::db::{Database, url_with_user};
use crate::common;

/// How a consumer process applies an event's effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ConsumerMode {
    /// `IdempotentConsumer` over `PgInbox`: inbox record and effect in one transaction,
    /// then the ack.
    Idempotent,
    /// `DurableReceiver` stores and acks, `InboxProcessor` applies.
    Durable,
    /// No inbox: the effect is written, then the delivery is acked (the harness must
    /// then find double effects).
    Direct,
}

impl ConsumerMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Idempotent => "idempotent inbox",
            Self::Durable => "durable inbox",
            Self::Direct => "no inbox",
        }
    }
}

/// The event type the producers write.
pub(crate) const EVENT_TYPE: &str = "OrderPlaced";
/// The event type of the side events: a second destination (its own RabbitMQ routing
/// key and queue, its own NATS subject and stream) that no consumer reads, held full by
/// the destination-full fault while [`EVENT_TYPE`]'s destination must keep flowing.
pub(crate) const SIDE_EVENT_TYPE: &str = "OrderNoted";
/// The event type of the delayed lane's messages (`delayed`): a destination of its own
/// that no consumer reads (RabbitMQ: only the `#` queues take it; NATS: a second
/// subject of the orders' stream, outside the consumers' filter).
pub(crate) const DELAYED_EVENT_TYPE: &str = "OrderReminder";
/// The inbox consumer name of the effect handler.
pub(crate) const CONSUMER: &str = "chaos-effect";
/// `application_name` of the relays' database connections.
pub(crate) const RELAY_APP: &str = "chaos-relay";
/// `application_name` of the consumers' database connections.
pub(crate) const CONSUMER_APP: &str = "chaos-consumer";
/// `application_name` of the harness's own connections (producers, verdict).
pub(crate) const HARNESS_APP: &str = "chaos-harness";

/// The quorum queue's `x-delivery-limit` and the NATS consumer's `max_deliver`: the
/// default limit of RabbitMQ 4's quorum queues. Above what a message's honest
/// redeliveries reach in a run (the inbox's 5 deliveries of a failing handler, plus one
/// per consumer kill, broker restart or freeze that caught it in flight), far below
/// what a database outage would spend if the consumers requeued deliveries while it
/// lasts (one every 200 ms): a message over the limit is dropped by the broker (no
/// dead-letter exchange, no further delivery) and the verdict counts it lost.
pub(crate) const DELIVERY_LIMIT: u16 = 20;

/// The names of everything one chaos run creates, all derived from its schema.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// PostgreSQL schema: orders, effects, deliveries, outbox and inbox tables.
    pub(crate) schema: String,
    /// RabbitMQ topic exchange the relays publish to.
    pub(crate) exchange: String,
    /// RabbitMQ quorum queue of the consumers (bound to [`EVENT_TYPE`]).
    pub(crate) queue: String,
    /// RabbitMQ audit queue (classic, durable, bound to `#`), drained by the harness.
    pub(crate) audit_queue: String,
    /// RabbitMQ queue held full during the queue-full fault (classic, durable, bound to
    /// `#`, never consumed; its content is of no interest).
    pub(crate) overflow_queue: String,
    /// RabbitMQ queue of the side events (classic, durable, bound to
    /// [`SIDE_EVENT_TYPE`], never consumed), held full by the destination-full fault.
    pub(crate) side_queue: String,
    /// NATS subject prefix of the relays.
    pub(crate) subject_prefix: String,
    /// NATS stream capturing [`EVENT_TYPE`]'s subject.
    pub(crate) stream: String,
    /// NATS stream capturing [`SIDE_EVENT_TYPE`]'s subject, held full (`max_msgs`,
    /// `discard: new`) by the destination-full fault.
    pub(crate) side_stream: String,
    /// NATS durable consumer shared by the consumer processes.
    pub(crate) durable: String,
    /// PostgreSQL login role (MariaDB user) of the consumer processes (not a superuser,
    /// so that the harness can lock it out alone: see `injector`).
    pub(crate) consumer_role: String,
    /// MariaDB user of the relays (on PostgreSQL they log in as `DATABASE_URL`'s user,
    /// told apart by their `application_name`; MariaDB has none, so a user of their
    /// own, whose connections `KILL CONNECTION` finds).
    pub(crate) relay_role: String,
}

impl Names {
    pub(crate) fn new(schema: &str) -> Self {
        Self {
            schema: schema.to_owned(),
            exchange: format!("{schema}.events"),
            queue: format!("{schema}.projection"),
            audit_queue: format!("{schema}.audit"),
            overflow_queue: format!("{schema}.overflow"),
            side_queue: format!("{schema}.side"),
            subject_prefix: format!("{schema}.events"),
            stream: format!("{schema}_events"),
            side_stream: format!("{schema}_side"),
            durable: "projection".to_owned(),
            consumer_role: format!("{schema}_consumer"),
            relay_role: format!("{schema}_relay"),
        }
    }

    /// `{schema}.{table}`.
    pub(crate) fn table(&self, table: &str) -> String {
        format!("{}.{table}", self.schema)
    }
}

/// `DATABASE_URL` with `application_name` set, so the harness can find (and
/// terminate) one group's connections in `pg_stat_activity`.
pub(crate) fn database_url_as(app: &str) -> String {
    common::with_application_name(&common::database_url(), app)
}

/// Connect options of `DATABASE_URL` with `application_name` = `app`.
pub(crate) fn pg_options(app: &str) -> anyhow::Result<PgConnectOptions> {
    Ok(outboxkit_postgres::parse_url(&common::database_url())?.application_name(app))
}

/// Connect options of the consumer processes: `DATABASE_URL` as the run's consumer
/// role, with `application_name` = [`CONSUMER_APP`].
pub(crate) fn consumer_pg_options(names: &Names) -> anyhow::Result<PgConnectOptions> {
    Ok(pg_options(CONSUMER_APP)?.username(&names.consumer_role))
}

/// The relays' `--database-url`: on PostgreSQL `DATABASE_URL` with `application_name`
/// [`RELAY_APP`], on MariaDB `MYSQL_URL` as the run's relay user, starting in the run's
/// database.
pub(crate) fn relay_url(database: Database, names: &Names) -> String {
    match database {
        Database::Postgres => database_url_as(RELAY_APP),
        Database::Mysql => {
            url_with_user(&common::mysql_url(), &names.relay_role, Some(&names.schema))
        }
    }
}

/// Connect options of the consumer processes on MariaDB: `MYSQL_URL` as the run's
/// consumer user, starting in the run's database (sessions in UTC).
pub(crate) fn consumer_mysql_options(names: &Names) -> anyhow::Result<MySqlConnectOptions> {
    Ok(outboxkit_mysql::parse_url(&url_with_user(
        &common::mysql_url(),
        &names.consumer_role,
        Some(&names.schema),
    ))?)
}

/// The password of the harness's URL's user (`DATABASE_URL`, `MYSQL_URL`), if it has one
/// (percent-decoded): the consumer role and the relay user get the same, so that they
/// can log in wherever the harness can.
pub(crate) fn database_password(database: Database) -> Option<String> {
    let url = database.url();
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    let password = userinfo.split_once(':')?.1;
    let bytes = password.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Queue arguments of the consumers' queue: a quorum queue with a delivery limit
/// ([`DELIVERY_LIMIT`]).
pub(crate) fn quorum_queue() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongInt(i32::from(DELIVERY_LIMIT)),
    );
    args
}

/// The consumers' NATS `ack_wait`. Batched consumers keep every message they hold alive
/// with `+WPI` every third of it, so it only bounds how long a killed consumer's
/// messages wait: 10 s, which the consumers' database outage outlasts. One message at a
/// time, a deferred delivery is handed back after up to 15 s, and each try waits for
/// the pool (5 s acquire timeout) twice (the delivery record, then the inbox): the
/// default 30 s, above those 25 s.
pub(crate) fn nats_ack_wait(batched: bool) -> Duration {
    Duration::from_secs(if batched { 10 } else { 30 })
}

pub(crate) fn rabbit_config(names: &Names) -> anyhow::Result<RabbitConfig> {
    Ok(RabbitConfig::new(common::amqp_url()).with_exchange(&names.exchange))
}

pub(crate) fn nats_config(names: &Names, connection: &str) -> anyhow::Result<NatsConfig> {
    Ok(NatsConfig::new(common::nats_url())
        .with_subject_prefix(&names.subject_prefix)
        .with_connection_name(connection))
}

/// The consumers' RabbitMQ consumer: the quorum queue bound to [`EVENT_TYPE`].
pub(crate) fn rabbit_consumer(names: &Names) -> anyhow::Result<RabbitConsumer> {
    Ok(RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit_config(names)?, &names.queue)
            .with_binding_keys([EVENT_TYPE])
            .with_queue_arguments(quorum_queue())
            .with_prefetch(64)
            .with_requeue_delay(Duration::from_millis(200)),
    )?)
}

/// The consumers' NATS consumer: the durable pull consumer on [`EVENT_TYPE`]'s subject,
/// with [`nats_ack_wait`] and `max_deliver` = [`DELIVERY_LIMIT`].
pub(crate) fn nats_consumer(
    names: &Names,
    connection: &str,
    batched: bool,
) -> anyhow::Result<NatsConsumer> {
    let config = nats_config(names, connection)?;
    Ok(NatsConsumer::new(
        NatsConsumerConfig::new(config.clone(), &names.stream, &names.durable)
            .with_filter_subject(config.subject_for(EVENT_TYPE))
            .with_concurrency(64)
            .with_ack_wait(nats_ack_wait(batched))
            .with_max_deliver(Some(u32::from(DELIVERY_LIMIT)))
            .with_nak_delays(vec![Duration::from_millis(200)]),
    )?)
}
