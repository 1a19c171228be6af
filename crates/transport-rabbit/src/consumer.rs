//! [`RabbitConsumer`]: consumes a queue with manual acknowledgements and hands each
//! decoded message to a [`DeliveryHandler`].
//!
//! # Contract
//!
//! - The queue is declared durable, as a replicated quorum queue by default
//!   ([`QueueType`]; unless declaring is turned off), and bound to the configured
//!   exchange with the given binding keys; `basic.qos` limits unacknowledged deliveries
//!   to the prefetch count; `basic.consume` runs with `no_ack = false` (AMQP 0-9-1
//!   manual acknowledgement, see RabbitMQ's [consumer acknowledgements]).
//! - Each delivery is decoded with [`IncomingMessage::decode`] (AMQP binding: the
//!   `message_id` property and `cloudEvents:*` headers). The broker is answered only
//!   **after** the handler returns, so a handler that commits its database transaction
//!   before returning [`HandlerDecision::Ack`] never loses a message: a crash before the
//!   ack means a redelivery, which the inbox deduplicates.
//! - A delivery that cannot be decoded (no id, an id that is not a UUID, no event type,
//!   a malformed or over-long attribute) goes to the handler's
//!   [`handle_undecodable`](DeliveryHandler::handle_undecodable) as an
//!   [`UndecodableMessage`], its raw headers and body and the id it can be recorded
//!   under; the answer is carried out like any other (the `outboxkit-inbox` crate's consumers
//!   record a consumer dead letter and answer `Ack`; the default rejects it without
//!   requeue, `basic.nack` with `requeue = false`, to the queue's dead-letter exchange
//!   if it has one). It never blocks the queue.
//! - [`HandlerDecision::Requeue`] waits the requeue delay (default 1 s,
//!   [`RabbitConsumerConfig::with_requeue_delay`]) before `basic.nack` with
//!   `requeue = true`, so a failing message does not loop at full speed (AMQP 0-9-1 has
//!   no delayed requeue of its own).
//! - [`HandlerDecision::Defer`] (the handler's database is unavailable) keeps the
//!   delivery unacknowledged and hands it to the handler again after 1 s, 2 s, ... up to
//!   15 s, until it is decided: no `basic.nack`, so nothing counts toward a quorum
//!   queue's `x-delivery-limit`, however long the outage. With every prefetched
//!   delivery waiting, the broker sends no more. The broker's own `consumer_timeout`
//!   (30 min by default) closes a channel that holds a delivery longer; the deliveries
//!   then return to the queue (a quorum queue counts that as one delivery each) and the
//!   consumer reconnects.
//! - A handler that panics is caught and logged, and the delivery requeued: it is never
//!   rejected (the `outboxkit-inbox` crate's handlers count their own panics as failures and
//!   end a message that always panics as a consumer dead letter).
//! - Deliveries are handled **concurrently**, up to the prefetch count at a time, within
//!   the task that calls [`run`](RabbitConsumer::run); the order in which handlers finish
//!   is not the delivery order.
//! - A lost connection is re-established with exponential backoff until shutdown;
//!   handlers in flight when it was lost are finished first (their acks fail and the
//!   broker redelivers those messages).
//! - On shutdown the consumer is cancelled (`basic.cancel`), in-flight handlers finish
//!   and are acknowledged, then the connection is closed; deliveries prefetched but not
//!   started are returned to the queue by the broker.
//!
//! # Batched mode
//!
//! [`RabbitConsumer::run_batched`] hands deliveries to a [`BatchDeliveryHandler`] in
//! batches instead (the `outboxkit-inbox` crate's `IdempotentConsumer` applies a batch in one
//! database transaction). Everything above holds per delivery, and:
//!
//! - A batch takes the deliveries already received, up to the batch size (default: the
//!   prefetch), and waits at most the linger (default 3 ms) after its first delivery for
//!   more. Up to `batches_in_flight` batches (default 2) are handled at once; the next
//!   one is collected meanwhile. An undecodable delivery goes to the handler's
//!   [`handle_undecodable`](BatchDeliveryHandler::handle_undecodable) alone, at once.
//! - The broker is answered per message, as soon as the handler has decided: a
//!   `Requeue` after the requeue delay, a `Defer` kept while only the deferred messages
//!   are handed to the handler again (after 1 s, 2 s, ... up to 15 s). A batch whose
//!   decisions are all `Ack` is acknowledged with **one** `basic.ack` with
//!   `multiple = true` on its highest delivery tag, but only when every delivery
//!   outstanding on the channel up to that tag belongs to the batch (another batch in
//!   flight, a delivery waiting out its requeue delay or being rejected would be
//!   acknowledged too): otherwise each delivery is acknowledged on its own.
//! - A panic of the handler requeues every delivery of the batch (never a reject).
//! - On shutdown the batches in flight finish and are answered; deliveries collected
//!   for a batch not started yet are returned to the queue by the broker.
//!
//! [consumer acknowledgements]: https://www.rabbitmq.com/docs/confirms#consumer-acknowledgements

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions};
use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use outboxkit_core::consumer::{
    BatchDeliveryHandler, DeliveryHandler, HandlerDecision, handle_until_decided, until_decided,
};
use outboxkit_core::wire::{Binding, IncomingMessage, UndecodableMessage};
use outboxkit_core::{BatchSettings, Consumer, ErrorKind, Headers, TransportKind};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::{RabbitConfig, Resolved};
use crate::connection::close_connection;
use crate::error::RabbitError;

/// Default number of unacknowledged deliveries (and concurrent handlers).
pub const DEFAULT_PREFETCH: u16 = 100;
/// Default first delay before reconnecting.
pub const DEFAULT_RECONNECT_INITIAL: Duration = Duration::from_millis(200);
/// Default longest delay between reconnection attempts.
pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(30);

/// Default wait before a delivery the handler asked to requeue is returned to the queue.
pub const DEFAULT_REQUEUE_DELAY: Duration = Duration::from_secs(1);

/// The type of the queue a [`RabbitConsumer`] declares (`x-queue-type`).
///
/// [`Quorum`](Self::Quorum), the default, is the type for data that must survive the
/// loss of a node: a queue replicated over the cluster with Raft, which confirms a
/// publish only once a majority of its replicas wrote it to disk, and moves its leader
/// to another node when one is lost (<https://www.rabbitmq.com/docs/quorum-queues>).
/// [`Classic`](Self::Classic) keeps a queue on one node only (not replicated: its node
/// lost, the queue is unavailable, or lost with the node's disk).
///
/// A quorum queue counts each return of a delivery to the queue (a `Requeue`, a
/// channel closed with unacknowledged deliveries) toward its `x-delivery-limit`, and
/// drops or dead-letters a message past it. This crate's consumers never spend a
/// delivery on an outage (`Defer` keeps the delivery, see the module docs), and the
/// `outboxkit-inbox` crate records a message that keeps failing as a consumer dead letter after
/// its own attempts; leave the delivery limit unset (RabbitMQ 3.x: unlimited) or set it
/// well above those attempts (RabbitMQ 4.0 sets 20 by default), so that the broker never
/// ends a message the inbox has not recorded. See `docs/clusters.md`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueType {
    /// A replicated quorum queue (`x-queue-type: quorum`). The default.
    #[default]
    Quorum,
    /// A classic queue on one node (`x-queue-type: classic`).
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

/// Settings of a [`RabbitConsumer`]: plain data. [`new`](Self::new) takes the transport's
/// configuration and the queue, every `with_*` setter consumes and returns the
/// configuration, getters are named after the settings, and
/// [`validate`](Self::validate) checks them all (and the transport's configuration);
/// [`RabbitConsumer::new`] calls it first.
#[derive(Debug, Clone)]
#[must_use]
pub struct RabbitConsumerConfig {
    config: RabbitConfig,
    queue: String,
    prefetch: u16,
    binding_keys: Vec<String>,
    declare_queue: bool,
    dead_letter_exchange: Option<String>,
    queue_type: QueueType,
    queue_arguments: FieldTable,
    consumer_tag: Option<String>,
    reconnect_initial: Duration,
    reconnect_max: Duration,
    requeue_delay: Duration,
    batch: BatchSettings,
}

impl RabbitConsumerConfig {
    /// A consumer of `queue` on the broker and exchange of `config`, every other
    /// setting at its default.
    pub fn new(config: RabbitConfig, queue: impl Into<String>) -> Self {
        Self {
            config,
            queue: queue.into(),
            prefetch: DEFAULT_PREFETCH,
            binding_keys: Vec::new(),
            declare_queue: true,
            dead_letter_exchange: None,
            queue_type: QueueType::Quorum,
            queue_arguments: FieldTable::default(),
            consumer_tag: None,
            reconnect_initial: DEFAULT_RECONNECT_INITIAL,
            reconnect_max: DEFAULT_RECONNECT_MAX,
            requeue_delay: DEFAULT_REQUEUE_DELAY,
            batch: BatchSettings::new(),
        }
    }

    /// Largest number of unacknowledged deliveries (`basic.qos` prefetch count), which
    /// is also the largest number of handlers running at once. At least 1. Default 100.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Adds a binding of the queue to the exchange with this topic pattern (`*` matches
    /// one word, `#` zero or more, words separated by `.`). Default: no bindings, so the
    /// queue only gets what is bound elsewhere.
    pub fn with_binding_key(mut self, key: impl Into<String>) -> Self {
        self.binding_keys.push(key.into());
        self
    }

    /// Adds several binding keys (see [`with_binding_key`](Self::with_binding_key)).
    pub fn with_binding_keys<I, K>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = K>,
        K: Into<String>,
    {
        self.binding_keys.extend(keys.into_iter().map(Into::into));
        self
    }

    /// Whether to declare the queue (durable, not exclusive, not auto-deleted) before
    /// consuming. Default `true`; with `false` the queue must exist.
    pub fn with_declare_queue(mut self, declare: bool) -> Self {
        self.declare_queue = declare;
        self
    }

    /// Declares the queue with this dead-letter exchange (`x-dead-letter-exchange`):
    /// rejected deliveries go there. Default none. Only applies when the queue is
    /// declared, and must match the arguments of an existing queue.
    pub fn with_dead_letter_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.dead_letter_exchange = Some(exchange.into());
        self
    }

    /// The type of the queue declared (`x-queue-type`). Default [`QueueType::Quorum`].
    /// Only applies when the queue is declared, and must match the type of an existing
    /// queue (RabbitMQ refuses a declaration with another type:
    /// `406 PRECONDITION_FAILED`).
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Extra `queue.declare` arguments (e.g. `x-expires`, `x-delivery-limit`). Default
    /// none. An `x-queue-type` here wins over [`with_queue_type`](Self::with_queue_type).
    pub fn with_queue_arguments(mut self, arguments: FieldTable) -> Self {
        self.queue_arguments = arguments;
        self
    }

    /// The consumer tag. Default: generated by the broker.
    pub fn with_consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = Some(tag.into());
        self
    }

    /// Reconnection backoff: the first delay and the cap of the doubling delay.
    /// Defaults 200 ms and 30 s.
    pub fn with_reconnect_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.reconnect_initial = initial;
        self.reconnect_max = max;
        self
    }

    /// How long a delivery the handler answered with [`HandlerDecision::Requeue`] waits
    /// before it is returned to the queue (`basic.nack` with `requeue = true`). AMQP
    /// 0-9-1 has no delayed requeue: without a wait, a failing message comes straight
    /// back and loops as fast as the handler fails. The wait holds one of the prefetch
    /// slots; shutdown cuts it short. Default 1 s; zero requeues at once.
    pub fn with_requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = delay;
        self
    }

    /// Batched mode ([`Consumer::run_batched`]): batch size, linger and batches in
    /// flight. The batch size is at most the prefetch (the default size). Default
    /// [`BatchSettings::new`].
    pub fn with_batch(mut self, batch: BatchSettings) -> Self {
        self.batch = batch;
        self
    }

    /// Validates the settings, the transport's configuration
    /// ([`RabbitConfig::validate`]) first.
    ///
    /// # Errors
    /// The transport configuration's [`RabbitError::InvalidUrl`] or
    /// [`RabbitError::InvalidConfig`]; [`RabbitError::InvalidConfig`] when the queue name is empty, a name, key or tag is
    /// longer than 255 bytes or contains control characters, the prefetch is 0, the
    /// backoff is zero or its initial delay exceeds its cap, or the
    /// [batch settings](BatchSettings::check) do not fit the prefetch (fields
    /// `batch_size`, `batch_linger`, `batches_in_flight`).
    pub fn validate(&self) -> Result<(), RabbitError> {
        self.config.validate()?;
        check_name("queue", &self.queue)?;
        for key in &self.binding_keys {
            check_short("binding_key", key)?;
        }
        if let Some(tag) = &self.consumer_tag {
            check_short("consumer_tag", tag)?;
        }
        if let Some(dlx) = &self.dead_letter_exchange {
            check_short("dead_letter_exchange", dlx)?;
        }
        if self.prefetch == 0 {
            return Err(RabbitError::InvalidConfig {
                field: "prefetch",
                reason: "must be at least 1 (0 would mean unlimited)".to_owned(),
            });
        }
        if self.reconnect_initial.is_zero() || self.reconnect_initial > self.reconnect_max {
            return Err(RabbitError::InvalidConfig {
                field: "reconnect_backoff",
                reason: "the initial delay must be greater than zero and at most the maximum"
                    .to_owned(),
            });
        }
        self.batch_size()?;
        Ok(())
    }

    /// The batch size resolved against the prefetch.
    fn batch_size(&self) -> Result<usize, RabbitError> {
        self.batch
            .check(usize::from(self.prefetch))
            .map_err(|e| RabbitError::InvalidConfig {
                field: e.field,
                reason: e.reason,
            })
    }

    /// The transport's configuration.
    pub fn config(&self) -> &RabbitConfig {
        &self.config
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The prefetch count (and concurrency limit).
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    /// The binding keys the queue is bound with, in order.
    pub fn binding_keys(&self) -> &[String] {
        &self.binding_keys
    }

    /// Whether the queue is declared before consuming.
    pub fn declare_queue(&self) -> bool {
        self.declare_queue
    }

    /// The dead-letter exchange the queue is declared with, if any.
    pub fn dead_letter_exchange(&self) -> Option<&str> {
        self.dead_letter_exchange.as_deref()
    }

    /// The type of the queue declared.
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The extra `queue.declare` arguments.
    pub fn queue_arguments(&self) -> &FieldTable {
        &self.queue_arguments
    }

    /// The consumer tag, if set (else the broker generates one).
    pub fn consumer_tag(&self) -> Option<&str> {
        self.consumer_tag.as_deref()
    }

    /// The reconnection backoff: the first delay and the cap.
    pub fn reconnect_backoff(&self) -> (Duration, Duration) {
        (self.reconnect_initial, self.reconnect_max)
    }

    /// How long a requeued delivery waits before it is returned to the queue.
    pub fn requeue_delay(&self) -> Duration {
        self.requeue_delay
    }

    /// The batched mode's settings.
    pub fn batch(&self) -> &BatchSettings {
        &self.batch
    }
}

impl RabbitConsumer {
    /// The consumer `config` describes. Nothing connects here: the consumer connects
    /// when it runs (or [`declare`](Self::declare)s).
    ///
    /// # Errors
    /// What [`RabbitConsumerConfig::validate`] finds, before anything else:
    /// [`RabbitError::InvalidUrl`] or [`RabbitError::InvalidConfig`] naming the setting.
    pub fn new(config: RabbitConsumerConfig) -> Result<Self, RabbitError> {
        config.validate()?;
        let batch_size = config.batch_size()?;
        let mut queue_arguments = config.queue_arguments;
        let queue_type = ShortString::from("x-queue-type");
        if !queue_arguments.inner().contains_key(&queue_type) {
            queue_arguments.insert(
                queue_type,
                AMQPValue::LongString(LongString::from(config.queue_type.as_str())),
            );
        }
        if let Some(dlx) = config.dead_letter_exchange {
            queue_arguments.insert(
                ShortString::from("x-dead-letter-exchange"),
                AMQPValue::LongString(LongString::from(dlx)),
            );
        }
        Ok(RabbitConsumer {
            config: config.config.resolve()?,
            queue: config.queue,
            prefetch: config.prefetch,
            binding_keys: config.binding_keys,
            declare_queue: config.declare_queue,
            queue_arguments,
            consumer_tag: config.consumer_tag.unwrap_or_default(),
            reconnect_initial: config.reconnect_initial,
            reconnect_max: config.reconnect_max,
            requeue_delay: config.requeue_delay,
            batch_size,
            batch: config.batch,
        })
    }
}

fn check_short(field: &'static str, value: &str) -> Result<(), RabbitError> {
    if value.len() > 255 {
        return Err(RabbitError::InvalidConfig {
            field,
            reason: format!("is {} bytes long, AMQP allows at most 255", value.len()),
        });
    }
    if value.chars().any(char::is_control) {
        return Err(RabbitError::InvalidConfig {
            field,
            reason: "contains a control character".to_owned(),
        });
    }
    Ok(())
}

fn check_name(field: &'static str, value: &str) -> Result<(), RabbitError> {
    if value.is_empty() {
        return Err(RabbitError::InvalidConfig {
            field,
            reason: "must not be empty".to_owned(),
        });
    }
    check_short(field, value)
}

/// Consumes one queue and answers the broker with what a [`DeliveryHandler`] decides.
/// See the [module docs](self) for the contract.
///
/// ```no_run
/// use async_trait::async_trait;
/// use outboxkit_core::wire::IncomingMessage;
/// use tokio_util::sync::CancellationToken;
/// use outboxkit_rabbit::{
///     Consumer as _, DeliveryHandler, HandlerDecision, RabbitConfig, RabbitConsumer,
///     RabbitConsumerConfig,
/// };
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
/// # async fn run() -> Result<(), outboxkit_rabbit::RabbitError> {
/// let config = RabbitConfig::from_env()?;
/// let consumer = RabbitConsumer::new(
///     RabbitConsumerConfig::new(config, "projection.orders")
///         .with_binding_key("Order*")
///         .with_prefetch(50),
/// )?;
/// let shutdown = CancellationToken::new();
/// consumer.run(Projection, shutdown).await
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RabbitConsumer {
    pub(crate) config: Resolved,
    pub(crate) queue: String,
    pub(crate) prefetch: u16,
    pub(crate) binding_keys: Vec<String>,
    pub(crate) declare_queue: bool,
    pub(crate) queue_arguments: FieldTable,
    consumer_tag: String,
    reconnect_initial: Duration,
    reconnect_max: Duration,
    pub(crate) requeue_delay: Duration,
    pub(crate) batch_size: usize,
    /// Batched mode's linger and batches in flight (`batch_size` is its size resolved
    /// against the window).
    pub(crate) batch: BatchSettings,
}

#[async_trait]
impl Consumer for RabbitConsumer {
    type Error = RabbitError;

    fn kind(&self) -> TransportKind {
        TransportKind::Rabbit
    }

    async fn declare(&self) -> Result<(), RabbitError> {
        RabbitConsumer::declare(self).await
    }

    /// Consumes until `shutdown` is cancelled, reconnecting with backoff after a lost
    /// connection.
    ///
    /// # Errors
    /// Only errors retrying cannot fix, at any (re)connection: bad credentials or
    /// permissions (`403 ACCESS_REFUSED`), an unknown virtual host, a queue or exchange
    /// declared with other arguments (`406 PRECONDITION_FAILED`). Returns `Ok(())` after
    /// a graceful shutdown.
    async fn run<H: DeliveryHandler>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), Self::Error> {
        self.keep_consuming(&shutdown, || self.consume_once(&handler, &shutdown))
            .await
    }

    /// Consumes until `shutdown` is cancelled like [`run`](Self::run), but hands the
    /// deliveries to `handler` in batches (see the [module docs](self#batched-mode)):
    /// up to the [batch size](BatchSettings::with_size) deliveries, taken as they come
    /// and for at most the [linger](BatchSettings::with_linger) after the first, with up
    /// to [that many](BatchSettings::with_in_flight) batches handled at once (set with
    /// [`RabbitConsumerConfig::with_batch`]); a batch whose decisions are all `Ack` is acknowledged with one
    /// `basic.ack` (`multiple = true`) when that acknowledges nothing else.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    async fn run_batched<H: BatchDeliveryHandler>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), Self::Error> {
        self.keep_consuming(&shutdown, || {
            crate::batch::consume_batched_once(self, &handler, &shutdown)
        })
        .await
    }
}

impl RabbitConsumer {
    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The prefetch count (and concurrency limit).
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    /// The largest batch of [`run_batched`](Self::run_batched), in deliveries.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Runs `once` (one connection's worth of consuming, which says whether it got as
    /// far as consuming) until it ends with a shutdown or a permanent error,
    /// reconnecting with backoff in between.
    async fn keep_consuming<F, Fut>(
        &self,
        shutdown: &CancellationToken,
        mut once: F,
    ) -> Result<(), RabbitError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = (bool, Result<(), RabbitError>)>,
    {
        let mut delay = self.reconnect_initial;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let (established, result) = once().await;
            match result {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Permanent => {
                    error!(queue = %self.queue, error = %e, "RabbitMQ consumer stopped: retrying cannot help");
                    return Err(e);
                }
                Err(e) => {
                    if established {
                        delay = self.reconnect_initial;
                    }
                    warn!(
                        queue = %self.queue,
                        error = %e,
                        retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        "RabbitMQ consumer disconnected, reconnecting"
                    );
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(self.reconnect_max);
                }
            }
        }
    }

    /// Connects, declares, sets the prefetch and starts consuming.
    pub(crate) async fn open(&self) -> Result<Session, RabbitError> {
        let connection = self.connect().await?;
        let setup = self
            .with_timeout(async {
                let channel = self.setup(&connection).await?;
                let consumer = channel
                    .basic_consume(
                        ShortString::from(self.queue.as_str()),
                        ShortString::from(self.consumer_tag.as_str()),
                        BasicConsumeOptions {
                            no_ack: false,
                            ..BasicConsumeOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|source| RabbitError::Consume {
                        queue: self.queue.clone(),
                        reason: "basic.consume failed".to_owned(),
                        source: Some(Box::new(source)),
                    })?;
                Ok((channel, consumer))
            })
            .await;
        match setup {
            Ok((channel, consumer)) => {
                info!(
                    queue = %self.queue,
                    consumer_tag = %consumer.tag(),
                    prefetch = self.prefetch,
                    "consuming from RabbitMQ"
                );
                Ok(Session {
                    connection,
                    channel,
                    consumer,
                })
            }
            Err(e) => {
                close_connection(&connection, self.config.connect_timeout()).await;
                Err(e)
            }
        }
    }

    /// Stops new deliveries (`basic.cancel`); prefetched ones not yet started are
    /// requeued by the broker when the channel closes.
    pub(crate) async fn cancel(&self, session: &Session) {
        let cancel = session
            .channel
            .basic_cancel(session.consumer.tag(), BasicCancelOptions::default());
        if let Ok(Err(e)) = timeout(self.config.connect_timeout(), cancel).await {
            debug!(error = %e, "basic.cancel failed");
        }
    }

    /// Closes the channel and the connection.
    pub(crate) async fn close(&self, session: Session, shutdown: bool) {
        let Session {
            connection,
            channel,
            consumer,
        } = session;
        drop(consumer);
        if channel.status().connected() {
            let _ = timeout(
                self.config.connect_timeout(),
                channel.close(200, "consumer stopped".into()),
            )
            .await;
        }
        close_connection(&connection, self.config.connect_timeout()).await;
        if shutdown {
            info!(queue = %self.queue, "RabbitMQ consumer shut down");
        }
    }

    /// The error of a delivery stream that failed or ended.
    pub(crate) fn stream_error(&self, failed: Option<lapin::Error>) -> RabbitError {
        match failed {
            Some(source) => RabbitError::Consume {
                queue: self.queue.clone(),
                reason: "the delivery stream failed".to_owned(),
                source: Some(Box::new(source)),
            },
            None => RabbitError::Consume {
                queue: self.queue.clone(),
                reason: "the consumer was cancelled (queue deleted, or the channel closed)"
                    .to_owned(),
                source: None,
            },
        }
    }

    /// One connection's worth of consuming, a handler per delivery. `Ok(())` means
    /// shutdown; the `bool` whether consuming started.
    async fn consume_once<H: DeliveryHandler>(
        &self,
        handler: &H,
        shutdown: &CancellationToken,
    ) -> (bool, Result<(), RabbitError>) {
        let mut session = match self.open().await {
            Ok(session) => session,
            Err(e) => return (false, Err(e)),
        };
        let limit = usize::from(self.prefetch);
        let mut in_flight = FuturesUnordered::new();
        let ended = loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(()),
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                next = session.consumer.next(), if in_flight.len() < limit => match next {
                    Some(Ok(delivery)) => in_flight.push(process(handler, delivery, self.requeue_delay, self.config.connect_timeout(), shutdown)),
                    Some(Err(source)) => break Err(self.stream_error(Some(source))),
                    None => break Err(self.stream_error(None)),
                },
            }
        };
        if ended.is_ok() {
            self.cancel(&session).await;
        }
        let draining = in_flight.len();
        if draining > 0 {
            debug!(in_flight = draining, "waiting for in-flight handlers");
        }
        while in_flight.next().await.is_some() {}
        self.close(session, ended.is_ok()).await;
        (true, ended)
    }
}

/// One consuming channel: its connection, the channel and the consumer on it.
pub(crate) struct Session {
    connection: Connection,
    channel: Channel,
    pub(crate) consumer: lapin::Consumer,
}

/// Decodes, handles and answers one delivery. Never panics, never returns an error:
/// failures are logged and the broker redelivers what was not acknowledged.
/// A requeue waits `requeue_delay` first (cut short by `shutdown`).
async fn process<H: DeliveryHandler>(
    handler: &H,
    delivery: Delivery,
    requeue_delay: Duration,
    answer_timeout: Duration,
    shutdown: &CancellationToken,
) {
    let Delivery {
        delivery_tag,
        redelivered,
        properties,
        data,
        acker,
        ..
    } = delivery;
    let message_id = properties.message_id().as_ref().map(ShortString::as_str);
    // An unacknowledged delivery stays ours: nothing to do to keep it while the
    // handler defers.
    let decision = match decode_delivery(&properties, data, redelivered) {
        Ok(msg) => handle_until_decided(handler, &msg, shutdown, || async {}).await,
        Err(undecodable) => {
            debug!(
                delivery_tag,
                message_id = message_id.unwrap_or(""),
                error = %undecodable.error,
                "undecodable delivery handed to the handler"
            );
            until_decided(
                undecodable.id,
                || handler.handle_undecodable(&undecodable),
                shutdown,
                || async {},
            )
            .await
        }
    };
    if decision == HandlerDecision::Requeue && !requeue_delay.is_zero() {
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(requeue_delay) => {}
        }
    }
    if let Err(e) = answer(&acker, decision, answer_timeout).await {
        warn!(delivery_tag, ?decision, error = %e, "could not answer the broker; it will redeliver");
    }
}

/// Answers one delivery as `decision` says (`Ack` → `basic.ack`; `Requeue` and a
/// `Defer` still pending at shutdown → `basic.nack` with requeue; `Reject` →
/// `basic.nack` without), giving up after `limit`: an answer on a connection that
/// died meanwhile must not hold the consumer (the broker redelivers what was not
/// answered).
pub(crate) async fn answer(
    acker: &lapin::Acker,
    decision: HandlerDecision,
    limit: Duration,
) -> Result<(), String> {
    let answering = async {
        match decision {
            HandlerDecision::Ack => acker.ack(BasicAckOptions::default()).await,
            HandlerDecision::Requeue | HandlerDecision::Defer => {
                acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await
            }
            HandlerDecision::Reject => {
                acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: false,
                    })
                    .await
            }
        }
    };
    match timeout(limit, answering).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer from the channel within {limit:?}")),
    }
}

/// Decodes a delivery's properties and body (AMQP binding: the `message_id` property
/// and `cloudEvents:*` headers). Pure (a lapin `Delivery` holds an `Acker` only lapin
/// can make), so that it can be tested with arbitrary properties.
pub(crate) fn decode_delivery(
    properties: &BasicProperties,
    data: Vec<u8>,
    redelivered: bool,
) -> Result<IncomingMessage, Box<UndecodableMessage>> {
    IncomingMessage::decode(
        Binding::Amqp,
        properties.message_id().as_ref().map(ShortString::as_str),
        headers_to_strings(properties.headers().as_ref()),
        data,
        redelivered,
        None,
    )
}

/// AMQP headers as strings: strings as they are (long strings decoded as UTF-8,
/// lossily), numbers, booleans and timestamps as decimal text, byte arrays when they are
/// UTF-8. Nested tables, arrays and void values are left out.
pub fn headers_to_strings(table: Option<&FieldTable>) -> Headers {
    let mut headers = Headers::new();
    if let Some(table) = table {
        for (name, value) in table.inner() {
            if let Some(text) = value_to_string(value) {
                headers.insert(name.as_str().to_owned(), text);
            }
        }
    }
    headers
}

fn value_to_string(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        AMQPValue::DecimalValue(d) => decimal_text(*d),
        AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).ok()?.to_owned(),
        AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) | AMQPValue::Void => return None,
    })
}

/// An AMQP decimal (`value` × 10^-`scale`) as text, e.g. 12345 with scale 2 → `123.45`.
fn decimal_text(d: DecimalValue) -> String {
    let digits = d.value.to_string();
    let scale = usize::from(d.scale);
    if scale == 0 {
        return digits;
    }
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{int}.{frac}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::ByteArray;

    #[test]
    fn header_values_become_text() {
        let mut table = FieldTable::default();
        table.insert("a".into(), AMQPValue::LongString("x".into()));
        table.insert("b".into(), AMQPValue::ShortString("y".into()));
        table.insert("c".into(), AMQPValue::LongLongInt(-42));
        table.insert("d".into(), AMQPValue::ShortUInt(7));
        table.insert("e".into(), AMQPValue::Boolean(true));
        table.insert("f".into(), AMQPValue::Timestamp(1_700_000_000));
        table.insert(
            "g".into(),
            AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 5 }),
        );
        table.insert("h".into(), AMQPValue::FieldTable(FieldTable::default()));
        table.insert("i".into(), AMQPValue::Void);
        table.insert(
            "j".into(),
            AMQPValue::ByteArray(ByteArray::from(vec![b'o', b'k'])),
        );
        let headers = headers_to_strings(Some(&table));
        assert_eq!(headers.get("a").map(String::as_str), Some("x"));
        assert_eq!(headers.get("b").map(String::as_str), Some("y"));
        assert_eq!(headers.get("c").map(String::as_str), Some("-42"));
        assert_eq!(headers.get("d").map(String::as_str), Some("7"));
        assert_eq!(headers.get("e").map(String::as_str), Some("true"));
        assert_eq!(headers.get("f").map(String::as_str), Some("1700000000"));
        assert_eq!(headers.get("g").map(String::as_str), Some("0.05"));
        assert_eq!(headers.get("j").map(String::as_str), Some("ok"));
        assert!(!headers.contains_key("h"));
        assert!(!headers.contains_key("i"));
        assert!(headers_to_strings(None).is_empty());
    }

    #[test]
    fn decimals() {
        assert_eq!(
            decimal_text(DecimalValue {
                scale: 0,
                value: 12
            }),
            "12"
        );
        assert_eq!(
            decimal_text(DecimalValue {
                scale: 2,
                value: 12345
            }),
            "123.45"
        );
        assert_eq!(decimal_text(DecimalValue { scale: 3, value: 7 }), "0.007");
    }

    #[test]
    fn config_validates() {
        let config = crate::RabbitConfig::new(crate::config::DEFAULT_URL);
        // `validate` itself, the transport configuration's errors included.
        assert!(
            RabbitConsumerConfig::new(config.clone(), "q")
                .validate()
                .is_ok()
        );
        assert!(matches!(
            RabbitConsumerConfig::new(config.clone(), "q")
                .with_reconnect_backoff(Duration::from_secs(2), Duration::from_secs(1))
                .validate(),
            Err(RabbitError::InvalidConfig {
                field: "reconnect_backoff",
                ..
            })
        ));
        assert!(matches!(
            RabbitConsumerConfig::new(config.clone().with_exchange(""), "q").validate(),
            Err(RabbitError::InvalidConfig {
                field: "exchange",
                ..
            })
        ));
        assert!(matches!(
            RabbitConsumerConfig::new(crate::RabbitConfig::new("http://u:p@h/"), "q").validate(),
            Err(RabbitError::InvalidUrl { .. })
        ));
        let field = |b: RabbitConsumerConfig| match RabbitConsumer::new(b) {
            Err(RabbitError::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        };
        assert_eq!(
            field(RabbitConsumerConfig::new(config.clone(), "")),
            "queue"
        );
        assert_eq!(
            field(RabbitConsumerConfig::new(config.clone(), "q").with_prefetch(0)),
            "prefetch"
        );
        assert_eq!(
            field(RabbitConsumerConfig::new(config.clone(), "q").with_binding_key("k".repeat(256))),
            "binding_key"
        );
        let consumer = RabbitConsumer::new(
            RabbitConsumerConfig::new(config, "q").with_binding_keys(["a.*", "b.#"]),
        )
        .expect("valid");
        assert_eq!(consumer.prefetch(), DEFAULT_PREFETCH);
        assert_eq!(consumer.queue(), "q");
    }
}

/// Property tests: no panic is reachable from a delivery's properties. A lapin
/// `Delivery` cannot be built outside lapin (its `Acker`), so these exercise
/// [`decode_delivery`], all of `process` that reads the delivery's content.
#[cfg(test)]
mod properties {
    use super::*;
    use lapin::types::{ByteArray, FieldArray};
    use outboxkit_core::proptest_support::{config, text};
    use proptest::prelude::*;

    /// An AMQP short string: any text of at most 255 bytes.
    fn short(max_chars: usize) -> impl Strategy<Value = ShortString> {
        text(max_chars).prop_map(|mut s| {
            while s.len() > 255 {
                s.pop();
            }
            ShortString::try_new(s).expect("at most 255 bytes")
        })
    }

    /// Texts an attribute parses (UUIDs, integers, times, trace contexts) or not.
    fn attribute_text() -> impl Strategy<Value = String> {
        prop_oneof![
            2 => text(40),
            2 => any::<u128>().prop_map(|n| uuid::Uuid::from_u128(n).to_string()),
            1 => any::<i64>().prop_map(|n| n.to_string()),
            1 => "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{1,9})?Z",
            1 => "[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}",
        ]
    }

    /// Any AMQP field value: every scalar type (NaN and infinities, any decimal
    /// scale), short and long strings, long strings and byte arrays of arbitrary
    /// (non-UTF-8) bytes, void, and arrays and tables nested 3 deep.
    fn amqp_value() -> impl Strategy<Value = AMQPValue> {
        let leaf = prop_oneof![
            any::<bool>().prop_map(AMQPValue::Boolean),
            any::<i8>().prop_map(AMQPValue::ShortShortInt),
            any::<u8>().prop_map(AMQPValue::ShortShortUInt),
            any::<i16>().prop_map(AMQPValue::ShortInt),
            any::<u16>().prop_map(AMQPValue::ShortUInt),
            any::<i32>().prop_map(AMQPValue::LongInt),
            any::<u32>().prop_map(AMQPValue::LongUInt),
            any::<i64>().prop_map(AMQPValue::LongLongInt),
            any::<f32>().prop_map(AMQPValue::Float),
            any::<f64>().prop_map(AMQPValue::Double),
            (any::<u8>(), any::<u32>())
                .prop_map(|(scale, value)| AMQPValue::DecimalValue(DecimalValue { scale, value })),
            any::<u64>().prop_map(AMQPValue::Timestamp),
            short(60).prop_map(AMQPValue::ShortString),
            attribute_text().prop_map(|s| AMQPValue::LongString(LongString::from(s))),
            prop::collection::vec(any::<u8>(), 0..64)
                .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
            attribute_text().prop_map(|s| AMQPValue::ByteArray(ByteArray::from(s.into_bytes()))),
            prop::collection::vec(any::<u8>(), 0..64)
                .prop_map(|b| AMQPValue::ByteArray(ByteArray::from(b))),
            Just(AMQPValue::Void),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6)
                    .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
                prop::collection::btree_map(short(20), inner, 0..6)
                    .prop_map(|m| AMQPValue::FieldTable(FieldTable::from(m))),
            ]
        })
    }

    /// Header names: any short string, near the 255-byte limit, or an attribute.
    fn header_name() -> impl Strategy<Value = ShortString> {
        prop_oneof![
            2 => short(40),
            1 => (0usize..=255).prop_map(|n| ShortString::try_new("h".repeat(n)).expect("short")),
            3 => prop::sample::select(vec![
                "cloudEvents:id", "cloudEvents:type", "cloudEvents:source",
                "cloudEvents:subject", "cloudEvents:time", "cloudEvents:aggregatetype",
                "cloudEvents:aggregateversion", "cloudEvents:tenantid",
                "cloudEvents:partitionkey", "cloudEvents:correlationid",
                "cloudEvents:causationid", "traceparent", "tracestate", "",
            ])
            .prop_map(ShortString::from),
        ]
    }

    /// A UUID as any of the AMQP types a string can travel as.
    fn uuid_value() -> impl Strategy<Value = AMQPValue> {
        (any::<u128>(), 0..3).prop_map(|(n, kind)| {
            let id = uuid::Uuid::from_u128(n).to_string();
            match kind {
                0 => AMQPValue::LongString(LongString::from(id)),
                1 => AMQPValue::ShortString(ShortString::from(id)),
                _ => AMQPValue::ByteArray(ByteArray::from(id.into_bytes())),
            }
        })
    }

    /// Delivery properties: arbitrary headers (often with a UUID id and some type, so
    /// that decoding gets past them), with or without a `message_id`.
    fn properties() -> impl Strategy<Value = BasicProperties> {
        (
            prop::option::weighted(
                0.9,
                prop::collection::btree_map(header_name(), amqp_value(), 0..12),
            ),
            prop::option::weighted(0.7, uuid_value()),
            prop::option::weighted(
                0.8,
                prop_oneof![
                    2 => text(30).prop_map(|s| AMQPValue::LongString(LongString::from(s))),
                    1 => amqp_value(),
                ],
            ),
            prop::option::of(prop_oneof![
                short(40),
                any::<u128>().prop_map(|n| ShortString::from(uuid::Uuid::from_u128(n).to_string())),
            ]),
        )
            .prop_map(|(headers, id, kind, message_id)| {
                let mut properties = BasicProperties::default();
                if let Some(mut headers) = headers {
                    if let Some(id) = id {
                        headers.insert(ShortString::from("cloudEvents:id"), id);
                    }
                    if let Some(kind) = kind {
                        headers.insert(ShortString::from("cloudEvents:type"), kind);
                    }
                    properties = properties.with_headers(FieldTable::from(headers));
                }
                if let Some(id) = message_id {
                    properties = properties.with_message_id(id);
                }
                properties
            })
    }

    proptest! {
        #![proptest_config(config())]

        /// Guards against the consumer panicking on a delivery's properties (anyone
        /// who may publish to the exchange chooses them): any header names, values of
        /// every AMQP type (non-UTF-8 strings and byte arrays, NaN, decimals of any
        /// scale, nested arrays and tables, void), attributes of the wrong type,
        /// malformed or missing, with or without a `message_id`. Scalars and UTF-8 byte
        /// arrays become headers, arrays, tables, void and other byte arrays are left
        /// out; `Ok` carries the `cloudEvents:id` or `message_id` as its id.
        #[test]
        fn decode_delivery_never_panics(
            properties in properties(),
            data in prop::collection::vec(any::<u8>(), 0..64),
            redelivered in any::<bool>(),
        ) {
            let decoded = decode_delivery(&properties, data.clone(), redelivered);
            let headers = headers_to_strings(properties.headers().as_ref());
            if let Some(table) = properties.headers() {
                for (name, value) in table.inner() {
                    let kept = match value {
                        AMQPValue::FieldArray(_)
                        | AMQPValue::FieldTable(_)
                        | AMQPValue::Void => false,
                        AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).is_ok(),
                        _ => true,
                    };
                    prop_assert_eq!(headers.contains_key(name.as_str()), kept, "{:?}", value);
                }
            }
            if let Ok(msg) = decoded {
                let raw_id = headers.get("cloudEvents:id").map(String::as_str).or_else(|| {
                    properties.message_id().as_ref().map(ShortString::as_str)
                });
                prop_assert_eq!(raw_id.and_then(|id| uuid::Uuid::parse_str(id).ok()), Some(msg.id));
                prop_assert_eq!(Some(&msg.event_type), headers.get("cloudEvents:type"));
                prop_assert_eq!(msg.redelivered, redelivered);
                prop_assert_eq!(msg.payload, data);
            }
        }

        /// Guards `decimal_text` (it pads and splits at `len - scale`) against any
        /// scale, 0 to 255, and any value: the text has `scale` digits after the point
        /// and reads back as the value.
        #[test]
        fn decimals_never_panic(scale in any::<u8>(), value in any::<u32>()) {
            let text = decimal_text(DecimalValue { scale, value });
            match text.split_once('.') {
                None => prop_assert_eq!(scale, 0),
                Some((int, frac)) => {
                    prop_assert_eq!(frac.len(), usize::from(scale));
                    prop_assert!(!int.is_empty());
                }
            }
            let digits = text.replace('.', "");
            prop_assert_eq!(digits.parse::<u128>().ok(), Some(u128::from(value)));
        }
    }
}
