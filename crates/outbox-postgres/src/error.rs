//! Mapping of sqlx errors onto [`OutboxError`] with a retryable/permanent kind.

use outbox_core::{ErrorKind, OutboxError};

/// Classifies a sqlx error: connection trouble is `Unavailable`, serialization failures,
/// deadlocks, lock timeouts and shutdowns are `Transient`, the rest `Permanent`.
pub(crate) fn classify(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => ErrorKind::Unavailable,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // class 08: connection exception; 57P0x: admin/crash shutdown, cannot connect now
            Some(code) if code.starts_with("08") || code.starts_with("57P") => {
                ErrorKind::Unavailable
            }
            // serialization failure, deadlock, lock not available, query canceled (timeout)
            Some("40001" | "40P01" | "55P03" | "57014" | "53300") => ErrorKind::Transient,
            _ => ErrorKind::Permanent,
        },
        _ => ErrorKind::Permanent,
    }
}

/// Wraps a sqlx error, naming the operation that failed.
pub(crate) fn db(operation: &'static str) -> impl FnOnce(sqlx::Error) -> OutboxError {
    move |e| OutboxError::Database {
        kind: classify(&e),
        operation,
        source: Box::new(e),
    }
}
