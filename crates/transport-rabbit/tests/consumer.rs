//! `RabbitConsumer` against the real RabbitMQ, fed by `RabbitPublisher` (and by raw
//! lapin for messages our publisher would never produce).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, ExchangeKind};
use outbox_core::EventPublisher;
use outbox_core::wire::IncomingMessage;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use transport_rabbit::{
    DeliveryHandler, HandlerDecision, RabbitConfig, RabbitConsumer, RabbitError, RabbitPublisher,
};
use uuid::Uuid;

use common::*;

/// What a handler saw.
#[derive(Debug, Clone)]
struct Seen {
    id: Uuid,
    event_type: String,
    redelivered: bool,
    aggregate_version: Option<i64>,
    at: std::time::Instant,
}

/// Records every message; requeues the first delivery of ids listed in `requeue_once`;
/// sleeps `delay` before answering.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
    finished: Arc<Mutex<Vec<Uuid>>>,
    requeue_once: Arc<Mutex<Vec<Uuid>>>,
    delay: Duration,
}

impl Recorder {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    fn finished(&self) -> Vec<Uuid> {
        self.finished.lock().expect("lock").clone()
    }
}

#[async_trait]
impl DeliveryHandler for Recorder {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        self.seen.lock().expect("lock").push(Seen {
            id: msg.id,
            event_type: msg.event_type.clone(),
            redelivered: msg.redelivered,
            aggregate_version: msg.aggregate_version,
            at: std::time::Instant::now(),
        });
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let requeue = {
            let mut once = self.requeue_once.lock().expect("lock");
            match once.iter().position(|id| *id == msg.id) {
                Some(i) => {
                    once.remove(i);
                    true
                }
                None => false,
            }
        };
        self.finished.lock().expect("lock").push(msg.id);
        if requeue {
            HandlerDecision::Requeue
        } else {
            HandlerDecision::Ack
        }
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

/// A consumer with `requeue_delay` on a fresh queue, running a handler that requeues
/// the first delivery of one message, and that message published to it.
struct RequeuedOnce {
    exchange: String,
    queue: String,
    msg: outbox_core::OutboxMessage,
    handler: Recorder,
    running: Running,
}

async fn requeued_once(tag: &str, requeue_delay: Duration, aggregate_id: &str) -> RequeuedOnce {
    let exchange = unique(tag);
    let queue = unique(&format!("{tag}.q"));
    let config = build(config(&exchange));
    let consumer = RabbitConsumer::builder(config.clone(), queue.clone())
        .with_binding_key("#")
        .with_queue_arguments(expiring(FieldTable::default()))
        .with_requeue_delay(requeue_delay)
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");

    let msg = message(
        "OrderPlaced",
        aggregate_id,
        &format!(r#"{{"order":{aggregate_id}}}"#),
    );
    let handler = Recorder::default();
    handler.requeue_once.lock().expect("lock").push(msg.id);
    let running = start(consumer, handler.clone());
    let outcomes = publisher(&config)
        .await
        .publish_batch(std::slice::from_ref(&msg))
        .await;
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    RequeuedOnce {
        exchange,
        queue,
        msg,
        handler,
        running,
    }
}

/// A handler that answers `Requeue` gets the message again, flagged as redelivered,
/// after the requeue delay, and once it answers `Ack` the message is gone from the
/// queue.
#[tokio::test]
async fn requeued_message_is_redelivered_then_acked() {
    let RequeuedOnce {
        exchange,
        queue,
        msg,
        handler,
        running,
    } = requeued_once("requeue", Duration::from_millis(400), "42").await;

    eventually("the message is delivered twice", || async {
        handler.finished().len() >= 2
    })
    .await;
    let seen = handler.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen.iter()
            .all(|s| s.id == msg.id && s.event_type == "OrderPlaced")
    );
    assert!(!seen[0].redelivered, "first delivery is not a redelivery");
    assert!(
        seen[1].redelivered,
        "the requeued delivery is flagged redelivered"
    );
    assert!(
        seen[1].at.duration_since(seen[0].at) >= Duration::from_millis(400),
        "the requeue waited its delay: {:?}",
        seen[1].at.duration_since(seen[0].at)
    );

    running.stop().await;
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    assert_eq!(queue_len(&channel, &queue).await, 0, "acked: nothing left");
    assert_eq!(handler.seen().len(), 2, "no third delivery");
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// Shutdown cuts a pending requeue delay short: the consumer stops in time and the
/// message is back in the queue.
#[tokio::test]
async fn shutdown_cuts_the_requeue_delay_short() {
    let RequeuedOnce {
        exchange,
        queue,
        handler,
        running,
        ..
    } = requeued_once("requeue-stop", Duration::from_secs(600), "7").await;
    eventually("the handler asked for a requeue", || async {
        !handler.finished().is_empty()
    })
    .await;

    running.stop().await; // within DEADLINE (30 s), far below the 600 s delay
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    assert_eq!(
        queue_len(&channel, &queue).await,
        1,
        "the requeued message waits in the queue"
    );
    assert_eq!(handler.seen().len(), 1, "not delivered again meanwhile");
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// A delivery without an id is rejected without requeue (to the queue's dead-letter
/// exchange) and does not block the queue even with a prefetch of 1; a raw message
/// with an id property and non-string AMQP headers is decoded.
#[tokio::test]
async fn undecodable_message_is_rejected_and_does_not_block_the_queue() {
    let exchange = unique("poison");
    let queue = unique("poison.q");
    let dlx = unique("poison.dlx");
    let dlq = unique("poison.dlq");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &dlx, ExchangeKind::Fanout).await;
    bind_queue(&channel, &dlx, &dlq, "").await;

    let config = build(config(&exchange));
    let consumer = RabbitConsumer::builder(config.clone(), queue.clone())
        .with_binding_key("#")
        .with_prefetch(1)
        .with_dead_letter_exchange(dlx.clone())
        .with_queue_arguments(expiring(FieldTable::default()))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");

    // 1. No message_id, no CloudEvents headers: undecodable.
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let confirm = channel
        .basic_publish(
            exchange.as_str().into(),
            "Garbage".into(),
            BasicPublishOptions::default(),
            b"not even json",
            BasicProperties::default(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(confirm.is_ack());
    // 2. A message id that is not a UUID: undecodable too.
    channel
        .basic_publish(
            exchange.as_str().into(),
            "Garbage".into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default().with_message_id("not-a-uuid".into()),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    // 3. Raw but decodable: the id only in the property, the version as an integer
    //    header. (No short-string header: RabbitMQ reads field type `s` as a 16-bit
    //    integer and fails the connection.)
    let raw_id = Uuid::now_v7();
    let mut headers = FieldTable::default();
    headers.insert(
        "cloudEvents:type".into(),
        AMQPValue::LongString("RawEvent".into()),
    );
    headers.insert("cloudEvents:aggregateversion".into(), AMQPValue::LongInt(5));
    channel
        .basic_publish(
            exchange.as_str().into(),
            "RawEvent".into(),
            BasicPublishOptions::default(),
            b"{}",
            BasicProperties::default()
                .with_message_id(raw_id.to_string().into())
                .with_headers(headers),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    // 4. A regular message from our publisher.
    let good = message("OrderPlaced", "1", "{}");
    assert!(
        publisher(&config)
            .await
            .publish_batch(std::slice::from_ref(&good))
            .await[0]
            .is_published()
    );

    let handler = Recorder::default();
    let running = start(consumer, handler.clone());
    eventually("both decodable messages are handled", || async {
        handler.finished().len() >= 2
    })
    .await;
    let seen = handler.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].id, raw_id);
    assert_eq!(seen[0].event_type, "RawEvent");
    assert_eq!(seen[0].aggregate_version, Some(5));
    assert_eq!(seen[1].id, good.id);

    eventually("both undecodable messages are dead-lettered", || async {
        queue_len(&channel, &dlq).await == 2
    })
    .await;
    running.stop().await;
    assert_eq!(queue_len(&channel, &queue).await, 0);
    cleanup(&channel, &[&exchange, &dlx], &[&queue, &dlq]).await;
}

/// Several deliveries are handled at once (up to the prefetch), and a graceful
/// shutdown lets running handlers finish and acks them; nothing they handled comes
/// back, and what they did not start stays in the queue.
#[tokio::test]
async fn concurrent_handling_and_graceful_shutdown() {
    let exchange = unique("graceful");
    let queue = unique("graceful.q");
    let config = build(config(&exchange));
    let consumer = RabbitConsumer::builder(config.clone(), queue.clone())
        .with_binding_key("#")
        .with_prefetch(4)
        .with_queue_arguments(expiring(FieldTable::default()))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let messages: Vec<_> = (0..10)
        .map(|i| message("Slow", &i.to_string(), "{}"))
        .collect();
    let outcomes = publisher(&config).await.publish_batch(&messages).await;
    assert!(outcomes.iter().all(|o| o.is_published()));

    let handler = Recorder {
        delay: Duration::from_millis(1500),
        ..Recorder::default()
    };
    let running = start(consumer, handler.clone());
    eventually("four handlers run at once", || async {
        handler.seen().len() == 4
    })
    .await;
    assert!(handler.finished().is_empty(), "they are still running");
    running.stop().await;

    let started = handler.seen().len();
    assert_eq!(
        handler.finished().len(),
        started,
        "in-flight handlers finished"
    );
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    eventually("unstarted messages are back in the queue", || async {
        usize::try_from(queue_len(&channel, &queue).await).expect("u32 fits") == 10 - started
    })
    .await;
    cleanup(&channel, &[&exchange], &[&queue]).await;
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
    let consumer = RabbitConsumer::builder(consumer_config, queue.clone())
        .with_binding_key("#")
        .with_queue_arguments(expiring(FieldTable::default()))
        .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .build()
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

    let consumer = RabbitConsumer::builder(build(config(&exchange)), queue.clone())
        .with_dead_letter_exchange("some.dlx")
        .with_queue_arguments(expiring(FieldTable::default()))
        .build()
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
            assert_eq!(e.kind(), outbox_core::ErrorKind::Permanent);
        }
        other => panic!("expected a permanent queue.declare error, got {other:?}"),
    }
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// Panics on the first two deliveries, counting them, then acks.
#[derive(Clone, Default)]
struct Panicker {
    calls: Arc<Mutex<Vec<bool>>>,
}

#[async_trait]
impl DeliveryHandler for Panicker {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let mut calls = self.calls.lock().expect("lock");
        calls.push(msg.redelivered);
        if calls.len() <= 2 {
            drop(calls);
            panic!("handler bug (expected by the test)");
        }
        HandlerDecision::Ack
    }
}

/// A handler that panics does not take the consumer down, and its delivery is never
/// rejected (nothing recorded it): it is requeued until the handler stops panicking;
/// nothing reaches the queue's dead-letter exchange.
#[tokio::test]
async fn panicking_handler_is_requeued_never_dead_lettered() {
    let exchange = unique("panic");
    let queue = unique("panic.q");
    let dlx = unique("panic.dlx");
    let dlq = unique("panic.dlq");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &dlx, ExchangeKind::Fanout).await;
    bind_queue(&channel, &dlx, &dlq, "").await;
    let config = build(config(&exchange));
    let consumer = RabbitConsumer::builder(config.clone(), queue.clone())
        .with_binding_key("#")
        .with_dead_letter_exchange(dlx.clone())
        .with_queue_arguments(expiring(FieldTable::default()))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let handler = Panicker::default();
    let shutdown = CancellationToken::new();
    let task = {
        let (handler, token) = (handler.clone(), shutdown.clone());
        tokio::spawn(async move { consumer.run(handler, token).await })
    };
    let msg = message("Poison", "1", "{}");
    assert!(
        publisher(&config)
            .await
            .publish_batch(std::slice::from_ref(&msg))
            .await[0]
            .is_published()
    );

    eventually("the message is handled after two panics", || async {
        handler.calls.lock().expect("lock").len() == 3 && queue_len(&channel, &queue).await == 0
    })
    .await;
    assert_eq!(
        *handler.calls.lock().expect("lock"),
        vec![false, true, true]
    );
    assert_eq!(
        queue_len(&channel, &dlq).await,
        0,
        "nothing was dead-lettered"
    );
    assert!(!task.is_finished(), "the consumer survived the panics");
    shutdown.cancel();
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("stops")
        .expect("no panic escaped")
        .expect("clean shutdown");
    cleanup(&channel, &[&exchange, &dlx], &[&queue, &dlq]).await;
}
