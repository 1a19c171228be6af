//! The delayed lane: messages delivered after a delay
//! ([`NewMessage::deliver_after`]), beside the orders.
//!
//! At the start of the fault phase [`FAR`] messages due long after the run
//! ([`far_delay`]: none may be published during it), then one message every
//! [`NEAR_EVERY`] due in 1 to 5 s. Each is recorded in the run's `delayed_events`
//! table in its own transaction (its delay in milliseconds, and whether it is far).
//! They go to a destination of their own ([`DELAYED_EVENT_TYPE`]) that no consumer
//! reads; the audit queue (RabbitMQ) and the orders' stream (NATS) keep a copy.
//!
//! The far messages sit where each relay keeps what is not due yet: the polling relay's
//! claim index (`visible_at` ahead), the WAL relay's parked rows (over 10,000 of them,
//! which its sweeper once never looked past). The verdict (`verdict::delayed`) fails a
//! run in which a message that came due was not published within [`DEADLINE`] of it
//! outside the fault windows, was published before it was due by the database's clock,
//! was published twice, or in which any far message reached the broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outboxkit_core::{NewMessage, OutboxProducer};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::db::{Arg, Outbox, bound, on_outbox};
use super::producers::written;
use super::timeline::Timeline;
use super::topology::{DELAYED_EVENT_TYPE, Names};

/// Messages due long after the run, written at its start: more than the 10,000 parked
/// rows the WAL relay's sweeper once looked at.
pub(crate) const FAR: usize = 12_000;
/// Far messages per transaction.
const FAR_BATCH: usize = 500;
/// One message due in seconds is written this often.
pub(crate) const NEAR_EVERY: Duration = Duration::from_secs(2);
/// How late a message due in seconds may be published, outside the fault windows.
/// The relays' poll interval and lease are far below it; a message stranded behind
/// the far ones (the fault this lane exists for) is late by minutes.
pub(crate) const DEADLINE: Duration = Duration::from_secs(10);

/// The far messages' delay: an hour, or four times the run with its drain when that
/// is longer, so that none comes due while the run or its verdict looks.
pub(crate) fn far_delay(run_and_drain: Duration) -> Duration {
    (run_and_drain * 4).max(Duration::from_secs(3_600))
}

/// The near messages' delay: 1 to 5 s, spread by their number.
fn near_delay(n: u64) -> Duration {
    Duration::from_millis(1_000 + (n * 733) % 4_000)
}

/// What the lane wrote.
#[derive(Debug, Default)]
pub(crate) struct DelayedStats {
    pub(crate) far: AtomicU64,
    pub(crate) near: AtomicU64,
    /// Near messages not written (a database fault outlasted the retries).
    pub(crate) failed: AtomicU64,
}

/// Writes `messages` (each due after `delays[i]`) and their `delayed_events` rows in
/// one transaction.
async fn write(
    outbox: &Outbox,
    names: &Names,
    messages: &[NewMessage],
    delays: &[Duration],
    far: bool,
) -> anyhow::Result<()> {
    let sql = format!(
        "INSERT INTO {} (id, delay_ms, far) VALUES {}",
        names.table("delayed_events"),
        outbox.database().rows(messages.len(), 3)
    );
    let args: Vec<Arg> = messages
        .iter()
        .zip(delays)
        .flat_map(|(m, d)| {
            [
                Arg::Uuid(m.id),
                Arg::Int(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
                Arg::Bool(far),
            ]
        })
        .collect();
    on_outbox!(outbox, store => {
        let mut tx = store.begin().await?;
        store.enqueue_batch(&mut tx, messages).await?;
        bound!(query, sql, args).execute(&mut *tx).await?;
        tx.commit().await?;
    });
    Ok(())
}

/// Writes `messages` (see [`write`]), retried with the same ids for up to 30 s while
/// the database is at fault. Returns whether they are written.
async fn write_retrying(
    outbox: &Outbox,
    names: &Names,
    messages: &[NewMessage],
    delays: &[Duration],
    far: bool,
    stop: &CancellationToken,
) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match write(outbox, names, messages, delays, far).await {
            Ok(()) => return true,
            Err(_) if written(outbox, names, messages[0].id).await => return true,
            Err(e) if tokio::time::Instant::now() < deadline && !stop.is_cancelled() => {
                tracing::debug!(error = %e, "delayed messages not written yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "delayed messages could not be written");
                return false;
            }
        }
    }
}

fn message(n: u64, delay: Duration) -> anyhow::Result<NewMessage> {
    Ok(
        NewMessage::builder("reminder", Uuid::now_v7().to_string(), DELAYED_EVENT_TYPE)
            .payload(&serde_json::json!({ "n": n, "delay_ms": delay.as_millis() }))
            .deliver_after(delay)
            .build()?,
    )
}

/// The lane: [`FAR`] messages due after `far`, then one due in seconds every
/// [`NEAR_EVERY`] until `stop`.
pub(crate) async fn lane(
    outbox: Outbox,
    names: Names,
    far: Duration,
    stats: Arc<DelayedStats>,
    timeline: Timeline,
    stop: CancellationToken,
) {
    let mut n = 0_u64;
    for _ in 0..FAR.div_ceil(FAR_BATCH) {
        let batch: anyhow::Result<Vec<NewMessage>> = (0..FAR_BATCH)
            .map(|_| {
                n += 1;
                message(n, far)
            })
            .collect();
        let batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                timeline.say(format!("the delayed lane cannot build its messages: {e}"));
                return;
            }
        };
        let delays = vec![far; batch.len()];
        if write_retrying(&outbox, &names, &batch, &delays, true, &stop).await {
            stats.far.fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
    }
    timeline.say(format!(
        "delayed lane: {} messages due in {}; one due in 1-5 s every {}s from now",
        stats.far.load(Ordering::Relaxed),
        humantime::format_duration(far),
        NEAR_EVERY.as_secs()
    ));
    let mut tick = tokio::time::interval(NEAR_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        n += 1;
        let delay = near_delay(n);
        let Ok(m) = message(n, delay) else {
            continue;
        };
        if write_retrying(&outbox, &names, &[m], &[delay], false, &stop).await {
            stats.near.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}
