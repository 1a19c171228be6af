//! `RabbitConsumer` against the real RabbitMQ, for what only AMQP has: the broker
//! closing the consumer's connection, a queue declared with other arguments. Requeue,
//! reject, undecodable deliveries, panics and shutdown are properties of the transport
//! conformance suite (`tests/conformance.rs`).

mod common;

use outboxkit_core::Consumer as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::ExchangeKind;
use lapin::types::FieldTable;
use outboxkit_core::EventPublisher;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_rabbit::{
    DeliveryHandler, HandlerDecision, RabbitConfig, RabbitConsumer, RabbitConsumerConfig,
    RabbitError, RabbitPublisher,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// Records the id of every message it acks.
#[derive(Clone, Default)]
struct Recorder {
    finished: Arc<Mutex<Vec<Uuid>>>,
}

impl Recorder {
    fn finished(&self) -> Vec<Uuid> {
        self.finished.lock().expect("lock").clone()
    }
}

#[async_trait]
impl DeliveryHandler for Recorder {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        self.finished.lock().expect("lock").push(msg.id);
        HandlerDecision::Ack
    }
}

struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), RabbitError>>,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("consumer stops before the deadline")
            .expect("consumer task did not panic")
            .expect("consumer ends without error");
    }
}

fn start(consumer: RabbitConsumer, handler: Recorder) -> Running {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let task = tokio::spawn(async move { consumer.run(handler, token).await });
    Running { shutdown, task }
}

async fn publisher(config: &RabbitConfig) -> RabbitPublisher {
    RabbitPublisher::connect(config.clone())
        .await
        .expect("publisher connects")
}

/// The broker closes the consumer's connection: it reconnects by itself and keeps
/// consuming.
#[tokio::test]
async fn consumer_reconnects_after_the_broker_closes_its_connection() {
    let exchange = unique("consumer.reconnect");
    let queue = unique("consumer.reconnect.q");
    let name = unique("consumer.reconnect.conn");
    let publisher_config = build(config(&exchange));
    let consumer_config = build(config(&exchange).with_connection_name(name.clone()));
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(consumer_config, queue.clone())
            .with_binding_key("#")
            .with_queue_arguments(expiring(FieldTable::default()))
            .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1)),
    )
    .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let publisher = publisher(&publisher_config).await;

    let handler = Recorder::default();
    let running = start(consumer, handler.clone());
    let first = message("First", "1", "{}");
    assert!(publisher.publish_batch(std::slice::from_ref(&first)).await[0].is_published());
    eventually("the first message is handled", || async {
        handler.finished().contains(&first.id)
    })
    .await;

    assert_eq!(force_close_connections(&name).await, 1);

    let second = message("Second", "2", "{}");
    assert!(publisher.publish_batch(std::slice::from_ref(&second)).await[0].is_published());
    eventually(
        "the second message is handled after reconnecting",
        || async { handler.finished().contains(&second.id) },
    )
    .await;
    assert!(!running.task.is_finished(), "still running");
    running.stop().await;

    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// A queue that exists with other arguments cannot be fixed by retrying: `run` returns
/// the typed, permanent error instead of looping.
#[tokio::test]
async fn inequivalent_queue_is_a_permanent_error() {
    let exchange = unique("inequivalent");
    let queue = unique("inequivalent.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await; // no dead-letter exchange

    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(build(config(&exchange)), queue.clone())
            .with_dead_letter_exchange("some.dlx")
            .with_queue_arguments(expiring(FieldTable::default())),
    )
    .expect("valid consumer");
    let result = tokio::time::timeout(
        DEADLINE,
        consumer.run(Recorder::default(), CancellationToken::new()),
    )
    .await
    .expect("returns instead of retrying forever");
    match result {
        Err(
            e @ RabbitError::Declare {
                operation: "queue.declare",
                ..
            },
        ) => {
            assert_eq!(e.kind(), outboxkit_core::ErrorKind::Permanent);
        }
        other => panic!("expected a permanent queue.declare error, got {other:?}"),
    }
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// The broker closes the consumer's connection while a handler holds a delivery: the
/// handler's answer cannot reach the broker any more (it must not wait for it forever),
/// the consumer reconnects, the broker delivers the message again, and the consumer
/// still stops when asked.
#[tokio::test]
async fn a_delivery_in_flight_when_the_connection_closes_is_redelivered() {
    let exchange = unique("consumer.inflight");
    let queue = unique("consumer.inflight.q");
    let name = unique("consumer.inflight.conn");
    let publisher_config = build(config(&exchange));
    let consumer_config = build(config(&exchange).with_connection_name(name.clone()));
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(consumer_config, queue.clone())
            .with_binding_key("#")
            .with_queue_arguments(expiring(FieldTable::default()))
            .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1)),
    )
    .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let publisher = publisher(&publisher_config).await;
    let handler = Holding::default();
    let shutdown = CancellationToken::new();
    let task = {
        let (handler, token) = (handler.clone(), shutdown.clone());
        tokio::spawn(async move { consumer.run(handler, token).await })
    };
    let msg = message("Held", "1", "{}");
    assert!(publisher.publish_batch(std::slice::from_ref(&msg)).await[0].is_published());
    tokio::time::timeout(DEADLINE, handler.started.notified())
        .await
        .expect("the handler holds the delivery");
    assert_eq!(force_close_connections(&name).await, 1);
    handler.release.notify_one();
    eventually(
        "the message is delivered again after reconnecting",
        || async { handler.seen.lock().expect("lock").len() >= 2 },
    )
    .await;
    assert_eq!(handler.seen.lock().expect("lock").clone(), [msg.id, msg.id]);
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("the consumer stops when asked")
        .expect("no panic")
        .expect("no error");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    cleanup(&channel, &[&exchange], &[&queue]).await;
}
