//! The WAL relay: reads committed outbox rows from a logical replication slot
//! (`pgoutput`, a publication on the outbox table) instead of claiming them, publishes
//! them in commit order and confirms the slot's position only past what the broker
//! confirmed. See `docs/wal.md`.
//!
//! - [`WalConfig`]: the slot and publication names and the stream's settings;
//! - [`setup`], [`status`], [`drop_slot`]: the slot and publication (`outbox wal
//!   setup|status|drop`);
//! - [`WalRelay`]: the relay loop over any [`EventPublisher`](outbox_core::EventPublisher);
//! - [`WalError`]: its failures, typed (`wal_level` not `logical`, the slot gone, ...).
//!
//! The producer API is unchanged: messages are enqueued into the outbox table as
//! before. The relay marks each published batch `Sent` (or deletes it, with
//! [`SentRetention::Delete`](outbox_core::SentRetention)) in one statement, so `outbox
//! stats`, the dashboard, dead letters and replay keep working; there is no claim, no
//! lease and (after [`setup`]) no NOTIFY trigger on the producers' commits.

mod admin;
mod connect;
mod pgoutput;
mod relay;

use std::time::Duration;

pub use admin::{SetupReport, SlotStatus, check, drop_slot, setup, status, wal_level};
pub use relay::{WAL_RETAINED_BYTES, WalRelay, WalRelayConfig, WalRelayStats, WalStatsHandle};

/// The name of the replication slot and of the publication of a schema's outbox, and
/// the stream's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalConfig {
    slot: String,
    publication: String,
    status_interval: Duration,
    failover: bool,
}

impl WalConfig {
    /// The defaults for `schema`: slot and publication `{schema}_outbox` (PostgreSQL
    /// folds and limits the names: see [`build`](Self::build)), standby status updates
    /// every second.
    pub fn new(schema: &str) -> Self {
        let name = format!("{schema}_outbox");
        Self {
            slot: name.clone(),
            publication: name,
            status_interval: Duration::from_secs(1),
            failover: false,
        }
    }

    /// The replication slot's name [default: `{schema}_outbox`].
    #[must_use]
    pub fn with_slot(mut self, slot: impl Into<String>) -> Self {
        self.slot = slot.into();
        self
    }

    /// The publication's name [default: `{schema}_outbox`].
    #[must_use]
    pub fn with_publication(mut self, publication: impl Into<String>) -> Self {
        self.publication = publication.into();
        self
    }

    /// How often the confirmed position is reported to the server at most
    /// [default: 1 s].
    #[must_use]
    pub fn with_status_interval(mut self, interval: Duration) -> Self {
        self.status_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// Whether [`setup`] creates the slot as a failover slot [default: `false`]: on
    /// PostgreSQL 17 and later, a slot created with `failover = true` is copied to
    /// standbys that set `sync_replication_slots = on`, so that after a failover the
    /// promoted standby has the slot at (or before) the position the relay confirmed
    /// (PostgreSQL 17 documentation, "Logical Replication Failover"). Earlier servers
    /// have no such slots: [`setup`] fails with [`WalError::FailoverUnsupported`].
    /// The relay itself reads a failover slot like any other.
    #[must_use]
    pub fn with_failover(mut self, failover: bool) -> Self {
        self.failover = failover;
        self
    }

    /// Checks the names: they are spliced into replication commands, so only
    /// `[a-z0-9_]{1,63}` is accepted (what PostgreSQL allows for slot names).
    ///
    /// # Errors
    /// [`WalError::InvalidName`].
    pub fn build(self) -> Result<Self, WalError> {
        for (what, name) in [("slot", &self.slot), ("publication", &self.publication)] {
            let ok = !name.is_empty()
                && name.len() <= 63
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !ok {
                return Err(WalError::InvalidName {
                    what,
                    name: name.clone(),
                });
            }
        }
        Ok(self)
    }

    /// The slot's name.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// The publication's name.
    pub fn publication(&self) -> &str {
        &self.publication
    }

    /// Whether [`setup`] creates a failover slot ([`with_failover`](Self::with_failover)).
    pub fn failover(&self) -> bool {
        self.failover
    }
}

/// A failure of the WAL relay or of the slot's administration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WalError {
    /// The server's `wal_level` is not `logical`: no logical slot can be read.
    #[error(
        "wal_level is {actual:?}, the WAL relay needs \"logical\": run `ALTER SYSTEM SET wal_level = logical` and restart PostgreSQL (`cargo xtask services` does it locally)"
    )]
    WalLevel {
        /// The server's setting.
        actual: String,
    },
    /// The replication slot does not exist (never set up, or dropped, or lost on a
    /// failover before PostgreSQL 17). The relay never re-creates it by itself: a new
    /// slot starts from "now" and would silently skip what was committed meanwhile.
    #[error(
        "replication slot {slot:?} does not exist: run `outbox wal setup` (a new slot starts at the current position: messages committed since the old one was lost are not in it; `outbox stats` shows them pending)"
    )]
    SlotMissing {
        /// The slot.
        slot: String,
    },
    /// The publication does not exist.
    #[error("publication {publication:?} does not exist: run `outbox wal setup`")]
    PublicationMissing {
        /// The publication.
        publication: String,
    },
    /// The slot exists but is not a `pgoutput` logical slot.
    #[error("replication slot {slot:?} uses plugin {plugin:?}, not pgoutput")]
    WrongPlugin {
        /// The slot.
        slot: String,
        /// Its output plugin.
        plugin: String,
    },
    /// A failover slot was asked for ([`WalConfig::with_failover`]) from a server
    /// before PostgreSQL 17, which has none. Nothing was created.
    #[error(
        "failover slots need PostgreSQL 17 or later, this server is {server_version}: nothing was created; before 17 a slot exists only on the primary (docs/wal.md, Failover)"
    )]
    FailoverUnsupported {
        /// The server's `server_version`.
        server_version: String,
    },
    /// A failover slot was asked for but the slot exists without `failover`. It is not
    /// dropped and created again (a new slot starts at the current position): change it
    /// over a replication connection, `ALTER_REPLICATION_SLOT {slot} (FAILOVER true)`
    /// (PostgreSQL 17, streaming replication protocol).
    #[error(
        "replication slot {slot:?} exists without failover: set it over a replication connection, e.g. psql \"dbname=... replication=database\" -c 'ALTER_REPLICATION_SLOT {slot} (FAILOVER true)' (dropping and creating it again would start it at the current position)"
    )]
    FailoverOff {
        /// The slot.
        slot: String,
    },
    /// Another session reads the slot (`outbox wal drop` without `--force`).
    #[error("replication slot {slot:?} is in use by the backend with pid {pid}")]
    SlotActive {
        /// The slot.
        slot: String,
        /// The walsender's process id.
        pid: i32,
    },
    /// A slot or publication name outside `[a-z0-9_]{1,63}`.
    #[error("invalid {what} name {name:?}: use 1 to 63 of a-z, 0-9 and _")]
    InvalidName {
        /// `slot` or `publication`.
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// The database URL cannot be used for a replication connection.
    #[error("database URL: {0}")]
    Url(String),
    /// The replication stream failed (connection, protocol, server error).
    #[error("replication stream: {0}")]
    Stream(#[source] pgwire_replication::PgWireError),
    /// The stream carried a message that does not decode.
    #[error("replication stream: {0}")]
    Malformed(String),
    /// A statement failed (checks, marking messages sent or dead).
    #[error(transparent)]
    Store(#[from] outbox_core::OutboxError),
}

impl WalError {
    /// Whether waiting and trying again can help (a connection failure, a server
    /// restarting), as opposed to a configuration the operator must change.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Stream(pgwire_replication::PgWireError::Server(message)) => {
                // The server's SQLSTATE, which the client appends as "(SQLSTATE xxxxx)":
                // refused permissions (42501), authentication (class 28) and a missing
                // database (3D000) need the operator.
                let code = message
                    .rsplit_once("(SQLSTATE ")
                    .and_then(|(_, rest)| rest.get(..5))
                    .unwrap_or("");
                !(code == "42501" || code == "3D000" || code.starts_with("28"))
            }
            Self::Stream(e) => !matches!(
                e,
                pgwire_replication::PgWireError::Auth(_) | pgwire_replication::PgWireError::Tls(_)
            ),
            Self::Store(e) => matches!(
                e.kind(),
                outbox_core::ErrorKind::Transient | outbox_core::ErrorKind::Unavailable
            ),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(WalConfig::new("outbox").build().is_ok());
        assert_eq!(WalConfig::new("outbox").slot(), "outbox_outbox");
        for bad in ["", "Slot", "a-b", "x;drop", &"a".repeat(64)] {
            assert!(
                WalConfig::new("outbox").with_slot(bad).build().is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn server_errors_that_need_the_operator_are_not_retried() {
        let server = |m: &str| WalError::Stream(pgwire_replication::PgWireError::Server(m.into()));
        assert!(!server("permission denied to start WAL sender (SQLSTATE 42501)").is_retryable());
        assert!(!server("password authentication failed (SQLSTATE 28P01)").is_retryable());
        assert!(
            server("replication slot \"s\" is active for PID 7 (SQLSTATE 55006)").is_retryable()
        );
        assert!(server("terminating connection (SQLSTATE 57P01)").is_retryable());
        assert!(!WalError::SlotMissing { slot: "s".into() }.is_retryable());
    }
}
