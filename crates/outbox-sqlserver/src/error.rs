//! Mapping of tiberius and pool errors onto [`OutboxError`] with a retryable/permanent
//! kind. Callers branch on [`ErrorKind`], never on the message text.

use std::time::Duration;

use outbox_core::{ErrorKind, OutboxError};

/// Server error numbers that say "try again": deadlock victim (1205), lock request
/// timeout (1222), out of lock resources (1204), snapshot update conflict (3960),
/// insufficient memory (701, 8645), transaction log full during a spike (9002), and
/// Azure SQL's throttling and reconfiguration errors (40501, 40613, 40197, 49918-49920),
/// and "could not continue scan with NOLOCK due to data movement" (601), which the
/// ordered claim's non-blocking reads can meet under heavy concurrent deletes.
const TRANSIENT: &[u32] = &[
    601, 1205, 1222, 1204, 3960, 701, 8645, 9002, 40501, 40613, 40197, 49918, 49919, 49920,
];

/// Server error numbers that mean the server (or the database) cannot be used right
/// now: database not available or shutting down (942, 945, 952, 6005, 6006),
/// "server is in script upgrade mode" (18401), connection broken (233, 10053, 10054).
const UNAVAILABLE: &[u32] = &[233, 942, 945, 952, 6005, 6006, 10053, 10054, 18401];

/// Classifies a tiberius error: I/O, TLS and routing trouble is `Unavailable`,
/// deadlocks, lock timeouts and throttling are `Transient`, the rest (SQL errors,
/// constraint violations, login failures such as 18456, bad conversions) `Permanent`.
pub(crate) fn classify(e: &tiberius::error::Error) -> ErrorKind {
    use tiberius::error::Error as E;
    match e {
        E::Io { .. } | E::Tls(_) | E::Routing { .. } => ErrorKind::Unavailable,
        E::Server(token) => classify_code(token.code()),
        _ => ErrorKind::Permanent,
    }
}

/// The kind of a server error number (see [`classify`]).
pub(crate) fn classify_code(code: u32) -> ErrorKind {
    if TRANSIENT.contains(&code) {
        ErrorKind::Transient
    } else if UNAVAILABLE.contains(&code) {
        ErrorKind::Unavailable
    } else {
        ErrorKind::Permanent
    }
}

/// Wraps a tiberius error, naming the operation that failed.
pub(crate) fn db(operation: &'static str) -> impl FnOnce(tiberius::error::Error) -> OutboxError {
    move |e| OutboxError::Database {
        kind: classify(&e),
        operation,
        source: Box::new(e),
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
        assert_eq!(classify_code(1205), ErrorKind::Transient, "deadlock victim");
        assert_eq!(classify_code(1222), ErrorKind::Transient, "lock timeout");
        assert_eq!(classify_code(40613), ErrorKind::Transient, "Azure failover");
        assert_eq!(
            classify_code(942),
            ErrorKind::Unavailable,
            "database offline"
        );
        assert_eq!(classify_code(18456), ErrorKind::Permanent, "login failed");
        assert_eq!(
            classify_code(2627),
            ErrorKind::Permanent,
            "unique violation"
        );
        assert_eq!(classify_code(547), ErrorKind::Permanent, "check constraint");
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
