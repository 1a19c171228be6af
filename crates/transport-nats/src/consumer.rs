//! [`NatsConsumer`]: consumes a JetStream stream through a durable pull consumer with
//! explicit acks and hands each decoded message to a [`DeliveryHandler`].
//!
//! # Contract
//!
//! - The durable consumer is created, or updated to the configured settings, before
//!   consuming: explicit acks ([`AckPolicy::Explicit`]), `ack_wait`, `max_deliver`,
//!   server-side `backoff` for ack timeouts, an optional filter subject, and
//!   `max_ack_pending` = the concurrency limit (JetStream [consumers]). Its position is
//!   kept by the server: a restarted consumer resumes where it stopped.
//! - Each message is decoded with [`IncomingMessage::decode`] (NATS binding: the
//!   `Nats-Msg-Id` header and `ce-*` headers), with `redelivered` = JetStream's
//!   delivery count > 1 and `delivery_count` = that count. The server is answered only
//!   **after** the handler returns, so a handler that commits its database transaction
//!   before returning [`HandlerDecision::Ack`] never loses a message: a crash before
//!   the ack means a redelivery after `ack_wait`, which the inbox deduplicates.
//! - Answers: `Ack` → `+ACK`; `Requeue` → `-NAK` with a delay from the configured
//!   [nak delays](NatsConsumerConfig::with_nak_delays) (by delivery count); `Reject` →
//!   `+TERM` (never redelivered; JetStream publishes a
//!   `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED` advisory); `Defer` (the handler's
//!   database is unavailable) → `+WPI` (in progress: the server restarts `ack_wait` and
//!   counts no delivery) and the same message is handed to the handler again after 1 s,
//!   2 s, ... up to 15 s, until it is decided, however long the outage; at shutdown a
//!   still deferred message gets `-NAK`. Keep `ack_wait` above 15 s plus the handler's
//!   longest wait for its database (the pool's acquire timeout); batched mode needs no
//!   such margin (see below).
//! - A message that cannot be decoded (no id, an id that is not a UUID, no event type,
//!   a malformed or over-long attribute) goes to the handler's
//!   [`handle_undecodable`](DeliveryHandler::handle_undecodable) as an
//!   [`UndecodableMessage`] (its raw headers and body and the id it can be recorded
//!   under) and is answered like any other message (the `outboxkit-inbox` crate's consumers
//!   record a consumer dead letter and answer `Ack`; the default terminates it,
//!   `+TERM`). It never blocks the consumer.
//! - A handler that panics is caught and logged, and the message redelivered (`-NAK`):
//!   it is never terminated (the `outboxkit-inbox` crate's handlers count their own panics as
//!   failures and end a message that always panics as a consumer dead letter).
//! - Messages are handled **concurrently**, up to the concurrency limit at a time,
//!   within the task that calls [`run`](NatsConsumer::run); handlers may finish in any
//!   order.
//! - The client reconnects by itself after a lost connection and the pull subscription
//!   resumes; if the consumer or stream is gone (deleted, or lost with a memory-storage
//!   stream in a server restart) it is created again, with exponential backoff.
//! - On shutdown no more messages are pulled, in-flight handlers finish and are
//!   answered, and the client is flushed; messages pulled but not started are
//!   redelivered by the server after `ack_wait`.
//!
//! # Batched mode
//!
//! [`NatsConsumer::run_batched`] hands messages to a [`BatchDeliveryHandler`] in
//! batches instead (the `outboxkit-inbox` crate's `IdempotentConsumer` applies a batch in one
//! database transaction). Everything above holds per message, and:
//!
//! - Every delivery is taken off the pull subscription as soon as it arrives (none is
//!   left in the client's buffer) and waits for a batch; `max_ack_pending` (the
//!   concurrency) bounds how many are held. A batch takes the oldest waiting messages,
//!   up to the batch size (default: the concurrency), and waits at most the linger
//!   (default 3 ms) after the first of them for more. Up to `batches_in_flight`
//!   batches (default 2) are handled at once; the others wait meanwhile. An
//!   undecodable message goes to the handler's
//!   [`handle_undecodable`](BatchDeliveryHandler::handle_undecodable) alone, at once.
//! - Every message held, waiting for a batch or in one and not yet answered, gets a
//!   `+WPI` every third of `ack_wait` (or of the shortest
//!   [backoff](NatsConsumerConfig::with_backoff) step, if shorter), so the server
//!   neither redelivers it nor counts a delivery however long it is held: a database
//!   outage of any length, a slow batch or busy batch slots spend no delivery attempt
//!   and never reach `max_deliver`. In this mode `ack_wait` only bounds how long the
//!   messages of a consumer that stopped answering (crashed, cut off) wait before
//!   they are redelivered; a batch slower than `ack_wait` is not redelivered while it
//!   runs.
//! - Each message is answered as soon as the handler has decided it (after the
//!   handler's commit), the answers of a batch written together and flushed with the
//!   client's next write, not awaited one by one. While some messages are deferred,
//!   only those are handed to the handler again (after 1 s, 2 s, ... up to 15 s).
//! - A panic of the handler naks every message of the batch (never a `+TERM`).
//! - On shutdown the batches in flight finish and are answered; messages waiting for
//!   a batch not started yet are redelivered by the server after `ack_wait`.
//!
//! # Delivery limits and the inbox
//!
//! `max_deliver` counts every delivery of a message, acked or not. When the limit is
//! reached JetStream stops delivering the message (advisory
//! `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES`); it stays in the stream but this
//! consumer never sees it again. The default here is **no limit**: the `outboxkit-inbox` crate's
//! `IdempotentConsumer` counts its own handler failures and, after its
//! `max_deliveries` (5 by default), records the message as a **consumer dead letter**
//! and acks it, and a database outage defers deliveries without spending any, so no
//! message ever leaves unrecorded. If you set a limit, set it well **above** the
//! inbox's `max_deliveries`.
//!
//! [consumers]: https://docs.nats.io/nats-concepts/jetstream/consumers

use std::time::Duration;

use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy};
use async_nats::jetstream::{self, AckKind, ErrorCode};
use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use outboxkit_core::consumer::{
    BatchDeliveryHandler, DeliveryHandler, HandlerDecision, handle_until_decided, until_decided,
};
use outboxkit_core::wire::{Binding, IncomingMessage, UndecodableMessage};
use outboxkit_core::{BatchSettings, Consumer, ErrorKind, Headers, TransportKind};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::{NatsConfig, invalid};
use crate::error::{NatsError, classify_api};
use crate::publisher::MSG_ID_HEADER;
use crate::topology::StreamSetup;

/// Default number of handlers running at once (and the consumer's `max_ack_pending`).
pub const DEFAULT_CONCURRENCY: usize = 100;
/// Largest accepted concurrency.
pub const MAX_CONCURRENCY: usize = 10_000;
/// Default time the server waits for an answer before redelivering: 30 s.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default deliveries of one message before JetStream stops delivering it. Larger than
/// the inbox's default of 5 failed deliveries, see the [module docs](self).
pub const DEFAULT_MAX_DELIVER: Option<u32> = None;
/// Default delays of a `-NAK` after the 1st, 2nd, ... delivery (the last repeats).
pub const DEFAULT_NAK_DELAYS: [Duration; 4] = [
    Duration::from_secs(1),
    Duration::from_secs(5),
    Duration::from_secs(15),
    Duration::from_secs(30),
];
/// Default first delay before setting the consumer up again.
pub const DEFAULT_RECONNECT_INITIAL: Duration = Duration::from_millis(200);
/// Default longest delay between setup attempts.
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(30);
/// Idle heartbeat requested with each pull: a pull that hears nothing for two of them
/// is considered lost and re-issued.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
/// Lifetime of one pull request.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
/// Stream errors in a row, without a message in between, after which the consumer is
/// set up again.
const MAX_CONSECUTIVE_ERRORS: u32 = 5;

/// Settings of a [`NatsConsumer`]: plain data. [`new`](Self::new) takes the transport's
/// configuration, the stream and the durable consumer's name, every `with_*` setter
/// consumes and returns the configuration, getters are named after the settings, and
/// [`validate`](Self::validate) checks them all (and the transport's configuration);
/// [`NatsConsumer::new`] calls it first.
#[derive(Debug, Clone)]
#[must_use]
pub struct NatsConsumerConfig {
    config: NatsConfig,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    ack_wait: Duration,
    max_deliver: Option<u32>,
    backoff: Vec<Duration>,
    nak_delays: Vec<Duration>,
    concurrency: usize,
    reconnect_initial: Duration,
    reconnect_max: Duration,
    batch: BatchSettings,
    stream_setup: Option<StreamSetup>,
}

impl NatsConsumerConfig {
    /// A durable consumer named `durable` of `stream` on the server of `config`, every
    /// other setting at its default.
    pub fn new(config: NatsConfig, stream: impl Into<String>, durable: impl Into<String>) -> Self {
        Self {
            config,
            stream: stream.into(),
            durable: durable.into(),
            filter_subject: None,
            ack_wait: DEFAULT_ACK_WAIT,
            max_deliver: DEFAULT_MAX_DELIVER,
            backoff: Vec::new(),
            nak_delays: DEFAULT_NAK_DELAYS.to_vec(),
            concurrency: DEFAULT_CONCURRENCY,
            reconnect_initial: DEFAULT_RECONNECT_INITIAL,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            batch: BatchSettings::new(),
            stream_setup: None,
        }
    }

    /// Only messages whose subject matches this filter (wildcards allowed) are
    /// delivered. Default: every message of the stream.
    pub fn with_filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// How long the server waits for an answer to a delivery before delivering it again.
    /// Default 30 s; it must exceed the slowest handler (a slower one gets a duplicate,
    /// which the inbox absorbs). [`run_batched`](NatsConsumer::run_batched) keeps every
    /// message it holds with `+WPI` every third of it instead, so there it only bounds
    /// how long the messages of a consumer that stopped answering wait (see the
    /// [module docs](self#batched-mode)).
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Deliveries of one message after which JetStream stops delivering it, or `None`
    /// for no limit. Default `None`: the inbox enforces its own limit on handler
    /// failures and records a consumer dead letter, while a database outage (a deferred
    /// delivery) spends no delivery at all, so nothing is ever dropped unrecorded. A
    /// limit makes JetStream drop a message silently (advisory
    /// `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES`) once reached, e.g. after repeated
    /// shutdowns or `ack_wait` expiries; if you set one, keep it well above the inbox's
    /// `max_deliveries` (see the [module docs](self)). Must exceed the number of
    /// [`with_backoff`](Self::with_backoff) steps.
    pub fn with_max_deliver(mut self, max_deliver: Option<u32>) -> Self {
        self.max_deliver = max_deliver;
        self
    }

    /// Server-side redelivery delays after an **unanswered** delivery (the consumer's
    /// `backoff`, which replaces `ack_wait` for the n-th redelivery; the last repeats).
    /// Default none: `ack_wait` every time.
    pub fn with_backoff(mut self, delays: Vec<Duration>) -> Self {
        self.backoff = delays;
        self
    }

    /// Delays of the `-NAK` sent for [`HandlerDecision::Requeue`]: after delivery `n`
    /// the message comes back after `delays[n - 1]` (the last delay repeats). Default
    /// 1 s, 5 s, 15 s, 30 s. An empty list naks without delay (immediate redelivery).
    pub fn with_nak_delays(mut self, delays: Vec<Duration>) -> Self {
        self.nak_delays = delays;
        self
    }

    /// Largest number of handlers running at once, which is also the consumer's
    /// `max_ack_pending` (unanswered deliveries the server allows). 1 to
    /// [`MAX_CONCURRENCY`]. Default 100.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Backoff between attempts to (re)create the consumer or reconnect: the first
    /// delay and the cap of the doubling delay. Defaults 200 ms and 30 s.
    pub fn with_reconnect_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.reconnect_initial = initial;
        self.reconnect_max = max;
        self
    }

    /// Batched mode ([`Consumer::run_batched`]): batch size, linger and batches in
    /// flight. The batch size is at most the concurrency (the default size). Default
    /// [`BatchSettings::new`].
    pub fn with_batch(mut self, batch: BatchSettings) -> Self {
        self.batch = batch;
        self
    }

    /// The stream to create, when it does not exist yet, before the durable consumer is
    /// created (by [`declare`](NatsConsumer::declare) and at every (re)start of
    /// [`run`](Consumer::run)), as a RabbitMQ consumer declares its exchange and queue.
    /// An existing stream is left as it is: its settings belong to whoever created it
    /// (the relay's [`NatsPublisher::ensure_stream`](crate::NatsPublisher::ensure_stream),
    /// `outbox streams`, an operator). `setup` must name the consumer's stream. Default:
    /// none, the stream must exist (a missing one is waited for, as an outage).
    pub fn with_stream_setup(mut self, setup: StreamSetup) -> Self {
        self.stream_setup = Some(setup);
        self
    }

    /// Validates the settings, the transport's configuration ([`NatsConfig::validate`])
    /// first.
    ///
    /// # Errors
    /// The transport configuration's [`NatsError::InvalidUrl`] or
    /// [`NatsError::InvalidConfig`]; [`NatsError::InvalidConfig`] when the [stream setup](Self::with_stream_setup)
    /// names another stream or is invalid, the stream or durable name is empty or contains
    /// whitespace, `.`, `*`, `>`, `/` or `\`; the filter subject is not a valid subject;
    /// `ack_wait` is zero; `max_deliver` is `Some(0)` or not above the number of backoff
    /// steps; a backoff delay is zero; the concurrency is outside `1..=10_000`; the
    /// reconnect backoff is zero or its initial delay exceeds its cap; or the
    /// [batch settings](BatchSettings::check) do not fit the concurrency (fields
    /// `batch_size`, `batch_linger`, `batches_in_flight`).
    pub fn validate(&self) -> Result<(), NatsError> {
        self.config.validate()?;
        check_name("stream", &self.stream)?;
        check_name("durable", &self.durable)?;
        if let Some(filter) = &self.filter_subject {
            let probe = filter
                .split('.')
                .map(|t| if t == "*" || t == ">" { "w" } else { t })
                .collect::<Vec<_>>()
                .join(".");
            if let Some(problem) = crate::config::subject_problem(&probe) {
                return Err(invalid("filter_subject", problem.replace(&probe, filter)));
            }
        }
        if self.ack_wait.is_zero() {
            return Err(invalid("ack_wait", "must be greater than zero"));
        }
        if self.backoff.iter().any(Duration::is_zero) {
            return Err(invalid("backoff", "delays must be greater than zero"));
        }
        match self.max_deliver {
            Some(0) => return Err(invalid("max_deliver", "must be at least 1, or None")),
            Some(n) if !self.backoff.is_empty() && (n as usize) <= self.backoff.len() => {
                return Err(invalid(
                    "max_deliver",
                    format!(
                        "must exceed the {} backoff steps (a JetStream rule)",
                        self.backoff.len()
                    ),
                ));
            }
            _ => {}
        }
        if !(1..=MAX_CONCURRENCY).contains(&self.concurrency) {
            return Err(invalid(
                "concurrency",
                format!(
                    "must be between 1 and {MAX_CONCURRENCY}, got {}",
                    self.concurrency
                ),
            ));
        }
        if self.reconnect_initial.is_zero() || self.reconnect_initial > self.reconnect_max {
            return Err(invalid(
                "reconnect_backoff",
                "the initial delay must be greater than zero and at most the maximum",
            ));
        }
        self.batch_size()?;
        if let Some(setup) = &self.stream_setup {
            if setup.name() != self.stream {
                return Err(invalid(
                    "stream_setup",
                    format!(
                        "names the stream {:?}, the consumer reads {:?}",
                        setup.name(),
                        self.stream
                    ),
                ));
            }
            setup.check()?;
        }
        Ok(())
    }

    /// The batch size resolved against the concurrency.
    fn batch_size(&self) -> Result<usize, NatsError> {
        self.batch
            .check(self.concurrency)
            .map_err(|e| invalid(e.field, e.reason))
    }

    /// The transport's configuration.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// The stream consumed.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// The filter subject, if any.
    pub fn filter_subject(&self) -> Option<&str> {
        self.filter_subject.as_deref()
    }

    /// How long the server waits for an answer to a delivery.
    pub fn ack_wait(&self) -> Duration {
        self.ack_wait
    }

    /// Deliveries of one message after which JetStream stops delivering it (`None`:
    /// no limit).
    pub fn max_deliver(&self) -> Option<u32> {
        self.max_deliver
    }

    /// The server-side redelivery delays after an unanswered delivery.
    pub fn backoff(&self) -> &[Duration] {
        &self.backoff
    }

    /// The delays of the `-NAK` sent for [`HandlerDecision::Requeue`].
    pub fn nak_delays(&self) -> &[Duration] {
        &self.nak_delays
    }

    /// The concurrency limit (and `max_ack_pending`).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The reconnection backoff: the first delay and the cap.
    pub fn reconnect_backoff(&self) -> (Duration, Duration) {
        (self.reconnect_initial, self.reconnect_max)
    }

    /// The batched mode's settings.
    pub fn batch(&self) -> &BatchSettings {
        &self.batch
    }

    /// The stream created when missing, if any.
    pub fn stream_setup(&self) -> Option<&StreamSetup> {
        self.stream_setup.as_ref()
    }
}

impl NatsConsumer {
    /// The consumer `config` describes. Nothing connects here: the consumer connects
    /// when it runs (or [`declare`](Self::declare)s).
    ///
    /// # Errors
    /// What [`NatsConsumerConfig::validate`] finds, before anything else:
    /// [`NatsError::InvalidUrl`] or [`NatsError::InvalidConfig`] naming the setting.
    pub fn new(config: NatsConsumerConfig) -> Result<Self, NatsError> {
        config.validate()?;
        let batch_size = config.batch_size()?;
        Ok(NatsConsumer {
            config: config.config,
            stream: config.stream,
            durable: config.durable,
            filter_subject: config.filter_subject,
            ack_wait: config.ack_wait,
            max_deliver: config.max_deliver,
            backoff: config.backoff,
            nak_delays: config.nak_delays,
            concurrency: config.concurrency,
            reconnect_initial: config.reconnect_initial,
            reconnect_max: config.reconnect_max,
            batch_size,
            batch: config.batch,
            stream_setup: config.stream_setup,
        })
    }
}

fn check_name(field: &'static str, value: &str) -> Result<(), NatsError> {
    if value.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if value
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
    {
        return Err(invalid(
            field,
            format!("{value:?} must not contain whitespace, '.', '*', '>', '/' or '\\'"),
        ));
    }
    Ok(())
}

/// Consumes a JetStream stream through a durable pull consumer and answers the server
/// with what a [`DeliveryHandler`] decides. See the [module docs](self) for the
/// contract.
///
/// ```no_run
/// use async_trait::async_trait;
/// use outboxkit_core::wire::IncomingMessage;
/// use tokio_util::sync::CancellationToken;
/// use outboxkit_nats::{Consumer as _, DeliveryHandler, HandlerDecision, NatsConfig, NatsConsumer, NatsConsumerConfig};
///
/// struct Projection;
///
/// #[async_trait]
/// impl DeliveryHandler for Projection {
///     async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
///         println!("{} {}", msg.event_type, msg.id);
///         HandlerDecision::Ack
///     }
/// }
///
/// # async fn run() -> Result<(), outboxkit_nats::NatsError> {
/// let config = NatsConfig::from_env()?
///     .with_subject_prefix("orders.events");
/// let consumer = NatsConsumer::new(NatsConsumerConfig::new(config, "ORDERS", "projection")
///     .with_filter_subject("orders.events.OrderPlaced")
///     .with_concurrency(50))?;
/// let shutdown = CancellationToken::new();
/// consumer.run(Projection, shutdown).await
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct NatsConsumer {
    config: NatsConfig,
    stream: String,
    durable: String,
    filter_subject: Option<String>,
    ack_wait: Duration,
    max_deliver: Option<u32>,
    backoff: Vec<Duration>,
    nak_delays: Vec<Duration>,
    concurrency: usize,
    reconnect_initial: Duration,
    reconnect_max: Duration,
    batch_size: usize,
    /// Batched mode's linger and batches in flight (`batch_size` is its size resolved
    /// against the window).
    pub(crate) batch: BatchSettings,
    stream_setup: Option<StreamSetup>,
}

/// Per-message settings the processing of a delivery needs.
#[derive(Debug, Clone)]
struct Answering {
    nak_delays: Vec<Duration>,
}

#[async_trait]
impl Consumer for NatsConsumer {
    type Error = NatsError;

    fn kind(&self) -> TransportKind {
        TransportKind::Nats
    }

    async fn declare(&self) -> Result<(), NatsError> {
        NatsConsumer::declare(self).await
    }

    /// Consumes until `shutdown` is cancelled, reconnecting and setting the consumer up
    /// again with backoff after failures.
    ///
    /// # Errors
    /// Only errors retrying cannot fix: an authorization violation at connect time, a
    /// consumer configuration the server refuses (e.g. a filter subject outside the
    /// stream's subjects). Returns `Ok(())` after a graceful shutdown.
    async fn run<H: DeliveryHandler>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), Self::Error> {
        let answering = Answering {
            nak_delays: self.nak_delays.clone(),
        };
        self.keep_consuming(&shutdown, |js| {
            self.consume_once(js, &handler, &answering, &shutdown)
        })
        .await
    }

    /// Consumes until `shutdown` is cancelled like [`run`](Self::run), but hands the
    /// messages to `handler` in batches (see the [module docs](self#batched-mode)): up
    /// to the [batch size](BatchSettings::with_size) messages, taken as they come and
    /// for at most the [linger](BatchSettings::with_linger) after the first, with up to
    /// [that many](BatchSettings::with_in_flight) batches handled at once (set with
    /// [`NatsConsumerConfig::with_batch`]); each message is answered as soon as the handler has decided
    /// it (the acks of a batch are pipelined, not awaited one by one).
    ///
    /// # Errors
    /// As [`run`](Self::run).
    async fn run_batched<H: BatchDeliveryHandler>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), Self::Error> {
        self.keep_consuming(&shutdown, |js| {
            crate::batch::consume_batched_once(self, js, &handler, &shutdown)
        })
        .await
    }
}

impl NatsConsumer {
    /// The stream consumed.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The durable consumer's name.
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// The concurrency limit.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The largest batch of [`run_batched`](Self::run_batched).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// How often batched mode sends `+WPI` for each message it holds: a third of the
    /// shortest time the server waits for an answer (`ack_wait`, or a shorter
    /// [backoff](NatsConsumerConfig::with_backoff) step), at least 1 ms.
    pub(crate) fn keep_alive_period(&self) -> Duration {
        let shortest = self
            .backoff
            .iter()
            .copied()
            .fold(self.ack_wait, Duration::min);
        (shortest / 3).max(Duration::from_millis(1))
    }

    /// The delays of the `-NAK` sent for [`HandlerDecision::Requeue`].
    pub(crate) fn nak_delays(&self) -> &[Duration] {
        &self.nak_delays
    }

    /// The JetStream consumer configuration this consumer creates or updates.
    fn consumer_config(&self) -> consumer::pull::Config {
        consumer::pull::Config {
            durable_name: Some(self.durable.clone()),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver.map_or(-1, i64::from),
            backoff: self.backoff.clone(),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            max_ack_pending: i64::try_from(self.concurrency).unwrap_or(i64::MAX),
            ..consumer::pull::Config::default()
        }
    }

    /// Connects once, creates the durable consumer (or updates it to these settings),
    /// and disconnects. Call it before publishing when the consumer must exist first
    /// (e.g. with [`StreamRetention::Interest`](crate::StreamRetention::Interest), where messages
    /// without an interested consumer are not kept).
    ///
    /// # Errors
    /// A connection error, or [`NatsError::Stream`] / [`NatsError::Consumer`] when the
    /// stream does not exist or the server refuses the consumer's settings.
    pub async fn declare(&self) -> Result<(), NatsError> {
        let client = self.config.connect_client().await?;
        let js = jetstream::new(client.clone());
        let result = self.setup(&js).await.map(drop);
        let _ = timeout(self.config.connect_timeout(), client.drain()).await;
        result
    }

    /// Connects (with backoff), then runs `once` (one pull subscription's worth of
    /// consuming, which says whether it got as far as consuming) until it ends with a
    /// shutdown or a permanent error, setting the consumer up again with backoff in
    /// between; flushes and drains the client at the end.
    async fn keep_consuming<F, Fut>(
        &self,
        shutdown: &CancellationToken,
        mut once: F,
    ) -> Result<(), NatsError>
    where
        F: FnMut(jetstream::Context) -> Fut,
        Fut: Future<Output = (bool, Result<(), NatsError>)>,
    {
        let mut delay = self.reconnect_initial;
        let client = loop {
            match self.config.connect_client().await {
                Ok(client) => break client,
                Err(e) if e.kind() == ErrorKind::Permanent => {
                    error!(stream = %self.stream, consumer = %self.durable, error = %e, "NATS consumer stopped: retrying cannot help");
                    return Err(e);
                }
                Err(e) => {
                    warn!(error = %e, retry_in_ms = millis(delay), "NATS unreachable, retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(self.reconnect_max);
                }
            }
        };
        let js = jetstream::new(client.clone());
        let mut delay = self.reconnect_initial;
        let result = loop {
            if shutdown.is_cancelled() {
                break Ok(());
            }
            let (established, result) = once(js.clone()).await;
            match result {
                Ok(()) => break Ok(()),
                Err(e) if e.kind() == ErrorKind::Permanent => {
                    error!(stream = %self.stream, consumer = %self.durable, error = %e, "NATS consumer stopped: retrying cannot help");
                    break Err(e);
                }
                Err(e) => {
                    if established {
                        delay = self.reconnect_initial;
                    }
                    warn!(
                        stream = %self.stream,
                        consumer = %self.durable,
                        error = %e,
                        retry_in_ms = millis(delay),
                        "NATS consumer interrupted, setting it up again"
                    );
                    tokio::select! {
                        () = shutdown.cancelled() => break Ok(()),
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(self.reconnect_max);
                }
            }
        };
        // Acks were written to the client; make sure they reach the server.
        let _ = timeout(self.config.connect_timeout(), client.flush()).await;
        let _ = timeout(self.config.connect_timeout(), client.drain()).await;
        if result.is_ok() {
            info!(stream = %self.stream, consumer = %self.durable, "NATS consumer shut down");
        }
        result
    }

    /// Gets the stream and creates or updates the durable consumer.
    async fn setup(
        &self,
        js: &jetstream::Context,
    ) -> Result<consumer::Consumer<consumer::pull::Config>, NatsError> {
        let limit = self.config.connect_timeout();
        let found = match &self.stream_setup {
            Some(setup) => {
                return self
                    .create_durable(setup.get_or_create(js, limit).await?)
                    .await;
            }
            None => timeout(limit, js.get_stream(&self.stream)).await,
        };
        let stream = match found {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                use async_nats::jetstream::context::GetStreamErrorKind as K;
                let kind = match e.kind() {
                    // The relay may not have created it yet.
                    K::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND => {
                        ErrorKind::Transient
                    }
                    K::JetStream(js) => classify_api(&js),
                    K::EmptyName | K::InvalidStreamName => ErrorKind::Permanent,
                    _ => ErrorKind::Unavailable,
                };
                return Err(NatsError::Stream {
                    operation: "stream.info",
                    stream: self.stream.clone(),
                    kind,
                    source: Box::new(e),
                });
            }
            Err(_) => return Err(self.timeout("stream.info")),
        };
        self.create_durable(stream).await
    }

    /// Creates the durable consumer on `stream`, or updates it to these settings.
    async fn create_durable(
        &self,
        stream: jetstream::stream::Stream,
    ) -> Result<consumer::Consumer<consumer::pull::Config>, NatsError> {
        let limit = self.config.connect_timeout();
        match timeout(limit, stream.create_consumer(self.consumer_config())).await {
            Ok(Ok(consumer)) => Ok(consumer),
            Ok(Err(e)) => {
                use async_nats::jetstream::stream::ConsumerErrorKind as K;
                let kind = match e.kind() {
                    K::JetStream(js) => classify_api(&js),
                    K::InvalidConsumerType | K::InvalidName => ErrorKind::Permanent,
                    K::TimedOut | K::Request => ErrorKind::Unavailable,
                    _ => ErrorKind::Transient,
                };
                Err(NatsError::Consumer {
                    operation: "consumer.create_or_update",
                    stream: self.stream.clone(),
                    consumer: self.durable.clone(),
                    kind,
                    source: Box::new(e),
                })
            }
            Err(_) => Err(self.timeout("consumer.create_or_update")),
        }
    }

    fn timeout(&self, operation: &'static str) -> NatsError {
        NatsError::Timeout {
            operation,
            url_redacted: self.config.url_redacted().to_owned(),
            timeout: self.config.connect_timeout(),
        }
    }

    fn consume_error(&self, reason: impl Into<String>, source: Option<BoxedError>) -> NatsError {
        NatsError::Consume {
            stream: self.stream.clone(),
            consumer: self.durable.clone(),
            reason: reason.into(),
            source,
        }
    }

    /// Creates or updates the durable consumer and starts its pull subscription.
    pub(crate) async fn subscribe(
        &self,
        js: &jetstream::Context,
    ) -> Result<consumer::pull::Stream, NatsError> {
        let consumer = self.setup(js).await?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.concurrency)
            .heartbeat(PULL_HEARTBEAT)
            .expires(PULL_EXPIRES)
            .messages()
            .await
            .map_err(|e| {
                self.consume_error("starting the pull subscription failed", Some(Box::new(e)))
            })?;
        info!(
            stream = %self.stream,
            consumer = %self.durable,
            concurrency = self.concurrency,
            "consuming from JetStream"
        );
        Ok(messages)
    }

    /// What an error of the pull subscription means, `errors_in_a_row` counting it:
    /// `Some` ends this subscription (it is set up again), `None` is a hiccup it gets
    /// over by itself.
    pub(crate) fn pull_error(
        &self,
        e: consumer::pull::MessagesError,
        errors_in_a_row: &mut u32,
    ) -> Option<NatsError> {
        let terminal = matches!(
            e.kind(),
            MessagesErrorKind::ConsumerDeleted
                | MessagesErrorKind::PushBasedConsumer
                | MessagesErrorKind::RequestLimitExceeded
        );
        *errors_in_a_row += 1;
        if terminal || *errors_in_a_row >= MAX_CONSECUTIVE_ERRORS {
            return Some(self.consume_error(
                format!("the pull subscription failed ({errors_in_a_row} errors in a row)"),
                Some(Box::new(e)),
            ));
        }
        debug!(error = %e, "pull subscription hiccup; it re-issues its pull");
        None
    }

    /// The error of a pull subscription that ended.
    pub(crate) fn ended_error(&self) -> NatsError {
        self.consume_error("the pull subscription ended", None)
    }

    /// One pull subscription's worth of consuming, a handler per message. `Ok(())`
    /// means shutdown; the `bool` whether consuming started.
    async fn consume_once<H: DeliveryHandler>(
        &self,
        js: jetstream::Context,
        handler: &H,
        answering: &Answering,
        shutdown: &CancellationToken,
    ) -> (bool, Result<(), NatsError>) {
        let mut messages = match self.subscribe(&js).await {
            Ok(messages) => messages,
            Err(e) => return (false, Err(e)),
        };
        let mut in_flight = FuturesUnordered::new();
        let mut errors_in_a_row = 0u32;
        let ended = loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(()),
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                next = messages.next(), if in_flight.len() < self.concurrency => match next {
                    Some(Ok(message)) => {
                        errors_in_a_row = 0;
                        in_flight.push(process(handler, message, answering, shutdown));
                    }
                    Some(Err(e)) => {
                        if let Some(e) = self.pull_error(e, &mut errors_in_a_row) {
                            break Err(e);
                        }
                    }
                    None => break Err(self.ended_error()),
                },
            }
        };
        // No more pulls; let the running handlers finish and answer.
        drop(messages);
        let draining = in_flight.len();
        if draining > 0 {
            debug!(in_flight = draining, "waiting for in-flight handlers");
        }
        while in_flight.next().await.is_some() {}
        (true, ended)
    }
}

type BoxedError = outboxkit_core::BoxError;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Decodes, handles and answers one message. Never panics, never returns an error:
/// failures are logged and the server redelivers what was not answered.
async fn process<H: DeliveryHandler>(
    handler: &H,
    message: jetstream::Message,
    answering: &Answering,
    shutdown: &CancellationToken,
) {
    let (delivered, stream_sequence) = match message.info() {
        Ok(info) => (
            u64::try_from(info.delivered).unwrap_or(1).max(1),
            info.stream_sequence,
        ),
        Err(e) => {
            warn!(subject = %message.subject, error = %e, "not a JetStream message; ignored");
            return;
        }
    };
    let (message_id, decoded) =
        decode_message(message.headers.as_ref(), &message.payload, delivered);
    // "+WPI" (work in progress) before each wait restarts the server's ack_wait, so
    // a deferred delivery is neither redelivered nor counted again.
    let keep = || async {
        if let Err(e) = message.ack_with(AckKind::Progress).await {
            debug!(stream_sequence, error = %e, "could not send +WPI");
        }
    };
    let decision = match decoded {
        Ok(msg) => handle_until_decided(handler, &msg, shutdown, keep).await,
        Err(undecodable) => {
            debug!(
                stream_sequence,
                message_id = message_id.as_deref().unwrap_or(""),
                error = %undecodable.error,
                "undecodable message handed to the handler"
            );
            until_decided(
                undecodable.id,
                || handler.handle_undecodable(&undecodable),
                shutdown,
                keep,
            )
            .await
        }
    };
    let kind = match decision {
        HandlerDecision::Ack => AckKind::Ack,
        HandlerDecision::Requeue => AckKind::Nak(nak_delay(&answering.nak_delays, delivered)),
        // Still deferred at shutdown: let the server redeliver it at once.
        HandlerDecision::Defer => AckKind::Nak(None),
        HandlerDecision::Reject => AckKind::Term,
    };
    if let Err(e) = message.ack_with(kind).await {
        warn!(stream_sequence, ?decision, error = %e, "could not answer the server; it will redeliver after ack_wait");
    }
}

/// Decodes a JetStream message's headers and payload (NATS binding: `Nats-Msg-Id` and
/// `ce-*` headers) as delivery number `delivered`. Returns the `Nats-Msg-Id` too, for
/// logging. Pure (a `jetstream::Message` needs a live client), so that it can be tested
/// with arbitrary headers.
pub(crate) fn decode_message(
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
    delivered: u64,
) -> (
    Option<String>,
    Result<IncomingMessage, Box<UndecodableMessage>>,
) {
    let headers = headers_to_strings(headers);
    let message_id = headers.get(MSG_ID_HEADER).cloned();
    let decoded = IncomingMessage::decode(
        Binding::Nats,
        message_id.as_deref(),
        headers,
        payload.to_vec(),
        delivered > 1,
        Some(delivered),
    );
    (message_id, decoded)
}

/// The delay of the `-NAK` after delivery number `delivered` (1-based).
pub(crate) fn nak_delay(delays: &[Duration], delivered: u64) -> Option<Duration> {
    let index = usize::try_from(delivered.saturating_sub(1)).unwrap_or(usize::MAX);
    delays.get(index).or_else(|| delays.last()).copied()
}

/// NATS headers as strings: the first value of each header.
pub fn headers_to_strings(map: Option<&async_nats::HeaderMap>) -> Headers {
    let mut headers = Headers::new();
    if let Some(map) = map {
        for (name, values) in map.iter() {
            if let Some(value) = values.first() {
                headers.insert(
                    AsRef::<str>::as_ref(name).to_owned(),
                    value.as_str().to_owned(),
                );
            }
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nak_delays_follow_the_delivery_count() {
        let delays = [Duration::from_secs(1), Duration::from_secs(5)];
        assert_eq!(nak_delay(&delays, 1), Some(Duration::from_secs(1)));
        assert_eq!(nak_delay(&delays, 2), Some(Duration::from_secs(5)));
        assert_eq!(nak_delay(&delays, 9), Some(Duration::from_secs(5)));
        assert_eq!(nak_delay(&[], 3), None);
    }

    #[test]
    fn headers_become_strings() {
        let mut map = async_nats::HeaderMap::new();
        map.insert("ce-type", "OrderPlaced");
        map.append("multi", "first");
        map.append("multi", "second");
        let headers = headers_to_strings(Some(&map));
        assert_eq!(
            headers.get("ce-type").map(String::as_str),
            Some("OrderPlaced")
        );
        assert_eq!(headers.get("multi").map(String::as_str), Some("first"));
        assert!(headers_to_strings(None).is_empty());
    }

    #[test]
    fn config_validates() {
        let config = crate::NatsConfig::new(crate::config::DEFAULT_URL);
        // `validate` itself, the transport configuration's errors included.
        assert!(
            NatsConsumerConfig::new(config.clone(), "S", "d")
                .validate()
                .is_ok()
        );
        assert!(matches!(
            NatsConsumerConfig::new(config.clone(), "S", "d")
                .with_backoff(vec![Duration::ZERO])
                .validate(),
            Err(NatsError::InvalidConfig {
                field: "backoff",
                ..
            })
        ));
        assert!(matches!(
            NatsConsumerConfig::new(config.clone().with_max_in_flight(0), "S", "d").validate(),
            Err(NatsError::InvalidConfig {
                field: "max_in_flight",
                ..
            })
        ));
        assert!(matches!(
            NatsConsumerConfig::new(crate::NatsConfig::new("amqp://h"), "S", "d").validate(),
            Err(NatsError::InvalidUrl { .. })
        ));
        let field = |b: NatsConsumerConfig| match NatsConsumer::new(b) {
            Err(NatsError::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        };
        let base = || NatsConsumerConfig::new(config.clone(), "S", "d");
        assert_eq!(
            field(NatsConsumerConfig::new(config.clone(), "", "d")),
            "stream"
        );
        assert_eq!(
            field(NatsConsumerConfig::new(config.clone(), "S", "a.b")),
            "durable"
        );
        assert_eq!(field(base().with_concurrency(0)), "concurrency");
        assert_eq!(field(base().with_ack_wait(Duration::ZERO)), "ack_wait");
        assert_eq!(field(base().with_max_deliver(Some(0))), "max_deliver");
        assert_eq!(
            field(
                base()
                    .with_max_deliver(Some(2))
                    .with_backoff(vec![Duration::from_secs(1); 2])
            ),
            "max_deliver"
        );
        assert_eq!(field(base().with_filter_subject("a..b")), "filter_subject");
        let consumer = NatsConsumer::new(
            base()
                .with_filter_subject("orders.*.placed")
                .with_max_deliver(None),
        )
        .expect("valid");
        assert_eq!(consumer.concurrency(), DEFAULT_CONCURRENCY);
        let config = consumer.consumer_config();
        assert_eq!(config.max_deliver, -1);
        assert_eq!(config.ack_policy, AckPolicy::Explicit);
        assert_eq!(config.max_ack_pending, 100);
        assert_eq!(config.filter_subject, "orders.*.placed");
    }
}

/// Property tests: no panic is reachable from a delivered message's headers. A
/// `jetstream::Message` needs a live client, so these exercise [`decode_message`], all
/// of `process` that reads the message's content.
#[cfg(test)]
mod properties {
    use super::*;
    use async_nats::{HeaderMap, HeaderName, HeaderValue};
    use outboxkit_core::proptest_support::config;
    use proptest::prelude::*;

    /// Every name a `HeaderMap` can hold (printable ASCII without ':', empty too),
    /// often one the decoder looks up, in any case.
    fn header_name() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[!-9;-~]{0,30}",
            1 => (0usize..400).prop_map(|n| "h".repeat(n)),
            3 => prop::sample::select(vec![
                "Nats-Msg-Id", "nats-msg-id", "ce-id", "CE-ID", "ce-type", "ce-source",
                "ce-subject", "ce-time", "ce-aggregatetype", "ce-aggregateversion",
                "ce-tenantid", "ce-partitionkey", "ce-correlationid", "ce-causationid",
                "traceparent", "tracestate", "Content-Type", "Nats-Expected-Stream", "",
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// Every value a `HeaderMap` can hold (anything without CR or LF), often one an
    /// attribute parses: UUIDs, integers, times, trace contexts.
    fn header_value() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[^\\r\\n]{0,40}",
            2 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
            1 => any::<i64>().prop_map(|n| n.to_string()),
            1 => "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{1,9})?Z",
            1 => "[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}",
            1 => (0usize..2000).prop_map(|n| "v".repeat(n)),
        ]
    }

    /// A header map as a delivered message may carry: several values per name too,
    /// often with a UUID id and some type, so that decoding gets past them.
    fn header_map() -> impl Strategy<Value = HeaderMap> {
        let uuid = || any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string());
        (
            prop::collection::vec((header_name(), header_value()), 0..16),
            prop::option::weighted(0.5, uuid()),
            prop::option::weighted(0.3, uuid()),
            prop::option::weighted(0.8, header_value()),
        )
            .prop_map(|(pairs, msg_id, ce_id, kind)| {
                let mut map = HeaderMap::new();
                for (name, value) in pairs {
                    let name: HeaderName = name.parse().expect("a valid header name");
                    let value: HeaderValue = value.parse().expect("a valid header value");
                    map.append(name, value);
                }
                for (name, value) in [(MSG_ID_HEADER, msg_id), ("ce-id", ce_id), ("ce-type", kind)]
                {
                    if let Some(value) = value {
                        map.insert(name, value.as_str());
                    }
                }
                map
            })
    }

    proptest! {
        #![proptest_config(config())]

        /// Guards against the consumer panicking on a delivered message's headers
        /// (anyone who may publish to the stream chooses them): any names, any values,
        /// several values per name, attributes malformed or missing, any delivery
        /// count. The first value of each header is what is decoded; `Ok` carries the
        /// `Nats-Msg-Id` or `ce-id` as its id, otherwise a `DecodeError`.
        #[test]
        fn decode_message_never_panics(
            map in prop::option::weighted(0.9, header_map()),
            payload in prop::collection::vec(any::<u8>(), 0..64),
            delivered in 1u64..=u64::MAX,
        ) {
            let (message_id, decoded) = decode_message(map.as_ref(), &payload, delivered);
            let headers = headers_to_strings(map.as_ref());
            if let Some(map) = &map {
                for (name, values) in map.iter() {
                    prop_assert_eq!(
                        headers.get(AsRef::<str>::as_ref(name)).map(String::as_str),
                        values.first().map(HeaderValue::as_str)
                    );
                }
            }
            prop_assert_eq!(&message_id, &headers.get(MSG_ID_HEADER).cloned());
            if let Ok(msg) = decoded {
                let raw_id = headers.get("ce-id").or(message_id.as_ref());
                prop_assert_eq!(raw_id.and_then(|id| uuid::Uuid::parse_str(id).ok()), Some(msg.id));
                prop_assert_eq!(Some(&msg.event_type), headers.get("ce-type"));
                prop_assert_eq!(msg.delivery_count, Some(delivered));
                prop_assert_eq!(msg.redelivered, delivered > 1);
                prop_assert_eq!(msg.payload, payload);
            }
        }
    }
}
