//! Mapping of tiberius and pool errors onto [`OutboxError`] with a retryable/permanent
//! kind. Callers branch on [`ErrorKind`], never on the message text.

use std::time::Duration;

use outboxkit_core::{ErrorKind, OutboxError};

/// Server error numbers that say "try again": deadlock victim (1205), lock request
/// timeout (1222), out of lock resources (1204), snapshot update conflict (3960),
/// insufficient memory (701, 8645), transaction log full during a spike (9002), and
/// Azure SQL's throttling and reconfiguration errors (40501, 40613, 40197, 49918-49920),
/// "could not continue scan with NOLOCK due to data movement" (601), which the
/// ordered claim's non-blocking reads can meet under heavy concurrent deletes, and the
/// validation failures of a transaction on memory-optimized tables, which a handler's
/// own tables may be and which show at commit: update conflict (41302), repeatable read
/// and serializable validation (41305, 41325), a dependency that aborted (41301), too
/// many commit dependencies (41839); Microsoft's "retry logic for transactions on
/// memory-optimized tables" lists exactly these as retryable.
const TRANSIENT: &[u32] = &[
    601, 1205, 1222, 1204, 3960, 701, 8645, 9002, 40501, 40613, 40197, 49918, 49919, 49920, 41301,
    41302, 41305, 41325, 41839,
];

/// Server error numbers that mean the server (or the database) cannot be used right
/// now: database not available or shutting down (942, 945, 952, 6005, 6006),
/// "server is in script upgrade mode" (18401), connection broken (233, 10053, 10054).
const UNAVAILABLE: &[u32] = &[233, 942, 945, 952, 6005, 6006, 10053, 10054, 18401];

/// Server error numbers that refuse the data of the statement, not the statement or the
/// database: the same statement succeeds with other values. SQL Server's counterparts of
/// PostgreSQL's SQLSTATE classes 22 (data exception), 23 (integrity constraint
/// violation) and 54 (program limit exceeded):
///
/// - constraints: duplicate key in a PRIMARY KEY or UNIQUE constraint (2627) or a unique
///   index (2601), a FOREIGN KEY or CHECK constraint conflict (547), NULL into a column
///   that does not allow nulls (515);
/// - too long: "String or binary data would be truncated" (8152; 2628 is the same error
///   naming the table, column and value, the default at compatibility level 150, SQL
///   Server 2019, and above);
/// - conversions and arithmetic: arithmetic overflow converting to a type (8115), for a
///   type (220 integer values, 232 float values), adding to a date/time column
///   overflowed (517), "Error converting data type" (8114), a string that is not a
///   number or of the type (245), not a date/time (241, 295 for smalldatetime), not a
///   uniqueidentifier (8169), a date/time conversion out of range (242, 296 for
///   smalldatetime), division by zero (8134), JSON text that is not well formed (13609);
/// - limits: an index entry longer than the index key limit (1946: "Operation failed.
///   The index entry of length %d bytes for the index '%.*ls' exceeds the maximum length
///   of %d bytes": at `INSERT`/`UPDATE` time this is an error, severity 16, and the
///   statement fails; SQL Server 2016 and later allow 1,700 bytes in a nonclustered key
///   and 900 in a clustered one; `CREATE INDEX` over columns that could exceed them
///   only warns, with 1945), a row longer than the 8,060-byte row limit (511).
///
/// Left out on purpose: errors about the statement's text rather than its values (207,
/// 8116, 8117, 102 ...), "Subquery returned more than 1 value" (512) and a `MERGE` that
/// updates a row twice (8672), which are bugs in the statement even when data reveals
/// them: those stay `Permanent`.
const INVALID_DATA: &[u32] = &[
    2627, 2601, 547, 515, 8152, 2628, 8115, 220, 232, 517, 8114, 245, 241, 295, 8169, 242, 296,
    8134, 13609, 1946, 511,
];

/// Server error numbers that mean the statement ran on a transaction that had already
/// ended or could no longer commit; nothing of that transaction committed (reported as
/// [`OutboxError::TransactionAborted`] by [`db`]):
///
/// - 3930: "The current transaction cannot be committed and cannot support operations
///   that write to the log file. Roll back the transaction." A write or a `COMMIT` on a
///   doomed transaction (`XACT_STATE() = -1`: an error caught in `TRY ... CATCH`, or one
///   that dooms the transaction even with `XACT_ABORT OFF`).
/// - 3902: "The COMMIT TRANSACTION request has no corresponding BEGIN TRANSACTION." The
///   transaction was already gone, in practice rolled back at once by an earlier failed
///   statement under `XACT_ABORT ON` (this crate's session setting).
/// - 3998: "Uncommittable transaction is detected at the end of the batch. The
///   transaction is rolled back." A batch ended with the transaction doomed (its error
///   caught and not re-raised); the server rolled it back.
///
/// Not 266 ("Transaction count after EXECUTE indicates a mismatching number of BEGIN and
/// COMMIT statements"): a procedure or `sp_executesql` batch changed `@@TRANCOUNT`,
/// which may be a `ROLLBACK` inside it but equally a `COMMIT` (its work is then
/// committed) or a `BEGIN` left open, so it does not say that nothing committed; it
/// stays `Permanent`, a programming error. Not 3971 ("The server failed to resume the
/// transaction") either: it names a stale transaction descriptor, which tiberius clears
/// when the server reports the rollback, so this crate should never meet it.
const TRANSACTION_ABORTED: &[u32] = &[3930, 3902, 3998];

/// Classifies a tiberius error: I/O, TLS and routing trouble is `Unavailable`; server
/// errors by number (see [`classify_code`]); the rest (a protocol or conversion error of
/// the driver) `Permanent`.
pub(crate) fn classify(e: &tiberius::error::Error) -> ErrorKind {
    use tiberius::error::Error as E;
    match e {
        E::Io { .. } | E::Tls(_) | E::Routing { .. } => ErrorKind::Unavailable,
        E::Server(token) => classify_code(token.code()),
        _ => ErrorKind::Permanent,
    }
}

/// The kind of a server error number: deadlocks, lock timeouts, throttling and the
/// like are `Transient`, a database going away `Unavailable`, the statement's data
/// refused (see [`INVALID_DATA`]) `InvalidData`, the rest `Permanent`: a missing object
/// (208), a refused permission (229, 230, 262), a failed login (18456), a database the
/// login cannot open (4060), a syntax error.
pub(crate) fn classify_code(code: u32) -> ErrorKind {
    if TRANSIENT.contains(&code) {
        ErrorKind::Transient
    } else if UNAVAILABLE.contains(&code) {
        ErrorKind::Unavailable
    } else if INVALID_DATA.contains(&code) {
        ErrorKind::InvalidData
    } else {
        ErrorKind::Permanent
    }
}

/// Whether server error `code` says that the transaction the statement ran on had
/// already ended or could no longer commit (see [`TRANSACTION_ABORTED`]).
pub(crate) fn aborts_transaction(code: u32) -> bool {
    TRANSACTION_ABORTED.contains(&code)
}

/// Wraps a tiberius error, naming the operation that failed. An error saying that the
/// transaction had already been aborted (3930, 3902, 3998: see [`TRANSACTION_ABORTED`])
/// is [`OutboxError::TransactionAborted`].
pub(crate) fn db(operation: &'static str) -> impl FnOnce(tiberius::error::Error) -> OutboxError {
    move |e| {
        if e.code().is_some_and(aborts_transaction) {
            return OutboxError::TransactionAborted { operation };
        }
        OutboxError::Database {
            kind: classify(&e),
            operation,
            source: Box::new(e),
        }
    }
}

/// Why a connection could not be opened or borrowed, beyond what tiberius reports.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The TCP connect or the login did not finish in time.
    #[error("could not connect to SQL Server at {addr} within {timeout:?}")]
    Timeout {
        /// `host:port` that was dialled.
        addr: String,
        /// The configured connect timeout.
        timeout: Duration,
    },
    /// The TCP connection could not be opened (refused, unreachable, DNS failure).
    #[error("could not reach SQL Server at {addr}: {source}")]
    Unreachable {
        /// `host:port` that was dialled.
        addr: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The server answered but the login or the TLS handshake failed.
    #[error("SQL Server at {addr} refused the connection: {source}")]
    Login {
        /// `host:port` that was dialled.
        addr: String,
        /// The driver's error (e.g. server error 18456 "Login failed for user").
        #[source]
        source: tiberius::error::Error,
    },
    /// A pooled connection failed its liveness check (`SELECT 1`) when borrowed; the
    /// pool discards it and opens another.
    #[error("a pooled SQL Server connection to {addr} failed its liveness check: {source}")]
    Broken {
        /// `host:port` of the connection.
        addr: String,
        /// The driver's error.
        #[source]
        source: tiberius::error::Error,
    },
    /// No pooled connection became free within the acquire timeout.
    #[error("no pooled SQL Server connection became free within {0:?}")]
    PoolTimeout(Duration),
}

impl ConnectError {
    /// Retryable or not: a timeout or an unreachable server is `Unavailable`; a failed
    /// login is classified like any server error (18456, bad credentials, is
    /// `Permanent`; 4060, database not available yet, too).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Timeout { .. } | Self::Unreachable { .. } | Self::PoolTimeout(_) => {
                ErrorKind::Unavailable
            }
            Self::Login { source, .. } | Self::Broken { source, .. } => classify(source),
        }
    }
}

/// Wraps a connect error, naming the operation that needed the connection.
pub(crate) fn connect(operation: &'static str) -> impl FnOnce(ConnectError) -> OutboxError {
    move |e| OutboxError::Database {
        kind: e.kind(),
        operation,
        source: Box::new(e),
    }
}

/// Wraps a pool error (a failed connect or an acquire timeout).
pub(crate) fn pool(
    operation: &'static str,
    acquire_timeout: Duration,
) -> impl FnOnce(bb8::RunError<ConnectError>) -> OutboxError {
    move |e| {
        let e = match e {
            bb8::RunError::User(e) => e,
            bb8::RunError::TimedOut => ConnectError::PoolTimeout(acquire_timeout),
        };
        connect(operation)(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_are_classified_by_number() {
        for (code, kind, what) in [
            (1205, ErrorKind::Transient, "deadlock victim"),
            (1222, ErrorKind::Transient, "lock request timeout"),
            (3960, ErrorKind::Transient, "snapshot update conflict"),
            (40613, ErrorKind::Transient, "Azure failover"),
            (
                41302,
                ErrorKind::Transient,
                "memory-optimized update conflict",
            ),
            (
                41305,
                ErrorKind::Transient,
                "repeatable read validation at commit",
            ),
            (
                41325,
                ErrorKind::Transient,
                "serializable validation at commit",
            ),
            (41301, ErrorKind::Transient, "commit dependency aborted"),
            (942, ErrorKind::Unavailable, "database offline"),
            (10054, ErrorKind::Unavailable, "connection reset"),
            (
                2627,
                ErrorKind::InvalidData,
                "PRIMARY KEY / UNIQUE constraint",
            ),
            (2601, ErrorKind::InvalidData, "unique index"),
            (
                547,
                ErrorKind::InvalidData,
                "FOREIGN KEY / CHECK constraint",
            ),
            (515, ErrorKind::InvalidData, "NULL into NOT NULL"),
            (
                8152,
                ErrorKind::InvalidData,
                "string or binary data truncated",
            ),
            (2628, ErrorKind::InvalidData, "truncated, naming the column"),
            (
                8115,
                ErrorKind::InvalidData,
                "arithmetic overflow converting",
            ),
            (
                220,
                ErrorKind::InvalidData,
                "arithmetic overflow for a type",
            ),
            (
                232,
                ErrorKind::InvalidData,
                "arithmetic overflow, float value",
            ),
            (517, ErrorKind::InvalidData, "date/time addition overflow"),
            (8114, ErrorKind::InvalidData, "error converting data type"),
            (245, ErrorKind::InvalidData, "conversion failed"),
            (241, ErrorKind::InvalidData, "not a date/time"),
            (295, ErrorKind::InvalidData, "not a smalldatetime"),
            (8169, ErrorKind::InvalidData, "not a uniqueidentifier"),
            (242, ErrorKind::InvalidData, "date/time out of range"),
            (296, ErrorKind::InvalidData, "smalldatetime out of range"),
            (8134, ErrorKind::InvalidData, "divide by zero"),
            (13609, ErrorKind::InvalidData, "malformed JSON text"),
            (
                1946,
                ErrorKind::InvalidData,
                "index entry over the key limit",
            ),
            (511, ErrorKind::InvalidData, "row over the row size limit"),
            (208, ErrorKind::Permanent, "invalid object name"),
            (207, ErrorKind::Permanent, "invalid column name"),
            (102, ErrorKind::Permanent, "syntax error"),
            (229, ErrorKind::Permanent, "permission denied on an object"),
            (230, ErrorKind::Permanent, "permission denied on a column"),
            (
                262,
                ErrorKind::Permanent,
                "permission denied in the database",
            ),
            (18456, ErrorKind::Permanent, "login failed"),
            (4060, ErrorKind::Permanent, "cannot open database"),
            (
                512,
                ErrorKind::Permanent,
                "subquery returned more than 1 value",
            ),
            (266, ErrorKind::Permanent, "mismatched transaction count"),
            (
                3930,
                ErrorKind::Permanent,
                "doomed transaction (TransactionAborted in db)",
            ),
        ] {
            assert_eq!(classify_code(code), kind, "{code}: {what}");
        }
    }

    #[test]
    fn errors_of_an_already_aborted_transaction_are_recognised() {
        // Doomed (3930), already rolled back when the COMMIT came (3902), rolled back
        // at the end of a batch that left it doomed (3998).
        for code in [3930, 3902, 3998] {
            assert!(aborts_transaction(code), "{code}");
        }
        // 266 may follow a COMMIT inside a procedure: not "nothing committed". The
        // rest are ordinary failures of a live transaction.
        for code in [266, 3903, 3971, 1205, 2627, 208] {
            assert!(!aborts_transaction(code), "{code}");
        }
        // No number is in two lists.
        for code in TRANSIENT
            .iter()
            .chain(UNAVAILABLE)
            .chain(INVALID_DATA)
            .chain(TRANSACTION_ABORTED)
        {
            let lists = [TRANSIENT, UNAVAILABLE, INVALID_DATA, TRANSACTION_ABORTED]
                .iter()
                .filter(|list| list.contains(code))
                .count();
            assert_eq!(lists, 1, "{code}");
        }
    }

    #[test]
    fn io_errors_are_unavailable() {
        let e = tiberius::error::Error::Io {
            kind: std::io::ErrorKind::ConnectionReset,
            message: "reset".into(),
        };
        assert_eq!(classify(&e), ErrorKind::Unavailable);
        let e = ConnectError::Timeout {
            addr: "db:1433".into(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("db:1433"));
    }
}
