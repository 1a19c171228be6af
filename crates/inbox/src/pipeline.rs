//! [`Pipeline`]: the handlers subscribed to each event type, in order, and the step that
//! runs one handler in its own transaction.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use futures::FutureExt as _;
use outboxkit_core::inbox::{ConsumerDeadLetters, InboxClaim, VersionTracking};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{InboxStore, MAX_NAME_LEN, OutboxError};
use tracing::{Instrument as _, debug, info_span, warn};
use uuid::Uuid;

use crate::handler::{Handler, HandlerContext, HandlerError, StalePolicy};

pub(crate) struct Registered<S: InboxStore> {
    pub(crate) consumer: String,
    pub(crate) handler: Arc<dyn Handler<S>>,
    pub(crate) stale: StalePolicy,
}

/// Default of [`Pipeline::with_max_version_jump`]: 1,000,000 versions.
pub const DEFAULT_MAX_VERSION_JUMP: u64 = 1_000_000;

/// Handlers by event type, each under its own consumer name.
///
/// Several handlers may subscribe to one event type; they run in the order added, each
/// in its own transaction with its own inbox record `(message_id, consumer)`, so a
/// retry re-runs only the handlers that have not succeeded yet.
pub struct Pipeline<S: InboxStore> {
    routes: HashMap<String, Vec<Arc<Registered<S>>>>,
    max_version_jump: Option<u64>,
}

impl<S: InboxStore> std::fmt::Debug for Pipeline<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let routes: HashMap<&str, Vec<&str>> = self
            .routes
            .iter()
            .map(|(k, v)| (k.as_str(), v.iter().map(|r| r.consumer.as_str()).collect()))
            .collect();
        f.debug_struct("Pipeline")
            .field("routes", &routes)
            .field("max_version_jump", &self.max_version_jump)
            .finish()
    }
}

impl<S: InboxStore> Default for Pipeline<S> {
    fn default() -> Self {
        Self {
            routes: HashMap::new(),
            max_version_jump: Some(DEFAULT_MAX_VERSION_JUMP),
        }
    }
}

impl<S: InboxStore> Pipeline<S> {
    /// An empty pipeline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Subscribes `handler`, under the consumer name `consumer`, to `event_type`, with
    /// the default [`StalePolicy::Skip`]. Handlers of one event type run in the order
    /// added.
    ///
    /// # Panics
    /// If `consumer` is empty, longer than [`MAX_NAME_LEN`] (255) bytes, or already
    /// subscribed to `event_type` (a programming error).
    #[must_use]
    pub fn on(
        self,
        event_type: impl Into<String>,
        consumer: impl Into<String>,
        handler: impl Handler<S>,
    ) -> Self {
        self.on_with(event_type, consumer, handler, StalePolicy::Skip)
    }

    /// As [`on`](Self::on), with a stale-version policy.
    ///
    /// # Panics
    /// As [`on`](Self::on).
    #[must_use]
    pub fn on_with(
        mut self,
        event_type: impl Into<String>,
        consumer: impl Into<String>,
        handler: impl Handler<S>,
        stale: StalePolicy,
    ) -> Self {
        let consumer = consumer.into();
        assert!(!consumer.is_empty(), "consumer name must not be empty");
        assert!(
            consumer.len() <= MAX_NAME_LEN,
            "consumer name {consumer:?} is longer than {MAX_NAME_LEN} bytes"
        );
        let list = self.routes.entry(event_type.into()).or_default();
        assert!(
            list.iter().all(|r| r.consumer != consumer),
            "consumer {consumer:?} subscribed twice to one event type"
        );
        list.push(Arc::new(Registered {
            consumer,
            handler: Arc::new(handler),
            stale,
        }));
        self
    }

    /// The largest step an aggregate's version may take past the last version a
    /// handler applied (from 0 for an aggregate it has not seen yet): a versioned
    /// message further ahead is refused as implausible and becomes a consumer dead
    /// letter (in the durable inbox, `Dead`) instead of being applied. Default
    /// [`DEFAULT_MAX_VERSION_JUMP`] (1,000,000); `None` trusts every version.
    ///
    /// Versions are per-aggregate sequence numbers (1, 2, 3, ...): the stale check
    /// skips every message not newer than the last applied one and the durable inbox
    /// holds back a message ahead of a gap. So one message claiming a version of, say,
    /// `i64::MAX` (another producer's bug) would otherwise become the aggregate's
    /// version and silence every later event of it. Raise the bound for aggregates
    /// whose consumers may start late on a very long history, or disable it when
    /// versions are not sequence numbers (then also use
    /// [`StalePolicy::Deliver`] and no reorder window).
    #[must_use]
    pub fn with_max_version_jump(mut self, max: Option<u64>) -> Self {
        self.max_version_jump = max;
        self
    }

    pub(crate) fn max_version_jump(&self) -> Option<u64> {
        self.max_version_jump
    }

    pub(crate) fn handlers(&self, event_type: &str) -> &[Arc<Registered<S>>] {
        self.routes.get(event_type).map_or(&[], Vec::as_slice)
    }

    /// Every consumer name, for retention checks and tooling.
    pub fn consumers(&self) -> impl Iterator<Item = &str> {
        self.routes.values().flatten().map(|r| r.consumer.as_str())
    }
}

/// How a handler's transaction claims its inbox record (and a batch's transaction all
/// of its records).
#[async_trait]
pub(crate) trait Claims<S: InboxStore>: Sync {
    async fn claim(
        &self,
        store: &S,
        conn: &mut S::Connection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError>;

    async fn claim_batch(
        &self,
        store: &S,
        conn: &mut S::Connection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<InboxClaim>, OutboxError>;
}

/// [`InboxStore::try_claim`]: the durable inbox, which keeps its own dead state.
pub(crate) struct Plain;

#[async_trait]
impl<S: InboxStore> Claims<S> for Plain {
    async fn claim(
        &self,
        store: &S,
        conn: &mut S::Connection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError> {
        Ok(if store.try_claim(conn, message_id, consumer).await? {
            InboxClaim::Claimed
        } else {
            InboxClaim::Duplicate
        })
    }

    async fn claim_batch(
        &self,
        store: &S,
        conn: &mut S::Connection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<InboxClaim>, OutboxError> {
        Ok(store
            .try_claim_batch(conn, pairs)
            .await?
            .into_iter()
            .map(|new| {
                if new {
                    InboxClaim::Claimed
                } else {
                    InboxClaim::Duplicate
                }
            })
            .collect())
    }
}

/// [`ConsumerDeadLetters::claim_unless_dead`]: the idempotent consumer, one statement
/// for the dead-letter check and the claim.
pub(crate) struct UnlessDead;

#[async_trait]
impl<S: ConsumerDeadLetters> Claims<S> for UnlessDead {
    async fn claim(
        &self,
        store: &S,
        conn: &mut S::Connection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError> {
        store.claim_unless_dead(conn, message_id, consumer).await
    }

    async fn claim_batch(
        &self,
        store: &S,
        conn: &mut S::Connection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<InboxClaim>, OutboxError> {
        store.claim_batch_unless_dead(conn, pairs).await
    }
}

/// The `inbox.handle` span of one handler run on `msg`, whose OpenTelemetry parent is
/// the message's W3C trace context.
pub(crate) fn handle_span(msg: &IncomingMessage, consumer: &str, attempt: u32) -> tracing::Span {
    let span = info_span!(
        "inbox.handle",
        message_id = %msg.id,
        event_type = %msg.event_type,
        consumer = %consumer,
        tenant = msg.tenant_id.as_deref().unwrap_or(""),
        aggregate_type = msg.aggregate_type.as_deref().unwrap_or(""),
        aggregate_id = msg.aggregate_id.as_deref().unwrap_or(""),
        version = msg.aggregate_version.unwrap_or(0),
        attempt,
        trace_id = tracing::field::Empty,
        parent_span_id = tracing::field::Empty,
    );
    if let Some(tp) = msg.traceparent {
        span.record("trace_id", format!("{:032x}", tp.trace_id));
        span.record("parent_span_id", format!("{:016x}", tp.parent_id));
        #[cfg(feature = "opentelemetry")]
        crate::otel::set_remote_parent(&span, tp, msg.tracestate.as_deref());
    }
    span
}

/// The text of a caught panic, for the failure it becomes.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// What running one handler did.
#[derive(Debug)]
pub(crate) enum Step {
    /// The handler ran and committed.
    Applied,
    /// This consumer had already handled the message (inbox record present).
    AlreadyDone,
    /// The message is a consumer dead letter of this consumer: not run.
    DeadLetter,
    /// The version was stale and the policy skips: recorded as handled, not run.
    SkippedStale,
    /// The version is ahead of the next expected one (a predecessor is missing).
    Gap { expected: i64, got: i64 },
    /// The handler failed; its transaction was rolled back.
    Failed(HandlerError),
}

/// Rolls `tx` back after an outcome was already decided (`after`: a handler failure,
/// a duplicate, ...), logging a failure at warn instead of returning it. Nothing of
/// `tx` committed either way: a rollback fails when the connection broke (PostgreSQL,
/// and the server then rolls back as the connection closes) or when the server already
/// ended the transaction (SQL Server under `XACT_ABORT ON`), so the decided outcome
/// stands.
pub(crate) async fn rollback_quietly<S: InboxStore>(store: &S, tx: S::Transaction, after: &str) {
    if let Err(e) = store.rollback(tx).await {
        warn!(error = %e, after, "rollback failed; nothing was committed, the outcome stands");
    }
}

/// The aggregate type, id and version of a versioned message (version above 0).
pub(crate) fn version_key(msg: &IncomingMessage) -> Option<(&str, &str, i64)> {
    match (
        &msg.aggregate_type,
        &msg.aggregate_id,
        msg.aggregate_version,
    ) {
        (Some(t), Some(id), Some(v)) if v > 0 => Some((t.as_str(), id.as_str(), v)),
        _ => None,
    }
}

/// A versioned message's version further past the last applied one than the pipeline
/// allows ([`Pipeline::with_max_version_jump`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "aggregate version {version} is {jump} past the last applied version {applied}, more than the pipeline allows ({max}): refused as implausible (Pipeline::with_max_version_jump)"
)]
pub(crate) struct VersionTooFarAhead {
    version: i64,
    applied: i64,
    jump: u64,
    max: u64,
}

/// The failure of a message whose `version` is more than `max` past `applied` (0 when
/// none), if it is.
pub(crate) fn version_too_far(
    version: i64,
    applied: Option<i64>,
    max: Option<u64>,
) -> Option<HandlerError> {
    let max = max?;
    let applied = applied.unwrap_or(0);
    let jump = u64::try_from(version.checked_sub(applied)?).ok()?;
    (jump > max).then(|| {
        HandlerError::permanent(VersionTooFarAhead {
            version,
            applied,
            jump,
            max,
        })
    })
}

/// Runs `reg` on `msg` in its own transaction, claiming its inbox record the way
/// `claims` says. `hold_gaps`: report a version gap instead of running the handler;
/// `max_jump`: the pipeline's [`with_max_version_jump`](Pipeline::with_max_version_jump).
///
/// Round trips on the transaction's one connection, for an unversioned message: begin,
/// claim, the handler's own statements, the store's commit (PostgreSQL: a check that
/// the transaction is not aborted, then `COMMIT`); a versioned one adds the locked
/// version read and its update.
///
/// Whose fault a failure is decides the outcome (see the `fault` module): a failure of
/// the handler, a transaction it left aborted, or data the database refuses
/// ([`ErrorKind::InvalidData`](outboxkit_core::ErrorKind::InvalidData)) is
/// [`Step::Failed`]; the database's trouble (an outage, a misconfiguration, or a
/// deadlock or timeout inside the handler) is `Err`, never charged to the message.
pub(crate) async fn run_handler<S, C>(
    store: &S,
    reg: &Registered<S>,
    msg: &IncomingMessage,
    attempt: u32,
    hold_gaps: bool,
    max_jump: Option<u64>,
    claims: &C,
) -> Result<Step, OutboxError>
where
    S: InboxStore + VersionTracking,
    C: Claims<S>,
{
    let span = handle_span(msg, &reg.consumer, attempt);
    async {
        let started = std::time::Instant::now();
        let mut tx = store.begin().await?;
        // On an error `tx` is dropped, which rolls it back (an explicit rollback on a
        // failing connection would log a failure per delivery).
        match claims.claim(store, &mut tx, msg.id, &reg.consumer).await? {
            InboxClaim::Claimed => {}
            InboxClaim::Duplicate => {
                rollback_quietly(store, tx, "duplicate").await;
                crate::metrics::duplicate(&reg.consumer);
                debug!("duplicate: already handled by this consumer");
                return Ok(Step::AlreadyDone);
            }
            InboxClaim::DeadLetter => {
                rollback_quietly(store, tx, "dead letter").await;
                debug!("a consumer dead letter of this consumer: not run");
                return Ok(Step::DeadLetter);
            }
        }
        let mut ctx = HandlerContext {
            consumer: reg.consumer.clone(),
            applied_version: None,
            stale: false,
            attempt,
        };
        let versioned = version_key(msg);
        if let Some((agg_type, agg_id, version)) = versioned {
            let applied = match store
                .applied_version(&mut tx, &reg.consumer, agg_type, agg_id)
                .await
            {
                Ok(applied) => applied,
                Err(e) => {
                    drop(tx);
                    let failure = crate::fault::of_message_data(e)?;
                    crate::metrics::failed(&reg.consumer);
                    return Ok(Step::Failed(failure));
                }
            };
            ctx.applied_version = applied;
            if let Some(failure) = version_too_far(version, applied, max_jump) {
                rollback_quietly(store, tx, "version too far ahead").await;
                crate::metrics::failed(&reg.consumer);
                return Ok(Step::Failed(failure));
            }
            if let Some(last) = applied {
                if version <= last {
                    if reg.stale == StalePolicy::Skip {
                        store.commit(tx).await?;
                        crate::metrics::stale(&reg.consumer);
                        debug!(last, "stale version skipped");
                        return Ok(Step::SkippedStale);
                    }
                    ctx.stale = true;
                } else if hold_gaps && version > last + 1 {
                    rollback_quietly(store, tx, "version gap").await;
                    return Ok(Step::Gap {
                        expected: last + 1,
                        got: version,
                    });
                }
            }
        }
        // A panic is a handler failure like any other: counted, retried, and in the end
        // a dead letter that names it, never a lost delivery.
        let handled = std::panic::AssertUnwindSafe(reg.handler.handle(&mut tx, msg, &ctx))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                Err(HandlerError::retryable(format!(
                    "the handler panicked: {}",
                    panic_text(&*panic)
                )))
            });
        match handled {
            Ok(()) => {
                let recorded = match versioned {
                    Some((agg_type, agg_id, version)) if !ctx.stale => {
                        store
                            .record_version(&mut tx, &reg.consumer, agg_type, agg_id, version)
                            .await
                    }
                    _ => Ok(()),
                };
                let finished = match recorded {
                    Ok(()) => store.commit(tx).await,
                    Err(e) => {
                        drop(tx);
                        Err(e)
                    }
                };
                if let Err(e) = finished {
                    // A transaction the handler left aborted, or data of the handler's
                    // that the commit refused: the handler failed. Anything else is the
                    // database's trouble.
                    let failure = crate::fault::after_handler(e)?;
                    warn!(error = %failure, "the handler returned Ok but its transaction did not commit");
                    crate::metrics::failed(&reg.consumer);
                    return Ok(Step::Failed(failure));
                }
                crate::metrics::processed(
                    &reg.consumer,
                    &msg.event_type,
                    started.elapsed(),
                    msg.occurred_at,
                );
                Ok(Step::Applied)
            }
            Err(e) => {
                // The handler's failure is the outcome, whatever the rollback says: a
                // rollback error must not turn a poison message into a store outage
                // that redelivers it forever instead of counting it towards its dead
                // letter.
                rollback_quietly(store, tx, "handler failure").await;
                // Unless the failure was the database's: a deadlock, a statement
                // timeout, a terminated connection inside the handler.
                if let Some(hiccup) = crate::fault::hiccup(store, &e) {
                    debug!(error = %e, "the handler met the database's trouble: not charged");
                    return Err(hiccup);
                }
                crate::metrics::failed(&reg.consumer);
                Ok(Step::Failed(e))
            }
        }
    }
    .instrument(span)
    .await
}
