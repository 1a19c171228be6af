//! The WAL relay: reads committed outbox rows from a logical replication slot
//! (`pgoutput`, a publication on the outbox table) instead of claiming them, publishes
//! them in commit order and confirms the slot's position only past what the broker
//! confirmed. See `docs/wal.md`.
//!
//! - [`WalConfig`]: the slot and publication names and the stream's settings;
//! - [`setup`], [`status`], [`drop_slot`]: the slot and publication (`outbox wal
//!   setup|status|drop`);
//! - [`WalRelay`]: the relay loop over any [`EventPublisher`](outboxkit_core::EventPublisher);
//! - [`WalError`]: its failures, typed (`wal_level` not `logical`, the slot gone, ...).
//!
//! The producer API is unchanged: messages are enqueued into the outbox table as
//! before. The relay marks each published batch `Sent` (or deletes it, with
//! [`SentRetention::Delete`](outboxkit_core::SentRetention)) in one statement, so `outbox
//! stats`, the dashboard, dead letters and replay keep working; there is no claim, no
//! lease and (after [`setup`]) no NOTIFY trigger on the producers' commits.

mod admin;
mod connect;
mod pgoutput;
mod relay;

use std::time::Duration;

pub use admin::{
    PublicationGap, SetupReport, SlotStatus, check, drop_slot, setup, status, wal_level,
};
pub use relay::{WAL_RETAINED_BYTES, WalRelay, WalRelayConfig, WalRelayStats, WalStatsHandle};

/// The name of the replication slot and of the publication of a schema's outbox, and
/// the stream's settings: plain data, made with [`new`](Self::new) and the `with_*`
/// setters (which never fail), checked by [`validate`](Self::validate), which what is
/// built from it calls first ([`WalRelay::new`], [`setup`], [`status`], [`check`],
/// [`drop_slot`]): an invalid name is refused before any connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalConfig {
    slot: String,
    publication: String,
    status_interval: Duration,
    failover: bool,
}

impl WalConfig {
    /// The defaults for `schema`: slot and publication `{schema}_outbox` (PostgreSQL
    /// folds and limits the names: see [`validate`](Self::validate)), standby status updates
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
    /// [`WalRelay::new`], [`setup`], [`status`], [`check`] and [`drop_slot`] call it
    /// first.
    ///
    /// # Errors
    /// [`WalError::InvalidName`] naming the setting (`slot` or `publication`).
    pub fn validate(&self) -> Result<(), WalError> {
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
        Ok(())
    }

    /// The slot's name.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// The publication's name.
    pub fn publication(&self) -> &str {
        &self.publication
    }

    /// How often the confirmed position is reported to the server at most
    /// ([`with_status_interval`](Self::with_status_interval)).
    pub fn status_interval(&self) -> Duration {
        self.status_interval
    }

    /// Whether [`setup`] creates a failover slot ([`with_failover`](Self::with_failover)).
    pub fn failover(&self) -> bool {
        self.failover
    }
}

/// What an operator does when the slot can no longer be read: the end of the messages
/// of [`WalError`]'s variants that need it.
const START_OVER: &str = "to start over: `outbox wal drop`, `outbox wal setup`, then the polling relay (`outbox relay`) until `outbox stats` shows nothing pending (the new slot starts now and lacks those rows), then `outbox relay --source wal` (docs/wal.md, Starting over)";

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
    /// The publication does not exist while the slot does. Created again, it would not
    /// help: the slot decodes each change with the catalog as it was then, and cannot
    /// get past one written while the publication did not exist.
    #[error(
        "publication {publication:?} does not exist: its slot cannot be read past changes written without it; the rows it did not publish are pending in the table, nothing is lost; {}",
        START_OVER
    )]
    PublicationMissing {
        /// The publication.
        publication: String,
    },
    /// The publication does not cover every insert and update of the outbox table
    /// ([`PublicationGap`]): a relay reading it would confirm the slot's position past
    /// rows it never receives (and replayed dead letters, which are updates, would
    /// never go out). Refused by the relay at start and by [`setup`].
    #[error(
        "publication {publication:?} does not cover the inserts and updates of {table} ({gap}): a relay reading it would confirm the slot past rows it never receives. Complete it (ALTER PUBLICATION), or let `outbox wal setup` create one (drop it, or name another with --publication); a slot already read with it lacks the rows committed meanwhile: {}",
        START_OVER
    )]
    PublicationIncomplete {
        /// The publication.
        publication: String,
        /// The outbox table (`schema.outbox_messages`).
        table: String,
        /// What it lacks.
        gap: PublicationGap,
    },
    /// PostgreSQL invalidated the slot (`wal_status = 'lost'`): most often it retained
    /// more WAL than `max_slot_wal_keep_size` allows (a relay stopped or stalled for
    /// long) and a checkpoint removed WAL it still needed. It can never be read again.
    #[error(
        "replication slot {slot:?} was invalidated by PostgreSQL ({reason}) and can never be read again; the rows it did not publish are pending in the table, nothing is lost; {}",
        START_OVER
    )]
    SlotInvalidated {
        /// The slot.
        slot: String,
        /// PostgreSQL's reason (`wal_removed`, ... as PostgreSQL 17's
        /// `invalidation_reason` says), and what it means.
        reason: String,
    },
    /// WAL the slot needs was removed from the server (SQLSTATE `58P01`, "requested
    /// WAL segment ... has already been removed") though PostgreSQL had not
    /// invalidated the slot: removed by hand, or a server restored without it. The
    /// slot can never be read again.
    #[error(
        "WAL that replication slot {slot:?} needs was removed from the server ({server}): the slot can never be read again; the rows it did not publish are pending in the table, nothing is lost; {}",
        START_OVER
    )]
    WalRemoved {
        /// The slot.
        slot: String,
        /// The server's error.
        server: String,
    },
    /// The stream failed with "publication ... does not exist" (SQLSTATE `42704`)
    /// while the publication exists: it was dropped and created again while the slot
    /// was behind, and the slot cannot decode a change written in between (`pgoutput`
    /// reads the publication as the catalog was at each change). It can never be read
    /// past it.
    #[error(
        "replication slot {slot:?} cannot be read past changes written while publication {publication:?} did not exist (it was dropped and created again; the server says: {server}); the rows it did not publish are pending in the table, nothing is lost; {}",
        START_OVER
    )]
    PublicationRecreated {
        /// The slot.
        slot: String,
        /// The publication.
        publication: String,
        /// The server's error.
        server: String,
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
    /// A setting of [`WalRelayConfig`] is invalid (refused by
    /// [`WalRelayConfig::validate`], which [`WalRelay::new`] calls before anything
    /// starts).
    #[error("invalid configuration: {field}: {reason}")]
    InvalidConfig {
        /// The setting, as its `with_*` setter names it (`ordering`, ...).
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
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
    Store(#[from] outboxkit_core::OutboxError),
}

impl WalError {
    /// The server's SQLSTATE of a [`Stream`](Self::Stream) failure the server reported
    /// (the client appends it to the server's message as `(SQLSTATE xxxxx)`).
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Self::Stream(pgwire_replication::PgWireError::Server(message)) => message
                .rsplit_once("(SQLSTATE ")
                .and_then(|(_, rest)| rest.get(..5)),
            _ => None,
        }
    }

    /// Whether waiting and trying again can help (a connection failure, a server
    /// restarting or short of connections, a slot held by another session), as opposed
    /// to what the operator must change or decide.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Stream(pgwire_replication::PgWireError::Server(_)) => {
                // Need the operator: authentication (class 28), a missing database
                // (3D000), refused permissions and missing objects (class 42: 42501,
                // 42704), a slot that cannot be read (55000: invalidated, another
                // database's), WAL removed (58P01), a server that cannot decode (0A000:
                // a standby before PostgreSQL 16). A server shutting down or starting
                // (class 57), short of resources (53) or a connection lost (08) passes.
                let code = self.sqlstate().unwrap_or("");
                !(code.starts_with("28")
                    || code.starts_with("42")
                    || matches!(code, "3D000" | "55000" | "58P01" | "0A000"))
            }
            Self::Stream(e) => !matches!(
                e,
                pgwire_replication::PgWireError::Auth(_) | pgwire_replication::PgWireError::Tls(_)
            ),
            Self::Store(e) => matches!(
                e.kind(),
                outboxkit_core::ErrorKind::Transient | outboxkit_core::ErrorKind::Unavailable
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
        assert!(WalConfig::new("outbox").validate().is_ok());
        assert_eq!(WalConfig::new("outbox").slot(), "outbox_outbox");
        for bad in ["", "Slot", "a-b", "x;drop", &"a".repeat(64)] {
            assert!(
                matches!(
                    WalConfig::new("outbox").with_slot(bad).validate(),
                    Err(WalError::InvalidName { what: "slot", .. })
                ),
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
        assert!(server("the database system is starting up (SQLSTATE 57P03)").is_retryable());
        assert!(server("sorry, too many clients already (SQLSTATE 53300)").is_retryable());
        assert!(!WalError::SlotMissing { slot: "s".into() }.is_retryable());
        // A slot that cannot be read, WAL removed, a publication missing at a change.
        for code in ["55000", "58P01", "42704"] {
            let e = server(&format!("error (SQLSTATE {code})"));
            assert_eq!(e.sqlstate(), Some(code));
            assert!(!e.is_retryable(), "{code}");
        }
    }
}
