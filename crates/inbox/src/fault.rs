//! Whose fault a failure is: the message's (counted against it, then a dead letter) or
//! the database's (deferred without charging the message, reported loudly).
//!
//! | what failed | kind | whose fault | what happens |
//! |---|---|---|---|
//! | a statement or the commit after the handler returned `Ok` | [`OutboxError::TransactionAborted`] | the handler's: it swallowed a database error | a handler failure (retried, then a dead letter) |
//! | the commit, or a version statement after the handler | [`ErrorKind::InvalidData`] | the message's: the handler's data (a deferred constraint) | a handler failure |
//! | a version statement before the handler | [`ErrorKind::InvalidData`] | the message's own attributes (an aggregate key the index cannot hold) | a permanent failure: a dead letter at once |
//! | the handler's own statement | [`ErrorKind::Transient`] / [`ErrorKind::Unavailable`] (a deadlock, a statement timeout, a terminated backend) | the database's | deferred, not charged |
//! | any inbox statement | [`ErrorKind::Unavailable`] / [`ErrorKind::Transient`] / [`ErrorKind::Permanent`] (an outage; a missing table, a refused permission) | the database's | deferred, not charged, reported by [`StoreTrouble`] |

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outboxkit_core::{ErrorKind, InboxStore, OutboxError};
use tracing::{error, info};

use crate::handler::HandlerError;

/// What a handler failure text says when the handler returned `Ok` on an aborted
/// transaction.
pub(crate) const SWALLOWED: &str = "the handler returned Ok, but its transaction was aborted: \
     a statement failed and its error was caught and ignored, so nothing was committed \
     (a handler must return the error, or wrap the statement in a savepoint)";

/// An inbox statement that failed after the handler returned `Ok` (recording the
/// version, the commit): the handler's failure when the transaction was aborted or the
/// database refused the handler's data, else (an outage, a misconfiguration) the store
/// error itself.
pub(crate) fn after_handler(e: OutboxError) -> Result<HandlerError, OutboxError> {
    match e {
        OutboxError::TransactionAborted { .. } => Ok(HandlerError::retryable(SWALLOWED)),
        e if e.kind() == ErrorKind::InvalidData => Ok(HandlerError::retryable(e)),
        e => Err(e),
    }
}

/// An inbox statement about the message's own attributes that failed before the
/// handler ran (locking the aggregate's version row): a permanent failure of the
/// message when the database refused its data (an aggregate key over the index's size
/// limit), else the store error itself.
pub(crate) fn of_message_data(e: OutboxError) -> Result<HandlerError, OutboxError> {
    if e.kind() == ErrorKind::InvalidData {
        Ok(HandlerError::permanent(e))
    } else {
        Err(e)
    }
}

/// The database's hiccup behind a handler's error, if that is what it is: the first
/// error of its `source()` chain that is an [`OutboxError::Database`] or that `store`
/// classifies as its driver's, when that kind is retryable (a deadlock, a statement
/// timeout, a terminated connection). Such a failure is not the message's: it is
/// retried without being counted.
pub(crate) fn hiccup<S: InboxStore>(store: &S, e: &HandlerError) -> Option<OutboxError> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e.source_error());
    while let Some(error) = next {
        let kind = match error.downcast_ref::<OutboxError>() {
            Some(OutboxError::Database { kind, .. }) => Some(*kind),
            Some(_) => return None,
            None => store.classify(error),
        };
        if let Some(kind) = kind {
            return kind.is_retryable().then(|| OutboxError::Database {
                kind,
                operation: "handler",
                source: e.to_string().into(),
            });
        }
        next = error.source();
    }
    None
}

/// How often [`StoreTrouble`] logs while the store keeps failing.
const REPORT_EVERY: Duration = Duration::from_secs(60);

/// Reports a failing inbox database loudly but not per delivery: every deferral is
/// counted in [`DEFERRED_TOTAL`](crate::metrics::DEFERRED_TOTAL), and a line at error
/// level, with how many deliveries were deferred since the last one, goes out at most
/// once a minute; after such a line, a line at info level says when the store works
/// again.
#[derive(Debug, Default)]
pub(crate) struct StoreTrouble {
    last_report: Mutex<Option<Instant>>,
    since_report: AtomicU64,
    /// A failure was logged and no success since.
    reported: AtomicBool,
}

impl StoreTrouble {
    /// `messages` were deferred because of `error` (a store error: not their fault).
    pub(crate) fn deferred(&self, error: &OutboxError, messages: usize) {
        let kind = error.kind();
        crate::metrics::deferred(kind, messages);
        let count = u64::try_from(messages).unwrap_or(u64::MAX);
        let since = self.since_report.fetch_add(count, Ordering::Relaxed) + count;
        let mut last = self
            .last_report
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_none_or(|at| at.elapsed() >= REPORT_EVERY) {
            *last = Some(Instant::now());
            self.since_report.store(0, Ordering::Relaxed);
            self.reported.store(true, Ordering::Relaxed);
            let what = match kind {
                ErrorKind::Unavailable | ErrorKind::Transient => "unavailable",
                _ => "refusing the inbox's statements (a misconfiguration? fix it)",
            };
            error!(error = %error, ?kind, deferred = since, "the inbox database is {what}: deliveries are deferred, none is charged or lost (this line repeats at most once a minute)");
        }
    }

    /// The store worked: says so once after a logged failure.
    pub(crate) fn ok(&self) {
        if self.reported.load(Ordering::Relaxed) && self.reported.swap(false, Ordering::Relaxed) {
            info!("the inbox database works again");
        }
    }
}
