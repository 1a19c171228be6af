//! The `outboxkit-inbox` crate driven by `NatsConsumer`, in both modes, over the real NATS server
//! and PostgreSQL:
//!
//! - idempotent consumer: copies of one message have one effect, and a poison message
//!   becomes a consumer dead letter (recorded by the inbox after its `max_deliveries`,
//!   below JetStream's `max_deliver`) and is acked, so the messages behind it flow;
//! - durable inbox: deliveries are stored once and acked, then a processor applies them;
//! - a database outage longer than JetStream's whole delivery budget loses nothing: the
//!   consumer defers its deliveries (`+WPI`) instead of spending them.

mod common;

use outboxkit_core::Consumer as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::inbox::ConsumerDeadLetters;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{EventPublisher, OutboxMessage};
use outboxkit_inbox::{
    ConsumerConfig, DurableReceiver, Handler, HandlerContext, HandlerError, IdempotentConsumer,
    InboxProcessor, Pipeline, ProcessorConfig,
};
use outboxkit_nats::{NatsConsumer, NatsConsumerConfig, NatsPublisher};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit_testkit::pg::PgLockout;
use sqlx::PgConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// Inserts one `effects` row per application; fails every `Poison` message.
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
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.0
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// One aggregate per message, so no message is stale for another.
fn fresh(event_type: &str) -> OutboxMessage {
    let mut msg = message(event_type, "x", "{}");
    msg.aggregate_id = msg.id.to_string();
    msg
}

async fn setup() -> (TestOutbox, Arc<PgInbox>) {
    let outbox = fresh_outbox().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {}.effects (message_id uuid NOT NULL)",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    let store = Arc::new(outbox.inbox());
    (outbox, store)
}

async fn effects(outbox: &PgOutbox, id: Uuid) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.effects WHERE message_id = $1",
        outbox.schema()
    )))
    .bind(id)
    .fetch_one(outbox.pool())
    .await
    .expect("count")
}

/// Three copies of one event (published raw without `Nats-Msg-Id`, so the stream keeps
/// all three; the `ce-id` is the same) have one effect; a poison message is recorded
/// as a consumer dead letter after the inbox's 3 failed deliveries and acked (JetStream
/// would allow 10), and the message published after it is processed, with a
/// concurrency of 1.
#[tokio::test]
async fn idempotent_consumer_over_nats_duplicates_and_a_poison_message() {
    let fx = Fixture::new().await;
    let (outbox, store) = setup().await;

    let dup = fresh("OrderPlaced");
    for _ in 0..3 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("ce-id", dup.id.to_string().as_str());
        headers.insert("ce-type", "OrderPlaced");
        headers.insert("ce-subject", dup.aggregate_id.as_str());
        headers.insert("ce-aggregateversion", "1");
        fx.js
            .publish_with_headers(format!("{}.OrderPlaced", fx.prefix), headers, "{}".into())
            .await
            .expect("send")
            .await
            .expect("PubAck");
    }
    let poison = fresh("Poison");
    let after = fresh("OrderPlaced");
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    for outcome in publisher
        .publish_batch(&[poison.clone(), after.clone()])
        .await
    {
        assert!(outcome.is_published(), "{outcome:?}");
    }
    assert_eq!(fx.stored().await, 5);

    let handler = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new()
            .on(
                "OrderPlaced",
                "projector",
                Projector(outbox.schema().to_owned()),
            )
            .on("Poison", "projector", Projector(outbox.schema().to_owned())),
        ConsumerConfig::new().with_max_deliveries(3),
    )
    .expect("valid consumer config");
    let consumer = NatsConsumer::new(
        NatsConsumerConfig::new(fx.build(), &fx.stream, "inbox")
            .with_concurrency(1)
            .with_max_deliver(Some(10))
            .with_nak_delays(vec![Duration::from_millis(50)]),
    )
    .expect("valid");
    let token = CancellationToken::new();
    let run = {
        let t = token.clone();
        tokio::spawn(async move { consumer.run(handler, t).await })
    };
    eventually(
        "the poison message is dead-lettered and the later one applied",
        || async {
            effects(&outbox, after.id).await == 1
                && store.is_dead(poison.id, "projector").await.expect("dead")
        },
    )
    .await;
    fx.nothing_pending("inbox").await;
    token.cancel();
    run.await.expect("join").expect("consumer ends cleanly");

    assert_eq!(
        effects(&outbox, dup.id).await,
        1,
        "three copies, one effect"
    );
    let dead = store
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("dead letters");
    assert_eq!(
        dead.iter()
            .map(|d| (d.message_id, d.attempts))
            .collect::<Vec<_>>(),
        [(poison.id, 3)]
    );
    fx.cleanup().await;
}

/// Durable inbox: every delivery is stored (once per id) and acked at once; a processor
/// then applies each message exactly once.
#[tokio::test]
async fn durable_inbox_over_nats_stores_then_processes() {
    let fx = Fixture::new().await;
    let (outbox, store) = setup().await;
    let messages: Vec<OutboxMessage> = (0..10).map(|_| fresh("OrderPlaced")).collect();
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    for outcome in publisher.publish_batch(&messages).await {
        assert!(outcome.is_published(), "{outcome:?}");
    }

    let consumer = NatsConsumer::new(NatsConsumerConfig::new(fx.build(), &fx.stream, "durable"))
        .expect("valid");
    let token = CancellationToken::new();
    let run = {
        let (t, receiver) = (token.clone(), DurableReceiver::new(Arc::clone(&store)));
        tokio::spawn(async move { consumer.run(receiver, t).await })
    };
    let processor = InboxProcessor::new(
        Arc::clone(&store),
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            Projector(outbox.schema().to_owned()),
        ),
        ProcessorConfig::new(),
    )
    .expect("valid processor config");
    eventually("every message is stored and applied", || async {
        processor.run_once().await.expect("process");
        let mut all = true;
        for m in &messages {
            all &= effects(&outbox, m.id).await == 1;
        }
        all
    })
    .await;
    token.cancel();
    run.await.expect("join").expect("consumer ends cleanly");
    for m in &messages {
        assert_eq!(effects(&outbox, m.id).await, 1);
    }
    fx.cleanup().await;
}

/// PostgreSQL cuts and refuses the consumer's connections (its own role, locked out) for
/// 8 s while messages keep arriving, far longer than JetStream's delivery budget here
/// (`max_deliver` 3 with 100 ms nak delays: a `Requeue` per delivery would spend it in a
/// third of a second, and JetStream would then drop the message). When the database is
/// back, every message has its effect exactly once, nothing is pending, nothing was
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_longer_than_the_delivery_budget_loses_nothing() {
    let fx = Fixture::new().await;
    let (outbox, admin_store) = setup().await;
    let admin: PgConnectOptions = database_url().parse().expect("database URL");
    let lockout = PgLockout::new(outbox.pool(), &admin, outbox.schema()).await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(lockout.connect_options())
        .await
        .expect("connect as the consumer's role");
    let store = Arc::new(
        PgOutbox::new(pool, &PgConfig::default().with_schema(outbox.schema()))
            .expect("outbox")
            .inbox(),
    );
    let handler = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            Projector(outbox.schema().to_owned()),
        ),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let consumer = NatsConsumer::new(
        NatsConsumerConfig::new(fx.build(), &fx.stream, "outage")
            .with_max_deliver(Some(3))
            .with_nak_delays(vec![Duration::from_millis(100)]),
    )
    .expect("valid");
    let token = CancellationToken::new();
    let run = {
        let t = token.clone();
        tokio::spawn(async move { consumer.run(handler, t).await })
    };
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    let before: Vec<OutboxMessage> = (0..20).map(|_| fresh("OrderPlaced")).collect();
    let during: Vec<OutboxMessage> = (0..50).map(|_| fresh("OrderPlaced")).collect();
    for outcome in publisher.publish_batch(&before).await {
        assert!(outcome.is_published(), "{outcome:?}");
    }
    eventually("the first messages are applied", || async {
        let mut all = true;
        for m in &before {
            all &= effects(&outbox, m.id).await == 1;
        }
        all
    })
    .await;

    lockout.lock_out().await;
    for outcome in publisher.publish_batch(&during).await {
        assert!(outcome.is_published(), "{outcome:?}");
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    lockout.let_in().await;

    eventually_within(
        Duration::from_secs(60),
        "every message is applied after the outage",
        || async {
            let mut all = true;
            for m in &during {
                all &= effects(&outbox, m.id).await >= 1;
            }
            all
        },
    )
    .await;
    fx.nothing_pending("outage").await;
    token.cancel();
    run.await.expect("join").expect("consumer ends cleanly");
    for m in before.iter().chain(&during) {
        assert_eq!(effects(&outbox, m.id).await, 1, "exactly one effect");
    }
    let dead = admin_store
        .consumer_dead_letters(None, 10)
        .await
        .expect("dead letters");
    assert!(dead.is_empty(), "nothing was dead-lettered: {dead:?}");
    lockout.drop_role().await;
    fx.cleanup().await;
}
