//! `RabbitConsumer` while RabbitMQ is stopped and started again, in a binary of its own
//! so that no other test of this crate runs meanwhile (the broker is shared); it also
//! holds the machine-wide fault lock of `outboxkit_testkit::faults`.

mod common;

use outboxkit_core::Consumer as _;
use std::time::Duration;

use lapin::types::FieldTable;
use outboxkit_core::EventPublisher;
use outboxkit_rabbit::{RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};
use tokio_util::sync::CancellationToken;

use common::*;

/// The broker goes away abruptly (stopped, then started again) while the handler holds a
/// delivery: its answer meets a dead connection and must not hold the
/// consumer; once the broker is back the message is delivered again and handled.
#[tokio::test]
async fn a_delivery_in_flight_when_the_broker_restarts_is_redelivered() {
    let _lock = outboxkit_testkit::faults::lock().await;
    let exchange = unique("consumer.restart");
    let queue = unique("consumer.restart.q");
    let publisher_config = build(config(&exchange));
    let consumer_config = build(config(&exchange));
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(consumer_config, queue.clone())
            .with_binding_key("#")
            .with_queue_arguments(arguments)
            .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1)),
    )
    .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let publisher = RabbitPublisher::connect(publisher_config.clone())
        .await
        .expect("publisher connects");
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
    let stopped = outboxkit_testkit::faults::RabbitStopped::stop();
    handler.release.notify_one();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stopped.end();
    eventually(
        "the message is delivered again after the restart",
        || async { handler.seen.lock().expect("lock").len() >= 2 },
    )
    .await;
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
