//! The README's quick start: migrate, enqueue in a transaction, relay, consume exactly
//! once. PostgreSQL from `DATABASE_URL`; the broker from `OUTBOX_BROKER_URL` (`amqp://…` for
//! RabbitMQ, `nats://…` for NATS JetStream: only the URL changes).
//!
//! `cargo run -p outboxkit --example quick_start --features nats,inbox`
#![cfg_attr(rustfmt, rustfmt::skip)] // the README shows it line for line
use std::sync::Arc;

use outboxkit::inbox::{ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline};
use outboxkit::postgres::{PgConfig, PgInbox, PgOutbox, sqlx::{self, PgConnection}};
use outboxkit::{AnyConsumer, AnyConsumerConfig, AnyPublisher, AnyPublisherConfig, CancellationToken, Consumer as _, Dispatcher, DispatcherConfig, IncomingMessage, NewMessage, OutboxProducer};

struct Project; // the effect: one row per order, in the inbox's transaction
#[async_trait::async_trait]
impl Handler<PgInbox> for Project {
    async fn handle(&self, conn: &mut PgConnection, msg: &IncomingMessage, _: &HandlerContext) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO projected (id) VALUES ($1)").bind(msg.id).execute(conn).await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (broker, shutdown) = (std::env::var("OUTBOX_BROKER_URL")?, CancellationToken::new());
    let store = PgOutbox::connect(&PgConfig::from_env()?).await?; // DATABASE_URL
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS projected (id uuid PRIMARY KEY)").execute(store.pool()).await?;
    let mut tx = store.begin().await?; // business rows and their event commit together
    store.enqueue(&mut tx, &NewMessage::builder("order", "42", "OrderPlaced").payload(&serde_json::json!({ "id": 42 })).build()?).await?;
    tx.commit().await?;

    let consumer = AnyConsumer::new(AnyConsumerConfig::from_url(&broker, "projection")?.with_stream("OUTBOX"))?;
    consumer.declare().await?; // its queue (RabbitMQ) or stream and durable (NATS) exist before the first publish
    let handler = IdempotentConsumer::new(Arc::new(store.inbox()), Pipeline::new().on("OrderPlaced", "projection", Project), ConsumerConfig::new())?;
    let publisher = AnyPublisher::connect(AnyPublisherConfig::from_url(&broker)?).await?;
    let relay = Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())?; // LISTENs: a commit wakes it
    let (relayed, consumed) = tokio::join!(relay.run(shutdown.clone()), consumer.run(handler, shutdown.clone()));
    relayed?; consumed?; // runs until cancelled: wire `shutdown` to SIGTERM
    Ok(())
}
