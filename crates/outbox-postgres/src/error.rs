//! Mapping of sqlx errors onto [`OutboxError`] with a retryable/permanent kind.

use outboxkit_core::{ErrorKind, OutboxError};

/// SQLSTATE `25P02` (`in_failed_sql_transaction`): a statement sent on a transaction an
/// earlier failed statement aborted.
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";

/// Classifies a sqlx error (SQLSTATE codes: PostgreSQL's Appendix A, "PostgreSQL Error
/// Codes"):
///
/// - connection trouble, a server out of disk or memory and a read-only server (a
///   replica during failover) are `Unavailable`;
/// - serialization failures, deadlocks, lock timeouts, cancellations (a statement
///   timeout) and too many connections are `Transient`;
/// - the data of the statement refused (class `22` data exception, class `23`
///   integrity constraint violation, class `54` program limit exceeded, e.g. an index
///   entry over the btree limit) is `InvalidData`;
/// - the rest (a missing table, a refused permission, a trigger raising an exception)
///   is `Permanent`.
pub(crate) fn classify(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => ErrorKind::Unavailable,
        sqlx::Error::Database(db) => db
            .code()
            .as_deref()
            .map_or(ErrorKind::Permanent, classify_sqlstate),
        _ => ErrorKind::Permanent,
    }
}

/// The kind of a server error by its SQLSTATE (see [`classify`]).
pub(crate) fn classify_sqlstate(code: &str) -> ErrorKind {
    match code {
        // class 08: connection exception; 57P0x: admin/crash shutdown, cannot connect now
        code if code.starts_with("08") || code.starts_with("57P") => ErrorKind::Unavailable,
        // serialization failure, deadlock, lock not available, query canceled
        // (timeout), too many connections
        "40001" | "40P01" | "55P03" | "57014" | "53300" => ErrorKind::Transient,
        // class 53 insufficient resources (disk full, out of memory); 25006 read-only
        // transaction (a standby promoted late, a failover in progress)
        code if code.starts_with("53") || code == "25006" => ErrorKind::Unavailable,
        // the statement's data: data exceptions, constraint violations, limits
        code if code.starts_with("22") || code.starts_with("23") || code.starts_with("54") => {
            ErrorKind::InvalidData
        }
        _ => ErrorKind::Permanent,
    }
}

/// Wraps a sqlx error, naming the operation that failed. A statement refused because
/// an earlier one aborted the transaction (`25P02`) is
/// [`OutboxError::TransactionAborted`].
pub(crate) fn db(operation: &'static str) -> impl FnOnce(sqlx::Error) -> OutboxError {
    move |e| {
        if let sqlx::Error::Database(db) = &e
            && db.code().as_deref() == Some(IN_FAILED_TRANSACTION)
        {
            return OutboxError::TransactionAborted { operation };
        }
        OutboxError::Database {
            kind: classify(&e),
            operation,
            source: Box::new(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_by_fault() {
        for (code, kind) in [
            ("08006", ErrorKind::Unavailable),
            ("57P01", ErrorKind::Unavailable),
            ("53100", ErrorKind::Unavailable),
            ("25006", ErrorKind::Unavailable),
            ("40P01", ErrorKind::Transient),
            ("40001", ErrorKind::Transient),
            ("57014", ErrorKind::Transient),
            ("55P03", ErrorKind::Transient),
            ("22001", ErrorKind::InvalidData),
            ("22P02", ErrorKind::InvalidData),
            ("23505", ErrorKind::InvalidData),
            ("23503", ErrorKind::InvalidData),
            ("54000", ErrorKind::InvalidData),
            ("42P01", ErrorKind::Permanent),
            ("42501", ErrorKind::Permanent),
            ("28P01", ErrorKind::Permanent),
            ("3D000", ErrorKind::Permanent),
            ("P0001", ErrorKind::Permanent),
        ] {
            assert_eq!(classify_sqlstate(code), kind, "{code}");
        }
    }
}
