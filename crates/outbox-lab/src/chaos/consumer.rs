//! A consumer process of `cargo xtask chaos`: the real transport consumer
//! (`RabbitConsumer` on the run's quorum queue, or `NatsConsumer` on its file-storage
//! stream) applying each `OrderPlaced` event's effect, one row in `effects`, through the
//! real inbox:
//!
//! - `--inbox idempotent`: `IdempotentConsumer` over `PgInbox` (`--database mysql`:
//!   `MySqlInbox`; inbox record and effect in one transaction, then the ack);
//! - `--inbox durable`: `DurableReceiver` stores and acks, an `InboxProcessor` in the
//!   same process applies (3 attempts, about a second apart, so that a failing message
//!   is decided within the harness's drain);
//! - `--inbox direct`: no inbox, the effect is written in a transaction of its own,
//!   committed with sqlx's plain `commit`, and then the delivery acked, so a redelivery
//!   is a second effect and a swallowed error an ack without effect (the harness must
//!   catch both).
//!
//! With `--batched` the transport hands deliveries over in batches (`run_batched`): the
//! idempotent consumer applies a batch in one transaction and the durable receiver
//! stores it with one statement, so a kill lands between a batch's commit and its acks.
//!
//! The handler misbehaves on purpose for the orders the producers mark (`"audit": true`
//! in the event, and an `audit` row already written with the order): after the effect
//! it inserts the order's audit row, and on the unique violation it does what many
//! handlers do ("already there means already applied"): it ignores the error and returns
//! `Ok`, on a transaction the failed statement aborted. The inbox must count that as the
//! handler's failure, and the message must end as a consumer dead letter, never be
//! acked as applied.
//!
//! Deliveries the transport cannot decode (the harness's foreign producer publishes
//! such messages straight to the broker) go to the inbox's `handle_undecodable`, which
//! records them as consumer dead letters under `undecodable`.
//!
//! `effects` has no unique constraint on purpose: a double effect is a second row for
//! the same event id, counted by the harness rather than prevented. Every decodable
//! delivery is also recorded in `deliveries` (best effort, before it is handled) so the
//! harness can count what the broker delivered. The process connects to PostgreSQL as
//! the run's consumer role, which the harness locks out during the consumers' database
//! outage. The harness kills this process with `SIGKILL` at random moments; `SIGTERM`
//! or `SIGINT` stop it gracefully.

use outboxkit_core::Consumer as _;
use std::sync::Arc;
use std::time::Duration;

use super::db::{Arg, Database, Db, bound};
use super::topology::{self, CONSUMER, ConsumerMode, EVENT_TYPE, Names, TransportKind};
use anyhow::Context as _;
use async_trait::async_trait;
use outboxkit::AnyConsumer;
use outboxkit_core::RetryPolicy;
use outboxkit_core::consumer::{BatchDeliveryHandler, DeliveryHandler, HandlerDecision};
use outboxkit_core::wire::{IncomingMessage, UndecodableMessage};
use outboxkit_core::{ConsumerDeadLetters, DurableInbox, InboxStore, VersionTracking};
use outboxkit_inbox::{
    ConsumerConfig, DurableReceiver, Handler, HandlerContext, HandlerError, IdempotentConsumer,
    InboxProcessor, Pipeline, ProcessorConfig,
};
use outboxkit_mysql::{MySqlConfig, MySqlInbox, MySqlOutbox};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use serde::Deserialize;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{MySqlConnection, PgConnection};
use tokio_util::sync::CancellationToken;

/// One consumer process of a chaos run.
#[derive(Debug, clap::Parser)]
pub struct Args {
    /// The broker.
    #[arg(long, value_enum)]
    transport: TransportKind,
    /// The run's schema (names of the tables, queues and stream derive from it).
    #[arg(long)]
    schema: String,
    /// The database: PostgreSQL (`DATABASE_URL`) or MariaDB / MySQL (`MYSQL_URL`), as
    /// the run's consumer login.
    #[arg(long, value_enum, default_value_t = Database::Postgres)]
    database: Database,
    /// How effects are applied.
    #[arg(long, value_enum, default_value_t = ConsumerMode::Idempotent)]
    inbox: ConsumerMode,
    /// This consumer's number, recorded with its deliveries and effects.
    #[arg(long, default_value_t = 0)]
    instance: u32,
    /// Batched mode (`run_batched`); with `--inbox idempotent` or `durable` only.
    #[arg(long)]
    batched: bool,
}

/// The part of the event the effect needs.
#[derive(Debug, Deserialize)]
struct OrderPlaced {
    order_id: uuid::Uuid,
    /// The producer wrote the order's audit row already: the handler's own insert of it
    /// fails, and the handler swallows the error.
    #[serde(default)]
    audit: bool,
}

/// The effect: the effect row (the event id, its order, who applied it and when), then,
/// for an order marked `audit`, its audit row, whose unique violation is swallowed
/// ("already there means already applied"): the handler returns `Ok` on a transaction
/// the failed insert aborted (PostgreSQL), or on one that goes on without it (InnoDB
/// undoes the failed statement alone).
struct Effect {
    /// `INSERT` of the effect row: event id, order id, consumer.
    insert_effect: String,
    /// `INSERT` of the audit row: order id, event id.
    insert_audit: String,
    consumer: String,
}

impl Effect {
    fn new(names: &Names, database: Database, consumer: &str) -> Self {
        let a = |n| database.arg(n);
        Self {
            insert_effect: format!(
                "INSERT INTO {} (event_id, order_id, consumer, applied_at)
                 VALUES ({}, {}, {}, {})",
                names.table("effects"),
                a(1),
                a(2),
                a(3),
                database.now()
            ),
            insert_audit: format!(
                "INSERT INTO {} (order_id, event_id) VALUES ({}, {})",
                names.table("audit"),
                a(1),
                a(2)
            ),
            consumer: consumer.to_owned(),
        }
    }
}

/// Applies `$effect` (an [`Effect`]) for `$msg` on `$conn`, a connection of either
/// database (the statements are the same; the connection types differ).
macro_rules! apply_effect {
    ($effect:expr, $conn:expr, $msg:expr) => {{
        let (effect, msg): (&Effect, &IncomingMessage) = ($effect, $msg);
        let event: OrderPlaced = msg.json().map_err(HandlerError::permanent)?;
        bound!(
            query,
            effect.insert_effect.clone(),
            [
                Arg::Uuid(msg.id),
                Arg::Uuid(event.order_id),
                Arg::Text(effect.consumer.clone()),
            ]
        )
        .execute(&mut *$conn)
        .await?;
        if event.audit {
            let audited = bound!(
                query,
                effect.insert_audit.clone(),
                [Arg::Uuid(event.order_id), Arg::Uuid(msg.id)]
            )
            .execute(&mut *$conn)
            .await;
            match audited {
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {}
                other => {
                    other?;
                }
            }
        }
        Ok::<(), HandlerError>(())
    }};
}

/// The effect as the inbox's handler, on each database's inbox store.
macro_rules! effect_handler {
    ($store:ty, $conn:ty) => {
        #[async_trait]
        impl Handler<$store> for Effect {
            async fn handle(
                &self,
                conn: &mut $conn,
                msg: &IncomingMessage,
                _ctx: &HandlerContext,
            ) -> Result<(), HandlerError> {
                apply_effect!(self, conn, msg)
            }
        }
    };
}
effect_handler!(PgInbox, PgConnection);
effect_handler!(MySqlInbox, MySqlConnection);

/// No inbox: the effect in a transaction of its own, committed with sqlx's plain
/// `commit` (which does not notice a transaction the swallowed error aborted), then
/// ack. A database error defers the delivery (it is not the message's fault).
struct Direct {
    pool: Db,
    effect: Effect,
}

impl Direct {
    async fn write(&self, msg: &IncomingMessage) -> Result<(), HandlerError> {
        match &self.pool {
            Db::Pg(pool) => {
                let mut tx = pool.begin().await?;
                apply_effect!(&self.effect, tx, msg)?;
                tx.commit().await?;
            }
            Db::My(pool) => {
                let mut tx = pool.begin().await?;
                apply_effect!(&self.effect, tx, msg)?;
                tx.commit().await?;
            }
        }
        Ok(())
    }
}

#[async_trait]
impl DeliveryHandler for Direct {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        match self.write(msg).await {
            Ok(()) => HandlerDecision::Ack,
            Err(e) if e.is_permanent() => {
                tracing::error!(id = %msg.id, error = %e, "cannot apply: rejected");
                HandlerDecision::Reject
            }
            Err(e) => {
                tracing::warn!(id = %msg.id, error = %e, "cannot apply now: deferred");
                HandlerDecision::Defer
            }
        }
    }
}

/// Records each delivery in `deliveries` (best effort: a database outage loses the
/// record, not the delivery), then hands it to `inner`.
struct Recorded<H> {
    inner: H,
    pool: Db,
    deliveries: String,
    consumer: String,
}

#[async_trait]
impl<H: DeliveryHandler> DeliveryHandler for Recorded<H> {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let recorded = self
            .pool
            .execute(
                format!(
                    "INSERT INTO {} (event_id, consumer, redelivered) VALUES {}",
                    self.deliveries,
                    self.pool.database().rows(1, 3)
                ),
                vec![
                    Arg::Uuid(msg.id),
                    Arg::Text(self.consumer.clone()),
                    Arg::Bool(msg.redelivered),
                ],
            )
            .await;
        if let Err(e) = recorded {
            tracing::debug!(id = %msg.id, error = %e, "delivery not recorded");
        }
        self.inner.handle(msg).await
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        self.inner.handle_undecodable(msg).await
    }
}

/// [`Recorded`] for a batch: the batch's deliveries in one best-effort statement, then
/// `inner`.
struct RecordedBatch<H> {
    inner: H,
    pool: Db,
    deliveries: String,
    consumer: String,
}

#[async_trait]
impl<H: BatchDeliveryHandler> BatchDeliveryHandler for RecordedBatch<H> {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        let args = msgs
            .iter()
            .flat_map(|m| {
                [
                    Arg::Uuid(m.id),
                    Arg::Text(self.consumer.clone()),
                    Arg::Bool(m.redelivered),
                ]
            })
            .collect();
        let recorded = self
            .pool
            .execute(
                format!(
                    "INSERT INTO {} (event_id, consumer, redelivered) VALUES {}",
                    self.deliveries,
                    self.pool.database().rows(msgs.len(), 3)
                ),
                args,
            )
            .await;
        if let Err(e) = recorded {
            tracing::debug!(messages = msgs.len(), error = %e, "deliveries not recorded");
        }
        self.inner.handle_batch(msgs).await
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        self.inner.handle_undecodable(msg).await
    }
}

/// Cancels `token` at SIGTERM or SIGINT.
fn stop_on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = term => {}
        }
        token.cancel();
    });
}

/// The `chaos-consumer` binary: consumes until SIGTERM or SIGINT (see the
/// [module docs](self)).
///
/// # Errors
/// When the consumer stops for a reason retrying cannot fix, or `--batched` is given
/// with `--inbox direct`.
pub async fn main(args: Args) -> anyhow::Result<()> {
    let names = Names::new(&args.schema);
    super::db::use_database(args.database);
    // A short acquire timeout: during a database outage a delivery is deferred soon
    // rather than held for the default 30 s.
    let (max, timeout) = (16, Duration::from_secs(5));
    match args.database {
        Database::Postgres => {
            let pool = PgPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(timeout)
                .connect_lazy_with(topology::consumer_pg_options(&names)?);
            let config = PgConfig::default().with_schema(&args.schema);
            let store = Arc::new(PgOutbox::new(pool.clone(), &config)?.inbox());
            consume(&args, &names, store, Db::Pg(pool)).await
        }
        Database::Mysql => {
            let pool = MySqlPoolOptions::new()
                .max_connections(max)
                .acquire_timeout(timeout)
                .connect_lazy_with(topology::consumer_mysql_options(&names)?);
            let config = MySqlConfig::default().with_schema(&args.schema);
            let store = Arc::new(MySqlOutbox::new(pool.clone(), &config)?.inbox());
            consume(&args, &names, store, Db::My(pool)).await
        }
    }
}

/// Consumes with `store`, the inbox over `pool`, until SIGTERM or SIGINT.
async fn consume<S>(args: &Args, names: &Names, store: Arc<S>, pool: Db) -> anyhow::Result<()>
where
    S: InboxStore + VersionTracking + ConsumerDeadLetters + DurableInbox + 'static,
    Effect: Handler<S>,
{
    let consumer_name = format!("consumer-{}", args.instance);
    let consumer = match args.transport {
        TransportKind::Rabbit => AnyConsumer::Rabbit(topology::rabbit_consumer(names)?),
        TransportKind::Nats => AnyConsumer::Nats(topology::nats_consumer(
            names,
            &consumer_name,
            args.batched,
        )?),
    };
    let shutdown = CancellationToken::new();
    stop_on_signals(shutdown.clone());
    let effect = || Effect::new(names, pool.database(), &consumer_name);
    let record = |inner: Arc<dyn DeliveryHandler>| Recorded {
        inner,
        pool: pool.clone(),
        deliveries: names.table("deliveries"),
        consumer: consumer_name.clone(),
    };
    let record_batch = |inner: Arc<dyn BatchDeliveryHandler>| RecordedBatch {
        inner,
        pool: pool.clone(),
        deliveries: names.table("deliveries"),
        consumer: consumer_name.clone(),
    };
    anyhow::ensure!(
        !(args.batched && args.inbox == ConsumerMode::Direct),
        "--batched needs an inbox (not --inbox direct)"
    );
    eprintln!(
        "chaos-consumer {consumer_name}: {}{} over {} and {}",
        args.inbox.name(),
        if args.batched { " (batched)" } else { "" },
        args.transport.name(),
        pool.database().server()
    );
    match args.inbox {
        ConsumerMode::Idempotent => {
            let handler = Arc::new(IdempotentConsumer::new(
                store,
                Pipeline::new().on(EVENT_TYPE, CONSUMER, effect()),
                ConsumerConfig::new(),
            )?);
            if args.batched {
                consumer
                    .run_batched(
                        record_batch(handler as Arc<dyn BatchDeliveryHandler>),
                        shutdown,
                    )
                    .await?;
            } else {
                consumer
                    .run(record(handler as Arc<dyn DeliveryHandler>), shutdown)
                    .await?;
            }
            Ok(())
        }
        ConsumerMode::Durable => {
            let processor = InboxProcessor::new(
                Arc::clone(&store),
                Pipeline::new().on(EVENT_TYPE, CONSUMER, effect()),
                ProcessorConfig::new()
                    .with_poll_interval(Duration::from_millis(100))
                    .with_lease(Duration::from_secs(30))
                    .with_retry(
                        RetryPolicy::new()
                            .with_base(1.0)
                            .with_cap(Duration::from_secs(1))
                            .with_jitter(Duration::from_millis(500))
                            .with_max_attempts(3),
                    ),
            )?;
            // The processor stops by itself only on a store error retrying cannot fix:
            // then this process stops too (the harness counts a consumer's exit as a
            // failure) rather than keep storing what nobody processes.
            let token = shutdown.clone();
            let stopped = shutdown.clone();
            let processing = tokio::spawn(async move {
                let result = processor.run(token).await;
                stopped.cancel();
                result
            });
            let receiver = Arc::new(DurableReceiver::new(store));
            let receiving = if args.batched {
                consumer
                    .run_batched(
                        record_batch(receiver as Arc<dyn BatchDeliveryHandler>),
                        shutdown.clone(),
                    )
                    .await
            } else {
                consumer
                    .run(
                        record(receiver as Arc<dyn DeliveryHandler>),
                        shutdown.clone(),
                    )
                    .await
            };
            shutdown.cancel();
            processing
                .await
                .context("the inbox processor panicked")?
                .context("inbox processor")?;
            Ok(receiving?)
        }
        ConsumerMode::Direct => {
            let handler = Direct {
                pool: pool.clone(),
                effect: effect(),
            };
            consumer
                .run(
                    record(Arc::new(handler) as Arc<dyn DeliveryHandler>),
                    shutdown,
                )
                .await?;
            Ok(())
        }
    }
}
