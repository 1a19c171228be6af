//! What the chaos harness and its consumer processes agree on: the transport, the
//! consumer mode, the names of the tables, queues and stream, and how the consumers
//! connect. Used by both binaries (`chaos` and `chaos-consumer`).

use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use sqlx::postgres::PgConnectOptions;
use transport_nats::{NatsConfig, NatsConfigBuilder, NatsConsumer};
use transport_rabbit::{RabbitConfig, RabbitConsumer};

use crate::common;

/// The broker of a chaos run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Transport {
    /// RabbitMQ: a durable topic exchange, the consumers' quorum queue, an audit queue.
    Rabbit,
    /// NATS JetStream: a file-storage stream, a durable pull consumer shared by the
    /// consumer processes.
    Nats,
}

impl Transport {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Rabbit => "rabbit",
            Self::Nats => "nats",
        }
    }
}

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
/// The inbox consumer name of the effect handler.
pub(crate) const CONSUMER: &str = "chaos-effect";
/// `application_name` of the relays' database connections.
pub(crate) const RELAY_APP: &str = "chaos-relay";
/// `application_name` of the consumers' database connections.
pub(crate) const CONSUMER_APP: &str = "chaos-consumer";
/// `application_name` of the harness's own connections (producers, verdict).
pub(crate) const HARNESS_APP: &str = "chaos-harness";

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
    /// NATS subject prefix of the relays.
    pub(crate) subject_prefix: String,
    /// NATS stream capturing `{subject_prefix}.>`.
    pub(crate) stream: String,
    /// NATS durable consumer shared by the consumer processes.
    pub(crate) durable: String,
}

impl Names {
    pub(crate) fn new(schema: &str) -> Self {
        Self {
            schema: schema.to_owned(),
            exchange: format!("{schema}.events"),
            queue: format!("{schema}.projection"),
            audit_queue: format!("{schema}.audit"),
            overflow_queue: format!("{schema}.overflow"),
            subject_prefix: format!("{schema}.events"),
            stream: format!("{schema}_events"),
            durable: "projection".to_owned(),
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
    let url = common::database_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={app}")
}

/// Connect options of `DATABASE_URL` with `application_name` = `app`.
pub(crate) fn pg_options(app: &str) -> anyhow::Result<PgConnectOptions> {
    Ok(outbox_postgres::parse_url(&common::database_url())?.application_name(app))
}

/// Queue arguments of the consumers' queue: a quorum queue.
pub(crate) fn quorum_queue() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

pub(crate) fn rabbit_config(names: &Names) -> anyhow::Result<RabbitConfig> {
    Ok(RabbitConfig::builder(common::amqp_url())
        .with_exchange(&names.exchange)
        .build()?)
}

pub(crate) fn nats_config(names: &Names, connection: &str) -> anyhow::Result<NatsConfig> {
    Ok(NatsConfigBuilder::new(common::nats_url())
        .with_subject_prefix(&names.subject_prefix)
        .with_connection_name(connection)
        .build()?)
}

/// The consumers' RabbitMQ consumer: the quorum queue bound to [`EVENT_TYPE`].
pub(crate) fn rabbit_consumer(names: &Names) -> anyhow::Result<RabbitConsumer> {
    Ok(RabbitConsumer::builder(rabbit_config(names)?, &names.queue)
        .with_binding_keys([EVENT_TYPE])
        .with_queue_arguments(quorum_queue())
        .with_prefetch(64)
        .with_requeue_delay(Duration::from_millis(200))
        .build()?)
}

/// The consumers' NATS consumer: the durable pull consumer on [`EVENT_TYPE`]'s subject.
/// `ack_wait` stays at its default (30 s): above the 15 s of a deferred delivery plus
/// the pool's acquire timeout, as the transport asks.
pub(crate) fn nats_consumer(names: &Names, connection: &str) -> anyhow::Result<NatsConsumer> {
    let config = nats_config(names, connection)?;
    Ok(
        NatsConsumer::builder(config.clone(), &names.stream, &names.durable)
            .with_filter_subject(config.subject_for(EVENT_TYPE))
            .with_concurrency(64)
            .with_nak_delays(vec![Duration::from_millis(200)])
            .build()?,
    )
}
