//! SQL Server: the same outbox on SQL Server 2017+ (tiberius, a bb8 pool). Connect with
//! `DATABASE_URL` (an ADO.NET connection string, e.g.
//! `server=tcp:127.0.0.1,1433;user=sa;password=…;TrustServerCertificate=true;database=app`,
//! or `mssql://sa:…@127.0.0.1:1433/app?TrustServerCertificate=true`),
//! migrate, enqueue in the caller's transaction, relay. SQL Server has no push
//! notification for commits: the relay polls, adaptively (docs/sqlserver.md, which also
//! says which isolation level, locking hints and indexes the claims rely on).
//!
//! `DATABASE_URL=… OUTBOX_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!  cargo run -p outboxkit --example sqlserver_setup --features sqlserver`
use std::sync::Arc;
use std::time::Duration;

use outboxkit::sqlserver::{MssqlConfig, MssqlOutbox};
use outboxkit::{
    AnyPublisher, AnyPublisherConfig, Dispatcher, DispatcherConfig, NewMessage, OutboxProducer,
};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Tables in the schema `outbox` (OUTBOX_SCHEMA); migrations are versioned and
    // serialized by an application lock, so every instance may run them at start.
    let store = MssqlOutbox::connect(&MssqlConfig::from_env()?).await?;
    store.migrate().await?;

    let mut tx = store.begin().await?; // XACT_ABORT ON: an error rolls it all back
    tx.execute(
        "IF OBJECT_ID('dbo.orders') IS NULL CREATE TABLE dbo.orders (id bigint PRIMARY KEY)",
        &[],
    )
    .await?;
    let order_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    tx.execute("INSERT INTO dbo.orders (id) VALUES (@P1)", &[&order_id])
        .await?;
    let event = NewMessage::builder("order", order_id.to_string(), "OrderPlaced")
        .payload(&serde_json::json!({ "order_id": order_id }))
        .build()?;
    store.enqueue(&mut tx, &event).await?;
    tx.commit().await?;

    let publisher = AnyPublisher::connect(AnyPublisherConfig::from_url(&std::env::var(
        "OUTBOX_BROKER_URL",
    )?)?)
    .await?;
    // Polling only: at most every 500 ms when idle, back to back while there is work.
    let config = DispatcherConfig::new().with_poll_interval(Duration::from_millis(500));
    let relay = Dispatcher::new(Arc::new(store), Arc::new(publisher), config)?;
    let shutdown = CancellationToken::new();
    let on_ctrl_c = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_ctrl_c.cancel();
    });
    relay.run(shutdown).await?;
    Ok(())
}
