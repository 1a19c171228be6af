//! Push wake-up: relays `LISTEN` on the channel [`NOTIFY_CHANNEL`] and claim as soon as
//! a transaction that inserted outbox rows commits, instead of waiting for their poll.
//!
//! The notifications come from the database itself: migration 7 puts a statement-level
//! trigger on `outbox_messages` that sends `NOTIFY outbox, '<schema>'` after every
//! statement that inserted rows, so producers in any language wake the relays.
//! PostgreSQL sends a transaction's notifications when it commits and folds identical
//! ones, so a transaction sends one notification per schema however many rows it wrote.
//! Polling stays as the fallback at the dispatcher's poll interval. While the listener
//! cannot listen (its connection lost, reconnecting with backoff) it wakes the relay
//! every [`OUTAGE_WAKE_INTERVAL`] instead, so a relay with a long fallback poll (the
//! `outbox` binary's default on PostgreSQL is 2 s) still claims twice a second; and it
//! wakes the relay once after every (re)connection, since notifications sent while it
//! was not listening are gone.

use std::time::Duration;

use outbox_core::WakeHandle;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::PgOutbox;

/// The channel the notification trigger uses; its payload is the schema name.
pub const NOTIFY_CHANNEL: &str = "outbox";

/// Longest wait between two attempts to (re)connect the listener.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How often the listener wakes the relay while it cannot listen: the poll interval
/// that push wake-up replaces (500 milliseconds).
pub const OUTAGE_WAKE_INTERVAL: Duration = Duration::from_millis(500);

impl PgOutbox {
    /// Starts a task that calls [`WakeHandle::wake`] whenever a transaction that inserted
    /// rows into this outbox's schema commits, until `shutdown` is cancelled. The task
    /// holds one connection of the pool while it listens, reconnects by itself (with
    /// backoff up to 30 s) when that connection is lost, and wakes once after every
    /// (re)connection, since notifications sent while it was not listening are gone;
    /// while it cannot listen it wakes the relay every [`OUTAGE_WAKE_INTERVAL`].
    /// Needs migration 7 (the notification trigger); without it the relay simply
    /// polls.
    pub fn spawn_wake_listener(
        &self,
        wake: WakeHandle,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let pool = self.pool().clone();
        let schema = self.schema().to_owned();
        tokio::spawn(async move { listen(pool, schema, wake, shutdown).await })
    }
}

async fn listen(pool: sqlx::PgPool, schema: String, wake: WakeHandle, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let connected = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = tokio::select! {
            () = shutdown.cancelled() => return,
            connected = connected => match connected {
                Ok(listener) => listener,
                Err(e) => {
                    warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot LISTEN for outbox notifications; polling meanwhile");
                    // Not listening: stand in for the notifications until reconnected.
                    let retry_at = tokio::time::Instant::now() + backoff;
                    while tokio::time::Instant::now() < retry_at {
                        wake.wake();
                        let next = (tokio::time::Instant::now() + OUTAGE_WAKE_INTERVAL).min(retry_at);
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep_until(next) => {}
                        }
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            },
        };
        info!(schema = %schema, channel = NOTIFY_CHANNEL, "listening for outbox notifications");
        backoff = Duration::from_millis(100);
        wake.wake();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                received = listener.try_recv() => match received {
                    Ok(Some(notification)) => {
                        if notification.payload() == schema {
                            wake.wake();
                        }
                    }
                    // The connection was lost and has been re-established (eager
                    // reconnect): whatever was notified in between is gone.
                    Ok(None) => {
                        info!(schema = %schema, "outbox notification listener reconnected");
                        wake.wake();
                    }
                    Err(e) => {
                        debug!(error = %e, "outbox notification listener failed; reconnecting");
                        break;
                    }
                },
            }
        }
    }
}
