//! The [`Handler`] trait, its context, errors and per-handler policies.

use async_trait::async_trait;
use outboxkit_core::InboxStore;
use outboxkit_core::error::BoxError;
use outboxkit_core::wire::IncomingMessage;

/// What a handler learns about the delivery besides the message.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HandlerContext {
    /// The handler's consumer name (its inbox key).
    pub consumer: String,
    /// The last aggregate version this consumer applied before this message, when the
    /// message is versioned.
    pub applied_version: Option<i64>,
    /// `true` when the message's version is not newer than `applied_version` and the
    /// handler's policy is [`StalePolicy::Deliver`].
    pub stale: bool,
    /// Delivery or processing attempt, starting at 1.
    pub attempt: u32,
}

/// A handler failure. Retryable by default; [`permanent`](Self::permanent) failures are
/// dead-lettered at once.
#[derive(Debug)]
pub struct HandlerError {
    permanent: bool,
    source: BoxError,
}

impl HandlerError {
    /// A failure that may succeed on a later attempt.
    pub fn retryable(source: impl Into<BoxError>) -> Self {
        Self {
            permanent: false,
            source: source.into(),
        }
    }

    /// A failure no retry can fix (e.g. a payload that does not deserialize).
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self {
            permanent: true,
            source: source.into(),
        }
    }

    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The error the failure wraps, for walking its `source()` chain.
    pub(crate) fn source_error(&self) -> &(dyn std::error::Error + 'static) {
        &*self.source
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        Self::retryable(e)
    }
}

/// A failure of [`Handler::handle_batch`]: which message of the batch failed, and why.
#[derive(Debug)]
pub struct BatchHandlerError {
    index: usize,
    error: HandlerError,
}

impl BatchHandlerError {
    /// The message at `index` (in the slice given to `handle_batch`) failed with
    /// `error`. An index past the end counts as the last message.
    pub fn new(index: usize, error: HandlerError) -> Self {
        Self { index, error }
    }

    /// The index, in the slice given to `handle_batch`, of the message that failed.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Why it failed.
    pub fn error(&self) -> &HandlerError {
        &self.error
    }

    /// The failure, without the index.
    pub fn into_error(self) -> HandlerError {
        self.error
    }
}

impl std::fmt::Display for BatchHandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "message {} of the batch: {}", self.index, self.error)
    }
}

/// What to do with a message whose aggregate version is not newer than the last one
/// the handler applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StalePolicy {
    /// Do not call the handler; record the message as handled (default).
    #[default]
    Skip,
    /// Call the handler with [`HandlerContext::stale`] set.
    Deliver,
}

/// A message handler. It runs inside a database transaction that also holds its inbox
/// record, so its effects and "handled" commit together or not at all.
///
/// In batch mode (a transport's `run_batched` with [`IdempotentConsumer`], or the
/// [`InboxProcessor`]) that transaction holds a whole batch: the inbox records and
/// effects of every message of the batch and every handler. The handlers' calls are
/// not isolated from each other (no savepoints): when one fails, the whole batch is
/// rolled back and run again without the failing message, which is then run alone, as
/// in per-message mode. So a handler may run more than once for one delivery; its
/// effects through `conn` still commit exactly once.
///
/// # Contract
/// - It MUST make every effect through `conn` (or make external effects idempotent):
///   the transaction is rolled back when it fails and the message is retried, and in
///   batch mode when another message of the batch fails.
/// - It MUST NOT commit or roll back `conn`.
/// - It MUST NOT swallow an error of a statement on `conn` and go on: the statement's
///   failure aborts the transaction (PostgreSQL refuses every later statement,
///   `25P02`, and answers `COMMIT` with `ROLLBACK`; SQL Server dooms it or rolls it
///   back). If it does anyway, nothing of the transaction commits, and the store's
///   commit reports it: the run counts as a failure of the handler ("the handler
///   returned Ok, but its transaction was aborted …"), retried and in the end a dead
///   letter, never an acknowledged delivery without effect or inbox record. To
///   tolerate an expected error ("a unique violation means already applied"), run the
///   statement inside a savepoint (`conn.begin()` on PostgreSQL gives a nested
///   transaction) or use `INSERT … ON CONFLICT DO NOTHING`.
/// - Its database hiccups (a deadlock, a statement timeout, a terminated connection:
///   errors its store classifies as transient or unavailable, see
///   [`InboxStore::classify`](outboxkit_core::InboxStore::classify)) are the database's
///   fault, not the message's: returned as errors, they are retried without being
///   counted against the message.
///
/// [`IdempotentConsumer`]: crate::IdempotentConsumer
/// [`InboxProcessor`]: crate::InboxProcessor
#[async_trait]
pub trait Handler<S: InboxStore>: Send + Sync + 'static {
    /// Applies `msg`.
    ///
    /// # Errors
    /// A [`HandlerError`]: the transaction is rolled back; the message is retried, or
    /// dead-lettered when the error is permanent or attempts run out.
    async fn handle(
        &self,
        conn: &mut S::Connection,
        msg: &IncomingMessage,
        ctx: &HandlerContext,
    ) -> Result<(), HandlerError>;

    /// Applies several messages at once, in batch mode: override it for set-based writes
    /// (one `INSERT … SELECT FROM UNNEST` instead of a statement per message). The
    /// default calls [`handle`](Self::handle) for each message, in order.
    ///
    /// `msgs` holds, in delivery order, the messages of the batch this handler has to
    /// apply (its inbox record was just claimed on `conn`; duplicates, consumer dead
    /// letters and stale versions skipped by [`StalePolicy::Skip`] are left out), each
    /// with its context. A message's context is as if the messages before it in the
    /// batch had been applied: two versions of one aggregate in one batch arrive in
    /// order, and the second's [`HandlerContext::applied_version`] is the first's
    /// version. The handlers of one message still run in pipeline order. A message that
    /// fails is run alone afterwards, through [`handle`](Self::handle): both methods
    /// MUST have the same effects.
    ///
    /// # Errors
    /// A [`BatchHandlerError`] naming the message that failed (its index in `msgs`; if
    /// it cannot tell, the first): the batch's transaction is rolled back, the messages
    /// before that one are run again as a batch, that one alone (its failure counted,
    /// retried or dead-lettered as in per-message mode), then the rest.
    async fn handle_batch(
        &self,
        conn: &mut S::Connection,
        msgs: &[(&IncomingMessage, HandlerContext)],
    ) -> Result<(), BatchHandlerError> {
        for (index, (msg, ctx)) in msgs.iter().enumerate() {
            self.handle(conn, msg, ctx)
                .await
                .map_err(|error| BatchHandlerError::new(index, error))?;
        }
        Ok(())
    }
}
