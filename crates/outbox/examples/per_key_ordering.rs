//! Per-key ordering: the relay publishes the events of one key (here an order) in the
//! order they were written, one at a time, while different keys go out in parallel; a
//! message that fails holds its key back until it is published or dead-lettered
//! (`OnDead::Block`: the key stays stopped until an operator replays it). The consumer
//! below takes one delivery at a time (prefetch 1), so it prints them in broker order:
//! for each order, Placed, Paid, Shipped.
//!
//! `OUTBOX_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!  cargo run -p outboxkit --example per_key_ordering`
use std::sync::Arc;

use outboxkit::postgres::{PgConfig, PgOutbox};
use outboxkit::rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};
use outboxkit::{
    Consumer as _, DeliveryHandler, Dispatcher, DispatcherConfig, HandlerDecision, OutboxProducer,
};
use outboxkit::{IncomingMessage, NewMessage, Ordering};
use tokio_util::sync::CancellationToken;

/// Prints each delivery and stops the example after the last one.
struct Print {
    left: std::sync::atomic::AtomicUsize,
    done: CancellationToken,
}

#[async_trait::async_trait]
impl DeliveryHandler for Print {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let key = msg.partition_key.as_deref().unwrap_or("-");
        println!("{key}: {}", msg.event_type);
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 1 {
            self.done.cancel();
        }
        HandlerDecision::Ack
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A schema of its own, so that no other example's pending events are relayed here.
    let store = PgOutbox::connect(&PgConfig::from_env()?.with_schema("ordering_example")).await?;
    store.migrate().await?;
    let rabbit = RabbitConfig::from_env()? // OUTBOX_BROKER_URL, else the local broker
        .with_exchange("ordering.example");
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit.clone(), "ordering.example")
            .with_binding_key("#")
            .with_prefetch(1),
    )?;
    consumer.declare().await?; // the queue exists before the first publish

    let mut tx = store.begin().await?;
    for order in ["order-1", "order-2"] {
        for (version, step) in [(1, "OrderPlaced"), (2, "OrderPaid"), (3, "OrderShipped")] {
            let event = NewMessage::builder("order", order, step)
                .aggregate_version(version)
                .partition_key(order) // the key; without it: aggregate type and id
                .payload(&serde_json::json!({ "order": order }))
                .build()?;
            store.enqueue(&mut tx, &event).await?;
        }
    }
    tx.commit().await?;

    let config = DispatcherConfig::new().with_ordering(Ordering::per_key());
    let publisher = RabbitPublisher::connect(rabbit).await?;
    let relay = Dispatcher::new(Arc::new(store), Arc::new(publisher), config)?;
    let done = CancellationToken::new();
    let print = Print {
        left: 6.into(),
        done: done.clone(),
    };
    let (relayed, consumed) = tokio::join!(relay.run(done.clone()), consumer.run(print, done));
    relayed?;
    consumed?;
    Ok(())
}
