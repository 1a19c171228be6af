//! Mapping of sqlx MySQL errors onto [`OutboxError`] with a retryable/permanent kind.

use outboxkit_core::{ErrorKind, OutboxError};
use sqlx::mysql::MySqlDatabaseError;

/// `ER_LOCK_DEADLOCK`: InnoDB chose this transaction as a deadlock victim and rolled it
/// back whole.
pub(crate) const DEADLOCK: u16 = 1213;

/// Classifies a sqlx error (MySQL / MariaDB error numbers, then SQLSTATE classes):
///
/// - connection trouble, a server shutting down, a killed connection and a read-only
///   server (a replica during failover) are `Unavailable`;
/// - deadlocks, lock wait timeouts, statement timeouts and interrupted queries, too
///   many connections (the server's or the account's) are `Transient`;
/// - the data of the statement refused (SQLSTATE class `22` data exception, class `23`
///   integrity constraint violation, "incorrect string value", invalid JSON) is
///   `InvalidData`;
/// - the rest (a missing table, a refused permission) is `Permanent`.
pub(crate) fn classify(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => ErrorKind::Unavailable,
        sqlx::Error::Database(db) => {
            let number = db
                .try_downcast_ref::<MySqlDatabaseError>()
                .map(MySqlDatabaseError::number);
            classify_code(number, db.code().as_deref())
        }
        _ => ErrorKind::Permanent,
    }
}

/// The kind of a server error by its number and SQLSTATE (see [`classify`]).
pub(crate) fn classify_code(number: Option<u16>, sqlstate: Option<&str>) -> ErrorKind {
    match number {
        // server shutdown, gone away, lost connection, connection killed (MariaDB
        // 1927), --read-only, read-only transaction, server out of memory / disk
        Some(1053 | 2006 | 2013 | 1927 | 1290 | 1792 | 1836 | 1037 | 1041 | 1021) => {
            return ErrorKind::Unavailable;
        }
        // deadlock, lock wait timeout, too many connections (the server's 1040, the
        // account's 1203 and 1226: its `max_user_connections` resource, which an
        // operator may hold at -1 to keep the account out for a while), query
        // interrupted, statement timeout (MySQL 3024, MariaDB 1969), lock_wait on metadata
        Some(DEADLOCK | 1205 | 1040 | 1203 | 1226 | 1317 | 3024 | 1969 | 3572) => {
            return ErrorKind::Transient;
        }
        // incorrect string value (not utf8mb4), invalid JSON text, data too long,
        // constraint failed (MariaDB CHECK)
        Some(1366 | 3140 | 4038 | 1406 | 4025 | 3819) => return ErrorKind::InvalidData,
        _ => {}
    }
    match sqlstate {
        Some(code) if code.starts_with("08") => ErrorKind::Unavailable,
        Some("40001") => ErrorKind::Transient,
        Some(code) if code.starts_with("22") || code.starts_with("23") => ErrorKind::InvalidData,
        _ => ErrorKind::Permanent,
    }
}

/// Whether `e` is an InnoDB deadlock (the victim's transaction was rolled back whole).
pub(crate) fn is_deadlock(e: &OutboxError) -> bool {
    match e {
        OutboxError::Database { source, .. } => source
            .downcast_ref::<sqlx::Error>()
            .and_then(|e| match e {
                sqlx::Error::Database(d) => d
                    .try_downcast_ref::<MySqlDatabaseError>()
                    .map(|d| d.number() == DEADLOCK),
                _ => None,
            })
            .unwrap_or(false),
        _ => false,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_by_fault() {
        for (number, state, kind) in [
            (Some(2013), Some("HY000"), ErrorKind::Unavailable),
            (Some(1927), Some("70100"), ErrorKind::Unavailable),
            (Some(1290), Some("HY000"), ErrorKind::Unavailable),
            (Some(1213), Some("40001"), ErrorKind::Transient),
            (Some(1205), Some("HY000"), ErrorKind::Transient),
            (Some(1040), Some("08004"), ErrorKind::Transient),
            (Some(1226), Some("42000"), ErrorKind::Transient),
            (Some(1366), Some("HY000"), ErrorKind::InvalidData),
            (Some(1406), Some("22001"), ErrorKind::InvalidData),
            (Some(1062), Some("23000"), ErrorKind::InvalidData),
            (Some(1146), Some("42S02"), ErrorKind::Permanent),
            (Some(1142), Some("42000"), ErrorKind::Permanent),
            (None, Some("08S01"), ErrorKind::Unavailable),
        ] {
            assert_eq!(classify_code(number, state), kind, "{number:?} {state:?}");
        }
    }
}
