//! Run a relay: publish what the outbox holds to the broker of `OUTBOX_BROKER_URL`
//! (`amqp://…` for RabbitMQ, `nats://…` for NATS JetStream), with publisher confirms or
//! PubAcks, until Ctrl-C; then drain (batches in flight finish) and stop. Run as many
//! as you like against one database: claims never overlap.
//!
//! `OUTBOX_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!  cargo run -p outboxkit --example relay --features nats`
//!
//! The `outbox relay` binary is this loop with metrics, health checks, SIGTERM and a
//! config file (docs/operations.md).
use std::sync::Arc;

use outboxkit::postgres::{PgConfig, PgOutbox};
use outboxkit::{AnyPublisher, AnyPublisherConfig, Dispatcher, DispatcherConfig};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = PgOutbox::connect(&PgConfig::from_env()?).await?;
    store.migrate().await?;
    let publisher = AnyPublisher::connect(AnyPublisherConfig::from_url(&std::env::var(
        "OUTBOX_BROKER_URL",
    )?)?)
    .await?;
    if let Some(nats) = publisher.as_nats() {
        // JetStream stores only subjects a stream captures: `OUTBOX` takes `outbox.events.>`.
        let stream = outboxkit::nats::StreamSetup::for_config("OUTBOX", nats.config());
        nats.ensure_stream(&stream).await?;
    }

    // Defaults: batches of 500, 30 s leases, 8 attempts with exponential backoff, then
    // a dead letter; a circuit breaker per destination; a poll at least every 500 ms.
    let relay = Dispatcher::new(
        Arc::new(store),
        Arc::new(publisher),
        DispatcherConfig::new(),
    )?;
    // The relay wakes at once when an insert commits: it LISTENs to the store's NOTIFY
    // by itself while it runs (`DispatcherConfig::with_push_wake`).
    let shutdown = CancellationToken::new();
    let on_ctrl_c = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_ctrl_c.cancel();
    });
    let stats = relay.run(shutdown).await?;
    println!(
        "relay stopped: {} published, {} retried, {} dead-lettered",
        stats.published, stats.retried, stats.dead
    );
    Ok(())
}
