//! The [`Handler`] trait, its context, errors and per-handler policies.

use async_trait::async_trait;
use outbox_core::InboxStore;
use outbox_core::error::BoxError;
use outbox_core::wire::IncomingMessage;

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
/// # Contract
/// - It MUST make every effect through `conn` (or make external effects idempotent):
///   the transaction is rolled back when it fails and the message is retried.
/// - It MUST NOT commit or roll back `conn`.
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
}
