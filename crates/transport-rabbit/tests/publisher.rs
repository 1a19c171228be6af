//! `RabbitPublisher` against the real RabbitMQ, for what only AMQP has: its basic
//! properties, URLs and credentials, connections closed by the broker, passive and
//! deleted exchanges. The outcomes shared with NATS (confirmed with the wire format,
//! unroutable, oversized, invalid, unconfirmed, unreachable) are properties of the
//! transport conformance suite (`tests/conformance.rs`). Every test uses its own
//! exchange, queues and connection name, so the tests run in parallel with each other
//! and with anything else on the broker.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use lapin::ExchangeKind;
use lapin::message::Delivery;
use lapin::options::BasicConsumeOptions;
use lapin::types::{AMQPValue, FieldTable};
use outboxkit_core::{ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use outboxkit_rabbit::{
    RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitError, RabbitPublisher,
};

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

/// The AMQP basic properties that have no NATS counterpart (the wire format shared with
/// NATS is checked by the conformance suite): persistent delivery mode, the `type`
/// property carrying the event type, the `timestamp` property carrying `occurred_at`,
/// and the publisher's exchange.
#[tokio::test]
async fn amqp_properties_carry_persistence_type_and_timestamp() {
    let exchange = unique("properties");
    let queue = unique("properties.q");
    let raw = raw_connection().await;
    let channel = raw_channel(&raw).await;
    declare_exchange(&channel, &exchange, ExchangeKind::Topic).await;
    bind_queue(&channel, &exchange, &queue, "#").await;
    let publisher = RabbitPublisher::connect(build(config(&exchange)))
        .await
        .expect("connect");
    let messages: Vec<OutboxMessage> = (0..3)
        .map(|i| message("OrderPlaced", &i.to_string(), "{}"))
        .collect();
    assert_published(&publisher.publish_batch(&messages).await, 3);

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
    while received.len() < messages.len() {
        let delivery = tokio::time::timeout(DEADLINE, consumer.next())
            .await
            .expect("every message arrives before the deadline")
            .expect("consumer stream open")
            .expect("delivery");
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .expect("message_id property")
            .to_string();
        received.insert(id, delivery);
    }
    for msg in &messages {
        let d = &received[&msg.id.to_string()];
        let p = &d.properties;
        assert_eq!(d.exchange.as_str(), exchange);
        assert_eq!(*p.delivery_mode(), Some(2), "persistent");
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str()),
            Some(msg.event_type.as_str())
        );
        assert_eq!(
            *p.timestamp(),
            Some(u64::try_from(msg.occurred_at.timestamp()).expect("after 1970"))
        );
        assert_eq!(
            header(d, "cloudEvents:id"),
            Some(msg.id.to_string().as_str())
        );
    }
    cleanup(&channel, &[&exchange], &[&queue]).await;
}

/// A malformed URL is a typed `InvalidUrl` error, never a panic, and never shows the
/// password: from `validate`, and from `connect`, `connect_lazy` and the consumer's
/// `new`, which validate before anything else.
#[tokio::test]
async fn malformed_urls_are_invalid_url_errors() {
    for url in [
        "amqp://guest:hunter2@127.0.0.1:notaport/%2f",
        "http://guest:hunter2@127.0.0.1:5672/",
        "amqp//guest:hunter2@127.0.0.1",
        "",
    ] {
        let config = RabbitConfig::new(url);
        let errors = [
            config.validate().map(|()| "validated"),
            RabbitPublisher::connect(config.clone())
                .await
                .map(|_| "connected"),
            RabbitPublisher::connect_lazy(config.clone())
                .await
                .map(|_| "lazy"),
            RabbitConsumer::new(RabbitConsumerConfig::new(config, "q")).map(|_| "consumer"),
        ];
        for result in errors {
            match result {
                Err(e @ RabbitError::InvalidUrl { .. }) => {
                    assert_eq!(e.kind(), ErrorKind::Permanent);
                    assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
                }
                other => panic!("{url:?}: expected InvalidUrl, got {other:?}"),
            }
        }
    }
}

/// An invalid setting is the typed error of `validate`, returned by `connect` before any
/// connection is tried: a zero connect timeout to a broker that is up fails with
/// `InvalidConfig` naming the field, not with a timeout or a connection.
#[tokio::test]
async fn connect_validates_before_connecting() {
    let zero = config(&unique("zero")).with_connect_timeout(Duration::ZERO);
    for result in [
        zero.validate().map(|()| "validated"),
        RabbitPublisher::connect(zero.clone())
            .await
            .map(|_| "connected"),
        RabbitPublisher::connect_lazy(zero.clone())
            .await
            .map(|_| "lazy"),
        RabbitConsumer::new(RabbitConsumerConfig::new(zero, "q")).map(|_| "consumer"),
    ] {
        match result {
            Err(RabbitError::InvalidConfig { field, .. }) => assert_eq!(field, "connect_timeout"),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
    // A consumer setting is checked by the consumer's `new` as well.
    match RabbitConsumer::new(RabbitConsumerConfig::new(config("x"), "q").with_prefetch(0)) {
        Err(RabbitError::InvalidConfig { field, .. }) => assert_eq!(field, "prefetch"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
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
    let error = RabbitPublisher::connect(build(RabbitConfig::new(url)))
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

    let publisher = RabbitPublisher::connect_lazy(config)
        .await
        .expect("valid config");
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
