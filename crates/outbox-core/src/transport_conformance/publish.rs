//! Publishing properties: what an [`EventPublisher`] reports for each message, and what
//! reaches the broker.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::{RawMessage, SOURCE, TransportHarness, outbox_message, outbox_messages, publish_all};
use crate::error::{ErrorKind, PublishError};
use crate::message::OutboxMessage;
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::wire::{CORRELATION_ID, TRACEPARENT, format_time};

/// 1,000 messages in one batch are all confirmed, and a plain client of the broker reads
/// exactly those, once each, in the wire format of the design: the broker message id is
/// the outbox id; routing key (or subject) from `routing_key` or else `event_type`;
/// `application/json`; the CloudEvents attributes (configured `source`, `type`,
/// `subject`, `time`, the extensions) as headers of the transport's binding; headers of
/// the message passed through, but never over a CloudEvents attribute; the payload bytes.
pub async fn publishes_a_batch_with_the_wire_format<H: TransportHarness>(h: &H) {
    let publisher = h.publisher().await;
    let prefix = H::BINDING.prefix();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let messages: Vec<OutboxMessage> = (0..1000)
        .map(|i| {
            let event_type = if i % 2 == 0 {
                "OrderPlaced"
            } else {
                "OrderShipped"
            };
            let mut msg =
                outbox_message(event_type, &format!("agg-{i}"), &format!(r#"{{"n":{i}}}"#));
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
                msg.headers.insert(format!("{prefix}type"), "Forged".into());
            }
            msg
        })
        .collect();
    let started = Instant::now();
    publish_all(&publisher, &messages).await;
    eprintln!("1000 messages confirmed in {:?}", started.elapsed());

    let mut received: HashMap<String, RawMessage> = HashMap::new();
    for raw in h.read_raw(messages.len()).await {
        let id = raw.message_id.clone().expect("a broker message id");
        assert!(received.insert(id.clone(), raw).is_none(), "{id} twice");
    }
    for (i, msg) in messages.iter().enumerate() {
        let id = msg.id.to_string();
        let raw = received
            .get(&id)
            .unwrap_or_else(|| panic!("message {i} ({id}) not received"));
        let header = |attribute: &str| raw.headers.get(&format!("{prefix}{attribute}"));
        let text = |value: &str| Some(value.to_owned());
        assert_eq!(raw.destination, h.destination(msg.effective_routing_key()));
        assert_eq!(raw.payload, msg.payload.get().as_bytes(), "payload bytes");
        assert_eq!(raw.content_type.as_deref(), Some("application/json"));
        assert_eq!(header("specversion").cloned(), text("1.0"));
        assert_eq!(header("id").cloned(), text(&id));
        assert_eq!(
            header("type").cloned(),
            text(&msg.event_type),
            "message {i}"
        );
        assert_eq!(header("source").cloned(), text(SOURCE));
        assert_eq!(header("subject").cloned(), text(&msg.aggregate_id));
        assert_eq!(header("aggregatetype").cloned(), text("order"));
        assert_eq!(header("aggregateversion").cloned(), text(&i.to_string()));
        assert_eq!(header("tenantid").cloned(), text("acme"));
        assert_eq!(header("correlationid").cloned(), text(&format!("corr-{i}")));
        assert_eq!(header("time").cloned(), text(&format_time(msg.occurred_at)));
        assert_eq!(raw.headers.get(TRACEPARENT).cloned(), text(traceparent));
    }
}

/// Concurrent batches through a publisher that keeps few messages in flight (fewer
/// channels or a smaller window than there are batches) are all confirmed, each with
/// its own outcomes, and each message is stored once.
pub async fn concurrent_batches_are_all_confirmed<H: TransportHarness>(h: &H) {
    let publisher = h.narrow_publisher().await;
    let batches: Vec<Vec<OutboxMessage>> = (0..4)
        .map(|b| {
            (0..300)
                .map(|i| outbox_message("Concurrent", &format!("{b}-{i}"), "{}"))
                .collect()
        })
        .collect();
    futures::future::join_all(batches.iter().map(|batch| publish_all(&publisher, batch))).await;
    super::eventually("1200 messages stored", || async {
        h.stored().await == 1200
    })
    .await;
}

/// A message no queue or stream takes is a permanent `Unroutable` failure with the
/// broker's reply, in input order among messages that are published; the publisher
/// stays usable, and once a destination takes the routing key the same publisher
/// delivers it.
pub async fn unroutable_messages_are_permanent<H: TransportHarness>(h: &H) {
    let publisher = h.unrouted_publisher().await;
    let keyed = |key: &str| {
        let mut msg = outbox_message("Routed", key, "{}");
        msg.routing_key = Some(key.to_owned());
        msg
    };
    let assert_unroutable = |outcome: &PublishOutcome, key: &str| match outcome {
        PublishOutcome::Permanent(
            e @ PublishError::Unroutable {
                routing_key,
                reply_code,
                reply_text,
                ..
            },
        ) => {
            assert_eq!(e.kind(), ErrorKind::Permanent);
            assert!(routing_key.ends_with(key), "{routing_key}");
            let (code, text) = H::UNROUTABLE_REPLY;
            assert_eq!(*reply_code, code, "{e}");
            assert!(reply_text.contains(text), "{e}");
        }
        other => panic!("{key}: expected Permanent(Unroutable), got {other:?}"),
    };

    let outcomes = publisher.publish_batch(&[keyed("lost")]).await;
    assert_unroutable(&outcomes[0], "lost");

    h.route("routable").await;
    let outcomes = publisher
        .publish_batch(&[keyed("routable"), keyed("lost"), keyed("routable")])
        .await;
    assert_eq!(outcomes.len(), 3, "one outcome per message");
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    assert_unroutable(&outcomes[1], "lost");
    assert!(outcomes[2].is_published(), "{:?}", outcomes[2]);

    let outcomes = publisher.publish_batch(&[keyed("still.lost")]).await;
    assert_unroutable(&outcomes[0], "still.lost");
    publisher.check_ready().await.expect("still ready");
}

/// A payload over the publisher's configured limit, or over its default limit (the
/// broker's), is a permanent `PayloadTooLarge` naming the limit, is not sent, and does
/// not disturb the rest of the batch.
pub async fn oversized_payloads_are_permanent_and_never_sent<H: TransportHarness>(h: &H) {
    let limited = h.publisher_with_max_payload(1024).await;
    let ok = || outbox_message("Fine", "1", r#"{"ok":true}"#);
    let blob = |len: usize| format!(r#"{{"blob":"{}"}}"#, "x".repeat(len));
    let too_large = outbox_message("Huge", "2", &blob(2000));
    let outcomes = limited
        .publish_batch(&[ok(), too_large.clone(), ok()])
        .await;
    assert_eq!(outcomes.len(), 3, "one outcome per message");
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    match &outcomes[1] {
        PublishOutcome::Permanent(e @ PublishError::PayloadTooLarge { size, max }) => {
            assert_eq!(e.kind(), ErrorKind::Permanent);
            assert!(*size >= too_large.payload.get().len(), "{e}");
            assert_eq!(*max, 1024, "{e}");
        }
        other => panic!("expected Permanent(PayloadTooLarge), got {other:?}"),
    }
    assert!(outcomes[2].is_published(), "{:?}", outcomes[2]);

    let publisher = h.publisher().await;
    let default_max = h.default_max_payload(&publisher);
    let outcomes = publisher
        .publish_batch(&[outbox_message("Huge", "3", &blob(default_max)), ok()])
        .await;
    match &outcomes[0] {
        PublishOutcome::Permanent(e @ PublishError::PayloadTooLarge { size, max }) => {
            assert!(*size > default_max, "{e}");
            assert_eq!(*max, default_max, "{e}");
        }
        other => panic!("expected Permanent(PayloadTooLarge), got {other:?}"),
    }
    assert!(outcomes[1].is_published(), "{:?}", outcomes[1]);
    assert_eq!(h.stored().await, 3, "only the valid messages were sent");
    publisher.check_ready().await.expect("still ready");
}

/// Messages the transport cannot carry (headers and routing keys the broker's protocol
/// cannot express, or that would steer the broker) are permanent `Invalid` failures,
/// are not sent, and do not disturb the rest of the batch or the connection.
pub async fn invalid_messages_are_permanent_and_never_sent<H: TransportHarness>(h: &H) {
    let publisher = h.publisher().await;
    let ok = || outbox_message("Fine", "1", r#"{"ok":true}"#);
    let invalid = h.invalid_messages(&ok);
    assert!(!invalid.is_empty(), "the harness names invalid messages");
    let mut batch = vec![ok()];
    batch.extend(invalid.iter().map(|(_, msg)| msg.clone()));
    batch.push(ok());
    let outcomes = publisher.publish_batch(&batch).await;
    assert_eq!(outcomes.len(), batch.len(), "one outcome per message");
    assert!(outcomes[0].is_published(), "{:?}", outcomes[0]);
    for ((what, _), outcome) in invalid.iter().zip(&outcomes[1..]) {
        match outcome {
            PublishOutcome::Permanent(e @ PublishError::Invalid(_)) => {
                assert_eq!(e.kind(), ErrorKind::Permanent);
            }
            other => panic!("{what}: expected Permanent(Invalid), got {other:?}"),
        }
    }
    assert!(outcomes[batch.len() - 1].is_published());
    assert_eq!(h.stored().await, 2, "only the two valid messages were sent");
    publisher.check_ready().await.expect("still ready");
}

/// Confirmations that do not arrive within the confirm timeout are `Timeout` (an
/// outage: `ErrorKind::Unavailable`, never the message's fault), one outcome per
/// message, and the publisher stays usable.
pub async fn unconfirmed_messages_time_out<H: TransportHarness>(h: &H) {
    let timeout = Duration::from_millis(1);
    let publisher = h.publisher_with_confirm_timeout(timeout).await;
    let batch = outbox_messages(2000, "Slow");
    let outcomes = publisher.publish_batch(&batch).await;
    assert_eq!(outcomes.len(), batch.len(), "one outcome per message");
    let timed_out = outcomes
        .iter()
        .filter(
            |o| matches!(o, PublishOutcome::Transient(PublishError::Timeout(d)) if *d == timeout),
        )
        .count();
    let published = outcomes.iter().filter(|o| o.is_published()).count();
    assert!(
        outcomes.iter().all(|o| o.is_published() || o.is_outage()),
        "{outcomes:?}"
    );
    assert_eq!(timed_out + published, batch.len(), "{outcomes:?}");
    assert!(timed_out > 0, "2000 confirms cannot all arrive within 1 ms");
    publisher.check_ready().await.expect("still usable");
}

/// A broker that is not there: connecting fails fast (within twice the 2 s connect
/// timeout) with an `Unavailable` error that does not show the password; a publisher
/// created without connecting answers `check_ready` with `Unavailable` and
/// `publish_batch` with outages (which open the dispatcher's circuit and charge no
/// attempt) instead of hanging, except for a message that could never be published,
/// which stays a permanent failure.
pub async fn unreachable_broker_is_a_fast_typed_outage<H: TransportHarness>(h: &H) {
    let started = Instant::now();
    match h.connect_unreachable().await {
        Ok(_) => panic!("connected to an address where nothing listens"),
        Err((kind, text)) => {
            assert_eq!(kind, ErrorKind::Unavailable, "{text}");
            assert!(!text.contains("hunter2"), "the password leaked: {text}");
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "connecting took {:?}",
        started.elapsed()
    );

    let publisher = h.unreachable_publisher().await;
    let started = Instant::now();
    match publisher.check_ready().await {
        Err(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
        Ok(()) => panic!("ready without a broker"),
    }
    let ok = || outbox_message("Fine", "1", "{}");
    let (what, invalid) = h
        .invalid_messages(&ok)
        .into_iter()
        .next()
        .expect("the harness names invalid messages");
    let outcomes = publisher.publish_batch(&[ok(), invalid, ok()]).await;
    assert_eq!(outcomes.len(), 3, "one outcome per message");
    assert!(
        matches!(
            &outcomes[1],
            PublishOutcome::Permanent(PublishError::Invalid(_))
        ),
        "{what}: {:?}",
        outcomes[1]
    );
    for outcome in [&outcomes[0], &outcomes[2]] {
        assert!(outcome.is_outage(), "{outcome:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "check_ready and publish_batch took {:?}",
        started.elapsed()
    );
}
