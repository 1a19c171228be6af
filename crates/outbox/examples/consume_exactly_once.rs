//! Consume with exactly-once effects: the broker delivers at least once, the inbox
//! records each `(message, handler)` pair in the transaction of the handler's effect,
//! so a redelivered message is acknowledged without running the handler again. A
//! handler that keeps failing ends as a consumer dead letter (`outbox inbox dead list`)
//! instead of blocking the queue.
//!
//! `OUTBOX_BROKER_URL=nats://127.0.0.1:4222 DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!  cargo run -p outboxkit --example consume_exactly_once --features nats,inbox`
//! (with `relay.rs` running and `publish_in_transaction.rs` producing; Ctrl-C stops it
//! after the deliveries in hand are settled)
use std::sync::Arc;

use outboxkit::inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit::postgres::sqlx::{self, PgConnection};
use outboxkit::postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit::{AnyConsumer, AnyConsumerConfig, Consumer as _, IncomingMessage};
use tokio_util::sync::CancellationToken;

#[derive(serde::Deserialize)]
struct OrderPlaced {
    order_id: uuid::Uuid,
    total_cents: i64,
}

/// Adds each order to a per-day revenue total: not idempotent by itself, so a
/// duplicate would count twice without the inbox.
struct Revenue;

#[async_trait::async_trait]
impl Handler<PgInbox> for Revenue {
    async fn handle(
        &self,
        conn: &mut PgConnection, // the inbox's transaction: effect and record commit together
        msg: &IncomingMessage,
        _ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        // A payload that can never be read is permanent: dead-lettered at once.
        let order: OrderPlaced = msg.json().map_err(HandlerError::permanent)?;
        sqlx::query(
            "INSERT INTO revenue (day, cents, orders) VALUES (current_date, $1, 1)
             ON CONFLICT (day) DO UPDATE SET cents = revenue.cents + $1, orders = revenue.orders + 1",
        )
        .bind(order.total_cents)
        .execute(conn)
        .await?; // a database error rolls back and retries; it is never acknowledged
        println!("order {} counted", order.order_id);
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let inbox = PgOutbox::connect(&PgConfig::from_env()?).await?.inbox(); // the relay migrated it
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS revenue (day date PRIMARY KEY, cents bigint, orders bigint)",
    )
    .execute(inbox.pool())
    .await?;
    // RabbitMQ: the durable queue `revenue` bound to the exchange `outbox.events`;
    // NATS: the durable consumer `revenue` on the stream `OUTBOX`.
    let config = AnyConsumerConfig::from_url(&std::env::var("OUTBOX_BROKER_URL")?, "revenue")?;
    let consumer = AnyConsumer::new(config.with_stream("OUTBOX"))?;
    let pipeline = Pipeline::new().on("OrderPlaced", "revenue", Revenue);
    let handler = IdempotentConsumer::new(
        Arc::new(inbox),
        pipeline,
        ConsumerConfig::new().with_max_deliveries(5),
    )?;

    let shutdown = CancellationToken::new();
    let on_ctrl_c = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_ctrl_c.cancel();
    });
    consumer.run(handler, shutdown).await?; // reconnects by itself; Ok after a drain
    Ok(())
}
