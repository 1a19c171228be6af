//! [`IdempotentConsumer`]: exactly-once effects straight from broker deliveries.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_core::InboxStore;
use outbox_core::consumer::{DeliveryHandler, HandlerDecision};
use outbox_core::inbox::{ConsumerDeadLetters, VersionTracking};
use outbox_core::wire::IncomingMessage;
use tracing::{error, warn};

use crate::pipeline::{Pipeline, Step, run_handler};

/// Default deliveries of one message a handler may fail before it is dead-lettered.
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;

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
/// Database outages requeue the delivery without counting a failure. Version gaps are
/// not held back in this mode (the broker decides delivery order); use the durable
/// inbox for a reorder window.
pub struct IdempotentConsumer<S: InboxStore> {
    store: Arc<S>,
    pipeline: Arc<Pipeline<S>>,
    max_deliveries: u32,
}

impl<S: InboxStore> std::fmt::Debug for IdempotentConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentConsumer")
            .field("pipeline", &self.pipeline)
            .field("max_deliveries", &self.max_deliveries)
            .finish_non_exhaustive()
    }
}

impl<S> IdempotentConsumer<S>
where
    S: InboxStore + VersionTracking + ConsumerDeadLetters,
{
    /// A consumer running `pipeline` against `store`, with
    /// [`DEFAULT_MAX_DELIVERIES`].
    pub fn new(store: Arc<S>, pipeline: Pipeline<S>) -> Self {
        Self {
            store,
            pipeline: Arc::new(pipeline),
            max_deliveries: DEFAULT_MAX_DELIVERIES,
        }
    }

    /// Failed deliveries of one message per handler before it becomes a consumer dead
    /// letter (default 5, at least 1).
    #[must_use]
    pub fn with_max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// Handles one message and says how to answer the broker (the
    /// [`DeliveryHandler`] entry point, callable directly too).
    pub async fn process(&self, msg: &IncomingMessage) -> HandlerDecision {
        let attempt = msg
            .delivery_count
            .and_then(|c| u32::try_from(c).ok())
            .unwrap_or(1);
        for reg in self.pipeline.handlers(&msg.event_type) {
            match self.store.is_dead(msg.id, &reg.consumer).await {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    warn!(id = %msg.id, error = %e, "inbox unavailable, requeueing");
                    return HandlerDecision::Requeue;
                }
            }
            match run_handler(&*self.store, reg, msg, attempt, false).await {
                Ok(Step::Applied | Step::AlreadyDone | Step::SkippedStale | Step::Gap { .. }) => {}
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
                        Err(db) => {
                            warn!(id = %msg.id, error = %db, "could not count the failure, requeueing");
                            return HandlerDecision::Requeue;
                        }
                    }
                }
                Err(e) => {
                    warn!(id = %msg.id, consumer = %reg.consumer, error = %e, "inbox unavailable, requeueing");
                    return HandlerDecision::Requeue;
                }
            }
        }
        HandlerDecision::Ack
    }
}

#[async_trait]
impl<S> DeliveryHandler for IdempotentConsumer<S>
where
    S: InboxStore + VersionTracking + ConsumerDeadLetters,
{
    async fn handle(&self, msg: IncomingMessage) -> HandlerDecision {
        self.process(&msg).await
    }
}
