//! The README's quick start: migrate, enqueue in a transaction, relay, consume exactly
//! once. PostgreSQL from `DATABASE_URL`; the broker from `OUTBOX_BROKER_URL` (`amqp://…` for
//! RabbitMQ, `nats://…` for NATS JetStream: only the URL changes).
//!
//! `cargo run -p outboxkit --example quick_start --features nats,inbox`
use std::sync::Arc;

use outboxkit::inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit::postgres::{
    PgConfig, PgInbox, PgOutbox,
    sqlx::{self, PgConnection},
};
use outboxkit::{
    AnyConsumer, AnyConsumerConfig, AnyPublisher, AnyPublisherConfig, CancellationToken,
    Consumer as _, Dispatcher, DispatcherConfig, IncomingMessage, NewMessage, OutboxProducer,
};

struct Project; // the effect: one row per order, in the inbox's transaction
#[outboxkit::async_trait]
impl Handler<PgInbox> for Project {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO projected (id) VALUES ($1)")
            .bind(msg.id)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let broker = std::env::var("OUTBOX_BROKER_URL")?;
    let shutdown = CancellationToken::new(); // wire it to SIGTERM
    let store = PgOutbox::connect(&PgConfig::from_env()?).await?; // DATABASE_URL
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS projected (id uuid PRIMARY KEY)")
        .execute(store.pool())
        .await?;

    // Business rows and their event commit together.
    let mut tx = store.begin().await?;
    let event = NewMessage::builder("order", "42", "OrderPlaced")
        .payload(&serde_json::json!({ "id": 42 }))
        .build()?;
    store.enqueue(&mut tx, &event).await?;
    tx.commit().await?;

    // Its queue (RabbitMQ) or stream and durable (NATS) exist before the first publish.
    let config = AnyConsumerConfig::from_url(&broker, "projection")?.with_stream("OUTBOX");
    let consumer = AnyConsumer::new(config)?;
    consumer.declare().await?;
    let pipeline = Pipeline::new().on("OrderPlaced", "projection", Project);
    let handler =
        IdempotentConsumer::new(Arc::new(store.inbox()), pipeline, ConsumerConfig::new())?;

    // The relay LISTENs: a commit wakes it.
    let publisher = AnyPublisher::connect(AnyPublisherConfig::from_url(&broker)?).await?;
    let relay = Dispatcher::new(
        Arc::new(store),
        Arc::new(publisher),
        DispatcherConfig::new(),
    )?;
    let (relayed, consumed) = tokio::join!(
        relay.run(shutdown.clone()),
        consumer.run(handler, shutdown.clone())
    );
    relayed?; // both run until `shutdown` is cancelled
    consumed?;
    Ok(())
}
