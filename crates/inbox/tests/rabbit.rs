//! The inbox wired to the real RabbitMQ consumer adapter.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox::{Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline};
use outbox_core::inbox::ConsumerDeadLetters;
use outbox_core::wire::IncomingMessage;
use outbox_core::{EventPublisher, OutboxMessage};
use outbox_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use transport_rabbit::{RabbitConfig, RabbitConsumer, RabbitPublisher};
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
    let msg = outbox_core::NewMessage::builder("order", id.to_string(), event_type)
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
}

async fn setup(prefetch: u16) -> Setup {
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
        "CREATE TABLE {schema}.effects (message_id uuid NOT NULL)"
    )))
    .execute(outbox.pool())
    .await
    .expect("table");
    let store = Arc::new(PgInbox::new(outbox.pool().clone(), &schema).expect("inbox"));
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let config = RabbitConfig::builder(env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))
        .with_exchange(&exchange)
        .build()
        .expect("config");
    let consumer = RabbitConsumer::builder(config.clone(), format!("{exchange}.q"))
        .with_binding_key("#")
        .with_queue_arguments(expires_when_unused())
        .with_prefetch(prefetch)
        .build()
        .expect("consumer");
    consumer.declare().await.expect("declare");
    let publisher = RabbitPublisher::connect(config).await.expect("publisher");
    Setup {
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
    )
    .with_max_deliveries(3);
    let token = CancellationToken::new();
    let run = {
        let t = token.clone();
        tokio::spawn(async move { consumer.run(handler, t).await })
    };
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
    token.cancel();
    run.await.expect("join").expect("consumer");
    assert_eq!(count(dup.id).await, 1, "five deliveries, one effect");
    assert_eq!(
        count(after.id).await,
        1,
        "the message after the poison one was processed"
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

    let token = CancellationToken::new();
    let run = {
        let t = token.clone();
        let receiver = inbox::DurableReceiver::new(Arc::clone(&store));
        tokio::spawn(async move { consumer.run(receiver, t).await })
    };
    let processor = inbox::InboxProcessor::new(
        Arc::clone(&store),
        Pipeline::new().on("OrderPlaced", "projector", Projector(schema.clone())),
        inbox::ProcessorConfig::new(),
    );
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
    token.cancel();
    run.await.expect("join").expect("consumer");
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

/// Queue arguments that let RabbitMQ delete the test queue a minute after its last
/// consumer left, even when the test fails half-way.
fn expires_when_unused() -> lapin::types::FieldTable {
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-expires".into(), lapin::types::AMQPValue::LongInt(60_000));
    args
}
