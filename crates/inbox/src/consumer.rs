//! [`IdempotentConsumer`]: exactly-once effects straight from broker deliveries.

use std::sync::Arc;

use async_trait::async_trait;
use outboxkit_core::consumer::{BatchDeliveryHandler, DeliveryHandler, HandlerDecision};
use outboxkit_core::inbox::{ConsumerDeadLetters, VersionTracking};
use outboxkit_core::wire::{IncomingMessage, UndecodableMessage};
use outboxkit_core::{InboxStore, OutboxError};
use tracing::{debug, error, warn};

use crate::batch::{Attempt, Item, attempt};
use crate::fault::StoreTrouble;
use crate::pipeline::{Pipeline, Step, UnlessDead, run_handler};

/// Default deliveries of one message a handler may fail before it is dead-lettered.
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;

/// The consumer name under which [`UnhandledPolicy::DeadLetter`] records a message whose
/// event type no handler subscribes to.
pub const UNHANDLED_CONSUMER: &str = "unhandled";

/// The consumer name under which the consumers record a delivery the transport could
/// not decode (another producer's message with no event type, a malformed
/// `aggregateversion`, an attribute over its length limit, a CloudEvents id that is not
/// a UUID beside a broker message id that is): a consumer dead letter holding its raw
/// headers and body, listed by `outbox inbox dead list`. Only a delivery without any
/// usable id is dropped (counted in
/// [`UNDECODABLE_TOTAL`](crate::metrics::UNDECODABLE_TOTAL)).
pub const UNDECODABLE_CONSUMER: &str = "undecodable";

/// What a consumer does with a message whose event type no handler of its pipeline
/// subscribes to (an event that arrives before its handler is deployed, a producer's
/// new event type, a misrouted message).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UnhandledPolicy {
    /// Acknowledge it and forget it (the default): logged at debug level and counted in
    /// [`UNHANDLED_TOTAL`](crate::metrics::UNHANDLED_TOTAL).
    #[default]
    Ack,
    /// Keep it: recorded as a consumer dead letter under [`UNHANDLED_CONSUMER`] (with
    /// its payload and headers, listed by `outbox inbox dead list`, replayable once a
    /// handler exists), then acknowledged. The durable inbox marks it `Dead`.
    DeadLetter,
    /// Leave it for later: the broker delivers it again (after the transport's requeue
    /// delay), as if a handler had failed, but nothing is counted against it. Use it
    /// only while a handler is about to be deployed: the message keeps coming back.
    Requeue,
}

impl UnhandledPolicy {
    /// The metric label of the policy: `ack`, `dead_letter` or `requeue`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::DeadLetter => "dead_letter",
            Self::Requeue => "requeue",
        }
    }
}

/// Settings of an [`IdempotentConsumer`]: plain data, made with
/// [`ConsumerConfig::new`] and the `with_*` setters (which never fail), read with the
/// getters named after each setting, checked by [`validate`](Self::validate), which
/// [`IdempotentConsumer::new`] calls: an invalid setting is refused where the consumer
/// is built, before any delivery is handled. The durable inbox's counterpart is
/// [`ProcessorConfig`](crate::ProcessorConfig).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerConfig {
    max_deliveries: u32,
    unhandled: UnhandledPolicy,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            max_deliveries: DEFAULT_MAX_DELIVERIES,
            unhandled: UnhandledPolicy::Ack,
        }
    }
}

impl ConsumerConfig {
    /// The defaults: [`DEFAULT_MAX_DELIVERIES`] (5) failed deliveries per handler before
    /// a consumer dead letter, [`UnhandledPolicy::Ack`].
    pub fn new() -> Self {
        Self::default()
    }

    /// What to do with a message no handler subscribes to (default
    /// [`UnhandledPolicy::Ack`]; the same setting as
    /// [`ProcessorConfig::with_unhandled`](crate::ProcessorConfig::with_unhandled)).
    #[must_use]
    pub fn with_unhandled(mut self, policy: UnhandledPolicy) -> Self {
        self.unhandled = policy;
        self
    }

    /// Failed deliveries of one message per handler before it becomes a consumer dead
    /// letter (default [`DEFAULT_MAX_DELIVERIES`], 5; 0 is refused by
    /// [`validate`](Self::validate)).
    #[must_use]
    pub fn with_max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n;
        self
    }

    /// What happens to a message no handler subscribes to
    /// ([`with_unhandled`](Self::with_unhandled)).
    pub fn unhandled(&self) -> UnhandledPolicy {
        self.unhandled
    }

    /// Failed deliveries per handler before a consumer dead letter
    /// ([`with_max_deliveries`](Self::with_max_deliveries)).
    pub fn max_deliveries(&self) -> u32 {
        self.max_deliveries
    }

    /// Checks every setting, as [`IdempotentConsumer::new`] does.
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] naming the setting: `max_deliveries` 0.
    pub fn validate(&self) -> Result<(), OutboxError> {
        if self.max_deliveries == 0 {
            return Err(OutboxError::invalid_config(
                "max_deliveries",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Plugs a [`Pipeline`] into a transport's consumer adapter (it is a
/// [`DeliveryHandler`]).
///
/// For each delivery and each subscribed handler, in order, in one transaction: claim
/// `(message_id, consumer)`; if it was already there, skip; else run the handler; commit.
/// When every handler has succeeded (or had already), the delivery is acked.
///
/// A handler failure rolls back that handler's transaction, counts one failure of
/// `(message, consumer)` and asks the broker to redeliver; the handlers that already
/// succeeded are not run again. After `max_deliveries` failures (at once for a
/// [`HandlerError::permanent`](crate::HandlerError::permanent) error) the message is
/// recorded as a consumer dead letter for that handler, the remaining handlers run,
/// and the delivery is acked, so a poison message never blocks the queue.
///
/// A handler that panics fails like one that returns an error (the panic message is
/// the error). So does a handler that returns `Ok` on a transaction it left aborted (it
/// caught a database error and went on): the store's commit reports it, and the
/// failure says so. Data of the message or the handler that the database refuses
/// ([`ErrorKind::InvalidData`](outboxkit_core::ErrorKind::InvalidData): a constraint
/// checked at commit, an aggregate key over the index's size limit) is that message's
/// failure too.
///
/// What is never the message's fault: the inbox database being down, a connection
/// refused or terminated, no pooled connection free in time, a misconfiguration (a
/// missing table, a refused permission), and a deadlock, statement timeout or
/// terminated backend inside the handler. The answer is then
/// [`HandlerDecision::Defer`]: the transport holds the delivery and tries again until
/// the database is back, spending no delivery attempt and counting no failure, however
/// long it lasts; the consumer counts each deferral in
/// [`DEFERRED_TOTAL`](crate::metrics::DEFERRED_TOTAL) and logs at error level at most
/// once a minute. Messages whose event type has no handler follow the
/// [`UnhandledPolicy`]; a delivery the transport could not decode is recorded under
/// [`UNDECODABLE_CONSUMER`]. A versioned message further past the last applied version
/// than [`Pipeline::with_max_version_jump`] allows is dead-lettered at once. Version
/// gaps are not held back in this mode (the broker decides delivery order); use the
/// durable inbox for a reorder window.
///
/// # Batch mode
///
/// It is also a [`BatchDeliveryHandler`], for a transport's batched run mode
/// (`RabbitConsumer::run_batched`, `NatsConsumer::run_batched`):
/// [`process_batch`](Self::process_batch) handles many deliveries in **one**
/// transaction, with the same guarantees: it claims every `(message, handler)` pair of
/// the batch in one statement
/// ([`claim_batch_unless_dead`](ConsumerDeadLetters::claim_batch_unless_dead)), locks
/// the aggregates' version rows in one statement (sorted, so concurrent batches do not
/// deadlock), runs the handlers in delivery order (each message's handlers in pipeline
/// order; a handler may take its messages in one call, [`Handler::handle_batch`]),
/// raises the versions in one statement and commits; then every message is acked.
/// Inside a batch a message sees the versions the messages before it left (two versions
/// of one aggregate: the second sees the first's), so the stale policy holds as in
/// per-message mode. The handlers run without savepoints: when one fails or panics, the
/// batch is rolled back, the messages before the failing one run again as a batch, the
/// failing one runs alone through the per-message path (its failure counted per
/// handler, requeued, and dead-lettered after `max_deliveries`, exactly as in
/// per-message mode), then the rest. A database error of the inbox defers the messages
/// not committed yet.
///
/// [`Handler::handle_batch`]: crate::Handler::handle_batch
pub struct IdempotentConsumer<S: InboxStore> {
    store: Arc<S>,
    pipeline: Arc<Pipeline<S>>,
    max_deliveries: u32,
    unhandled: UnhandledPolicy,
    trouble: StoreTrouble,
}

impl<S: InboxStore> std::fmt::Debug for IdempotentConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentConsumer")
            .field("pipeline", &self.pipeline)
            .field("max_deliveries", &self.max_deliveries)
            .field("unhandled", &self.unhandled)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotentConsumer<S>
where
    S: InboxStore + VersionTracking + ConsumerDeadLetters,
{
    /// A consumer running `pipeline` against `store` with `config`
    /// ([`ConsumerConfig::new`] for the defaults).
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] naming the setting, before any delivery is
    /// handled: what [`ConsumerConfig::validate`] refuses.
    pub fn new(
        store: Arc<S>,
        pipeline: Pipeline<S>,
        config: ConsumerConfig,
    ) -> Result<Self, OutboxError> {
        config.validate()?;
        Ok(Self {
            store,
            pipeline: Arc::new(pipeline),
            max_deliveries: config.max_deliveries,
            unhandled: config.unhandled,
            trouble: StoreTrouble::default(),
        })
    }

    /// Handles one message and says how to answer the broker (the
    /// [`DeliveryHandler`] entry point, callable directly too).
    pub async fn process(&self, msg: &IncomingMessage) -> HandlerDecision {
        let attempt = msg
            .delivery_count
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(1);
        let handlers = self.pipeline.handlers(&msg.event_type);
        if handlers.is_empty() {
            return self.unhandled(msg).await;
        }
        let max_jump = self.pipeline.max_version_jump();
        for reg in handlers {
            match run_handler(
                &*self.store,
                reg,
                msg,
                attempt,
                false,
                max_jump,
                &UnlessDead,
            )
            .await
            {
                Ok(
                    Step::Applied
                    | Step::AlreadyDone
                    | Step::DeadLetter
                    | Step::SkippedStale
                    | Step::Gap { .. },
                ) => {}
                Ok(Step::Failed(e)) => {
                    let max = if e.is_permanent() {
                        1
                    } else {
                        self.max_deliveries
                    };
                    let text = e.to_string();
                    match self
                        .store
                        .record_failure(msg, &reg.consumer, &text, max)
                        .await
                    {
                        Ok(count) if count.dead => {
                            crate::metrics::dead(&reg.consumer);
                            error!(id = %msg.id, consumer = %reg.consumer, attempts = count.attempts, error = %text, "handler gave up: message recorded as a consumer dead letter");
                        }
                        Ok(count) => {
                            warn!(id = %msg.id, consumer = %reg.consumer, attempts = count.attempts, error = %text, "handler failed, requeueing");
                            return HandlerDecision::Requeue;
                        }
                        // Not counted: do not spend a delivery on it either.
                        Err(db) => return self.unavailable(&db, 1),
                    }
                }
                Err(e) => return self.unavailable(&e, 1),
            }
        }
        self.trouble.ok();
        HandlerDecision::Ack
    }

    /// Handles `msgs` in one transaction (see [Batch mode](Self#batch-mode)) and says,
    /// for each in order, how to answer the broker (the [`BatchDeliveryHandler`] entry
    /// point, callable directly too). Messages no handler subscribes to follow the
    /// [`UnhandledPolicy`] one by one.
    pub async fn process_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        let mut decisions = vec![HandlerDecision::Ack; msgs.len()];
        let mut items = Vec::with_capacity(msgs.len());
        let mut positions = Vec::with_capacity(msgs.len());
        for (k, msg) in msgs.iter().enumerate() {
            let regs = self.pipeline.handlers(&msg.event_type);
            if regs.is_empty() {
                decisions[k] = self.unhandled(msg).await;
                continue;
            }
            items.push(Item {
                msg,
                regs,
                attempt: msg
                    .delivery_count
                    .and_then(|c| u32::try_from(c).ok())
                    .unwrap_or(1),
                hold_gaps: false,
                max_jump: self.pipeline.max_version_jump(),
            });
            positions.push(k);
        }
        // `failed`: an item a failed attempt named; the items before it go as a batch
        // first, then it alone. A single message goes alone at once (no batch to
        // save, and a failure is then run once, not twice).
        let (mut start, mut failed) = (0, None);
        while start < items.len() {
            let end = failed.unwrap_or(items.len());
            if end - start <= 1 {
                decisions[positions[start]] = self.process(items[start].msg).await;
                if failed == Some(start) {
                    failed = None;
                }
                start += 1;
                continue;
            }
            match attempt(&*self.store, &items[start..end], &UnlessDead).await {
                Attempt::Committed => {
                    self.trouble.ok();
                    start = end;
                }
                Attempt::Failed { item } => failed = Some(start + item),
                Attempt::Store(e) if e.kind().is_retryable() => {
                    self.trouble.deferred(&e, items.len() - start);
                    for &k in &positions[start..] {
                        decisions[k] = HandlerDecision::Defer;
                    }
                    break;
                }
                // Not an outage (a transaction a handler left aborted, data the
                // database refuses at commit, a misconfiguration), or (never here) a
                // gap: each message alone, as in per-message mode, where the message at
                // fault fails alone and a misconfiguration defers.
                other => {
                    if let Attempt::Store(e) = &other {
                        debug!(error = %e, "a batch failed on an inbox statement: handling its messages one by one");
                    }
                    for k in start..end {
                        decisions[positions[k]] = self.process(items[k].msg).await;
                    }
                    start = end;
                }
            }
        }
        decisions
    }

    async fn unhandled(&self, msg: &IncomingMessage) -> HandlerDecision {
        crate::metrics::unhandled(self.unhandled.as_str());
        match self.unhandled {
            UnhandledPolicy::Ack => {
                debug!(id = %msg.id, event_type = %msg.event_type, "no handler for this event type: acknowledged");
                HandlerDecision::Ack
            }
            UnhandledPolicy::Requeue => {
                debug!(id = %msg.id, event_type = %msg.event_type, "no handler for this event type: requeued");
                HandlerDecision::Requeue
            }
            UnhandledPolicy::DeadLetter => {
                let error = format!("no handler subscribes to event type {:?}", msg.event_type);
                match self
                    .store
                    .record_failure(msg, UNHANDLED_CONSUMER, &error, 1)
                    .await
                {
                    Ok(_) => {
                        crate::metrics::dead(UNHANDLED_CONSUMER);
                        warn!(id = %msg.id, event_type = %msg.event_type, "no handler for this event type: recorded as a consumer dead letter");
                        HandlerDecision::Ack
                    }
                    Err(e) => self.unavailable(&e, 1),
                }
            }
        }
    }

    /// Records a delivery the transport could not decode as a consumer dead letter
    /// under [`UNDECODABLE_CONSUMER`] (its raw headers and body) and acknowledges it;
    /// drops one without a usable id (counted); defers while the store fails.
    async fn undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        record_undecodable(&*self.store, msg, &self.trouble).await
    }

    /// The inbox store failed on `messages` messages: they are not at fault, so no
    /// delivery is spent on them.
    fn unavailable(&self, error: &OutboxError, messages: usize) -> HandlerDecision {
        self.trouble.deferred(error, messages);
        HandlerDecision::Defer
    }
}

/// What the consumers do with an undecodable delivery: a consumer dead letter under
/// [`UNDECODABLE_CONSUMER`] holding its raw headers and body, then `Ack`; `Reject`
/// (dropped, counted) without a usable id; `Defer` while `store` fails.
pub(crate) async fn record_undecodable<S: ConsumerDeadLetters>(
    store: &S,
    msg: &UndecodableMessage,
    trouble: &StoreTrouble,
) -> HandlerDecision {
    let Some(received) = msg.as_received() else {
        crate::metrics::undecodable("dropped");
        warn!(error = %msg.error, "undecodable delivery without a usable id dropped: there is nothing to record it under");
        return HandlerDecision::Reject;
    };
    let error = format!("undecodable delivery: {}", msg.error);
    match store
        .record_failure(&received, UNDECODABLE_CONSUMER, &error, 1)
        .await
    {
        Ok(_) => {
            trouble.ok();
            crate::metrics::undecodable("dead_letter");
            crate::metrics::dead(UNDECODABLE_CONSUMER);
            warn!(id = %received.id, error = %msg.error, "undecodable delivery recorded as a consumer dead letter");
            HandlerDecision::Ack
        }
        Err(e) => {
            trouble.deferred(&e, 1);
            HandlerDecision::Defer
        }
    }
}

#[async_trait]
impl<S> DeliveryHandler for IdempotentConsumer<S>
where
    S: InboxStore + VersionTracking + ConsumerDeadLetters,
{
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        self.process(msg).await
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        self.undecodable(msg).await
    }
}

#[async_trait]
impl<S> BatchDeliveryHandler for IdempotentConsumer<S>
where
    S: InboxStore + VersionTracking + ConsumerDeadLetters,
{
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        self.process_batch(msgs).await
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        self.undecodable(msg).await
    }
}
