//! Mapping of sqlx errors onto [`OutboxError`] with a retryable/permanent kind.

use outbox_core::{ErrorKind, OutboxError};

/// Classifies a sqlx error: connection trouble, a server out of disk or memory and a
/// read-only server (a replica during failover) are `Unavailable`; serialization
/// failures, deadlocks, lock timeouts, cancellations and too many connections are
/// `Transient`; the rest (a statement or trigger that rejects the data) `Permanent`.
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
            // serialization failure, deadlock, lock not available, query canceled
            // (timeout), too many connections
            Some("40001" | "40P01" | "55P03" | "57014" | "53300") => ErrorKind::Transient,
            // class 53 insufficient resources (disk full, out of memory); 25006 read-only
            // transaction (a standby promoted late, a failover in progress)
            Some(code) if code.starts_with("53") || code == "25006" => ErrorKind::Unavailable,
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
