//! Push wake-up: relays `LISTEN` on the channel [`NOTIFY_CHANNEL`] and claim as soon as
//! a transaction that inserted outbox rows commits, instead of waiting for their poll.
//! A [`Dispatcher`](outboxkit_core::Dispatcher) over a [`PgOutbox`] starts the listener
//! itself when it runs (`PgOutbox`'s
//! [`spawn_wake_source`](outboxkit_core::OutboxStore::spawn_wake_source)) and stops it
//! with the relay; `DispatcherConfig::with_push_wake(false)` turns it off.
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
//!
//! It also checks that it really hears: at every (re)connection it sends itself a
//! notification (a payload no relay acts on) and counts itself not listening when the
//! notification does not come back within 5 s (a connection pooler in transaction mode,
//! such as PgBouncer's, delivers none); and after [`KEEPALIVE_INTERVAL`] without a word
//! from its connection it runs a query on it, reconnecting when the query does not
//! answer within 5 s (a half-open connection delivers nothing and reports nothing).
//! A lost connection ends its wait for notifications at once, so the wake-ups of an
//! outage start at once too.

use std::time::Duration;

use outboxkit_core::WakeHandle;
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

/// Starts the task behind `PgOutbox`'s
/// [`spawn_wake_source`](outboxkit_core::OutboxStore::spawn_wake_source), which the
/// dispatcher starts itself: it calls [`WakeHandle::wake`] whenever a transaction that
/// inserted rows into this outbox's schema commits, until `shutdown` is cancelled. The
/// task holds one connection of the pool while it listens, reconnects by itself (with
/// backoff up to 30 s) when that connection is lost, and wakes once after every
/// (re)connection, since notifications sent while it was not listening are gone; while
/// it cannot listen it wakes the relay every [`OUTAGE_WAKE_INTERVAL`]. Needs migration 7
/// (the notification trigger); without it the relay simply polls.
pub(crate) fn spawn(
    outbox: &PgOutbox,
    wake: WakeHandle,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let pool = outbox.pool().clone();
    let schema = outbox.schema().to_owned();
    let keepalive = outbox.listener_keepalive();
    tokio::spawn(async move { listen(pool, schema, keepalive, wake, shutdown).await })
}

/// How long the listener may go without hearing from its connection before it checks
/// it with a query: a connection that went half-open (a peer or middlebox gone without a
/// word) delivers nothing and reports nothing until then.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// How long that check, and the start-up self-test, may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The payload of the start-up self-test's notification: the schema's name plus this
/// suffix, which no relay takes for its schema.
const PROBE_SUFFIX: &str = ":listener-self-test";

/// Why the listener is not listening.
#[derive(Debug)]
enum NotListening {
    Db(sqlx::Error),
    /// LISTEN succeeded but its own notification never came back.
    Deaf,
}

impl std::fmt::Display for NotListening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Db(e) => e.fmt(f),
            Self::Deaf => write!(
                f,
                "LISTEN succeeded but a test notification did not arrive within {CHECK_TIMEOUT:?} \
                 (a connection pooler in transaction mode, such as PgBouncer's \
                 pool_mode = transaction, delivers no notifications: connect the relay \
                 directly or through session pooling)"
            ),
        }
    }
}

/// Connects a listener, LISTENs, and checks that a notification comes back: one sent
/// from another connection of the pool, with a payload no relay acts on.
async fn connect(pool: &sqlx::PgPool, schema: &str) -> Result<PgListener, NotListening> {
    let mut listener = PgListener::connect_with(pool)
        .await
        .map_err(NotListening::Db)?;
    // A lost connection ends `try_recv` at once (`Ok(None)`) instead of reconnecting
    // inside it, where the outage wake-ups below could not run.
    listener.eager_reconnect(false);
    listener
        .listen(NOTIFY_CHANNEL)
        .await
        .map_err(NotListening::Db)?;
    let probe = format!("{schema}{PROBE_SUFFIX}");
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(NOTIFY_CHANNEL)
        .bind(&probe)
        .execute(pool)
        .await
        .map_err(NotListening::Db)?;
    let heard = tokio::time::timeout(CHECK_TIMEOUT, async {
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) if n.payload() == probe => return Ok(()),
                Ok(Some(_)) => {}
                Ok(None) => return Err(NotListening::Db(sqlx::Error::PoolClosed)),
                Err(e) => return Err(NotListening::Db(e)),
            }
        }
    })
    .await;
    match heard {
        Ok(Ok(())) => Ok(listener),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(NotListening::Deaf),
    }
}

async fn listen(
    pool: sqlx::PgPool,
    schema: String,
    keepalive: Duration,
    wake: WakeHandle,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        // While connecting (which may hang: a server that accepts the connection and
        // says nothing), stand in for the notifications already.
        let connecting = connect(&pool, &schema);
        tokio::pin!(connecting);
        let mut stand_in = tokio::time::interval(OUTAGE_WAKE_INTERVAL);
        stand_in.tick().await;
        let connected = loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                connected = &mut connecting => break connected,
                _ = stand_in.tick() => wake.wake(),
            }
        };
        let mut listener = {
            match connected {
                Ok(listener) => listener,
                Err(e) => {
                    warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot LISTEN for outbox notifications; polling meanwhile");
                    // Not listening: stand in for the notifications until reconnected.
                    let retry_at = tokio::time::Instant::now() + backoff;
                    while tokio::time::Instant::now() < retry_at {
                        wake.wake();
                        let next =
                            (tokio::time::Instant::now() + OUTAGE_WAKE_INTERVAL).min(retry_at);
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep_until(next) => {}
                        }
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            }
        };
        info!(schema = %schema, channel = NOTIFY_CHANNEL, "listening for outbox notifications");
        backoff = Duration::from_millis(100);
        wake.wake();
        let mut quiet_until = tokio::time::Instant::now() + keepalive;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                received = listener.try_recv() => match received {
                    Ok(Some(notification)) => {
                        quiet_until = tokio::time::Instant::now() + keepalive;
                        if notification.payload() == schema {
                            wake.wake();
                        }
                    }
                    // The connection was lost: whatever is notified until a new one
                    // listens is gone.
                    Ok(None) => {
                        info!(schema = %schema, "outbox notification listener lost its connection; reconnecting");
                        wake.wake();
                        break;
                    }
                    Err(e) => {
                        debug!(error = %e, "outbox notification listener failed; reconnecting");
                        wake.wake();
                        break;
                    }
                },
                () = tokio::time::sleep_until(quiet_until) => {
                    // Nothing heard for a while: make sure the connection still answers.
                    let answered = tokio::time::timeout(
                        CHECK_TIMEOUT,
                        sqlx::query("SELECT 1").execute(&mut listener),
                    )
                    .await;
                    if !matches!(answered, Ok(Ok(_))) {
                        warn!(timeout_ms = CHECK_TIMEOUT.as_millis() as u64, "the outbox notification listener's connection does not answer; reconnecting");
                        wake.wake();
                        break;
                    }
                    quiet_until = tokio::time::Instant::now() + keepalive;
                }
            }
        }
    }
}
