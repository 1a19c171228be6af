//! Publish an event in the same transaction as the business change: the order row and
//! its `OrderPlaced` event commit together or not at all. A relay publishes the event
//! later (see `relay.rs`); until then `outbox stats` shows it pending.
//!
//! `DATABASE_URL=postgres://postgres@127.0.0.1/test cargo run -p outboxkit --example publish_in_transaction`
use outboxkit::postgres::{PgConfig, PgOutbox, sqlx};
use outboxkit::{NewMessage, OutboxProducer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // DATABASE_URL; the outbox tables live in the schema `outbox` (OUTBOX_SCHEMA).
    let store = PgOutbox::connect(&PgConfig::from_env()?).await?;
    store.migrate().await?; // versioned and idempotent: safe at every start
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id uuid PRIMARY KEY, total_cents bigint)")
        .execute(store.pool())
        .await?;

    let order_id = uuid::Uuid::now_v7();
    let event = NewMessage::builder("order", order_id.to_string(), "OrderPlaced")
        .aggregate_version(1) // lets consumers skip stale or replayed versions
        .payload(&serde_json::json!({ "order_id": order_id, "total_cents": 1999 }))
        .build()?; // a typed error for an empty event type, bad JSON or bad headers

    let mut tx = store.begin().await?;
    sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, $2)")
        .bind(order_id)
        .bind(1999_i64)
        .execute(&mut *tx)
        .await?;
    let event_id = store.enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    println!("order {order_id} and event {event_id} committed together");

    // A transaction that rolls back takes its events with it: nothing is published.
    let mut tx = store.begin().await?;
    let discarded = NewMessage::builder("order", "never", "OrderPlaced")
        .payload(&serde_json::json!({}))
        .build()?;
    store.enqueue(&mut tx, &discarded).await?;
    tx.rollback().await?;
    println!("event {} rolled back with its transaction", discarded.id);
    Ok(())
}
