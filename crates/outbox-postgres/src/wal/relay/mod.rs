//! The WAL relay loop ([`WalRelay`]): `session` reads the stream, `flush` publishes a
//! batch, `park` holds back what cannot go now and `sweep` publishes it later,
//! `record` writes outcomes to the table, `config` holds its settings and counters.

mod config;
mod flush;
mod gather;
mod park;
mod pipeline;
mod record;
mod session;
mod sweep;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use outboxkit_core::EventPublisher;
use pgwire_replication::Lsn;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

pub use config::{WAL_RETAINED_BYTES, WalRelayConfig, WalRelayStats, WalStatsHandle};

use super::{WalConfig, WalError, admin};
use crate::PgOutbox;
use config::Counters;

/// The WAL relay over `P`.
///
/// One session at a time reads the slot (PostgreSQL lets one walsender hold it; a
/// second relay waits as a standby and takes over when the first one's session ends).
/// Changes arrive in commit order. Inserted rows are gathered into a batch until it is
/// full or nothing more is waiting, then published; the position confirmed to the
/// server (the slot's `confirmed_flush_lsn`) is the end of the last transaction whose
/// rows were all published and recorded, so a crash replays from there (at least
/// once; the message ids are stable, so broker deduplication and the inbox absorb the
/// repeats).
///
/// What happens to a message, by what went wrong (the polling dispatcher's rules,
/// without claims):
/// - **published**: its row is marked `Sent` (or deleted) in one statement per batch;
/// - **undecodable row** or **a verdict about the message** (unroutable, oversized,
///   invalid): `Dead` with `last_error`, the stream goes on;
/// - **its destination refuses it** (a full queue or stream), **another transient
///   failure** (after the event type's backoff, charged; `Dead` after `max_attempts`)
///   or **`visible_at` still ahead**: *parked* (see `park`): left in the table as
///   `Processing` until it is due, its key's later messages parked behind it, while
///   other keys and destinations go on; a sweeper beside the stream publishes parked
///   rows in `seq` order per key as they come due;
/// - **the broker cannot take messages at all** (an outage): reading pauses, the broker
///   is probed with backoff, then the batch is published again from the first
///   unconfirmed message. No attempt is charged; nothing goes dead.
/// - **the database** (recording `Sent`/`Dead`/parked) failing transiently is retried
///   for a few seconds, then the session ends and the next one replays from the
///   confirmed position; failing permanently stops the relay ([`WalError::Store`]).
pub struct WalRelay<P> {
    outbox: PgOutbox,
    wal: WalConfig,
    publisher: Arc<P>,
    config: WalRelayConfig,
    counters: Arc<Counters>,
}

impl<P: EventPublisher> WalRelay<P> {
    /// The circuit of a message with `routing_key` (else `event_type`): the
    /// destination whose refusal holds it back, as the publisher names it
    /// ([`EventPublisher::destination`]; by default its routing key). The one place
    /// that decides it, for the stream, the sweeper and the table (`parked_for`); a
    /// trial keeps the circuit its row was parked for.
    pub(super) fn circuit<'a>(
        &'a self,
        routing_key: Option<&'a str>,
        event_type: &'a str,
    ) -> std::borrow::Cow<'a, str> {
        self.publisher
            .destination(routing_key.unwrap_or(event_type))
    }

    /// A relay reading `wal`'s slot for `outbox`'s table and publishing with
    /// `publisher`. Nothing connects or starts until [`run`](Self::run).
    ///
    /// # Errors
    /// Before any I/O: [`WalError::InvalidName`] ([`WalConfig::validate`]) and
    /// [`WalError::InvalidConfig`] ([`WalRelayConfig::validate`]), naming the setting.
    pub fn new(
        outbox: PgOutbox,
        wal: WalConfig,
        publisher: Arc<P>,
        config: WalRelayConfig,
    ) -> Result<Self, WalError> {
        wal.validate()?;
        config.validate()?;
        let counters = Arc::new(Counters::default());
        counters.retained.store(-1, Ordering::Relaxed);
        Ok(Self {
            outbox,
            wal,
            publisher,
            config,
            counters,
        })
    }

    /// A live view of the counters.
    pub fn stats(&self) -> WalStatsHandle {
        WalStatsHandle(Arc::clone(&self.counters))
    }

    /// Reads and publishes until `shutdown` is cancelled: then the batch being
    /// published is finished (or, during an outage, left unconfirmed for the next
    /// session), the confirmed position is reported to the server and the session
    /// ends. Connection failures and a server restarting are retried with backoff; a
    /// slot held by another session is waited for.
    ///
    /// What the operator must fix stops the relay: found before a session, when a
    /// session fails, and by a check of the slot and publication every gauge interval
    /// (`WalRelayConfig::with_gauge_interval`; a relay paused by a broker outage reads
    /// nothing that would fail), which ends the session as a shutdown does.
    ///
    /// # Errors
    /// [`WalError::WalLevel`], [`WalError::SlotMissing`] (also when the slot is
    /// dropped while the relay runs), [`WalError::SlotInvalidated`],
    /// [`WalError::WalRemoved`], [`WalError::PublicationMissing`],
    /// [`WalError::PublicationIncomplete`], [`WalError::PublicationRecreated`],
    /// [`WalError::WrongPlugin`], [`WalError::Url`], a permanent
    /// [`WalError::Store`] (a statement recording outcomes refused), or a stream
    /// failure that retrying cannot help (authentication, TLS, a malformed message, a
    /// server refusal such as SQLSTATE 55000).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<WalRelayStats, WalError> {
        // The watch ends the sessions (not the caller's token) when it finds the slot
        // or the publication unusable.
        let sessions = shutdown.child_token();
        let found = Arc::new(std::sync::Mutex::new(None));
        let watch = self.spawn_watch(sessions.clone(), Arc::clone(&found));
        let result = self.run_sessions(&sessions).await;
        watch.abort();
        let found = found
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match (result, found) {
            (Ok(()), Some(e)) => {
                error!(error = %e, "the WAL relay stops");
                Err(e)
            }
            (result, _) => result.map(|()| self.stats().snapshot()),
        }
    }

    async fn run_sessions(&self, shutdown: &CancellationToken) -> Result<(), WalError> {
        let mut backoff = Duration::from_millis(500);
        let mut waiting_logged = false;
        while !shutdown.is_cancelled() {
            let slot = match admin::preflight(&self.outbox, &self.wal).await {
                Ok(slot) => slot,
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, "cannot check the replication slot; retrying");
                    self.counters.session_failed(&e);
                    self.pause(shutdown, &mut backoff).await;
                    continue;
                }
                Err(e) => {
                    error!(error = %e, "the WAL relay stops");
                    return Err(e);
                }
            };
            if let Some(pid) = slot.active_pid {
                self.counters.standby.store(true, Ordering::Relaxed);
                if !waiting_logged {
                    info!(
                        slot = self.wal.slot(),
                        pid, "the replication slot is read by another session; standing by"
                    );
                    waiting_logged = true;
                }
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(self.config.standby_interval) => {}
                }
                continue;
            }
            // No longer standing by: a failure from here on is this relay's.
            self.counters.standby.store(false, Ordering::Relaxed);
            let start = slot
                .confirmed
                .as_deref()
                .and_then(|s| s.parse::<Lsn>().ok())
                .unwrap_or(Lsn::ZERO);
            let sessions_before = self.counters.sessions.load(Ordering::Relaxed);
            // A failure the server reports is looked into: what the operator must fix
            // comes back typed and stops the relay.
            let session = match self.session(start, shutdown).await {
                Ok(()) => Ok(()),
                Err(e) => Err(admin::explain(&self.outbox, &self.wal, e).await),
            };
            match session {
                Ok(()) => return Ok(()),
                Err(e) if e.is_retryable() => {
                    if self.counters.sessions.load(Ordering::Relaxed) != sessions_before {
                        // It had been reading: reconnect soon, not at the last backoff.
                        backoff = Duration::from_millis(500);
                    }
                    // The slot taken meanwhile, a server restart, a dropped connection:
                    // the next preflight tells which.
                    warn!(error = %e, "the replication session ended; reconnecting");
                    self.counters.session_failed(&e);
                    waiting_logged = false;
                    self.pause(shutdown, &mut backoff).await;
                }
                Err(e) => {
                    error!(error = %e, "the WAL relay stops");
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    async fn pause(&self, shutdown: &CancellationToken, backoff: &mut Duration) {
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(*backoff) => {}
        }
        *backoff = outboxkit_core::retry::outage_backoff(*backoff, Duration::from_secs(10));
    }

    /// Every gauge interval until `sessions` is cancelled: checks the slot and the
    /// publication as before a session ([`admin::preflight`]) and exports the WAL the
    /// slot retains. Something the operator must fix (the slot invalidated or dropped,
    /// the publication dropped or no longer covering the table) is put in `found` and
    /// the sessions are ended.
    fn spawn_watch(
        &self,
        sessions: CancellationToken,
        found: Arc<std::sync::Mutex<Option<WalError>>>,
    ) -> tokio::task::JoinHandle<()> {
        let (outbox, wal) = (self.outbox.clone(), self.wal.clone());
        let counters = Arc::clone(&self.counters);
        let every = self.config.gauge_interval;
        tokio::spawn(async move {
            loop {
                match admin::preflight(&outbox, &wal).await {
                    Ok(slot) => {
                        counters
                            .retained
                            .store(slot.retained.unwrap_or(-1), Ordering::Relaxed);
                        if let Some(bytes) = slot.retained {
                            #[allow(clippy::cast_precision_loss)] // reason: a gauge of bytes
                            metrics::gauge!(WAL_RETAINED_BYTES).set(bytes as f64);
                        }
                    }
                    Err(e) if e.is_retryable() => debug!(error = %e, "cannot check the slot"),
                    Err(e) => {
                        warn!(error = %e, "the slot or its publication cannot be used: the session ends");
                        *found
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                        sessions.cancel();
                        return;
                    }
                }
                tokio::select! {
                    () = sessions.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
            }
        })
    }
}
