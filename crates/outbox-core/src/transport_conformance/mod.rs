//! The transport conformance suite: the properties of an [`EventPublisher`] and of a
//! transport's consumer adapter ([`DeliveryHandler`], [`BatchDeliveryHandler`]) stated
//! once, run by every transport against its real broker (enable the `conformance`
//! feature in dev-dependencies).
//!
//! A transport supplies a [`TransportHarness`]: an isolated destination on the broker
//! (its own exchange and queue, its own stream and subject prefix) with publishers and
//! consumers for it, a plain client's view of what the broker holds, and the few things
//! only the transport knows (which messages it cannot carry, how to send a delivery no
//! publisher of ours would send). It then expands
//! [`transport_conformance_tests!`](crate::transport_conformance_tests):
//!
//! ```ignore
//! async fn harness() -> MyHarness { /* own exchange and queue */ }
//! outboxkit_core::transport_conformance_tests!(harness);
//! ```
//!
//! The properties, by module:
//!
//! - [`publish`]: a confirmed batch and its wire format as a plain client of the broker
//!   reads it; concurrent batches; unroutable, oversized and invalid messages are
//!   permanent, alone, and never sent; unconfirmed messages time out as an outage; an
//!   unreachable broker is a fast typed outage for `connect`, `check_ready` and
//!   `publish_batch`;
//! - [`consume`]: every attribute, header and the W3C trace context round trip from
//!   [`OutboxMessage`] to [`IncomingMessage`]; `Requeue` redelivers (flagged, counted
//!   where the broker counts) after the requeue delay and `Ack` removes; shutdown cuts a
//!   requeue delay short; `Reject` never redelivers; undecodable deliveries are rejected
//!   without blocking the rest (by a handler that keeps the default
//!   `handle_undecodable`), while a foreign producer's minimal delivery is decoded; an
//!   undecodable delivery with a usable id reaches `handle_undecodable` with its id,
//!   error and raw body, is kept while deferred and removed when acked;
//!   a panicking handler's delivery is redelivered, never rejected; a graceful shutdown
//!   finishes the handlers in flight and a new run resumes with the rest;
//! - [`batch`]: the batched run mode answers per message, never for another batch in
//!   flight; deferred messages are held (past the broker's redelivery timeout) and
//!   handed again alone; a panicking batch is redelivered and an undecodable delivery
//!   rejected alone, or handed to the batch handler's `handle_undecodable` alone;
//!   shutdown finishes the batches in flight.
//!
//! What one broker does and the other cannot (JetStream's duplicate window, AMQP
//! dead-letter exchanges and connection-level faults, stream and queue setup, settings
//! validation) stays in that transport's own tests. Each property panics with a message
//! naming what failed.

pub mod batch;
pub mod consume;
pub mod publish;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::consumer::{BatchDeliveryHandler, BatchSettings, DeliveryHandler};
use crate::error::{BoxError, ErrorKind};
use crate::message::{Headers, NewMessage, OutboxMessage};
use crate::publisher::EventPublisher;
use crate::wire::{Binding, IncomingMessage};

pub use batch::*;
pub use consume::*;
pub use publish::*;

/// The CloudEvents `source` every publisher of a harness MUST be configured with, so the
/// suite can see the setting travel.
pub const SOURCE: &str = "/tests/conformance";

/// How long any awaited condition may take before a property fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The running consumer a harness hands back: the transport's `run` or `run_batched`,
/// ending when its shutdown token is cancelled (or with the error that stopped it).
pub type ConsumerRun = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'static>>;

/// Consumer settings a property asks for. Every transport has each of them under its
/// own name; a harness maps them onto its consumer builder.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumerSettings {
    /// Deliveries handed out and handled at once (AMQP prefetch; JetStream
    /// concurrency, i.e. `max_ack_pending`). Default 10.
    pub concurrency: usize,
    /// How long a requeued delivery stays away (AMQP: the consumer's requeue delay
    /// before its `basic.nack`; JetStream: the `-NAK` delay). Default 50 ms.
    pub requeue_delay: Duration,
    /// Batched mode: handed to the consumer builder's `with_batch` as it is. Default:
    /// [`BatchSettings::new`] with a 200 ms linger.
    pub batch: BatchSettings,
    /// The broker's redelivery timeout for an unanswered delivery where a consumer
    /// sets one (JetStream `ack_wait`); `None`: the transport's default. AMQP has none
    /// per consumer (a delivery stays unacknowledged until its channel closes) and
    /// ignores it.
    pub ack_wait: Option<Duration>,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        Self {
            concurrency: 10,
            requeue_delay: Duration::from_millis(50),
            batch: BatchSettings::new().with_linger(Duration::from_millis(200)),
            ack_wait: None,
        }
    }
}

/// One message as a plain client of the broker reads it from the harness's destination
/// (not through the transport's consumer).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RawMessage {
    /// The broker's message id (AMQP `message-id` property, `Nats-Msg-Id` header).
    pub message_id: Option<String>,
    /// Where it was published (AMQP routing key, NATS subject).
    pub destination: String,
    /// The content type (AMQP `content-type` property, `Content-Type` header).
    pub content_type: Option<String>,
    /// Every application header, as text.
    pub headers: Headers,
    /// The body.
    pub payload: Vec<u8>,
}

impl RawMessage {
    /// A raw message; set the other fields after.
    pub fn new(destination: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            message_id: None,
            destination: destination.into(),
            content_type: None,
            headers: Headers::new(),
            payload,
        }
    }
}

/// What a transport provides to run the suite: one isolated destination on the real
/// broker per harness (a fresh harness per property), publishers and consumers for it,
/// and a plain client's view of it.
///
/// # Contract
/// - Every publisher MUST be configured with the CloudEvents source [`SOURCE`] and
///   otherwise the transport's defaults, unless the method says otherwise.
/// - The destination MUST take every routing key (a queue bound to `#`, a stream
///   capturing the whole subject prefix) and exist before [`publisher`](Self::publisher)
///   returns, so nothing published before a consumer starts is lost.
/// - Every consumer the harness runs MUST consume that destination under one name (the
///   same queue, the same durable consumer), so a second run resumes where the first
///   stopped.
#[async_trait]
pub trait TransportHarness: Send + Sync + 'static {
    /// The transport's publisher.
    type Publisher: EventPublisher;

    /// The CloudEvents binding of the transport's headers.
    const BINDING: Binding;

    /// Whether deliveries carry the broker's delivery count
    /// ([`IncomingMessage::delivery_count`]).
    const DELIVERY_COUNT: bool;

    /// What a permanent `Unroutable` outcome says: its reply code, and a piece of its
    /// reply text.
    const UNROUTABLE_REPLY: (u16, &'static str);

    /// A connected publisher to the destination.
    async fn publisher(&self) -> Self::Publisher;

    /// Like [`publisher`](Self::publisher), sending payloads of at most `max` bytes.
    async fn publisher_with_max_payload(&self, max: usize) -> Self::Publisher;

    /// Like [`publisher`](Self::publisher), awaiting confirmations at most `timeout`.
    async fn publisher_with_confirm_timeout(&self, timeout: Duration) -> Self::Publisher;

    /// Like [`publisher`](Self::publisher), with a small bound on what it keeps in
    /// flight (AMQP: 2 channels; JetStream: 8 unacknowledged publishes), so that
    /// concurrent batches must share it.
    async fn narrow_publisher(&self) -> Self::Publisher;

    /// The largest message `publisher` sends with its default settings, as its
    /// `PayloadTooLarge` error reports it (`max`).
    fn default_max_payload(&self, publisher: &Self::Publisher) -> usize;

    /// Where `publisher` sends a message of routing key `key` (AMQP routing key, NATS
    /// subject).
    fn destination(&self, key: &str) -> String;

    /// Messages the transport cannot carry, each `valid()` with one thing changed (a
    /// header name or value, a routing key the broker cannot take), named by what is
    /// wrong. The publisher MUST refuse each as `Permanent(Invalid)` without sending it,
    /// even while the broker is unreachable.
    fn invalid_messages(
        &self,
        valid: &dyn Fn() -> OutboxMessage,
    ) -> Vec<(&'static str, OutboxMessage)>;

    /// A connected publisher to a second destination of the harness that routes no
    /// message (an exchange with no queue, a subject prefix no stream captures) until
    /// [`route`](Self::route) is called.
    async fn unrouted_publisher(&self) -> Self::Publisher;

    /// Makes the second destination take the messages of routing key `key`, and only
    /// those.
    async fn route(&self, key: &str);

    /// Connects eagerly (the transport's `connect`) to an address where nothing
    /// listens, with the password `hunter2` in its URL and a connect timeout of 2 s.
    /// Returns the error's kind and its text (`Display` and `Debug`), or the publisher
    /// if it connected after all.
    async fn connect_unreachable(&self) -> Result<Self::Publisher, (ErrorKind, String)>;

    /// A publisher created without connecting (the transport's lazy constructor), to an
    /// address where nothing listens, with a connect timeout of 2 s.
    async fn unreachable_publisher(&self) -> Self::Publisher;

    /// How many messages the destination holds, counted by a plain client. Only
    /// meaningful before any consumer took one.
    async fn stored(&self) -> u64;

    /// Reads `n` messages of the destination with a plain client of the broker (in any
    /// order; it may consume them). Panics if they do not arrive within [`DEADLINE`].
    async fn read_raw(&self, n: usize) -> Vec<RawMessage>;

    /// Publishes, with a plain client, deliveries no consumer can decode: one without
    /// any id or type, one whose id is not a UUID. Returns how many (2).
    async fn publish_undecodable(&self) -> u64;

    /// Publishes, with a plain client, a delivery no consumer can decode but that can be
    /// identified: broker message id `id` (AMQP `message-id`, `Nats-Msg-Id`),
    /// CloudEvents `type` `RawEvent`, `aggregateversion` the text `1.0` (not an
    /// integer), body [`MALFORMED_BODY`].
    async fn publish_malformed(&self, id: Uuid);

    /// Publishes, with a plain client, what another producer might send: only the
    /// broker's message id `id`, the CloudEvents type `event_type` and the aggregate
    /// version `version`, in whichever header encoding such a producer would use (AMQP:
    /// an integer header).
    async fn publish_foreign(&self, id: Uuid, event_type: &str, version: i64);

    /// Messages of the destination neither acknowledged nor rejected by its consumer
    /// (handed out, waiting, or waiting for a redelivery), counted by a plain client.
    /// Read once the consumer has run and stopped.
    async fn unacknowledged(&self) -> u64;

    /// Deliveries the consumer rejected into the destination's dead-letter queue, or
    /// `None` when the broker has no such queue (JetStream `+TERM` drops them).
    async fn dead_lettered(&self) -> Option<u64>;

    /// The transport's consumer on the destination with `settings`, running `handler`
    /// (its `run`) until `shutdown` is cancelled.
    fn run(
        &self,
        settings: &ConsumerSettings,
        handler: Arc<dyn DeliveryHandler>,
        shutdown: CancellationToken,
    ) -> ConsumerRun;

    /// The transport's consumer on the destination with `settings`, running `handler`
    /// in batched mode (its `run_batched`) until `shutdown` is cancelled.
    fn run_batched(
        &self,
        settings: &ConsumerSettings,
        handler: Arc<dyn BatchDeliveryHandler>,
        shutdown: CancellationToken,
    ) -> ConsumerRun;

    /// Removes what the harness created on the broker. Called after every property,
    /// passed or failed; the default does nothing.
    async fn cleanup(&self) {}
}

/// The body of [`TransportHarness::publish_malformed`]'s delivery.
pub const MALFORMED_BODY: &[u8] = b"{\"raw\":true}";

/// Records what reaches [`DeliveryHandler::handle_undecodable`] (and the batch
/// handler's), answering `Defer` to the first delivery of each id and `Ack` after that;
/// acks every decodable message.
#[derive(Default)]
pub(crate) struct UndecodableRecorder {
    pub(crate) undecodable: std::sync::Mutex<Vec<crate::wire::UndecodableMessage>>,
    pub(crate) decoded: std::sync::Mutex<Vec<Uuid>>,
}

impl UndecodableRecorder {
    fn answer(&self, msg: &crate::wire::UndecodableMessage) -> crate::consumer::HandlerDecision {
        let mut seen = self.undecodable.lock().expect("lock");
        let before = seen.iter().filter(|m| m.id == msg.id).count();
        seen.push(msg.clone());
        if before == 0 {
            crate::consumer::HandlerDecision::Defer
        } else {
            crate::consumer::HandlerDecision::Ack
        }
    }
}

#[async_trait]
impl DeliveryHandler for UndecodableRecorder {
    async fn handle(&self, msg: &IncomingMessage) -> crate::consumer::HandlerDecision {
        self.decoded.lock().expect("lock").push(msg.id);
        crate::consumer::HandlerDecision::Ack
    }

    async fn handle_undecodable(
        &self,
        msg: &crate::wire::UndecodableMessage,
    ) -> crate::consumer::HandlerDecision {
        self.answer(msg)
    }
}

#[async_trait]
impl BatchDeliveryHandler for UndecodableRecorder {
    async fn handle_batch(
        &self,
        msgs: &[IncomingMessage],
    ) -> Vec<crate::consumer::HandlerDecision> {
        self.decoded
            .lock()
            .expect("lock")
            .extend(msgs.iter().map(|m| m.id));
        vec![crate::consumer::HandlerDecision::Ack; msgs.len()]
    }

    async fn handle_undecodable(
        &self,
        msg: &crate::wire::UndecodableMessage,
    ) -> crate::consumer::HandlerDecision {
        self.answer(msg)
    }
}

/// The scenario of the properties `an_identifiable_undecodable_delivery_reaches_the_handler`
/// and `…_the_batch_handler`: publishes a malformed but identifiable delivery
/// ([`TransportHarness::publish_malformed`]) and a decodable message, runs the consumer
/// `run` starts with an [`UndecodableRecorder`] as its handler, waits until the malformed
/// delivery was deferred, handed over again and acked and the decodable one handled,
/// stops, checks what the recorder saw and that nothing was dead-lettered.
pub(crate) async fn undecodable_is_recorded_and_acked<H: TransportHarness>(
    h: &H,
    run: impl FnOnce(Arc<UndecodableRecorder>, CancellationToken) -> ConsumerRun,
) {
    let id = Uuid::now_v7();
    h.publish_malformed(id).await;
    let good = outbox_message("OrderPlaced", "1", "{}");
    publish_all(&h.publisher().await, std::slice::from_ref(&good)).await;
    let recorder = Arc::new(UndecodableRecorder::default());
    let running = Running::start(|shutdown| run(Arc::clone(&recorder), shutdown));
    eventually(
        "the malformed delivery is acked after its Defer",
        || async {
            recorder.undecodable.lock().expect("lock").len() >= 2
                && !recorder.decoded.lock().expect("lock").is_empty()
        },
    )
    .await;
    running.stop_settled(h).await;
    assert_malformed_seen(&recorder, id, good.id);
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(dead, 0, "acked, not rejected");
    }
}

/// Checks what [`UndecodableRecorder`] saw of the malformed delivery `id` (published by
/// [`TransportHarness::publish_malformed`]): it reached `handle_undecodable` twice (the
/// `Defer`, then the `Ack`), with its id, its error, its type and its raw body, and the
/// decodable message `good` was handled.
fn assert_malformed_seen(recorder: &UndecodableRecorder, id: Uuid, good: Uuid) {
    let seen = recorder.undecodable.lock().expect("lock").clone();
    assert_eq!(
        seen.len(),
        2,
        "handed over, deferred once, then acked: {seen:?}"
    );
    for msg in &seen {
        assert_eq!(msg.id, Some(id), "the broker message id is the usable id");
        assert!(
            matches!(
                msg.error,
                crate::wire::DecodeError::Malformed {
                    attribute: "aggregateversion",
                    ..
                }
            ),
            "{:?}",
            msg.error
        );
        assert_eq!(msg.event_type.as_deref(), Some("RawEvent"));
        assert_eq!(msg.payload, MALFORMED_BODY, "the raw body");
    }
    assert_eq!(
        *recorder.decoded.lock().expect("lock"),
        [good],
        "the decodable message went to handle, the malformed one never did"
    );
}

/// An outbox row as a store hands it to a publisher: event type `event_type`,
/// aggregate `order`/`aggregate_id` at version 1, payload `payload` (JSON text).
pub fn outbox_message(event_type: &str, aggregate_id: &str, payload: &str) -> OutboxMessage {
    let msg = NewMessage::builder("order", aggregate_id, event_type)
        .aggregate_version(1)
        .payload_json(payload)
        .build()
        .expect("test payload is JSON");
    OutboxMessage::claimed_from(msg, chrono::Utc::now())
}

/// `n` messages of event type `event_type`, aggregates `0..n`, payload `{}`.
pub fn outbox_messages(n: usize, event_type: &str) -> Vec<OutboxMessage> {
    (0..n)
        .map(|i| outbox_message(event_type, &i.to_string(), "{}"))
        .collect()
}

/// Publishes `messages` with `publisher`, asserting each is confirmed.
pub async fn publish_all<P: EventPublisher>(publisher: &P, messages: &[OutboxMessage]) {
    let outcomes = publisher.publish_batch(messages).await;
    assert_eq!(outcomes.len(), messages.len(), "one outcome per message");
    for (i, outcome) in outcomes.iter().enumerate() {
        assert!(outcome.is_published(), "message {i}: {outcome:?}");
    }
}

/// Polls `condition` until it holds, failing the property after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_within(DEADLINE, what, condition).await;
}

/// Polls `condition` until it holds, failing the property after `limit`.
pub async fn eventually_within<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `property` on `h`, then [`TransportHarness::cleanup`] whether it passed or
/// panicked (the panic then goes on). What
/// [`transport_conformance_tests!`](crate::transport_conformance_tests) expands to.
pub async fn run_property<H: TransportHarness>(h: &H, property: impl Future<Output = ()>) {
    use futures::FutureExt as _;
    let result = std::panic::AssertUnwindSafe(property).catch_unwind().await;
    h.cleanup().await;
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

/// A consumer started by a property.
struct Running {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), BoxError>>,
}

impl Running {
    fn start(run: impl FnOnce(CancellationToken) -> ConsumerRun) -> Self {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(shutdown.clone()));
        Self { shutdown, task }
    }

    fn is_running(&self) -> bool {
        !self.task.is_finished()
    }

    /// Cancels the consumer and waits for it to end cleanly.
    async fn stop(self) {
        self.shutdown.cancel();
        match tokio::time::timeout(DEADLINE, self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => panic!("the consumer ended with an error: {e}"),
            Ok(Err(e)) => panic!("the consumer task panicked: {e}"),
            Err(_) => panic!("the consumer did not stop within {DEADLINE:?}"),
        }
    }

    /// [`stop`](Self::stop)s the consumer, then waits until the broker holds nothing
    /// unacknowledged for `h`'s destination (every delivery answered for good).
    async fn stop_settled<H: TransportHarness>(self, h: &H) {
        self.stop().await;
        eventually("nothing is left unacknowledged", || async {
            h.unacknowledged().await == 0
        })
        .await;
    }
}

/// One delivery as a handler saw it.
#[derive(Debug, Clone)]
struct Seen {
    msg: IncomingMessage,
    at: tokio::time::Instant,
}

impl Seen {
    fn now(msg: &IncomingMessage) -> Self {
        Self {
            msg: msg.clone(),
            at: tokio::time::Instant::now(),
        }
    }
}

/// Expands to one `#[tokio::test]` per transport conformance property, in a module
/// `transport_conformance`.
///
/// `transport_conformance_tests!($harness)`: `$harness` is the path of an
/// `async fn() -> impl TransportHarness` returning a fresh, isolated harness (its own
/// destination on the broker). [`TransportHarness::cleanup`] runs after each property,
/// passed or failed.
#[macro_export]
macro_rules! transport_conformance_tests {
    ($harness:path) => {
        mod transport_conformance {
            use super::*;
            $crate::transport_conformance_tests!(@each $harness;
                publishes_a_batch_with_the_wire_format,
                concurrent_batches_are_all_confirmed,
                unroutable_messages_are_permanent,
                oversized_payloads_are_permanent_and_never_sent,
                invalid_messages_are_permanent_and_never_sent,
                unconfirmed_messages_time_out,
                unreachable_broker_is_a_fast_typed_outage,
                headers_and_trace_context_round_trip,
                requeue_redelivers_after_the_delay_and_ack_removes,
                shutdown_cuts_a_requeue_delay_short,
                reject_is_not_redelivered,
                undecodable_deliveries_are_rejected_and_block_nothing,
                an_identifiable_undecodable_delivery_reaches_the_handler,
                panicking_handler_is_redelivered_never_rejected,
                graceful_shutdown_finishes_in_flight_and_a_new_run_resumes,
                batches_are_answered_per_message,
                deferred_messages_are_held_and_handed_again_alone,
                a_panicking_batch_is_redelivered_and_undecodable_deliveries_rejected,
                an_identifiable_undecodable_delivery_reaches_the_batch_handler,
                shutdown_finishes_the_batches_in_flight,
            );
        }
    };
    (@each $harness:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let h = $harness().await;
                $crate::transport_conformance::run_property(
                    &h,
                    $crate::transport_conformance::$name(&h),
                )
                .await;
            }
        )*
    };
}
