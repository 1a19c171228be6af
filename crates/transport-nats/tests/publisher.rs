//! `NatsPublisher` and `StreamSetup` against the real NATS server with JetStream. Every
//! test uses its own stream and subject prefix, so the tests run in parallel with each
//! other and with anything else on the server.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::wire::{CORRELATION_ID, TRACEPARENT};
use outbox_core::{
    Dispatcher, DispatcherConfig, ErrorKind, EventPublisher, MessageStatus, NewMessage,
    OutboxMessage, PublishError, PublishOutcome,
};
use tokio::time::Instant;
use transport_nats::{NatsConfigBuilder, NatsError, NatsPublisher, Storage, StreamSetup};

use common::*;

fn assert_published(outcomes: &[PublishOutcome], expected: usize) {
    assert_eq!(outcomes.len(), expected, "one outcome per message");
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(outcome.is_published(), "message {i}: {outcome:?}");
    }
}

/// 1,000 messages in one batch (with a window of 64 publishes in flight) are all
/// acknowledged and stored, and the stream holds exactly those ids with the wire format
/// of the design: subject = prefix + routing key or event type, `Nats-Msg-Id` = outbox
/// id, `Content-Type`, CloudEvents `ce-*` headers, trace context, the payload bytes.
#[tokio::test]
async fn publishes_a_batch_with_acks_and_the_expected_wire_format() {
    let fx = Fixture::new().await;
    let publisher = NatsPublisher::connect(
        fx.config()
            .with_source(Some("/tests/orders".into()))
            .with_max_in_flight(64)
            .build()
            .expect("valid"),
    )
    .await
    .expect("connect");

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let messages: Vec<OutboxMessage> = (0..1000)
        .map(|i| {
            let event_type = if i % 2 == 0 {
                "OrderPlaced"
            } else {
                "OrderShipped"
            };
            let mut msg = message(event_type, &format!("agg-{i}"), &format!(r#"{{"n":{i}}}"#));
            msg.aggregate_version = i;
            msg.tenant_id = Some("acme".into());
            msg.headers.insert(TRACEPARENT.into(), traceparent.into());
            msg.headers
                .insert(CORRELATION_ID.into(), format!("corr-{i}"));
            if i % 10 == 0 {
                msg.routing_key = Some(format!("orders.eu.{i}"));
            }
            if i == 7 {
                // A pass-through header must not overwrite a CloudEvents attribute.
                msg.headers.insert("ce-type".into(), "Forged".into());
            }
            msg
        })
        .collect();

    let started = Instant::now();
    let outcomes = publisher.publish_batch(&messages).await;
    eprintln!("1000 messages acknowledged in {:?}", started.elapsed());
    assert_published(&outcomes, 1000);
    assert_eq!(fx.stored().await, 1000);

    let received: HashMap<String, async_nats::Message> = fx
        .read_all()
        .await
        .into_iter()
        .map(|m| {
            (
                header(&m, "Nats-Msg-Id").expect("Nats-Msg-Id").to_owned(),
                m,
            )
        })
        .collect();
    assert_eq!(received.len(), 1000, "1000 distinct ids");
    for (i, msg) in messages.iter().enumerate() {
        let id = msg.id.to_string();
        let m = received
            .get(&id)
            .unwrap_or_else(|| panic!("message {i} ({id}) not stored"));
        assert_eq!(
            m.subject.as_str(),
            format!("{}.{}", fx.prefix, msg.effective_routing_key())
        );
        assert_eq!(m.payload.as_ref(), msg.payload.get().as_bytes());
        assert_eq!(header(m, "Content-Type"), Some("application/json"));
        assert_eq!(header(m, "ce-specversion"), Some("1.0"));
        assert_eq!(header(m, "ce-id"), Some(id.as_str()));
        assert_eq!(header(m, "ce-type"), Some(msg.event_type.as_str()));
        assert_eq!(header(m, "ce-source"), Some("/tests/orders"));
        assert_eq!(header(m, "ce-subject"), Some(msg.aggregate_id.as_str()));
        assert_eq!(header(m, "ce-aggregatetype"), Some("order"));
        assert_eq!(
            header(m, "ce-aggregateversion"),
            Some(i.to_string().as_str())
        );
        assert_eq!(header(m, "ce-tenantid"), Some("acme"));
        assert_eq!(
            header(m, "ce-correlationid"),
            Some(format!("corr-{i}").as_str())
        );
        assert_eq!(
            header(m, "ce-time"),
            Some(outbox_core::wire::format_time(msg.occurred_at).as_str())
        );
        assert_eq!(header(m, "traceparent"), Some(traceparent));
    }
    fx.cleanup().await;
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

/// Subjects NATS cannot publish to are permanent `Invalid` failures, never sent, and
/// do not disturb the rest of the batch; as are payloads over the configured or the
/// server's limit (`PayloadTooLarge`) and headers that NATS cannot carry or that would
/// steer JetStream (`Nats-*`).
#[tokio::test]
async fn invalid_messages_are_permanent_and_never_sent() {
    let fx = Fixture::new().await;
    let publisher = NatsPublisher::connect(fx.config().build().expect("valid"))
        .await
        .expect("connect");
    let limited = NatsPublisher::connect(
        fx.config()
            .with_max_payload_bytes(Some(1024))
            .build()
            .expect("valid"),
    )
    .await
    .expect("connect");

    let ok = || message("Fine", "1", r#"{"ok":true}"#);
    let with_key = |key: &str| {
        let mut m = ok();
        m.routing_key = Some(key.to_owned());
        m
    };
    let mut batch = vec![ok()];
    for key in [
        "bad key",
        "orders.*",
        "orders.>",
        "a..b",
        "trailing.",
        "tab\there",
    ] {
        batch.push(with_key(key));
    }
    let mut reserved = ok();
    reserved
        .headers
        .insert("Nats-Expected-Stream".into(), "OTHER".into());
    batch.push(reserved);
    let mut bad_name = ok();
    bad_name.headers.insert("x:y".into(), "v".into());
    batch.push(bad_name);
    let mut bad_value = ok();
    bad_value.headers.insert("x".into(), "line\r\nbreak".into());
    batch.push(bad_value);
    let server_max = publisher.client().max_payload();
    batch.push(message(
        "Huge",
        "2",
        &format!(r#"{{"blob":"{}"}}"#, "x".repeat(server_max)),
    ));
    batch.push(ok());

    let outcomes = publisher.publish_batch(&batch).await;
    assert_eq!(outcomes.len(), batch.len());
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    for (i, outcome) in outcomes.iter().enumerate().take(10).skip(1) {
        match outcome {
            PublishOutcome::Permanent(e @ PublishError::Invalid(text)) => {
                assert_eq!(e.kind(), ErrorKind::Permanent);
                eprintln!("message {i}: {text}");
            }
            other => panic!("message {i}: expected Permanent(Invalid), got {other:?}"),
        }
    }
    match &outcomes[10] {
        PublishOutcome::Permanent(PublishError::PayloadTooLarge { size, max }) => {
            assert!(*size > server_max);
            assert_eq!(*max, server_max);
        }
        other => panic!("expected Permanent(PayloadTooLarge), got {other:?}"),
    }
    assert!(outcomes[11].is_published(), "{:?}", outcomes[11]);
    assert_eq!(
        fx.stored().await,
        2,
        "only the two valid messages were sent"
    );

    let too_large = message("Big", "3", &format!(r#"{{"blob":"{}"}}"#, "x".repeat(2000)));
    match &limited.publish_batch(&[too_large]).await[0] {
        PublishOutcome::Permanent(PublishError::PayloadTooLarge { max, .. }) => {
            assert_eq!(*max, 1024);
        }
        other => panic!("expected Permanent(PayloadTooLarge), got {other:?}"),
    }
    publisher.check_ready().await.expect("still ready");
    fx.cleanup().await;
}

/// A subject that no stream captures gets "no responders": the publisher confirms with
/// JetStream that no stream captures it and reports a permanent `Unroutable` with a
/// clear reason.
#[tokio::test]
async fn subject_without_a_stream_is_permanently_unroutable() {
    let fx = Fixture::unconfigured().await; // no stream at all
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    let outcomes = publisher
        .publish_batch(&[message("Lost", "1", "{}"), message("Lost", "2", "{}")])
        .await;
    for outcome in &outcomes {
        match outcome {
            PublishOutcome::Permanent(e @ PublishError::Unroutable { routing_key, .. }) => {
                assert_eq!(routing_key, &format!("{}.Lost", fx.prefix));
                assert!(e.to_string().contains("no JetStream stream"), "{e}");
            }
            other => panic!("expected Permanent(Unroutable), got {other:?}"),
        }
    }
    // Once the stream exists the same messages go through.
    publisher
        .ensure_stream(&StreamSetup::for_config(&fx.stream, publisher.config()))
        .await
        .expect("create stream");
    assert_published(
        &publisher
            .publish_batch(&[message("Found", "3", "{}")])
            .await,
        1,
    );
    fx.cleanup().await;
}

/// Through the relay: a row whose routing key is not a valid subject ends `Dead` at
/// once (first attempt) with a clear `last_error`, while the valid rows of the batch
/// are `Sent`.
#[tokio::test]
async fn invalid_subject_is_dead_lettered_by_the_dispatcher() {
    let fx = Fixture::new().await;
    let outbox = Arc::new(fresh_outbox().await);
    let good = NewMessage::builder("order", "1", "OrderPlaced")
        .payload(&serde_json::json!({"ok": true}))
        .build()
        .expect("valid");
    let bad = NewMessage::builder("order", "2", "OrderPlaced")
        .routing_key("orders.*")
        .payload(&serde_json::json!({"ok": false}))
        .build()
        .expect("the builder accepts it; only NATS cannot publish it");
    let mut tx = outbox.pool().begin().await.expect("begin");
    outbox
        .enqueue_batch(&mut tx, &[good.clone(), bad.clone()])
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");

    let publisher = Arc::new(NatsPublisher::connect(fx.build()).await.expect("connect"));
    let dispatcher = Dispatcher::new(Arc::clone(&outbox), publisher, DispatcherConfig::new());
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
    drop_schema(&outbox).await;
    fx.cleanup().await;
}

/// More messages than the in-flight window, in concurrent batches: every one is
/// acknowledged and stored once.
#[tokio::test]
async fn small_window_and_concurrent_batches() {
    let fx = Fixture::with(|s| s.with_storage(Storage::Memory)).await;
    let publisher =
        NatsPublisher::connect(fx.config().with_max_in_flight(8).build().expect("valid"))
            .await
            .expect("connect");
    let batches: Vec<Vec<OutboxMessage>> = (0..4)
        .map(|b| {
            (0..300)
                .map(|i| message("Concurrent", &format!("{b}-{i}"), "{}"))
                .collect()
        })
        .collect();
    let results =
        futures::future::join_all(batches.iter().map(|batch| publisher.publish_batch(batch))).await;
    for outcomes in &results {
        assert_published(outcomes, 300);
    }
    assert_eq!(fx.stored().await, 1200);
    fx.cleanup().await;
}

/// PubAcks that do not arrive within the ack timeout give `Timeout` (transient) while
/// the connection stays up; one outcome per message; the publisher stays usable.
#[tokio::test]
async fn unacknowledged_messages_time_out() {
    let fx = Fixture::new().await;
    let publisher = NatsPublisher::connect(
        fx.config()
            .with_ack_timeout(Duration::from_millis(1))
            .build()
            .expect("valid"),
    )
    .await
    .expect("connect");
    let batch: Vec<OutboxMessage> = (0..2000)
        .map(|i| message("Slow", &i.to_string(), "{}"))
        .collect();
    let outcomes = publisher.publish_batch(&batch).await;
    assert_eq!(outcomes.len(), batch.len());
    let timed_out = outcomes
        .iter()
        .filter(|o| matches!(o, PublishOutcome::Transient(PublishError::Timeout(d)) if *d == Duration::from_millis(1)))
        .count();
    let published = outcomes.iter().filter(|o| o.is_published()).count();
    assert_eq!(timed_out + published, batch.len(), "{outcomes:?}");
    assert!(timed_out > 0, "2000 PubAcks cannot all arrive within 1 ms");
    publisher.check_ready().await.expect("still usable");
    fx.cleanup().await;
}

/// A server that is not there: `connect` fails fast with a typed, `Unavailable` error
/// without the password; a lazy publisher reports `Unavailable` from `check_ready` and
/// `publish_batch` (which opens the dispatcher's circuit) instead of hanging.
#[tokio::test]
async fn unreachable_server_is_a_fast_typed_error() {
    let config = NatsConfigBuilder::new("nats://app:hunter2@127.0.0.1:1")
        .with_connect_timeout(Duration::from_secs(2))
        .build()
        .expect("valid");
    let started = Instant::now();
    let error = NatsPublisher::connect(config.clone())
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(error, NatsError::Connect { .. } | NatsError::Timeout { .. }),
        "{error:?}"
    );
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    assert!(!format!("{error} {error:?}").contains("hunter2"), "{error}");

    let publisher = NatsPublisher::connect_lazy(config).await.expect("lazy");
    let started = Instant::now();
    assert!(matches!(
        publisher.check_ready().await,
        Err(PublishError::Unavailable { .. })
    ));
    let outcomes = publisher
        .publish_batch(&[message("A", "1", "{}"), message("B", "2", "{}")])
        .await;
    assert_eq!(outcomes.len(), 2);
    for outcome in &outcomes {
        assert!(outcome.is_outage(), "{outcome:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
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
