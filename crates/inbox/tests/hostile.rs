//! Exactly-once against handlers that misbehave and producers we do not control, over
//! the real RabbitMQ and PostgreSQL: every delivery ends applied exactly once or as a
//! recorded consumer dead letter, nothing is acked without one of the two, and no
//! message holds the consumer forever.
//!
//! - a handler that catches a database error and returns `Ok` (its transaction is then
//!   aborted: PostgreSQL answers the `COMMIT` with `ROLLBACK`), per message, in batches
//!   and in the durable inbox;
//! - a deferred constraint of the handler's own data failing at commit;
//! - another producer's messages published straight to the exchange: an aggregate id
//!   of 8,000 characters, a malformed `aggregateversion`, no `type`, a CloudEvents id
//!   that is not a UUID beside a message id that is, and no id at all;
//! - a statement cancelled by its timeout and a terminated backend inside the handler
//!   (the database's hiccups, not the message's fault);
//! - an aggregate version of `i64::MAX`, which must not silence the aggregate.

use outboxkit_core::Consumer as _;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outboxkit_core::inbox::{ConsumerDeadLetter, ConsumerDeadLetters};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{BatchSettings, EventPublisher, NewMessage, OutboxMessage};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit_rabbit::{
    BatchDeliveryHandler, DeliveryHandler, RabbitConfig, RabbitConsumer, RabbitConsumerConfig,
    RabbitPublisher,
};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.into())
}

fn amqp_url() -> String {
    env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// A fresh schema (outbox and inbox tables, `effects` with a unique message id, and
/// `audit`, whose unique key the swallowing handler trips over), an exchange of its own
/// with the consumer's queue, a publisher, and a raw AMQP channel for another
/// producer's messages.
struct Setup {
    schema: String,
    pool: PgPool,
    store: Arc<PgInbox>,
    consumer: RabbitConsumer,
    publisher: RabbitPublisher,
    exchange: String,
    foreign: lapin::Channel,
    _foreign_conn: Connection,
}

async fn setup(prefetch: u16, batch_size: usize) -> Setup {
    let schema = format!("t_{}", Uuid::new_v4().simple());
    let outbox = PgOutbox::connect(
        &PgConfig::new(env(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        ))
        .with_schema(&schema),
    )
    .await
    .expect("PostgreSQL");
    outbox.migrate().await.expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.effects (message_id uuid PRIMARY KEY);
         CREATE TABLE {schema}.audit (message_id uuid PRIMARY KEY);
         CREATE TABLE {schema}.deferred_effects (
             message_id uuid,
             CONSTRAINT once UNIQUE (message_id) DEFERRABLE INITIALLY DEFERRED)"
    )))
    .execute(outbox.pool())
    .await
    .expect("tables");
    let pool = outbox.pool().clone();
    let store = Arc::new(
        PgOutbox::new(pool.clone(), &PgConfig::default().with_schema(&schema))
            .expect("outbox")
            .inbox(),
    );
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let config = RabbitConfig::new(amqp_url()).with_exchange(&exchange);
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(config.clone(), format!("{exchange}.q"))
            .with_binding_key("#")
            .with_queue_arguments(args)
            .with_prefetch(prefetch)
            .with_batch(BatchSettings::new().with_size(batch_size))
            .with_requeue_delay(Duration::from_millis(50)),
    )
    .expect("consumer");
    consumer.declare().await.expect("declare");
    let publisher = RabbitPublisher::connect(config).await.expect("publisher");
    let foreign_conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("RabbitMQ");
    let foreign = foreign_conn.create_channel().await.expect("channel");
    Setup {
        schema,
        pool,
        store,
        consumer,
        publisher,
        exchange,
        foreign,
        _foreign_conn: foreign_conn,
    }
}

impl Setup {
    /// Publishes `messages` through our publisher (confirmed).
    async fn publish(&self, messages: &[OutboxMessage]) {
        let outcomes = self.publisher.publish_batch(messages).await;
        assert!(outcomes.iter().all(|o| o.is_published()), "{outcomes:?}");
    }

    /// Publishes a message as another producer would: straight to the exchange, with
    /// the given AMQP message id and `cloudEvents:` headers.
    async fn publish_foreign(&self, message_id: Option<&str>, headers: &[(&str, &str)]) {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                format!("cloudEvents:{name}").into(),
                AMQPValue::LongString((*value).into()),
            );
        }
        let mut properties = BasicProperties::default()
            .with_headers(table)
            .with_content_type("application/json".into());
        if let Some(id) = message_id {
            properties = properties.with_message_id(id.into());
        }
        self.foreign
            .basic_publish(
                self.exchange.as_str().into(),
                "foreign".into(),
                BasicPublishOptions::default(),
                b"{\"from\":\"elsewhere\"}",
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
    }

    async fn effects(&self) -> HashSet<Uuid> {
        sqlx::query_scalar::<_, Uuid>(AssertSqlSafe(format!(
            "SELECT message_id FROM {}.effects",
            self.schema
        )))
        .fetch_all(&self.pool)
        .await
        .expect("effects")
        .into_iter()
        .collect()
    }

    async fn inbox_records(&self, id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.inbox_records WHERE message_id = $1",
            self.schema
        )))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .expect("records")
    }

    /// Failures counted against any message (dead or not).
    async fn failures(&self) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.inbox_failures",
            self.schema
        )))
        .fetch_one(&self.pool)
        .await
        .expect("failures")
    }

    async fn dead_letters(&self) -> Vec<ConsumerDeadLetter> {
        self.store
            .consumer_dead_letters(None, 100)
            .await
            .expect("dead letters")
    }

    /// Messages still in the queue, ready or unacknowledged.
    async fn queued(&self) -> u32 {
        let q = self
            .foreign
            .queue_declare(
                format!("{}.q", self.exchange).as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue");
        q.message_count()
    }

    /// Drops what the test created (the queue expires by itself).
    async fn teardown(self) {
        self.publisher.close().await;
        let _ = self
            .foreign
            .exchange_delete(
                self.exchange.as_str().into(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(&self.pool)
        .await
        .expect("drop schema");
    }
}

/// A message of one aggregate of its own; `version` 0 means unversioned.
fn message(event_type: &str, version: i64) -> OutboxMessage {
    let id = Uuid::now_v7();
    let msg = NewMessage::builder("order", id.to_string(), event_type)
        .id(id)
        .aggregate_version(version)
        .payload_json("{}")
        .build()
        .expect("valid");
    OutboxMessage::claimed_from(msg, chrono::Utc::now())
}

/// Writes the effect, then the audit row; on a unique violation of the audit row it
/// does what many handlers do ("already there means already applied"): it ignores the
/// error and returns `Ok`. The ignored error leaves the transaction aborted.
struct Swallowing(String);

#[async_trait]
impl Handler<PgInbox> for Swallowing {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        let schema = &self.0;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.effects (message_id) VALUES ($1)"
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        match sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.audit (message_id) VALUES ($1)"
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await
        {
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(()),
            other => other.map(drop).map_err(HandlerError::from),
        }
    }
}

struct Running {
    token: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), outboxkit_rabbit::RabbitError>>,
}

impl Running {
    async fn stop(self) {
        self.token.cancel();
        self.task.await.expect("join").expect("consumer");
    }
}

fn start<H: DeliveryHandler>(consumer: RabbitConsumer, handler: H) -> Running {
    let token = CancellationToken::new();
    let t = token.clone();
    Running {
        token,
        task: tokio::spawn(async move { consumer.run(handler, t).await }),
    }
}

fn start_batched<H: BatchDeliveryHandler>(consumer: RabbitConsumer, handler: H) -> Running {
    let token = CancellationToken::new();
    let t = token.clone();
    Running {
        token,
        task: tokio::spawn(async move { consumer.run_batched(handler, t).await }),
    }
}

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Ten messages, two of which (one unversioned, one versioned) the handler's ignored
/// error leaves with an aborted transaction: those two end as consumer dead letters
/// naming the aborted transaction, never acked as applied; the other eight are applied
/// once.
async fn swallowed_errors_end_as_dead_letters(batched: bool) {
    let s = setup(10, 10).await;
    let mut messages: Vec<OutboxMessage> = (0..8).map(|_| message("OrderPlaced", 0)).collect();
    let swallowed = [message("OrderPlaced", 0), message("OrderPlaced", 1)];
    messages.insert(3, swallowed[0].clone());
    messages.insert(7, swallowed[1].clone());
    // The audit rows the handler will trip over.
    for m in &swallowed {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.audit (message_id) VALUES ($1)",
            s.schema
        )))
        .bind(m.id)
        .execute(&s.pool)
        .await
        .expect("audit row");
    }
    s.publish(&messages).await;
    let handler = IdempotentConsumer::new(
        Arc::clone(&s.store),
        Pipeline::new().on("OrderPlaced", "projector", Swallowing(s.schema.clone())),
        ConsumerConfig::new().with_max_deliveries(3),
    )
    .expect("valid consumer config");
    let running = if batched {
        start_batched(s.consumer.clone(), handler)
    } else {
        start(s.consumer.clone(), handler)
    };
    wait_for(
        "every delivery is applied or dead, and the queue is empty",
        Duration::from_secs(60),
        async || {
            s.effects().await.len() + s.dead_letters().await.len() >= 10 && s.queued().await == 0
        },
    )
    .await;
    running.stop().await;
    let effects = s.effects().await;
    for m in &messages {
        let swallow = swallowed.iter().any(|w| w.id == m.id);
        assert_eq!(effects.contains(&m.id), !swallow, "effect of {}", m.id);
        assert_eq!(s.inbox_records(m.id).await, i64::from(!swallow));
    }
    let dead = s.dead_letters().await;
    let mut dead_ids: Vec<Uuid> = dead.iter().map(|d| d.message_id).collect();
    dead_ids.sort();
    let mut want: Vec<Uuid> = swallowed.iter().map(|m| m.id).collect();
    want.sort();
    assert_eq!(
        dead_ids, want,
        "the two swallowing runs are dead letters: {dead:?}"
    );
    for d in &dead {
        assert_eq!(d.attempts, 3, "{d:?}");
        assert!(d.last_error.contains("aborted"), "{}", d.last_error);
    }
    s.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_database_error_is_never_acked_as_applied() {
    swallowed_errors_end_as_dead_letters(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_database_error_in_a_batch_is_never_acked_as_applied() {
    swallowed_errors_end_as_dead_letters(true).await;
}

/// The durable inbox: the swallowing handler's message goes `Dead` once its attempts
/// are spent, instead of `Done` with no effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_durable_inbox_never_marks_a_swallowed_error_done() {
    use outboxkit_core::inbox::DurableInbox as _;
    let s = setup(10, 10).await;
    let (good, swallowed) = (message("OrderPlaced", 0), message("OrderPlaced", 0));
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {}.audit (message_id) VALUES ($1)",
        s.schema
    )))
    .bind(swallowed.id)
    .execute(&s.pool)
    .await
    .expect("audit row");
    for m in [&good, &swallowed] {
        let incoming = IncomingMessage::new(m.id, "OrderPlaced", b"{}".to_vec());
        assert!(s.store.store(&incoming).await.expect("store"));
    }
    for batch_transactions in [true, false] {
        let processor = outboxkit_inbox::InboxProcessor::new(
            Arc::clone(&s.store),
            Pipeline::new().on("OrderPlaced", "projector", Swallowing(s.schema.clone())),
            outboxkit_inbox::ProcessorConfig::new()
                .with_batch_transactions(batch_transactions)
                .with_retry(
                    outboxkit_core::RetryPolicy::new()
                        .with_cap(Duration::ZERO)
                        .with_jitter(Duration::ZERO)
                        .with_max_attempts(2),
                ),
        )
        .expect("valid processor config");
        wait_for(
            "both messages decided",
            Duration::from_secs(30),
            async || {
                processor.run_once().await.expect("process");
                let open: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT count(*) FROM {}.inbox_messages WHERE status NOT IN (1, 3)",
                    s.schema
                )))
                .fetch_one(&s.pool)
                .await
                .expect("count");
                open == 0
            },
        )
        .await;
        let states: Vec<(Uuid, i16, Option<String>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, status, last_error FROM {}.inbox_messages ORDER BY id",
            s.schema
        )))
        .fetch_all(&s.pool)
        .await
        .expect("states");
        for (id, status, error) in &states {
            if *id == good.id {
                assert_eq!(*status, 1, "the good message is done");
            } else {
                assert_eq!(
                    *status, 3,
                    "the swallowing run is dead, not done: {error:?}"
                );
                assert!(
                    error.as_deref().is_some_and(|e| e.contains("aborted")),
                    "{error:?}"
                );
            }
        }
        assert_eq!(s.effects().await, HashSet::from([good.id]));
        // Again with the other mode, from fresh rows.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "UPDATE {0}.inbox_messages SET status = 0, attempts = 0, visible_at = now() WHERE id = '{1}';
             DELETE FROM {0}.inbox_records;",
            s.schema, swallowed.id
        )))
        .execute(&s.pool)
        .await
        .expect("reset");
    }
    s.teardown().await;
}

/// Inserts its effect twice into a table whose unique constraint is checked at commit:
/// the handler's own data fails the `COMMIT`.
struct DeferredDuplicate(String);

#[async_trait]
impl Handler<PgInbox> for DeferredDuplicate {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        let (schema, twice) = (&self.0, msg.event_type == "Twice");
        for _ in 0..if twice { 2 } else { 1 } {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {schema}.deferred_effects (message_id) VALUES ($1)"
            )))
            .bind(msg.id)
            .execute(&mut *conn)
            .await?;
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.effects (message_id) VALUES ($1)"
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// A commit refused because of the handler's data is that message's failure: it ends
/// as a consumer dead letter, and the message behind it is applied (on one delivery at
/// a time, a deferred message would hold the queue forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_refused_for_the_handlers_data_is_a_failure_of_that_message() {
    let s = setup(1, 1).await;
    let (bad, good) = (message("Twice", 0), message("Once", 0));
    s.publish(&[bad.clone(), good.clone()]).await;
    let handler = IdempotentConsumer::new(
        Arc::clone(&s.store),
        Pipeline::new()
            .on("Twice", "projector", DeferredDuplicate(s.schema.clone()))
            .on("Once", "projector", DeferredDuplicate(s.schema.clone())),
        ConsumerConfig::new().with_max_deliveries(2),
    )
    .expect("valid consumer config");
    let running = start(s.consumer.clone(), handler);
    // The bad message's last delivery may come after the good one is applied (a failed
    // delivery goes back to the queue): wait for both.
    wait_for(
        "the good message applied and the bad one a dead letter",
        Duration::from_secs(30),
        async || s.effects().await.contains(&good.id) && !s.dead_letters().await.is_empty(),
    )
    .await;
    running.stop().await;
    let dead = s.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, bad.id);
    assert!(
        dead[0].last_error.contains("23505") || dead[0].last_error.contains("unique"),
        "{}",
        dead[0].last_error
    );
    assert_eq!(s.effects().await, HashSet::from([good.id]));
    s.teardown().await;
}

/// Records every message it sees.
struct Recorder(String);

#[async_trait]
impl Handler<PgInbox> for Recorder {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.0
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// Another producer's messages, published straight to the exchange: each one with a
/// usable id ends applied or as a consumer dead letter with its headers and body;
/// only the one without any id is dropped; none holds the consumer, and the message
/// behind them is applied. Run per message and in batches.
async fn foreign_messages_end_recorded(batched: bool) {
    let s = setup(4, 4).await;
    let long_id: String = (0..8_000)
        .map(|i| char::from(b'a' + u8::try_from((i * 7919 + i / 13) % 26).expect("letter")))
        .collect();
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    let id_text: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    // An aggregate id far longer than any index entry may be, with a version.
    s.publish_foreign(
        Some(&id_text[0]),
        &[
            ("id", &id_text[0]),
            ("type", "OrderPlaced"),
            ("aggregatetype", "order"),
            ("subject", &long_id),
            ("aggregateversion", "1"),
        ],
    )
    .await;
    // A version that is not an integer.
    s.publish_foreign(
        Some(&id_text[1]),
        &[
            ("id", &id_text[1]),
            ("type", "OrderPlaced"),
            ("aggregatetype", "order"),
            ("subject", "a-1"),
            ("aggregateversion", "1.0"),
        ],
    )
    .await;
    // No event type.
    s.publish_foreign(Some(&id_text[2]), &[("id", &id_text[2])])
        .await;
    // A CloudEvents id that is not a UUID, beside a message id that is.
    s.publish_foreign(
        Some(&id_text[3]),
        &[("id", "order-17"), ("type", "OrderPlaced")],
    )
    .await;
    // No id at all: nothing to record it under.
    s.publish_foreign(None, &[("type", "OrderPlaced")]).await;
    // And a good one behind them.
    let good = message("OrderPlaced", 1);
    s.publish(std::slice::from_ref(&good)).await;

    let handler = IdempotentConsumer::new(
        Arc::clone(&s.store),
        Pipeline::new().on("OrderPlaced", "projector", Recorder(s.schema.clone())),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let running = if batched {
        start_batched(s.consumer.clone(), handler)
    } else {
        start(s.consumer.clone(), handler)
    };
    wait_for(
        "the good message applied, four dead letters, the queue empty",
        Duration::from_secs(30),
        async || {
            s.effects().await.contains(&good.id)
                && s.dead_letters().await.len() >= 4
                && s.queued().await == 0
        },
    )
    .await;
    running.stop().await;
    let dead = s.dead_letters().await;
    let mut dead_ids: Vec<Uuid> = dead.iter().map(|d| d.message_id).collect();
    dead_ids.sort();
    let mut want = ids[..4].to_vec();
    want.sort();
    assert_eq!(dead_ids, want, "{dead:?}");
    for d in &dead {
        assert_eq!(d.payload, b"{\"from\":\"elsewhere\"}", "the body is kept");
        assert_eq!(d.attempts, 1, "{d:?}");
    }
    let error_of = |id: Uuid| {
        dead.iter()
            .find(|d| d.message_id == id)
            .map(|d| d.last_error.clone())
            .unwrap_or_default()
    };
    assert!(error_of(ids[0]).contains("subject"), "{}", error_of(ids[0]));
    assert!(
        error_of(ids[1]).contains("aggregateversion"),
        "{}",
        error_of(ids[1])
    );
    assert!(error_of(ids[2]).contains("type"), "{}", error_of(ids[2]));
    assert!(error_of(ids[3]).contains("id"), "{}", error_of(ids[3]));
    assert_eq!(s.effects().await, HashSet::from([good.id]));
    s.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_producers_malformed_messages_end_as_dead_letters() {
    foreign_messages_end_recorded(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_producers_malformed_messages_end_as_dead_letters_in_batches() {
    foreign_messages_end_recorded(true).await;
}

/// The database's hiccups inside the handler: the first run's statement is cancelled
/// by its timeout (57014), the second run's backend is terminated (57P01), the third
/// succeeds.
struct Hiccups {
    schema: String,
    runs: AtomicU32,
}

#[async_trait]
impl Handler<PgInbox> for Hiccups {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        match self.runs.fetch_add(1, Ordering::SeqCst) {
            0 => {
                sqlx::query("SET LOCAL statement_timeout = '20ms'")
                    .execute(&mut *conn)
                    .await?;
                sqlx::query("SELECT pg_sleep(2)")
                    .execute(&mut *conn)
                    .await?;
            }
            1 => {
                sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
                    .execute(&mut *conn)
                    .await?;
            }
            _ => {}
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.schema
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// A statement timeout and a terminated backend are the database's trouble, not the
/// message's: with a delivery limit of 1 the message is still applied, and no failure
/// was counted against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_hiccups_in_the_handler_do_not_charge_the_message() {
    let s = setup(1, 1).await;
    let m = message("OrderPlaced", 0);
    s.publish(std::slice::from_ref(&m)).await;
    let hiccups = Arc::new(Hiccups {
        schema: s.schema.clone(),
        runs: AtomicU32::new(0),
    });
    struct Shared(Arc<Hiccups>);
    #[async_trait]
    impl Handler<PgInbox> for Shared {
        async fn handle(
            &self,
            conn: &mut PgConnection,
            msg: &IncomingMessage,
            ctx: &HandlerContext,
        ) -> Result<(), HandlerError> {
            self.0.handle(conn, msg, ctx).await
        }
    }
    let handler = IdempotentConsumer::new(
        Arc::clone(&s.store),
        Pipeline::new().on("OrderPlaced", "projector", Shared(Arc::clone(&hiccups))),
        ConsumerConfig::new().with_max_deliveries(1),
    )
    .expect("valid consumer config");
    let running = start(s.consumer.clone(), handler);
    wait_for("the message applied", Duration::from_secs(60), async || {
        s.effects().await.contains(&m.id) || !s.dead_letters().await.is_empty()
    })
    .await;
    running.stop().await;
    assert_eq!(s.dead_letters().await.len(), 0, "nothing dead");
    assert_eq!(s.effects().await, HashSet::from([m.id]));
    assert_eq!(
        s.failures().await,
        0,
        "no failure counted against the message"
    );
    assert_eq!(hiccups.runs.load(Ordering::SeqCst), 3);
    s.teardown().await;
}

/// Records the versions it applies, per aggregate.
struct Versions(Arc<Mutex<Vec<(String, i64)>>>, String);

#[async_trait]
impl Handler<PgInbox> for Versions {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.1
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        self.0.lock().expect("lock").push((
            msg.aggregate_id.clone().unwrap_or_default(),
            msg.aggregate_version.unwrap_or_default(),
        ));
        Ok(())
    }
}

/// One message claiming version `i64::MAX` does not become the aggregate's version
/// (which would make every later event of it stale and skipped): it is a consumer dead
/// letter, and versions 1 and 2 of the aggregate are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_far_ahead_is_a_dead_letter_not_the_new_version() {
    let s = setup(1, 1).await;
    let build = |version: i64| {
        let msg = NewMessage::builder("order", "o-1", "OrderPlaced")
            .aggregate_version(version)
            .payload_json("{}")
            .build()
            .expect("valid");
        OutboxMessage::claimed_from(msg, chrono::Utc::now())
    };
    let (far, one, two) = (build(i64::MAX), build(1), build(2));
    s.publish(&[far.clone(), one.clone(), two.clone()]).await;
    let applied = Arc::new(Mutex::new(Vec::new()));
    let handler = IdempotentConsumer::new(
        Arc::clone(&s.store),
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            Versions(Arc::clone(&applied), s.schema.clone()),
        ),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let running = start(s.consumer.clone(), handler);
    wait_for("all three decided", Duration::from_secs(30), async || {
        s.queued().await == 0 && !s.dead_letters().await.is_empty()
    })
    .await;
    running.stop().await;
    assert_eq!(
        *applied.lock().expect("lock"),
        [("o-1".to_owned(), 1), ("o-1".to_owned(), 2)]
    );
    let dead = s.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, far.id);
    assert!(
        dead[0].last_error.contains("version"),
        "{}",
        dead[0].last_error
    );
    s.teardown().await;
}
