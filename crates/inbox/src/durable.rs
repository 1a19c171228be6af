//! The durable inbox: [`DurableReceiver`] stores deliveries and acks them at once;
//! [`InboxProcessor`] claims stored messages with fenced leases and runs the pipeline
//! with its own backoff, attempts, dead state and reorder window.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::consumer::{BatchDeliveryHandler, DeliveryHandler, HandlerDecision};
use outboxkit_core::inbox::{
    ConsumerDeadLetters, DurableInbox, InboxCompletion, InboxOutcome, StoredMessage,
    VersionTracking,
};
use outboxkit_core::wire::{IncomingMessage, UndecodableMessage};
use outboxkit_core::{ErrorKind, InboxStore, OutboxError, RetryPolicies};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::batch::{Attempt, Gap, Item, attempt};
use crate::consumer::{
    UNDECODABLE_CONSUMER, UNHANDLED_CONSUMER, UnhandledPolicy, record_undecodable,
};
use crate::fault::StoreTrouble;
use crate::pipeline::{Pipeline, Plain, Step, run_handler};

/// Stores each delivery in the durable inbox (`ON CONFLICT DO NOTHING` on its id) and
/// acks it; a store failure defers the delivery ([`HandlerDecision::Defer`]: the
/// transport holds it and tries again, spending no delivery attempt), counted in
/// [`DEFERRED_TOTAL`](crate::metrics::DEFERRED_TOTAL) and logged at error level at most
/// once a minute. A delivery the database refuses to store for its own data
/// ([`ErrorKind::InvalidData`](outboxkit_core::ErrorKind::InvalidData); stores should
/// take any decodable message, so this is a store's shortfall) and a delivery the
/// transport could not decode are recorded as consumer dead letters under
/// [`UNDECODABLE_CONSUMER`] with their raw headers and body, then acked. Plug it into a
/// transport consumer.
///
/// It is also a [`BatchDeliveryHandler`] for a transport's batched run mode: a batch is
/// stored with one statement ([`DurableInbox::store_batch`]) and acked. An outage of
/// the store defers the whole batch; any other error of the batch statement (a message
/// the database refuses) makes the receiver store the batch's messages one by one, so
/// that only that message is set aside, as in per-message mode.
#[derive(Debug)]
pub struct DurableReceiver<S> {
    store: Arc<S>,
    trouble: StoreTrouble,
}

impl<S: DurableInbox + ConsumerDeadLetters> DurableReceiver<S> {
    /// A receiver writing into `store`.
    pub fn new(store: Arc<S>) -> Self {
        Self {
            store,
            trouble: StoreTrouble::default(),
        }
    }
}

#[async_trait]
impl<S: DurableInbox + ConsumerDeadLetters> DeliveryHandler for DurableReceiver<S> {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        match self.store.store(msg).await {
            Ok(new) => {
                self.trouble.ok();
                if !new {
                    debug!(id = %msg.id, "duplicate delivery: already in the durable inbox");
                }
                HandlerDecision::Ack
            }
            Err(e) if e.kind() == ErrorKind::InvalidData => {
                let error = format!("the durable inbox could not store the delivery: {e}");
                match self
                    .store
                    .record_failure(msg, UNDECODABLE_CONSUMER, &error, 1)
                    .await
                {
                    Ok(_) => {
                        crate::metrics::dead(UNDECODABLE_CONSUMER);
                        error!(id = %msg.id, error = %e, "the durable inbox could not store a delivery: recorded as a consumer dead letter");
                        HandlerDecision::Ack
                    }
                    Err(e) => {
                        self.trouble.deferred(&e, 1);
                        HandlerDecision::Defer
                    }
                }
            }
            // The message is not at fault: hold it until the database is back.
            Err(e) => {
                self.trouble.deferred(&e, 1);
                HandlerDecision::Defer
            }
        }
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        record_undecodable(&*self.store, msg, &self.trouble).await
    }
}

#[async_trait]
impl<S: DurableInbox + ConsumerDeadLetters> BatchDeliveryHandler for DurableReceiver<S> {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        match self.store.store_batch(msgs).await {
            Ok(new) => {
                self.trouble.ok();
                let duplicates = new.iter().filter(|n| !**n).count();
                if duplicates > 0 {
                    debug!(
                        duplicates,
                        "duplicate deliveries: already in the durable inbox"
                    );
                }
                vec![HandlerDecision::Ack; msgs.len()]
            }
            Err(e) if e.kind().is_retryable() => {
                self.trouble.deferred(&e, msgs.len());
                vec![HandlerDecision::Defer; msgs.len()]
            }
            Err(e) => {
                warn!(messages = msgs.len(), error = %e, "the database refused the batch: storing its messages one by one");
                let mut decisions = Vec::with_capacity(msgs.len());
                for msg in msgs {
                    decisions.push(self.handle(msg).await);
                }
                decisions
            }
        }
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        record_undecodable(&*self.store, msg, &self.trouble).await
    }
}

/// What to do with a message still missing its predecessor when the reorder window
/// has passed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GapPolicy {
    /// Process it anyway (the late predecessor will then be stale) (default).
    #[default]
    ProcessAnyway,
    /// Dead-letter it.
    DeadLetter,
}

/// Settings of an [`InboxProcessor`]: plain data, made with
/// [`ProcessorConfig::new`] and the `with_*` setters (which never fail), read with the
/// getters named after each setting, checked by [`validate`](Self::validate), which
/// [`InboxProcessor::new`] calls: an invalid setting is refused where the processor is
/// built, before anything runs.
#[derive(Debug, Clone)]
pub struct ProcessorConfig {
    batch_size: usize,
    lease: Duration,
    poll_interval: Duration,
    retry: RetryPolicies,
    reorder_window: Duration,
    gap_recheck: Duration,
    gap_policy: GapPolicy,
    unhandled: UnhandledPolicy,
    batch_transactions: bool,
}

/// How long a message no handler subscribes to waits before it is tried again under
/// [`UnhandledPolicy::Requeue`] (no attempt is counted).
const UNHANDLED_RECHECK: Duration = Duration::from_secs(30);

impl Default for ProcessorConfig {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            retry: RetryPolicies::default(),
            reorder_window: Duration::from_secs(180),
            gap_recheck: Duration::from_secs(1),
            gap_policy: GapPolicy::ProcessAnyway,
            unhandled: UnhandledPolicy::Ack,
            batch_transactions: true,
        }
    }
}

impl ProcessorConfig {
    /// Defaults: batches of 100 messages, 30 s lease, 500 ms poll interval, the default
    /// [`RetryPolicy`](outboxkit_core::RetryPolicy) (base 3 s, cap 300 s, 8 attempts), a 3-minute reorder window
    /// rechecked every second, [`GapPolicy::ProcessAnyway`], one transaction per batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Messages per claim (default 100; 0 is refused by [`validate`](Self::validate)).
    #[must_use]
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Claim lease (default 30 s; 0 is refused by [`validate`](Self::validate)); must
    /// exceed the slowest batch.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Wait after a batch that was not full (default 500 ms).
    #[must_use]
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Backoff and attempts for failing handlers, by the message's event type (default
    /// [`RetryPolicies::default`]: [`RetryPolicy::default`](outboxkit_core::RetryPolicy::default) for every event type). A
    /// single [`RetryPolicy`](outboxkit_core::RetryPolicy) is accepted too, for every event type
    /// (`From<RetryPolicy> for RetryPolicies`): the same shape as the dispatcher's and
    /// the WAL relay's `with_retry`.
    #[must_use]
    pub fn with_retry(mut self, retry: impl Into<RetryPolicies>) -> Self {
        self.retry = retry.into();
        self
    }

    /// How long a message ahead of a version gap waits for its predecessor, counted
    /// from when it was stored (default 180 s), and how often it is rechecked
    /// (default 1 s).
    #[must_use]
    pub fn with_reorder_window(mut self, window: Duration, recheck: Duration) -> Self {
        self.reorder_window = window;
        self.gap_recheck = recheck;
        self
    }

    /// What happens to a stored message no handler subscribes to (default
    /// [`UnhandledPolicy::Ack`]: marked done; `DeadLetter`: `Dead` with a `last_error`
    /// naming its event type; `Requeue`: tried again every 30 s without counting an
    /// attempt).
    #[must_use]
    pub fn with_unhandled(mut self, policy: UnhandledPolicy) -> Self {
        self.unhandled = policy;
        self
    }

    /// Whether a claimed batch is processed in one transaction (default `true`) or each
    /// message and handler in its own (`false`, as before batching). Outcomes,
    /// attempts, dead letters, version order and gaps are the same either way; one
    /// transaction per batch sends a few statements per batch instead of 4 to 6 per
    /// message and handler, but a failing handler makes the others of its batch run
    /// again (the batch is rolled back, run again without the failing message, which
    /// then runs alone), and version rows stay locked until the batch commits.
    #[must_use]
    pub fn with_batch_transactions(mut self, on: bool) -> Self {
        self.batch_transactions = on;
        self
    }

    /// What happens when the reorder window has passed (default
    /// [`GapPolicy::ProcessAnyway`]).
    #[must_use]
    pub fn with_gap_policy(mut self, policy: GapPolicy) -> Self {
        self.gap_policy = policy;
        self
    }

    /// Messages per claim ([`with_batch_size`](Self::with_batch_size)).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The claim lease ([`with_lease`](Self::with_lease)).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The wait after a batch that was not full
    /// ([`with_poll_interval`](Self::with_poll_interval)).
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// The retry policies ([`with_retry`](Self::with_retry)).
    pub fn retry(&self) -> &RetryPolicies {
        &self.retry
    }

    /// The reorder window and how often it is rechecked
    /// ([`with_reorder_window`](Self::with_reorder_window)).
    pub fn reorder_window(&self) -> (Duration, Duration) {
        (self.reorder_window, self.gap_recheck)
    }

    /// What happens to a message no handler subscribes to
    /// ([`with_unhandled`](Self::with_unhandled)).
    pub fn unhandled(&self) -> UnhandledPolicy {
        self.unhandled
    }

    /// Whether a claimed batch runs in one transaction
    /// ([`with_batch_transactions`](Self::with_batch_transactions)).
    pub fn batch_transactions(&self) -> bool {
        self.batch_transactions
    }

    /// What happens when the reorder window has passed
    /// ([`with_gap_policy`](Self::with_gap_policy)).
    pub fn gap_policy(&self) -> GapPolicy {
        self.gap_policy
    }

    /// Checks every setting, as [`InboxProcessor::new`] does.
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] naming the setting: `batch_size` 0, `lease` 0,
    /// `reorder_window` with a recheck of 0 (a message ahead of a gap would be
    /// rechecked without pause).
    pub fn validate(&self) -> Result<(), OutboxError> {
        let invalid = |field, reason| Err(OutboxError::invalid_config(field, reason));
        if self.batch_size == 0 {
            return invalid("batch_size", "must be at least 1");
        }
        if self.lease.is_zero() {
            return invalid("lease", "must be longer than 0");
        }
        if self.gap_recheck.is_zero() {
            return invalid(
                "reorder_window",
                "the recheck interval must be longer than 0",
            );
        }
        Ok(())
    }
}

/// Claims stored messages and runs the pipeline on them. Several processors (tasks,
/// processes, hosts) may share one inbox: claims use `FOR UPDATE SKIP LOCKED` and
/// completions are fenced by claim token, as in the outbox.
///
/// For each message, handlers run in order, each with its own inbox record; a failure
/// stops the message there and schedules a retry with backoff (handlers that succeeded
/// are not re-run); after the retry policy's `max_attempts` (or at once for a permanent
/// error) the message goes Dead with `last_error` naming the handler. A versioned
/// message ahead of a gap is deferred (not charged an attempt) until its predecessor is
/// applied or the reorder window passes.
///
/// By default a claimed batch runs in one transaction, as the batched idempotent
/// consumer does (see [`ProcessorConfig::with_batch_transactions`]): one statement
/// claims every inbox record of the batch, one locks its version rows, the handlers
/// run in order (a handler may take its messages in one call,
/// [`Handler::handle_batch`](crate::Handler::handle_batch)), one statement raises the
/// versions, one commit; a failing handler rolls the batch back, the messages before it
/// run again as a batch, it runs alone in per-message mode, then the rest.
pub struct InboxProcessor<S: InboxStore> {
    store: Arc<S>,
    pipeline: Arc<Pipeline<S>>,
    config: ProcessorConfig,
    trouble: StoreTrouble,
}

impl<S: InboxStore> std::fmt::Debug for InboxProcessor<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxProcessor")
            .field("pipeline", &self.pipeline)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What one processed batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessReport {
    /// Messages claimed.
    pub claimed: usize,
    /// Completed (every handler done).
    pub done: usize,
    /// Scheduled for retry.
    pub retried: usize,
    /// Dead.
    pub dead: usize,
    /// Deferred for the reorder window.
    pub deferred: usize,
    /// Completions fenced out (another processor took over after our lease expired).
    pub fenced: usize,
}

impl<S> InboxProcessor<S>
where
    S: DurableInbox + VersionTracking,
{
    /// A processor of `store` running `pipeline`. Nothing runs until
    /// [`run`](Self::run) or [`run_once`](Self::run_once).
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] naming the setting, before any I/O: what
    /// [`ProcessorConfig::validate`] refuses.
    pub fn new(
        store: Arc<S>,
        pipeline: Pipeline<S>,
        config: ProcessorConfig,
    ) -> Result<Self, OutboxError> {
        config.validate()?;
        Ok(Self {
            store,
            pipeline: Arc::new(pipeline),
            config,
            trouble: StoreTrouble::default(),
        })
    }

    /// Claims and processes one batch.
    ///
    /// # Errors
    /// A store error from the claim or the completion (claimed messages are then
    /// reclaimed after their lease).
    pub async fn run_once(&self) -> Result<ProcessReport, OutboxError> {
        let batch = self
            .store
            .claim(self.config.batch_size, self.config.lease)
            .await?;
        let mut report = ProcessReport {
            claimed: batch.len(),
            ..ProcessReport::default()
        };
        if batch.is_empty() {
            return Ok(report);
        }
        let outcomes = if self.config.batch_transactions {
            self.process_batch(&batch).await
        } else {
            let mut outcomes = Vec::with_capacity(batch.len());
            for stored in &batch {
                outcomes.push(self.process(stored).await);
            }
            outcomes
        };
        let mut completions = Vec::with_capacity(batch.len());
        for (stored, outcome) in batch.iter().zip(outcomes) {
            match &outcome {
                InboxOutcome::Done => report.done += 1,
                InboxOutcome::Retry { .. } => report.retried += 1,
                InboxOutcome::Dead { .. } => report.dead += 1,
                InboxOutcome::Defer { .. } => report.deferred += 1,
            }
            completions.push(InboxCompletion {
                id: stored.message.id,
                claim_token: stored.claim_token,
                outcome,
            });
        }
        let done = self.store.complete(&completions).await?;
        report.fenced = done.fenced.len();
        if report.fenced > 0 {
            warn!(
                fenced = report.fenced,
                "inbox completion fenced: another processor reclaimed these messages"
            );
        }
        Ok(report)
    }

    /// The outcomes of `batch`, in order, processed in one transaction (see the batch
    /// module); messages no handler subscribes to, and failing ones, go through
    /// [`process`](Self::process).
    async fn process_batch(&self, batch: &[StoredMessage]) -> Vec<InboxOutcome> {
        let mut outcomes: Vec<Option<InboxOutcome>> = vec![None; batch.len()];
        let mut items = Vec::with_capacity(batch.len());
        let mut positions = Vec::with_capacity(batch.len());
        for (k, stored) in batch.iter().enumerate() {
            let regs = self.pipeline.handlers(&stored.message.event_type);
            if regs.is_empty() {
                outcomes[k] = Some(self.process(stored).await);
                continue;
            }
            let window_passed = stored.age >= self.config.reorder_window;
            items.push(Item {
                msg: &stored.message,
                regs,
                attempt: u32::try_from(stored.attempts).unwrap_or(1),
                hold_gaps: !window_passed || self.config.gap_policy == GapPolicy::DeadLetter,
                max_jump: self.pipeline.max_version_jump(),
            });
            positions.push(k);
        }
        // Items cut before a version gap, with the gap that cut them.
        let mut gaps: Vec<Option<Gap>> = vec![None; items.len()];
        // As in `IdempotentConsumer::process_batch`: the items before a failed one as a
        // batch, then it alone; a single message alone at once.
        let (mut start, mut failed) = (0, None);
        while start < items.len() {
            let end = failed.unwrap_or(items.len());
            if end - start <= 1 {
                outcomes[positions[start]] = Some(self.process(&batch[positions[start]]).await);
                if failed == Some(start) {
                    failed = None;
                }
                start += 1;
                continue;
            }
            match attempt(&*self.store, &items[start..end], &Plain).await {
                Attempt::Committed => {
                    self.trouble.ok();
                    for k in start..end {
                        let stored = &batch[positions[k]];
                        outcomes[positions[k]] = Some(match gaps[k] {
                            Some(gap) => {
                                let all = self.pipeline.handlers(&stored.message.event_type);
                                let consumer =
                                    all.get(gap.handler).map_or("", |r| r.consumer.as_str());
                                self.gap_outcome(stored, consumer, gap.expected, gap.got)
                            }
                            None => InboxOutcome::Done,
                        });
                    }
                    start = end;
                }
                Attempt::Failed { item } => failed = Some(start + item),
                // Cut each such message before its gap and try again (nothing ran).
                Attempt::Gaps(found) => {
                    for mut gap in found {
                        let k = start + gap.item;
                        gap.item = k;
                        let all = self.pipeline.handlers(&items[k].msg.event_type);
                        items[k].regs = &all[..gap.handler];
                        gaps[k] = Some(gap);
                    }
                }
                Attempt::Store(e) if e.kind().is_retryable() => {
                    self.trouble.deferred(&e, items.len() - start);
                    for &k in &positions[start..] {
                        outcomes[k] = Some(InboxOutcome::Defer {
                            delay: self.config.gap_recheck,
                        });
                    }
                    break;
                }
                Attempt::Store(e) => {
                    debug!(error = %e, "a batch failed on an inbox statement: processing its messages one by one");
                    for k in start..end {
                        outcomes[positions[k]] = Some(self.process(&batch[positions[k]]).await);
                    }
                    start = end;
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or(InboxOutcome::Defer {
                    delay: self.config.gap_recheck,
                })
            })
            .collect()
    }

    /// The outcome of a message whose handler `consumer` is ahead of a version gap (the
    /// handlers before it have run): deferred, or dead once the reorder window has
    /// passed (only under [`GapPolicy::DeadLetter`]; otherwise the gap is not held).
    fn gap_outcome(
        &self,
        stored: &StoredMessage,
        consumer: &str,
        expected: i64,
        got: i64,
    ) -> InboxOutcome {
        let msg = &stored.message;
        if stored.age >= self.config.reorder_window {
            crate::metrics::dead(consumer);
            error!(id = %msg.id, consumer, expected, got, "predecessor never arrived: dead-lettered");
            return InboxOutcome::Dead {
                error: format!(
                    "{consumer}: version {got} arrived but {expected} never did within the reorder window of {:?}",
                    self.config.reorder_window
                ),
            };
        }
        debug!(id = %msg.id, expected, got, "ahead of a gap: deferred");
        InboxOutcome::Defer {
            delay: self.config.gap_recheck,
        }
    }

    async fn process(&self, stored: &StoredMessage) -> InboxOutcome {
        let msg = &stored.message;
        let attempt = u32::try_from(stored.attempts).unwrap_or(1);
        let window_passed = stored.age >= self.config.reorder_window;
        let handlers = self.pipeline.handlers(&msg.event_type);
        if handlers.is_empty() {
            crate::metrics::unhandled(self.config.unhandled.as_str());
            return match self.config.unhandled {
                UnhandledPolicy::Ack => {
                    debug!(id = %msg.id, event_type = %msg.event_type, "no handler for this event type: done");
                    InboxOutcome::Done
                }
                UnhandledPolicy::DeadLetter => {
                    crate::metrics::dead(UNHANDLED_CONSUMER);
                    warn!(id = %msg.id, event_type = %msg.event_type, "no handler for this event type: dead");
                    InboxOutcome::Dead {
                        error: format!("no handler subscribes to event type {:?}", msg.event_type),
                    }
                }
                UnhandledPolicy::Requeue => InboxOutcome::Defer {
                    delay: UNHANDLED_RECHECK,
                },
            };
        }
        let max_jump = self.pipeline.max_version_jump();
        for reg in handlers {
            let hold_gaps = !window_passed || self.config.gap_policy == GapPolicy::DeadLetter;
            match run_handler(&*self.store, reg, msg, attempt, hold_gaps, max_jump, &Plain).await {
                Ok(Step::Applied | Step::AlreadyDone | Step::DeadLetter | Step::SkippedStale) => {}
                Ok(Step::Gap { expected, got }) => {
                    return self.gap_outcome(stored, &reg.consumer, expected, got);
                }
                Ok(Step::Failed(e)) => {
                    let error = format!("{}: {e}", reg.consumer);
                    let retry = self.config.retry.for_event_type(&msg.event_type);
                    if e.is_permanent() || !retry.should_retry(attempt) {
                        crate::metrics::dead(&reg.consumer);
                        error!(id = %msg.id, consumer = %reg.consumer, attempt, error = %e, "inbox message is dead");
                        return InboxOutcome::Dead {
                            error: if e.is_permanent() {
                                error
                            } else {
                                format!(
                                    "attempts exhausted ({attempt}/{}): {error}",
                                    retry.max_attempts()
                                )
                            },
                        };
                    }
                    return InboxOutcome::Retry {
                        delay: retry.delay(attempt),
                        error,
                    };
                }
                // The database's trouble, not the message's: not charged.
                Err(e) => {
                    self.trouble.deferred(&e, 1);
                    return InboxOutcome::Defer {
                        delay: self.config.gap_recheck,
                    };
                }
            }
        }
        self.trouble.ok();
        InboxOutcome::Done
    }

    /// Processes batches until `shutdown` is cancelled; the batch in hand is finished.
    ///
    /// # Errors
    /// A store error that retrying cannot fix.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), OutboxError> {
        info!(
            batch_size = self.config.batch_size,
            "inbox processor started"
        );
        let mut backoff = Duration::ZERO;
        while !shutdown.is_cancelled() {
            let wait = match self.run_once().await {
                Ok(report) if report.claimed >= self.config.batch_size => {
                    backoff = Duration::ZERO;
                    continue;
                }
                Ok(_) => {
                    backoff = Duration::ZERO;
                    self.config.poll_interval
                }
                Err(e) if e.kind().is_retryable() => {
                    backoff =
                        outboxkit_core::retry::outage_backoff(backoff, Duration::from_secs(30));
                    warn!(error = %e, backoff_ms = backoff.as_millis() as u64, "inbox processor backing off");
                    backoff
                }
                Err(e) => return Err(e),
            };
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
        Ok(())
    }
}
