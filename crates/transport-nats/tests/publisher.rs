//! `NatsPublisher` and `StreamSetup` against the real NATS server with JetStream, for
//! what only JetStream has: the duplicate window, the stream helper, and an invalid
//! subject through the relay over PostgreSQL. The outcomes shared with RabbitMQ
//! (acknowledged with the wire format, unroutable, oversized, invalid, unacknowledged,
//! unreachable) are properties of the transport conformance suite
//! (`tests/conformance.rs`). Every test uses its own stream and subject prefix, so the
//! tests run in parallel with each other and with anything else on the server.

mod common;

use std::sync::Arc;
use std::time::Duration;

use outboxkit_core::{
    Dispatcher, DispatcherConfig, ErrorKind, EventPublisher, MessageStatus, NewMessage,
    OutboxMessage, OutboxProducer, PublishOutcome,
};
use outboxkit_nats::{
    NatsConfig, NatsConsumer, NatsConsumerConfig, NatsError, NatsPublisher, Storage, StreamSetup,
};

use common::*;

fn assert_published(outcomes: &[PublishOutcome], expected: usize) {
    assert_eq!(outcomes.len(), expected, "one outcome per message");
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(outcome.is_published(), "message {i}: {outcome:?}");
    }
}

/// A message published again with the same id inside the stream's duplicate window (a
/// relay that crashed after publishing) is acknowledged as published but stored once.
#[tokio::test]
async fn republished_message_is_stored_once_inside_the_duplicate_window() {
    let fx = Fixture::new().await;
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    let first: Vec<OutboxMessage> = (0..20)
        .map(|i| message("OrderPlaced", &i.to_string(), "{}"))
        .collect();
    assert_published(&publisher.publish_batch(&first).await, 20);
    assert_eq!(fx.stored().await, 20);

    // The same 20 again (same ids, as after a reclaim), plus one new message.
    let mut again = first.clone();
    again.push(message("OrderPlaced", "new", "{}"));
    assert_published(&publisher.publish_batch(&again).await, 21);
    assert_eq!(
        fx.stored().await,
        21,
        "the 20 re-published ids were dropped"
    );

    // Straight from JetStream: the PubAck of a re-publish says `duplicate`.
    let ack = fx
        .js
        .send_publish(
            format!("{}.OrderPlaced", fx.prefix),
            async_nats::jetstream::message::PublishMessage::build()
                .payload("{}".into())
                .message_id(first[0].id.to_string()),
        )
        .await
        .expect("send")
        .await
        .expect("PubAck");
    assert!(ack.duplicate, "{ack:?}");
    assert_eq!(fx.stored().await, 21);
    fx.cleanup().await;
}

/// Through the relay: a row whose routing key is not a valid subject ends `Dead` at
/// once (first attempt) with a clear `last_error`, while the valid rows of the batch
/// are `Sent`.
#[tokio::test]
async fn invalid_subject_is_dead_lettered_by_the_dispatcher() {
    let fx = Fixture::new().await;
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    let good = NewMessage::builder("order", "1", "OrderPlaced")
        .payload(&serde_json::json!({"ok": true}))
        .build()
        .expect("valid");
    let bad = NewMessage::builder("order", "2", "OrderPlaced")
        .routing_key("orders.*")
        .payload(&serde_json::json!({"ok": false}))
        .build()
        .expect("the builder accepts it; only NATS cannot publish it");
    let mut tx = outbox.begin().await.expect("begin");
    outbox
        .enqueue_batch(&mut tx, &[good.clone(), bad.clone()])
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");

    let publisher = Arc::new(NatsPublisher::connect(fx.build()).await.expect("connect"));
    let dispatcher = Dispatcher::new(Arc::clone(&outbox), publisher, DispatcherConfig::new())
        .expect("valid dispatcher config");
    let report = dispatcher.run_batch().await.expect("one batch");
    assert_eq!((report.claimed, report.published, report.dead), (2, 1, 1));

    let (status, error) = row_status(&outbox, bad.id).await;
    assert_eq!(status, MessageStatus::Dead as i16);
    let error = error.expect("last_error is set");
    assert!(
        error.contains("orders.*") && error.contains("wildcard"),
        "{error}"
    );
    let (status, _) = row_status(&outbox, good.id).await;
    assert_eq!(status, MessageStatus::Sent as i16);
    assert_eq!(fx.stored().await, 1);
    fx.cleanup().await;
}

/// The stream helper creates a stream, updates its duplicate window and max age in
/// place (idempotent), and reports a typed permanent error for subjects that overlap
/// another stream's.
#[tokio::test]
async fn stream_setup_creates_updates_and_reports_conflicts() {
    let fx = Fixture::unconfigured().await;
    let config = fx.build();
    let setup = StreamSetup::for_config(&fx.stream, &config)
        .with_storage(Storage::File)
        .with_duplicate_window(Duration::from_secs(60));
    let info = setup.apply(&config).await.expect("create");
    assert_eq!(info.config.duplicate_window, Duration::from_secs(60));
    assert_eq!(info.config.subjects, [format!("{}.>", fx.prefix)]);
    let info = setup
        .clone()
        .with_duplicate_window(Duration::from_secs(300))
        .with_max_age(Duration::from_secs(3600))
        .apply(&config)
        .await
        .expect("update");
    assert_eq!(info.config.duplicate_window, Duration::from_secs(300));
    assert_eq!(info.config.max_age, Duration::from_secs(3600));

    let overlapping = StreamSetup::new(format!("{}_OVERLAP", fx.stream))
        .with_subject(format!("{}.orders.>", fx.prefix));
    match overlapping.apply(&config).await {
        Err(e @ NatsError::Stream { .. }) => assert_eq!(e.kind(), ErrorKind::Permanent, "{e}"),
        other => panic!("expected a Stream error, got {other:?}"),
    }
    fx.cleanup().await;
}

/// A publisher configured with a stream declares it, as the RabbitMQ publisher declares
/// its exchange: `connect` creates it capturing the configuration's subjects (an
/// existing one is left as it is), the relay's readiness check creates it again after
/// it was deleted, and the messages published then are stored in it. Without the
/// setting (main before it existed) nothing creates the stream: the publish is refused
/// as having no stream, which the second half shows first.
#[tokio::test]
async fn a_configured_stream_is_declared_by_the_publisher_and_recreated_when_deleted() {
    let fx = Fixture::unconfigured().await;
    // Without a stream in the configuration nothing captures the subjects.
    let plain = NatsPublisher::connect(fx.build()).await.expect("connect");
    plain.check_ready().await.expect("the server is ready");
    let refused = plain
        .publish_batch(&[message("OrderPlaced", "0", r#"{"n":0}"#)])
        .await;
    assert!(
        !refused[0].is_published(),
        "no stream captures the subject: {refused:?}"
    );
    assert!(fx.js.get_stream(&fx.stream).await.is_err(), "no stream yet");

    let config = fx
        .config()
        .with_stream(StreamSetup::new(&fx.stream).with_duplicate_window(Duration::from_secs(90)));
    assert_eq!(
        config.stream().map(|setup| setup.subjects().to_vec()),
        Some(vec![format!("{}.>", fx.prefix)]),
        "a setup without subjects captures the configuration's"
    );
    let publisher = NatsPublisher::connect(config)
        .await
        .expect("connect declares the stream");
    let mut stream = fx
        .js
        .get_stream(&fx.stream)
        .await
        .expect("declared by connect");
    let info = stream.info().await.expect("info");
    assert_eq!(info.config.duplicate_window, Duration::from_secs(90));
    assert_eq!(info.config.subjects, [format!("{}.>", fx.prefix)]);
    assert_published(
        &publisher
            .publish_batch(&[message("OrderPlaced", "1", r#"{"n":1}"#)])
            .await,
        1,
    );
    assert_eq!(fx.stored().await, 1);

    // An existing stream is left as it is: another publisher configured with other
    // settings does not change it (an operator's replicas or limits are never undone).
    let other = fx
        .config()
        .with_stream(StreamSetup::new(&fx.stream).with_duplicate_window(Duration::from_secs(30)));
    drop(NatsPublisher::connect(other).await.expect("connect"));
    let info = stream.info().await.expect("info");
    assert_eq!(info.config.duplicate_window, Duration::from_secs(90));

    // Deleted behind the relay's back: the next readiness check (the relay makes one
    // before claiming again after an outage) declares it again.
    fx.js.delete_stream(&fx.stream).await.expect("delete");
    publisher
        .check_ready()
        .await
        .expect("the check recreates the stream");
    assert_published(
        &publisher
            .publish_batch(&[message("OrderPlaced", "2", r#"{"n":2}"#)])
            .await,
        1,
    );
    assert_eq!(
        fx.stored().await,
        1,
        "the recreated stream holds the new message"
    );

    // A stream overlapping another's subjects is a permanent error of `connect`.
    let clash = fx
        .config()
        .with_stream(StreamSetup::new(format!("{}_CLASH", fx.stream)));
    match NatsPublisher::connect(clash).await {
        Err(e @ NatsError::Stream { .. }) => assert_eq!(e.kind(), ErrorKind::Permanent, "{e}"),
        other => panic!("expected a Stream error, got {other:?}"),
    }
    // An invalid stream name is refused by `connect` before it connects.
    match NatsPublisher::connect(fx.config().with_stream(StreamSetup::new("bad.name"))).await {
        Err(NatsError::InvalidConfig { field, .. }) => assert_eq!(field, "stream name"),
        other => panic!("expected an InvalidConfig error, got {other:?}"),
    }
    fx.cleanup().await;
}

/// An invalid configuration is the typed error of `validate`, returned by `connect`,
/// `connect_lazy` and the consumer's `new` before anything connects or starts: a
/// malformed URL (`InvalidUrl`, the password hidden), a zero timeout (`InvalidConfig`
/// naming the field).
#[tokio::test]
async fn invalid_configurations_fail_before_connecting() {
    async fn all(config: NatsConfig) -> Vec<Result<&'static str, NatsError>> {
        vec![
            config.validate().map(|()| "validated"),
            NatsPublisher::connect(config.clone())
                .await
                .map(|_| "connected"),
            NatsPublisher::connect_lazy(config.clone())
                .await
                .map(|_| "lazy"),
            NatsConsumer::new(NatsConsumerConfig::new(config, "S", "d")).map(|_| "consumer"),
        ]
    }
    for url in [
        "nats://app:hunter2@127.0.0.1:notaport",
        "amqp://app:hunter2@127.0.0.1:5672",
        "",
    ] {
        for result in all(NatsConfig::new(url)).await {
            match result {
                Err(e @ NatsError::InvalidUrl { .. }) => {
                    assert_eq!(e.kind(), ErrorKind::Permanent);
                    assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
                }
                other => panic!("{url:?}: expected InvalidUrl, got {other:?}"),
            }
        }
    }
    // The server is up: a zero timeout still fails before any connection.
    let zero = NatsConfig::new(url()).with_connect_timeout(Duration::ZERO);
    for result in all(zero).await {
        match result {
            Err(NatsError::InvalidConfig { field, .. }) => assert_eq!(field, "connect_timeout"),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
    let zero = NatsConfig::new(url()).with_confirm_timeout(Duration::ZERO);
    match NatsPublisher::connect(zero).await {
        Err(NatsError::InvalidConfig { field, .. }) => assert_eq!(field, "confirm_timeout"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}
