//! The inbox wired to the real RabbitMQ consumer adapter: duplicates, poison messages,
//! the durable inbox, and faults of the consumer's own database (an outage longer than
//! a quorum queue's delivery limit, a handler that always panics, a pool much smaller
//! than the prefetch), none of which may lose a message or spend its deliveries.

use outboxkit_core::Consumer as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::inbox::ConsumerDeadLetters;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{EventPublisher, OutboxMessage};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit_rabbit::{
    DeliveryHandler, RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher,
};
use outboxkit_testkit::pg::PgLockout;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.into())
}

struct Projector(String);

#[async_trait]
impl Handler<PgInbox> for Projector {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        if msg.event_type == "Poison" {
            return Err(HandlerError::retryable(std::io::Error::other(
                "cannot project",
            )));
        }
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

fn outbox_message(event_type: &str) -> OutboxMessage {
    let id = Uuid::now_v7();
    // One aggregate per message: the same aggregate and version would make the later
    // messages stale for the projector.
    let msg = outboxkit_core::NewMessage::builder("order", id.to_string(), event_type)
        .id(id)
        .aggregate_version(1)
        .payload_json("{}")
        .build()
        .expect("valid");
    OutboxMessage::claimed_from(msg, chrono::Utc::now())
}

/// A fresh schema with an `effects` table, its inbox, and an isolated exchange with a
/// declared queue (prefetch `prefetch`), its consumer and a publisher.
struct Setup {
    schema: String,
    outbox: PgOutbox,
    store: Arc<PgInbox>,
    consumer: RabbitConsumer,
    publisher: RabbitPublisher,
    /// Last (fields drop in order): the exchange and the schema go once the rest is
    /// closed.
    _exchange: outboxkit_testkit::rabbit::DropExchange,
    _drop: outboxkit_testkit::pg::DropSchema,
}

async fn setup(prefetch: u16) -> Setup {
    let schema = format!("t_{}", Uuid::new_v4().simple());
    let url = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let outbox = PgOutbox::connect(&PgConfig::new(&url).with_schema(&schema))
        .await
        .expect("PostgreSQL");
    outbox.migrate().await.expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.effects (message_id uuid NOT NULL)"
    )))
    .execute(outbox.pool())
    .await
    .expect("table");
    let store = Arc::new(
        PgOutbox::new(
            outbox.pool().clone(),
            &PgConfig::default().with_schema(&schema),
        )
        .expect("outbox")
        .inbox(),
    );
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let amqp = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let config = RabbitConfig::new(&amqp).with_exchange(&exchange);
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(config.clone(), format!("{exchange}.q"))
            .with_binding_key("#")
            .with_queue_arguments(expires_when_unused())
            .with_prefetch(prefetch),
    )
    .expect("consumer");
    consumer.declare().await.expect("declare");
    let publisher = RabbitPublisher::connect(config).await.expect("publisher");
    Setup {
        _exchange: outboxkit_testkit::rabbit::DropExchange::new(&amqp, &exchange),
        _drop: outboxkit_testkit::pg::DropSchema::new(&url, &schema),
        schema,
        outbox,
        store,
        consumer,
        publisher,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_and_a_poison_message_through_rabbitmq() {
    let Setup {
        schema,
        outbox,
        store,
        consumer,
        publisher,
        _exchange,
        _drop,
    } = setup(1).await;

    // The same message published 5 times (same id), a poison message, then a good one.
    let dup = outbox_message("OrderPlaced");
    let poison = outbox_message("Poison");
    let after = outbox_message("OrderPlaced");
    let mut batch = vec![dup.clone(); 5];
    batch.push(poison.clone());
    batch.push(after.clone());
    assert!(
        publisher
            .publish_batch(&batch)
            .await
            .iter()
            .all(|o| o.is_published())
    );

    let handler = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new()
            .on("OrderPlaced", "projector", Projector(schema.clone()))
            .on("Poison", "projector", Projector(schema.clone())),
        ConsumerConfig::new().with_max_deliveries(3),
    )
    .expect("valid consumer config");
    let running = start(consumer, handler);
    let count = |id: Uuid| {
        let pool = outbox.pool().clone();
        let sql = format!("SELECT count(*) FROM {schema}.effects WHERE message_id = $1");
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                .bind(id)
                .fetch_one(&pool)
                .await
                .expect("count")
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while (count(after.id).await == 0
        || !store.is_dead(poison.id, "projector").await.expect("dead"))
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;
    assert_eq!(count(dup.id).await, 1, "five deliveries, one effect");
    assert_eq!(
        count(after.id).await,
        1,
        "the message after the poison one was processed"
    );
    assert_eq!(projector_dead_letters(&store).await, [(poison.id, 3)]);
    publisher.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_inbox_fed_by_rabbitmq() {
    let Setup {
        schema,
        outbox,
        store,
        consumer,
        publisher,
        _exchange,
        _drop,
    } = setup(100).await;
    let (a, b) = (outbox_message("OrderPlaced"), outbox_message("OrderPlaced"));
    let batch = vec![a.clone(), a.clone(), b.clone(), a.clone()];
    assert!(
        publisher
            .publish_batch(&batch)
            .await
            .iter()
            .all(|o| o.is_published())
    );

    let running = start(
        consumer,
        outboxkit_inbox::DurableReceiver::new(Arc::clone(&store)),
    );
    let processor = outboxkit_inbox::InboxProcessor::new(
        Arc::clone(&store),
        Pipeline::new().on("OrderPlaced", "projector", Projector(schema.clone())),
        outboxkit_inbox::ProcessorConfig::new(),
    )
    .expect("valid processor config");
    let effects = format!("SELECT count(*) FROM {schema}.effects");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sqlx::query_scalar::<_, i64>(AssertSqlSafe(effects.clone()))
        .fetch_one(outbox.pool())
        .await
        .expect("count")
        < 2
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "messages were not processed"
        );
        processor.run_once().await.expect("process");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;
    let stored: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {schema}.inbox_messages"
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("count");
    assert_eq!(stored, 2, "four deliveries, two distinct messages stored");
    assert_eq!(processor.run_once().await.expect("process").claimed, 0);
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(effects))
        .fetch_one(outbox.pool())
        .await
        .expect("count");
    assert_eq!(n, 2, "each applied once");
    publisher.close().await;
}

/// A message as another producer may send it: our builder refuses control characters,
/// theirs may not. PostgreSQL's `text` and `jsonb` cannot hold a NUL character.
fn with_nul_characters(event_type: &str) -> OutboxMessage {
    let mut msg = outbox_message(event_type);
    msg.headers.insert("note".into(), "before\0after".into());
    msg.aggregate_id = format!("{}\0x", msg.aggregate_id);
    msg
}

/// A handler that keeps failing on such a message makes it a consumer dead letter (its
/// NUL characters stored as `\0`) instead of deferring it forever because the dead
/// letter cannot be written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_with_nul_characters_still_becomes_a_dead_letter() {
    let Setup {
        schema,
        outbox: _outbox,
        store,
        consumer,
        publisher,
        _exchange,
        _drop,
    } = setup(1).await;
    let poison = with_nul_characters("Poison");
    let published = publisher.publish_batch(std::slice::from_ref(&poison)).await;
    assert!(published.iter().all(|o| o.is_published()), "{published:?}");

    let handler = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new().on("Poison", "projector", Projector(schema.clone())),
        ConsumerConfig::new().with_max_deliveries(3),
    )
    .expect("valid consumer config");
    let running = start(consumer, handler);
    wait_for("the dead letter", Duration::from_secs(30), async || {
        store.is_dead(poison.id, "projector").await.expect("dead")
    })
    .await;
    running.stop().await;
    assert_eq!(projector_dead_letters(&store).await, [(poison.id, 3)]);
    publisher.close().await;
}

/// The durable inbox stores such a message (NUL characters as `\0`) and processes it,
/// instead of deferring it, and the deliveries after it, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_durable_inbox_stores_and_processes_a_message_with_nul_characters() {
    let Setup {
        schema,
        outbox,
        store,
        consumer,
        publisher,
        _exchange,
        _drop,
    } = setup(1).await;
    let (odd, plain) = (
        with_nul_characters("OrderPlaced"),
        outbox_message("OrderPlaced"),
    );
    let published = publisher.publish_batch(&[odd.clone(), plain.clone()]).await;
    assert!(published.iter().all(|o| o.is_published()), "{published:?}");

    let running = start(
        consumer,
        outboxkit_inbox::DurableReceiver::new(Arc::clone(&store)),
    );
    let processor = outboxkit_inbox::InboxProcessor::new(
        Arc::clone(&store),
        Pipeline::new().on("OrderPlaced", "projector", Projector(schema.clone())),
        outboxkit_inbox::ProcessorConfig::new(),
    )
    .expect("valid processor config");
    let effects = format!("SELECT count(*) FROM {schema}.effects");
    wait_for(
        "both messages processed",
        Duration::from_secs(30),
        async || {
            processor.run_once().await.expect("process");
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(effects.clone()))
                .fetch_one(outbox.pool())
                .await
                .expect("count")
                == 2
        },
    )
    .await;
    running.stop().await;
    let (id, note): (String, String) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT aggregate_id, headers->>'note' FROM {schema}.inbox_messages WHERE id = $1"
    )))
    .bind(odd.id)
    .fetch_one(outbox.pool())
    .await
    .expect("stored");
    assert_eq!(
        (id, note),
        (
            odd.aggregate_id.replace('\0', "\\0"),
            "before\\0after".to_owned()
        )
    );
    publisher.close().await;
}

/// Queue arguments that let RabbitMQ delete the test queue a minute after its last
/// consumer left, even when the test fails half-way.
fn expires_when_unused() -> lapin::types::FieldTable {
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-expires".into(), lapin::types::AMQPValue::LongInt(60_000));
    args
}

/// Like [`Projector`], but the transaction also sleeps 50 ms (a slow projection), and
/// an event of type `Panics` makes it panic.
struct SlowOrPanicking(String);

#[async_trait]
impl Handler<PgInbox> for SlowOrPanicking {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        assert!(
            msg.event_type != "Panics",
            "projection bug (expected by the test)"
        );
        sqlx::query("SELECT pg_sleep(0.05)")
            .execute(&mut *conn)
            .await?;
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

/// A quorum queue that gives up on a message after `delivery_limit` returns
/// (`x-delivery-limit`; no dead-letter exchange, so it would be dropped), an `effects`
/// table, and the consumer's inbox on a pool of `pool_size` connections (1 s acquire
/// timeout) of a role of its own (so the test can lock the consumer out of
/// PostgreSQL).
struct Quorum {
    schema: String,
    outbox: PgOutbox,
    store: Arc<PgInbox>,
    lockout: PgLockout,
    consumer: RabbitConsumer,
    publisher: RabbitPublisher,
    queue: String,
    /// Last (fields drop in order): the exchange and the schema go once the rest is
    /// closed.
    _exchange: outboxkit_testkit::rabbit::DropExchange,
    _drop: outboxkit_testkit::pg::DropSchema,
}

async fn quorum(prefetch: u16, pool_size: u32, delivery_limit: i32) -> Quorum {
    let url = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let schema = format!("t_{}", Uuid::new_v4().simple());
    let outbox = PgOutbox::connect(&PgConfig::new(&url).with_schema(&schema))
        .await
        .expect("PostgreSQL");
    outbox.migrate().await.expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.effects (message_id uuid NOT NULL)"
    )))
    .execute(outbox.pool())
    .await
    .expect("table");
    let admin: PgConnectOptions = url.parse().expect("database URL");
    let lockout = PgLockout::new(outbox.pool(), &admin, &schema).await;
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .acquire_timeout(Duration::from_secs(1))
        .connect_with(lockout.connect_options())
        .await
        .expect("connect as the consumer's role");
    let store = Arc::new(
        PgOutbox::new(pool, &PgConfig::default().with_schema(&schema))
            .expect("outbox")
            .inbox(),
    );
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let queue = format!("{exchange}.q");
    let amqp = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let config = RabbitConfig::new(&amqp).with_exchange(&exchange);
    let mut args = expires_when_unused();
    args.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    args.insert(
        "x-delivery-limit".into(),
        lapin::types::AMQPValue::LongInt(delivery_limit),
    );
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(config.clone(), &queue)
            .with_binding_key("#")
            .with_queue_arguments(args)
            .with_prefetch(prefetch)
            .with_requeue_delay(Duration::from_millis(100)),
    )
    .expect("consumer");
    consumer.declare().await.expect("declare");
    let publisher = RabbitPublisher::connect(config).await.expect("publisher");
    Quorum {
        _exchange: outboxkit_testkit::rabbit::DropExchange::new(&amqp, &exchange),
        _drop: outboxkit_testkit::pg::DropSchema::new(&url, &schema),
        schema,
        outbox,
        store,
        lockout,
        consumer,
        publisher,
        queue,
    }
}

/// A consumer running in a task.
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

/// Runs `consumer` with `handler` in a task.
fn start<H: DeliveryHandler>(consumer: RabbitConsumer, handler: H) -> Running {
    let token = CancellationToken::new();
    let t = token.clone();
    Running {
        token,
        task: tokio::spawn(async move { consumer.run(handler, t).await }),
    }
}

/// The `projector` consumer's dead letters as `(message id, attempts)`.
async fn projector_dead_letters(store: &PgInbox) -> Vec<(Uuid, u32)> {
    store
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("dead letters")
        .iter()
        .map(|d| (d.message_id, d.attempts))
        .collect()
}

impl Quorum {
    /// Runs the queue's consumer with `handler`.
    fn start(&self, handler: IdempotentConsumer<PgInbox>) -> Running {
        start(self.consumer.clone(), handler)
    }

    /// Each of `messages` has exactly one effect, and no consumer dead letter exists.
    async fn applied_once_none_dead(&self, messages: &[OutboxMessage]) {
        for m in messages {
            assert_eq!(self.effects(m.id).await, 1, "exactly one effect");
        }
        let dead = self.store.consumer_dead_letters(None, 10).await;
        assert!(
            dead.as_ref().is_ok_and(Vec::is_empty),
            "nothing was dead-lettered: {dead:?}"
        );
    }

    async fn effects(&self, id: Uuid) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.effects WHERE message_id = $1",
            self.schema
        )))
        .bind(id)
        .fetch_one(self.outbox.pool())
        .await
        .expect("count")
    }

    async fn all_applied(&self, messages: &[OutboxMessage]) -> bool {
        for m in messages {
            if self.effects(m.id).await == 0 {
                return false;
            }
        }
        true
    }

    async fn publish(&self, messages: &[OutboxMessage]) {
        for outcome in self.publisher.publish_batch(messages).await {
            assert!(outcome.is_published(), "{outcome:?}");
        }
    }

    /// Deletes the queue (quorum queues outlive their consumers) and the role.
    async fn cleanup(self) {
        use lapin::options::QueueDeleteOptions;
        if let Ok(conn) = lapin::Connection::connect(
            &env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
            lapin::ConnectionProperties::default(),
        )
        .await
            && let Ok(channel) = conn.create_channel().await
        {
            let _ = channel
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        self.publisher.close().await;
        self.lockout.drop_role().await;
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

/// PostgreSQL cuts and refuses the consumer's connections for 8 s while messages keep
/// arriving on a quorum queue that drops a message after 2 returns. Requeueing each
/// delivery would spend that limit within a second and lose the messages; deferring
/// holds them unacknowledged. When the database is back every message has its effect
/// exactly once, the queue is empty and nothing was dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_on_a_quorum_queue_loses_nothing() {
    let q = quorum(100, 4, 2).await;
    let handler = IdempotentConsumer::new(
        Arc::clone(&q.store),
        Pipeline::new().on("OrderPlaced", "projector", Projector(q.schema.clone())),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let running = q.start(handler);
    let before: Vec<OutboxMessage> = (0..20).map(|_| outbox_message("OrderPlaced")).collect();
    let during: Vec<OutboxMessage> = (0..30).map(|_| outbox_message("OrderPlaced")).collect();
    q.publish(&before).await;
    wait_for(
        "the first messages are applied",
        Duration::from_secs(30),
        async || q.all_applied(&before).await,
    )
    .await;

    q.lockout.lock_out().await;
    q.publish(&during).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    q.lockout.let_in().await;

    wait_for(
        "every message is applied after the outage",
        Duration::from_secs(60),
        async || q.all_applied(&during).await,
    )
    .await;
    running.stop().await;
    let all: Vec<OutboxMessage> = before.into_iter().chain(during).collect();
    q.applied_once_none_dead(&all).await;
    q.cleanup().await;
}

/// A handler that panics on every delivery of one message: each panic is a counted
/// failure, and after `max_deliveries` (3) the message is a consumer dead letter whose
/// error carries the panic message, acknowledged; the messages behind it (prefetch 1)
/// are applied. The quorum queue's delivery limit (2 returns) stays above the inbox's
/// `max_deliveries` (2 failures, so one return), as it must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_always_panics_ends_as_a_dead_letter() {
    let q = quorum(1, 2, 2).await;
    let handler = IdempotentConsumer::new(
        Arc::clone(&q.store),
        Pipeline::new()
            .on(
                "OrderPlaced",
                "projector",
                SlowOrPanicking(q.schema.clone()),
            )
            .on("Panics", "projector", SlowOrPanicking(q.schema.clone())),
        ConsumerConfig::new().with_max_deliveries(2),
    )
    .expect("valid consumer config");
    let running = q.start(handler);
    let poison = outbox_message("Panics");
    let after: Vec<OutboxMessage> = (0..5).map(|_| outbox_message("OrderPlaced")).collect();
    q.publish(std::slice::from_ref(&poison)).await;
    q.publish(&after).await;
    wait_for(
        "the panicking message is a dead letter and the rest applied",
        Duration::from_secs(30),
        async || {
            q.all_applied(&after).await
                && q.store.is_dead(poison.id, "projector").await.expect("dead")
        },
    )
    .await;
    running.stop().await;
    let dead = q
        .store
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("dead letters");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, poison.id);
    assert!(
        dead[0].last_error.contains("panicked") && dead[0].last_error.contains("projection bug"),
        "{}",
        dead[0].last_error
    );
    q.cleanup().await;
}

/// 100 deliveries at once (prefetch 100) against a pool of 2 connections with a 1 s
/// acquire timeout and a 50 ms projection: most deliveries wait far longer than the
/// timeout for a connection. Waiting is not a failure: every message is applied exactly
/// once, none is dead-lettered, none dropped by the quorum queue's delivery limit of a
/// single return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_deliveries_wait_for_a_small_pool() {
    let q = quorum(100, 2, 1).await;
    let handler = IdempotentConsumer::new(
        Arc::clone(&q.store),
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            SlowOrPanicking(q.schema.clone()),
        ),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let running = q.start(handler);
    let messages: Vec<OutboxMessage> = (0..100).map(|_| outbox_message("OrderPlaced")).collect();
    q.publish(&messages).await;
    wait_for(
        "every message is applied",
        Duration::from_secs(90),
        async || q.all_applied(&messages).await,
    )
    .await;
    running.stop().await;
    q.applied_once_none_dead(&messages).await;
    q.cleanup().await;
}
