//! `RabbitPublisher` against the real RabbitMQ. Every test uses its own exchange, queues
//! and connection name, so the tests run in parallel with each other and with anything
//! else on the broker.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use lapin::ExchangeKind;
use lapin::message::Delivery;
use lapin::options::BasicConsumeOptions;
use lapin::types::{AMQPValue, FieldTable};
use outbox_core::wire::{CORRELATION_ID, TRACEPARENT};
use outbox_core::{ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use tokio::time::Instant;
use transport_rabbit::{RabbitConfigBuilder, RabbitError, RabbitPublisher};

use common::*;

fn header<'a>(delivery: &'a Delivery, name: &str) -> Option<&'a str> {
    match delivery.properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        other => panic!("header {name} is not a long string: {other:?}"),
    }
}

fn assert_published(outcomes: &[PublishOutcome], expected: usize) {
    assert_eq!(outcomes.len(), expected, "one outcome per message");
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(outcome.is_published(), "message {i}: {outcome:?}");
    }
}

/// 1,000 messages in one batch are all confirmed, and a plain AMQP consumer receives
/// exactly those ids with the wire format of the design: persistent, `message_id` =
/// outbox id, JSON content type, `type` and `timestamp` properties, CloudEvents
/// headers, trace context, the routing key, the payload bytes.
#[tokio::test]
async fn publishes_a_batch_of_1000_with_the_expected_wire_format() {
    let exchange = unique("batch");
    let queue = unique("batch.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;

    let publisher = RabbitPublisher::connect(build(
        config(&exchange).with_source(Some("/tests/orders".into())),
    ))
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
                msg.headers
                    .insert("cloudEvents:type".into(), "Forged".into());
            }
            msg
        })
        .collect();

    let started = Instant::now();
    let outcomes = publisher.publish_batch(&messages).await;
    let elapsed = started.elapsed();
    assert_published(&outcomes, 1000);
    eprintln!("1000 messages confirmed in {elapsed:?}");

    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    let mut received: HashMap<String, Delivery> = HashMap::new();
    let deadline = Instant::now() + DEADLINE;
    while received.len() < messages.len() {
        let delivery = tokio::time::timeout_at(deadline, consumer.next())
            .await
            .expect("all 1000 messages arrive before the deadline")
            .expect("consumer stream open")
            .expect("delivery");
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .expect("message_id property")
            .to_string();
        assert!(
            received.insert(id, delivery).is_none(),
            "duplicate delivery"
        );
    }
    assert_eq!(received.len(), 1000);

    for (i, msg) in messages.iter().enumerate() {
        let d = received
            .get(&msg.id.to_string())
            .unwrap_or_else(|| panic!("message {i} ({}) not received", msg.id));
        let p = &d.properties;
        assert_eq!(*p.delivery_mode(), Some(2), "persistent");
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str()),
            Some(msg.event_type.as_str())
        );
        assert_eq!(
            *p.timestamp(),
            Some(u64::try_from(msg.occurred_at.timestamp()).expect("after 1970"))
        );
        assert_eq!(d.routing_key.as_str(), msg.effective_routing_key());
        assert_eq!(d.exchange.as_str(), exchange);
        assert_eq!(d.data, msg.payload.get().as_bytes());

        let id = msg.id.to_string();
        assert_eq!(header(d, "cloudEvents:specversion"), Some("1.0"));
        assert_eq!(header(d, "cloudEvents:id"), Some(id.as_str()));
        assert_eq!(header(d, "cloudEvents:type"), Some(msg.event_type.as_str()));
        assert_eq!(header(d, "cloudEvents:source"), Some("/tests/orders"));
        assert_eq!(
            header(d, "cloudEvents:subject"),
            Some(msg.aggregate_id.as_str())
        );
        assert_eq!(header(d, "cloudEvents:aggregatetype"), Some("order"));
        assert_eq!(
            header(d, "cloudEvents:aggregateversion"),
            Some(i.to_string().as_str())
        );
        assert_eq!(header(d, "cloudEvents:tenantid"), Some("acme"));
        assert_eq!(
            header(d, "cloudEvents:correlationid"),
            Some(format!("corr-{i}").as_str())
        );
        assert_eq!(
            header(d, "cloudEvents:time"),
            Some(outbox_core::wire::format_time(msg.occurred_at).as_str())
        );
        assert_eq!(header(d, "traceparent"), Some(traceparent));
    }

    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// Concurrent batches (more of them than channels) all get confirmed, each with its
/// own outcomes.
#[tokio::test]
async fn concurrent_batches_are_all_confirmed() {
    let exchange = unique("concurrent");
    let queue = unique("concurrent.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;
    let publisher = RabbitPublisher::connect(build(config(&exchange).with_channels(2)))
        .await
        .expect("connect");

    let batches: Vec<Vec<OutboxMessage>> = (0..4)
        .map(|b| {
            (0..200)
                .map(|i| message("Concurrent", &format!("{b}-{i}"), "{}"))
                .collect()
        })
        .collect();
    let results =
        futures::future::join_all(batches.iter().map(|batch| publisher.publish_batch(batch))).await;
    for outcomes in &results {
        assert_published(outcomes, 200);
    }
    eventually("800 messages in the queue", || async {
        queue_len(&channel, &queue).await == 800
    })
    .await;
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// With no queue bound for its routing key, a mandatory publish comes back
/// (`basic.return` 312 NO_ROUTE): the outcome is permanent `Unroutable`, in input order
/// among routable messages that are published.
#[tokio::test]
async fn unroutable_messages_are_permanent_failures() {
    let exchange = unique("unroutable");
    let queue = unique("unroutable.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "routable").await;
    let publisher = RabbitPublisher::connect(build(config(&exchange)))
        .await
        .expect("connect");

    let mut routable = message("Routable", "1", "{}");
    routable.routing_key = Some("routable".into());
    let lost = message("NobodyListens", "2", "{}");
    let mut routable_too = message("Routable", "3", "{}");
    routable_too.routing_key = Some("routable".into());

    let outcomes = publisher
        .publish_batch(&[routable, lost, routable_too])
        .await;
    assert_eq!(outcomes.len(), 3);
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    match &outcomes[1] {
        PublishOutcome::Permanent(PublishError::Unroutable {
            exchange: ex,
            routing_key,
            reply_code,
            reply_text,
        }) => {
            assert_eq!(ex, &exchange);
            assert_eq!(routing_key, "NobodyListens");
            assert_eq!(*reply_code, 312);
            assert_eq!(reply_text, "NO_ROUTE");
        }
        other => panic!("expected Permanent(Unroutable), got {other:?}"),
    }
    assert!(outcomes[2].is_published(), "{:?}", outcomes[2]);

    // The channel stays usable after a return.
    let outcomes = publisher
        .publish_batch(&[message("StillNobody", "4", "{}")])
        .await;
    assert!(matches!(
        &outcomes[0],
        PublishOutcome::Permanent(PublishError::Unroutable { .. })
    ));
    assert_eq!(queue_len(&channel, &queue).await, 2);
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// Messages that cannot be published as they are (payload over the configured limit,
/// routing key or header name over 255 bytes, headers larger than an AMQP frame) are
/// permanent failures, are not sent, and do not disturb the rest of the batch.
#[tokio::test]
async fn invalid_messages_are_permanent_and_never_sent() {
    let exchange = unique("invalid");
    let queue = unique("invalid.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;
    let publisher = RabbitPublisher::connect(build(config(&exchange).with_max_payload_bytes(1024)))
        .await
        .expect("connect");

    let ok = || message("Fine", "1", r#"{"ok":true}"#);
    let too_large = message(
        "Huge",
        "2",
        &format!(r#"{{"blob":"{}"}}"#, "x".repeat(2000)),
    );
    let mut long_key = ok();
    long_key.routing_key = Some("k".repeat(256));
    let mut long_header_name = ok();
    long_header_name.headers.insert("h".repeat(300), "v".into());
    let mut huge_headers = ok();
    huge_headers
        .headers
        .insert("big".into(), "v".repeat(200_000));

    let batch = vec![
        ok(),
        too_large,
        long_key,
        long_header_name,
        huge_headers,
        ok(),
    ];
    let outcomes = publisher.publish_batch(&batch).await;
    assert_eq!(outcomes.len(), batch.len());
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    match &outcomes[1] {
        PublishOutcome::Permanent(PublishError::PayloadTooLarge { size, max }) => {
            assert_eq!(*size, batch[1].payload.get().len());
            assert_eq!(*max, 1024);
        }
        other => panic!("expected Permanent(PayloadTooLarge), got {other:?}"),
    }
    for (i, outcome) in outcomes.iter().enumerate().take(5).skip(2) {
        assert!(
            matches!(outcome, PublishOutcome::Permanent(PublishError::Invalid(_))),
            "message {i}: expected Permanent(Invalid), got {outcome:?}"
        );
    }
    assert!(outcomes[5].is_published(), "{:?}", outcomes[5]);
    // Only the two valid messages reached the queue (confirms come after enqueueing).
    assert_eq!(queue_len(&channel, &queue).await, 2);
    // The connection survived (no frame error from the oversized headers).
    publisher.check_ready().await.expect("still ready");
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// A malformed URL is a typed `InvalidUrl` error, never a panic, and never shows the
/// password.
#[tokio::test]
async fn malformed_urls_are_invalid_url_errors() {
    for url in [
        "amqp://guest:hunter2@127.0.0.1:notaport/%2f",
        "http://guest:hunter2@127.0.0.1:5672/",
        "amqp//guest:hunter2@127.0.0.1",
        "",
    ] {
        match RabbitConfigBuilder::new(url).build() {
            Err(e @ RabbitError::InvalidUrl { .. }) => {
                assert_eq!(e.kind(), ErrorKind::Permanent);
                assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
            }
            other => panic!("{url:?}: expected InvalidUrl, got {other:?}"),
        }
    }
}

/// A broker that is not there: `connect` fails fast with a typed, `Unavailable`
/// connect error; a lazy publisher's `check_ready` and `publish_batch` report
/// `Unavailable` (which opens the dispatcher's circuit) instead of hanging, except for
/// a message that could never be published, which stays a permanent failure.
#[tokio::test]
async fn unreachable_broker_is_a_fast_typed_error() {
    let config = build(
        RabbitConfigBuilder::new("amqp://guest:hunter2@127.0.0.1:1/%2f")
            .with_connect_timeout(Duration::from_secs(2)),
    );
    let started = Instant::now();
    let error = RabbitPublisher::connect(config.clone())
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            error,
            RabbitError::Connect { .. } | RabbitError::ConnectTimeout { .. }
        ),
        "{error:?}"
    );
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    assert!(!error.to_string().contains("hunter2"), "{error}");

    let publisher = RabbitPublisher::new(config);
    let started = Instant::now();
    let ready = publisher.check_ready().await;
    assert!(
        matches!(ready, Err(PublishError::Unavailable { .. })),
        "{ready:?}"
    );
    // A message that could never be published is rejected as such even while the
    // broker is away; the others are an outage, not charged an attempt.
    let mut long_key = message("C", "3", "{}");
    long_key.routing_key = Some("k".repeat(256));
    let outcomes = publisher
        .publish_batch(&[message("A", "1", "{}"), long_key, message("B", "2", "{}")])
        .await;
    assert_eq!(outcomes.len(), 3);
    assert!(
        matches!(
            &outcomes[1],
            PublishOutcome::Permanent(PublishError::Invalid(_))
        ),
        "{:?}",
        outcomes[1]
    );
    for outcome in [&outcomes[0], &outcomes[2]] {
        assert!(outcome.is_outage(), "{outcome:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "took {:?}",
        started.elapsed()
    );
}

/// Bad credentials: a typed connect error that says retrying will not help, without
/// the password in it.
#[tokio::test]
async fn bad_credentials_are_a_permanent_connect_error() {
    let mut url = url();
    // Swap the password of the test URL for a wrong one.
    let at = url.rfind('@').expect("test URL has credentials");
    let colon = url[..at].rfind(':').expect("test URL has a password");
    url.replace_range(colon + 1..at, "definitely-wrong-password");
    let error = RabbitPublisher::connect(build(RabbitConfigBuilder::new(url)))
        .await
        .expect_err("wrong password");
    assert!(matches!(error, RabbitError::Connect { .. }), "{error:?}");
    assert_eq!(error.kind(), ErrorKind::Permanent, "{error:?}");
    assert!(
        !error.to_string().contains("definitely-wrong-password"),
        "{error}"
    );
}

/// The broker closes the publisher's connection (as in a broker restart or a network
/// cut): the publisher notices by itself, reports `Unavailable` at most until it has
/// reconnected, `check_ready` turns `Ok` again and new batches are published, with no
/// help from outside.
#[tokio::test]
async fn publisher_reconnects_after_the_broker_closes_its_connection() {
    let exchange = unique("reconnect");
    let queue = unique("reconnect.q");
    let name = unique("reconnect.conn");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;
    let publisher =
        RabbitPublisher::connect(build(config(&exchange).with_connection_name(name.clone())))
            .await
            .expect("connect");
    assert_published(
        &publisher
            .publish_batch(&[message("Before", "1", "{}")])
            .await,
        1,
    );

    assert_eq!(force_close_connections(&name).await, 1);

    // Right after the close a batch either fails as an outage (never as the messages'
    // fault) or is already published over a new connection.
    let outcomes = publisher
        .publish_batch(&[message("During", "2", "{}"), message("During", "3", "{}")])
        .await;
    assert_eq!(outcomes.len(), 2);
    eprintln!("outcomes right after the forced close: {outcomes:?}");
    for outcome in &outcomes {
        assert!(
            outcome.is_published() || outcome.is_outage(),
            "expected Published or Unavailable, got {outcome:?}"
        );
    }
    eventually("check_ready succeeds again", || async {
        publisher.check_ready().await.is_ok()
    })
    .await;
    let after: Vec<OutboxMessage> = (0..50)
        .map(|i| message("After", &i.to_string(), "{}"))
        .collect();
    assert_published(&publisher.publish_batch(&after).await, 50);
    // The broker sees a new connection under the same name.
    assert_eq!(connection_pids(&name).len(), 1);
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// With `declare_exchange(false)` a missing exchange is reported when connecting
/// (passive declare, 404), and `declare_exchange()` creates it on demand.
#[tokio::test]
async fn passive_exchange_check_and_declare_on_demand() {
    let exchange = unique("passive");
    let config = build(config(&exchange).with_declare_exchange(false));
    let error = RabbitPublisher::connect(config.clone())
        .await
        .expect_err("the exchange does not exist yet");
    assert!(
        matches!(
            error,
            RabbitError::Declare {
                operation: "exchange.declare",
                ..
            }
        ),
        "{error:?}"
    );

    let publisher = RabbitPublisher::new(config);
    assert!(matches!(
        publisher.check_ready().await,
        Err(PublishError::Unavailable { .. })
    ));
    publisher
        .declare_exchange()
        .await
        .expect("declare on demand");
    publisher
        .check_ready()
        .await
        .expect("ready once the exchange exists");

    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    cleanup(&channel, &[&exchange], &[]).await;
}

/// The connection is closed by the broker while batches are in flight: every message
/// still gets exactly one outcome, only `Published` or `Unavailable` (an outage is
/// never blamed on the messages), everything reported `Published` really is in the
/// queue, and publishing carries on over a new connection.
#[tokio::test]
async fn connection_lost_mid_batch_reports_only_published_or_unavailable() {
    let exchange = unique("midflight");
    let queue = unique("midflight.q");
    let name = unique("midflight.conn");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;
    let publisher = std::sync::Arc::new(
        RabbitPublisher::connect(build(config(&exchange).with_connection_name(name.clone())))
            .await
            .expect("connect"),
    );

    let (first_done, first_done_rx) = tokio::sync::oneshot::channel();
    let task = {
        let publisher = std::sync::Arc::clone(&publisher);
        tokio::spawn(async move {
            let mut first_done = Some(first_done);
            let mut all = Vec::new();
            for b in 0..12 {
                let batch: Vec<OutboxMessage> = (0..2000)
                    .map(|i| message("MidFlight", &format!("{b}-{i}"), r#"{"pad":"................................................................"}"#))
                    .collect();
                let outcomes = publisher.publish_batch(&batch).await;
                assert_eq!(outcomes.len(), batch.len(), "one outcome per message");
                all.push(outcomes);
                if let Some(tx) = first_done.take() {
                    let _ = tx.send(());
                }
            }
            all
        })
    };
    first_done_rx.await.expect("first batch done");
    assert_eq!(force_close_connections(&name).await, 1);
    let batches = task.await.expect("publishing task");

    let (mut published, mut outages) = (0u32, 0u32);
    for outcomes in &batches {
        for outcome in outcomes {
            if outcome.is_published() {
                published += 1;
            } else {
                assert!(outcome.is_outage(), "expected Unavailable, got {outcome:?}");
                outages += 1;
            }
        }
    }
    eprintln!("published {published}, unavailable {outages}");
    eventually("check_ready succeeds again", || async {
        publisher.check_ready().await.is_ok()
    })
    .await;
    assert_published(
        &publisher
            .publish_batch(&[message("After", "1", "{}")])
            .await,
        1,
    );
    published += 1;
    // Confirmed means enqueued; an unconfirmed message may have been enqueued too.
    let in_queue = queue_len(&channel, &queue).await;
    assert!(
        in_queue >= published,
        "{in_queue} in the queue, {published} confirmed"
    );
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// The exchange is deleted while the publisher's connection stays up: publishing into
/// the void is an outage (`404 NOT_FOUND` closes the channel; not the messages'
/// fault), and the circuit-breaker probe `check_ready` declares the exchange again.
#[tokio::test]
async fn deleted_exchange_is_an_outage_and_check_ready_recreates_it() {
    let exchange = unique("deleted");
    let queue = unique("deleted.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    let publisher = RabbitPublisher::connect(build(config(&exchange).with_channels(1)))
        .await
        .expect("connect");
    bind_queue(&channel, &exchange, &queue, "#").await;
    assert_published(
        &publisher.publish_batch(&[message("One", "1", "{}")]).await,
        1,
    );

    channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await
        .expect("exchange.delete");
    let outcomes = publisher
        .publish_batch(&[message("Two", "2", "{}"), message("Two", "3", "{}")])
        .await;
    for outcome in &outcomes {
        assert!(outcome.is_outage(), "expected Unavailable, got {outcome:?}");
    }

    publisher
        .check_ready()
        .await
        .expect("probe redeclares the exchange");
    bind_queue(&channel, &exchange, &queue, "#").await;
    assert_published(
        &publisher
            .publish_batch(&[message("Three", "4", "{}")])
            .await,
        1,
    );
    assert_eq!(queue_len(&channel, &queue).await, 2);
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// Confirms that do not arrive within the confirm timeout give `Timeout` (an outage:
/// `ErrorKind::Unavailable`), one outcome per message, and the publisher stays usable.
#[tokio::test]
async fn unconfirmed_messages_time_out() {
    let exchange = unique("timeout");
    let queue = unique("timeout.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;
    let publisher = RabbitPublisher::connect(build(
        config(&exchange).with_confirm_timeout(Duration::from_millis(1)),
    ))
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
    assert!(
        outcomes.iter().all(|o| o.is_published() || o.is_outage()),
        "{outcomes:?}"
    );
    let published = outcomes.iter().filter(|o| o.is_published()).count();
    assert_eq!(timed_out + published, batch.len(), "{outcomes:?}");
    assert!(timed_out > 0, "2000 confirms cannot all arrive within 1 ms");
    publisher.check_ready().await.expect("still usable");
    cleanup(&channel, &[&exchange], &[&queue]).await;
}
