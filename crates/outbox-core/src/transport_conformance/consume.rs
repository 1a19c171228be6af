//! Consumer properties: the transport's `run` with a [`DeliveryHandler`], fed by the
//! transport's publisher and by a plain client of the broker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::SubsecRound as _;
use uuid::Uuid;

use super::{
    ConsumerSettings, Running, SOURCE, Seen, TransportHarness, eventually, outbox_message,
    outbox_messages, publish_all,
};
use crate::consumer::{DeliveryHandler, HandlerDecision};
use crate::message::{NewMessage, OutboxMessage};
use crate::wire::{IncomingMessage, TraceParent};

/// What a [`Recorder`] does with a message.
#[derive(Debug, Clone, Copy)]
enum Script {
    /// Answer this on the first `n` deliveries, then `Ack`.
    First(u32, HandlerDecision),
    /// Panic on the first `n` deliveries, then `Ack`.
    Panic(u32),
}

/// Records every delivery (when it started and when it finished), follows a script per
/// message id, sleeps `delay` before answering, and acks everything else.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<Seen>>,
    finished: Mutex<Vec<Uuid>>,
    script: Mutex<HashMap<Uuid, Script>>,
    delay: Duration,
}

impl Recorder {
    fn slow(delay: Duration) -> Self {
        Self {
            delay,
            ..Self::default()
        }
    }

    fn with(self, id: Uuid, script: Script) -> Self {
        self.script.lock().expect("lock").insert(id, script);
        self
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    fn deliveries(&self, id: Uuid) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.msg.id == id).collect()
    }

    fn finished(&self) -> Vec<Uuid> {
        self.finished.lock().expect("lock").clone()
    }
}

#[async_trait]
impl DeliveryHandler for Recorder {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let n = {
            let mut seen = self.seen.lock().expect("lock");
            seen.push(Seen::now(msg));
            seen.iter().filter(|s| s.msg.id == msg.id).count()
        };
        let n = u32::try_from(n).expect("few deliveries");
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let script = self.script.lock().expect("lock").get(&msg.id).copied();
        let decision = match script {
            Some(Script::First(times, decision)) if n <= times => decision,
            Some(Script::Panic(times)) if n <= times => {
                panic!("handler bug (expected by the property)")
            }
            _ => HandlerDecision::Ack,
        };
        self.finished.lock().expect("lock").push(msg.id);
        decision
    }
}

fn start<H: TransportHarness>(
    h: &H,
    settings: &ConsumerSettings,
    handler: &Arc<Recorder>,
) -> Running {
    let handler: Arc<dyn DeliveryHandler> = Arc::clone(handler) as _;
    Running::start(|shutdown| h.run(settings, handler, shutdown))
}

/// Asserts the broker's redelivery marks of `deliveries` of one message: the first is
/// not a redelivery, the later ones are, and, where the broker counts deliveries, they
/// are counted 1, 2, ...
fn assert_redelivery_marks<H: TransportHarness>(deliveries: &[Seen]) {
    for (i, seen) in deliveries.iter().enumerate() {
        assert_eq!(
            seen.msg.redelivered,
            i > 0,
            "delivery {} is flagged as a redelivery exactly when it is one",
            i + 1
        );
        let count = seen.msg.delivery_count;
        if H::DELIVERY_COUNT {
            assert_eq!(count, Some(i as u64 + 1), "delivery count");
        }
    }
}

/// Every attribute of an [`OutboxMessage`] reaches the handler of the transport's own
/// consumer as the matching [`IncomingMessage`] field: id, type, source, aggregate type,
/// id and version, tenant, partition key, correlation and causation ids, occurred-at (to
/// the microsecond), W3C `traceparent` and `tracestate`, pass-through headers, and the
/// payload bytes; a message without the optional attributes arrives without them.
pub async fn headers_and_trace_context_round_trip<H: TransportHarness>(h: &H) {
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let tracestate = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
    let occurred_at = chrono::Utc::now().trunc_subsecs(6) - chrono::Duration::minutes(5);
    let full = NewMessage::builder("invoice", "inv-42", "InvoiceIssued")
        .aggregate_version(7)
        .tenant_id("acme")
        .partition_key("customer-9")
        .correlation_id("corr-1")
        .causation_id("cause-1")
        .header("x-custom", "custom value")
        .trace_context(traceparent, Some(tracestate.to_owned()))
        .occurred_at(occurred_at)
        .payload_json(r#"{"total_cents":1999,"lines":[1,2]}"#)
        .build()
        .expect("valid message");
    let full = OutboxMessage::claimed_from(full, chrono::Utc::now());
    let mut bare = outbox_message("Bare", "b", "[]");
    bare.headers.clear();
    publish_all(&h.publisher().await, &[full.clone(), bare.clone()]).await;

    let handler = Arc::new(Recorder::default());
    let running = start(h, &ConsumerSettings::default(), &handler);
    eventually("both messages are handled", || async {
        handler.finished().len() >= 2
    })
    .await;
    running.stop().await;

    let got = handler.deliveries(full.id);
    assert_eq!(got.len(), 1, "delivered once");
    let m = &got[0].msg;
    assert_eq!(m.event_type, "InvoiceIssued");
    assert_eq!(m.source.as_deref(), Some(SOURCE));
    assert_eq!(m.aggregate_type.as_deref(), Some("invoice"));
    assert_eq!(m.aggregate_id.as_deref(), Some("inv-42"));
    assert_eq!(m.aggregate_version, Some(7));
    assert_eq!(m.tenant_id.as_deref(), Some("acme"));
    assert_eq!(m.partition_key.as_deref(), Some("customer-9"));
    assert_eq!(m.correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(m.causation_id.as_deref(), Some("cause-1"));
    assert_eq!(m.occurred_at, Some(occurred_at));
    assert_eq!(m.traceparent, TraceParent::parse(traceparent));
    assert!(m.traceparent.is_some());
    assert_eq!(m.tracestate.as_deref(), Some(tracestate));
    assert_eq!(
        m.headers.get("x-custom").map(String::as_str),
        Some("custom value")
    );
    assert_eq!(m.payload, full.payload.get().as_bytes());
    assert!(!m.redelivered);

    let got = handler.deliveries(bare.id);
    assert_eq!(got.len(), 1, "delivered once");
    let m = &got[0].msg;
    assert_eq!(m.event_type, "Bare");
    assert_eq!(m.payload, b"[]");
    assert_eq!(
        (&m.tenant_id, &m.partition_key, &m.correlation_id),
        (&None, &None, &None)
    );
    assert_eq!((m.traceparent, &m.tracestate), (None, &None));
}

/// A handler that answers `Requeue` gets the message again after the requeue delay,
/// flagged as a redelivery (and counted, where the broker counts); once it answers
/// `Ack` the message is gone: nothing is left unacknowledged and nothing comes a third
/// time.
pub async fn requeue_redelivers_after_the_delay_and_ack_removes<H: TransportHarness>(h: &H) {
    let msg = outbox_message("OrderPlaced", "42", r#"{"order":42}"#);
    publish_all(&h.publisher().await, std::slice::from_ref(&msg)).await;
    let handler =
        Arc::new(Recorder::default().with(msg.id, Script::First(1, HandlerDecision::Requeue)));
    let settings = ConsumerSettings {
        requeue_delay: Duration::from_millis(400),
        ..ConsumerSettings::default()
    };
    let running = start(h, &settings, &handler);
    eventually("the message is delivered twice", || async {
        handler.finished().len() >= 2
    })
    .await;
    running.stop_settled(h).await;

    let seen = handler.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|s| s.msg.id == msg.id));
    assert_redelivery_marks::<H>(&seen);
    let waited = seen[1].at.duration_since(seen[0].at);
    assert!(
        waited >= Duration::from_millis(400),
        "the requeue waited its delay: {waited:?}"
    );
}

/// Shutdown during a long requeue delay ends at once: the consumer stops in time, the
/// message was not delivered again meanwhile, and it is still waiting on the broker
/// (not lost, not acknowledged).
pub async fn shutdown_cuts_a_requeue_delay_short<H: TransportHarness>(h: &H) {
    let msg = outbox_message("OrderPlaced", "7", "{}");
    publish_all(&h.publisher().await, std::slice::from_ref(&msg)).await;
    let handler =
        Arc::new(Recorder::default().with(msg.id, Script::First(1, HandlerDecision::Requeue)));
    let settings = ConsumerSettings {
        requeue_delay: Duration::from_secs(600),
        ..ConsumerSettings::default()
    };
    let running = start(h, &settings, &handler);
    eventually("the handler asked for a requeue", || async {
        !handler.finished().is_empty()
    })
    .await;
    running.stop().await; // within DEADLINE (30 s), far below the 600 s delay
    eventually("the requeued message waits on the broker", || async {
        h.unacknowledged().await == 1
    })
    .await;
    assert_eq!(handler.seen().len(), 1, "not delivered again meanwhile");
}

/// A message the handler answers `Reject` is never delivered again (it goes to the
/// dead-letter queue where the broker has one), while the others are handled once.
pub async fn reject_is_not_redelivered<H: TransportHarness>(h: &H) {
    let msgs = outbox_messages(3, "Rejected");
    publish_all(&h.publisher().await, &msgs).await;
    let handler = Arc::new(
        Recorder::default().with(msgs[1].id, Script::First(u32::MAX, HandlerDecision::Reject)),
    );
    let running = start(h, &ConsumerSettings::default(), &handler);
    eventually("every message is handled", || async {
        handler.finished().len() >= 3
    })
    .await;
    running.stop_settled(h).await;
    for m in &msgs {
        assert_eq!(handler.deliveries(m.id).len(), 1, "{} handled once", m.id);
    }
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(dead, 1, "the rejected message is dead-lettered");
    }
}

/// Deliveries the consumer cannot decode (no id, an id that is not a UUID) never reach
/// the handler's `handle`, and a handler that does not override `handle_undecodable`
/// gets them rejected (dead-lettered where the broker can), without blocking
/// the deliveries behind them even one at a time; another producer's minimal delivery
/// (broker message id, type, version) is decoded and handled.
pub async fn undecodable_deliveries_are_rejected_and_block_nothing<H: TransportHarness>(h: &H) {
    let undecodable = h.publish_undecodable().await;
    let foreign = Uuid::now_v7();
    h.publish_foreign(foreign, "RawEvent", 5).await;
    let good = outbox_message("OrderPlaced", "1", "{}");
    publish_all(&h.publisher().await, std::slice::from_ref(&good)).await;

    let handler = Arc::new(Recorder::default());
    let settings = ConsumerSettings {
        concurrency: 1,
        ..ConsumerSettings::default()
    };
    let running = start(h, &settings, &handler);
    eventually("both decodable messages are handled", || async {
        handler.finished().len() >= 2
    })
    .await;
    running.stop_settled(h).await;
    let seen = handler.seen();
    assert_eq!(seen.len(), 2, "only the decodable messages: {seen:?}");
    let raw = handler.deliveries(foreign);
    assert_eq!(raw.len(), 1, "{seen:?}");
    assert_eq!(raw[0].msg.event_type, "RawEvent");
    assert_eq!(raw[0].msg.aggregate_version, Some(5));
    assert_eq!(handler.deliveries(good.id).len(), 1, "{seen:?}");
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(
            dead, undecodable,
            "the undecodable deliveries are dead-lettered"
        );
    }
}

/// A delivery the consumer cannot decode but can identify (a UUID broker message id, an
/// `aggregateversion` that is not an integer) reaches the handler's
/// [`handle_undecodable`](DeliveryHandler::handle_undecodable) with that id, its error,
/// type and raw body, so the handler can record it; a `Defer` keeps it (handed to the
/// handler again, not dropped), the `Ack` after it removes it, and nothing is
/// dead-lettered.
pub async fn an_identifiable_undecodable_delivery_reaches_the_handler<H: TransportHarness>(h: &H) {
    super::undecodable_is_recorded_and_acked(h, |recorder, shutdown| {
        let handler: Arc<dyn DeliveryHandler> = recorder;
        h.run(&ConsumerSettings::default(), handler, shutdown)
    })
    .await;
}

/// A handler that panics does not take the consumer down, and its delivery is never
/// rejected (nothing recorded it): it is redelivered, flagged, until the handler stops
/// panicking; nothing is dead-lettered.
pub async fn panicking_handler_is_redelivered_never_rejected<H: TransportHarness>(h: &H) {
    let msg = outbox_message("Poison", "1", "{}");
    publish_all(&h.publisher().await, std::slice::from_ref(&msg)).await;
    let handler = Arc::new(Recorder::default().with(msg.id, Script::Panic(2)));
    let running = start(h, &ConsumerSettings::default(), &handler);
    eventually("the message is handled after two panics", || async {
        handler.finished().contains(&msg.id)
    })
    .await;
    assert!(running.is_running(), "the consumer survived the panics");
    running.stop_settled(h).await;
    let seen = handler.seen();
    assert_eq!(seen.len(), 3, "two panics, then handled: {seen:?}");
    assert_redelivery_marks::<H>(&seen);
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(dead, 0, "nothing was dead-lettered");
    }
}

/// Up to the concurrency, deliveries are handled at once; a graceful shutdown lets the
/// running handlers finish and acknowledges them; what they did not start is still
/// waiting, and a new run gets exactly those messages.
pub async fn graceful_shutdown_finishes_in_flight_and_a_new_run_resumes<H: TransportHarness>(
    h: &H,
) {
    let messages = outbox_messages(10, "Slow");
    publish_all(&h.publisher().await, &messages).await;
    let first = Arc::new(Recorder::slow(Duration::from_millis(1500)));
    let settings = ConsumerSettings {
        concurrency: 4,
        ..ConsumerSettings::default()
    };
    let running = start(h, &settings, &first);
    eventually("four handlers run at once", || async {
        first.seen().len() == 4
    })
    .await;
    assert!(first.finished().is_empty(), "they are still running");
    running.stop().await;
    let done = first.finished();
    let started: Vec<Uuid> = first.seen().iter().map(|s| s.msg.id).collect();
    assert_eq!(done.len(), 4, "the in-flight handlers finished");
    assert!(
        started.iter().all(|id| done.contains(id)),
        "{started:?} {done:?}"
    );
    eventually("the six others wait on the broker", || async {
        h.unacknowledged().await == 6
    })
    .await;

    let second = Arc::new(Recorder::default());
    let settings = ConsumerSettings {
        concurrency: 10,
        ..settings
    };
    let running = start(h, &settings, &second);
    eventually("the other six are handled by the next run", || async {
        second.finished().len() >= 6
    })
    .await;
    running.stop_settled(h).await;
    let again = second.finished();
    assert_eq!(again.len(), 6, "{again:?}");
    assert!(
        again.iter().all(|id| !done.contains(id)),
        "nothing handled twice"
    );
}
