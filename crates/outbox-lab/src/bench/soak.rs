//! `--soak N`: the memory of `outbox relay` as its own process (default settings, the
//! release binary) while it relays N messages with nothing scraping its `/metrics`:
//! the polling relay, then the WAL relay (`--source wal`), each in a database of its
//! own (`--soak-source` picks one).
//!
//! Producers ([`PRODUCERS`] connections) commit transactions of [`CHUNK`] rows, the
//! shape of a service writing a few events per request, while keeping at most
//! [`PENDING`] messages pending: the relay sees small batches and many wake-ups, as at
//! a steady production rate, rather than only full ones. The relay's resident set size
//! (`VmRSS`) is sampled every second, by messages sent. The first [`WARM_UP`] messages
//! are the warm-up (pools, buffers, the allocator's arenas); the report gives the RSS
//! at its end and at the end of the run, the growth in between and what it comes to
//! per message. Target: a growth under 1 MiB. A measure by messages, not by time: a
//! slower machine takes longer for the same figures.
//!
//! The run holds the machine-wide fault lock shared, so no fault test of another
//! process restarts or freezes a server in the middle of it (a relay that rides out an
//! outage keeps the high-water mark of its buffers, which is not a leak).
//!
//! PostgreSQL here runs with `autovacuum = off` (a CI setting): the sent rows stay,
//! which costs the database, not the relay's memory. The sink is purged every
//! [`PURGE_EVERY`] messages for the same reason on the broker's side.

use outboxkit_core::OutboxProducer;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::ValueEnum;

use super::broker::Broker;
use super::relay_latency_bench::{Db, create_db, message, spawn_relay, stop};
use super::wal_throughput::{SlotGuard, Source};
use crate::common;

/// Messages kept pending for the relay, at most.
const PENDING: usize = 5_000;
/// Rows per producer transaction.
const CHUNK: usize = 10;
/// Producer connections.
const PRODUCERS: usize = 4;
/// Messages of the warm-up.
const WARM_UP: usize = 100_000;
/// The sink is purged every this many messages: a consumer-less queue of millions of
/// messages slows RabbitMQ down (long garbage collections, confirms past the relay's
/// timeout), which is not the relay's memory.
const PURGE_EVERY: usize = 100_000;
/// Longest a soak may take.
const LIMIT: Duration = Duration::from_secs(3 * 3_600);

/// Which relays `--soak` measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum SoakSource {
    /// The polling relay, then the WAL relay.
    Both,
    /// The polling relay (`outbox relay`).
    Polling,
    /// The WAL relay (`outbox relay --source wal`).
    Wal,
}

/// Runs the soak over `n` messages of `body` for the relays `which` asks for.
pub(crate) async fn run(
    broker: &Broker,
    body: &str,
    n: usize,
    which: SoakSource,
) -> anyhow::Result<()> {
    let _no_faults = outboxkit_testkit::faults::lock_shared().await;
    let sources: &[Source] = match which {
        SoakSource::Both => &[Source::Polling, Source::Wal],
        SoakSource::Polling => &[Source::Polling],
        SoakSource::Wal => &[Source::Wal],
    };
    for &source in sources {
        one(broker, body, n, source).await?;
    }
    Ok(())
}

/// The soak of one relay, in a database of its own (dropped at the end).
async fn one(broker: &Broker, body: &str, n: usize, source: Source) -> anyhow::Result<()> {
    let admin = sqlx::PgPool::connect(&common::database_url()).await?;
    let db = create_db(&admin).await?;
    let command: Vec<&str> = std::iter::once("outbox relay")
        .chain(source.relay_args().iter().copied())
        .collect();
    println!(
        "soak: the {} (`{}`, default settings, nothing scraping /metrics) → {}, {n} messages of {} bytes, {PRODUCERS} producers of {CHUNK}-row transactions, at most {PENDING} pending, database {} of its own",
        source.label(),
        command.join(" "),
        broker.name(),
        body.len(),
        db.name
    );
    let result = async {
        let slot = match source {
            Source::Polling => None,
            Source::Wal => Some(SlotGuard::setup(&db.url, db.schema())?),
        };
        let measured = phases(&db, broker, body, n, source).await;
        let dropped = slot.map_or(Ok(()), SlotGuard::disarm);
        measured?;
        dropped
    }
    .await;
    // The database goes whatever happened to the run or to the purge.
    let purged = broker.purge().await;
    db.outbox.pool().close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {} WITH (FORCE)",
        db.name
    )))
    .execute(&admin)
    .await?;
    result.and(purged)
}

/// Rows not yet sent: few (at most [`PENDING`] and the producers' last chunks), counted
/// through the pending index.
async fn pending(db: &Db) -> anyhow::Result<usize> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.outbox_messages WHERE phase = 0")
        .fetch_one(db.outbox.pool())
        .await?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Commits `n` messages in transactions of [`CHUNK`] rows from [`PRODUCERS`] tasks,
/// never more than [`PENDING`] ahead of the relay; `written` counts what committed.
async fn produce(
    db: &Db,
    body: &str,
    n: usize,
    written: &std::sync::atomic::AtomicUsize,
    sent: &std::sync::atomic::AtomicUsize,
) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let producer = || async {
        loop {
            while next.load(Relaxed).saturating_sub(sent.load(Relaxed)) >= PENDING {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let first = next.fetch_add(CHUNK, Relaxed);
            if first >= n {
                return anyhow::Ok(());
            }
            let msgs: Vec<_> = (first..(first + CHUNK).min(n))
                .map(|i| message("soak", i as u64, body))
                .collect::<anyhow::Result<_>>()?;
            let mut tx = db.outbox.begin().await?;
            db.outbox.enqueue_batch(&mut tx, &msgs).await?;
            tx.commit().await?;
            written.fetch_add(msgs.len(), Relaxed);
        }
    };
    futures::future::try_join_all((0..PRODUCERS).map(|_| producer())).await?;
    Ok(())
}

async fn phases(
    db: &Db,
    broker: &Broker,
    body: &str,
    n: usize,
    source: Source,
) -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let relay = spawn_relay(db, broker, source.relay_args())?;
    let pid = relay.id().to_string();
    let warm_up = WARM_UP.min(n);
    let started = Instant::now();
    let (written, sent) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut samples: Vec<(usize, u64)> = Vec::new();
    let mut warm = None;
    let watch = async {
        let mut next_sample = Instant::now();
        let mut purged = 0;
        loop {
            // Read `written` first: every row it counts is either pending or sent.
            let w = written.load(Relaxed);
            let done = w.saturating_sub(pending(db).await?);
            sent.store(done, Relaxed);
            if Instant::now() >= next_sample {
                let rss = common::rss_of(&pid);
                anyhow::ensure!(rss > 0, "the relay is gone");
                samples.push((done, rss));
                if warm.is_none() && done >= warm_up {
                    warm = Some((done, rss));
                }
                next_sample += Duration::from_secs(1);
            }
            if done >= n {
                return anyhow::Ok(());
            }
            if done >= purged + PURGE_EVERY {
                broker.purge().await?;
                // What autovacuum would do in production (it is off here, a CI
                // setting): without it the pending count above turns into a bitmap
                // scan over millions of dead index entries (1-5 s per sample).
                sqlx::query("VACUUM outbox.outbox_messages")
                    .execute(db.outbox.pool())
                    .await?;
                purged = done;
            }
            anyhow::ensure!(
                started.elapsed() < LIMIT,
                "the soak did not finish within {LIMIT:?} ({done} of {n} sent)"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let ran = tokio::try_join!(produce(db, body, n, &written, &sent), watch);
    let elapsed = started.elapsed();
    let end_rss = common::rss_of(&pid);
    stop(relay).await?;
    ran?;
    let dead: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.outbox_messages WHERE phase = 3")
            .fetch_one(db.outbox.pool())
            .await?;
    anyhow::ensure!(dead == 0, "{dead} messages went dead during the soak");
    let (warm_sent, warm_rss) = warm.context("no sample after the warm-up")?;
    let peak = samples.iter().map(|&(_, rss)| rss).max().unwrap_or(end_rss);
    let after = (n - warm_sent.min(n)).max(1);
    let growth = end_rss as i64 - warm_rss as i64;
    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    let label = source.label();
    println!(
        "soak, {label}: {n} messages in {:.0} s ({:.0} msg/s); relay RSS {:.1} MiB after the warm-up ({warm_sent} sent), {:.1} MiB at the end, peak {:.1} MiB",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        mib(warm_rss as i64),
        mib(end_rss as i64),
        mib(peak as i64),
    );
    println!(
        "soak, {label}: growth after the warm-up {:+.2} MiB over {after} messages ({:+.2} bytes per message); target: under 1 MiB: {}",
        mib(growth),
        growth as f64 / after as f64,
        if growth < 1024 * 1024 {
            "met"
        } else {
            "MISSED"
        }
    );
    // Two single readings fall where the allocator's swings put them (±2-3 MiB with
    // jemalloc): the medians of the samples of the first 100,000 messages after the
    // warm-up and of the last 100,000, and the least-squares slope of all samples after
    // the warm-up, read the level and the trend instead.
    let window = WARM_UP.min(n / 10).max(1);
    let (early, late) = (
        median(&samples, warm_sent, warm_sent + window),
        median(&samples, n.saturating_sub(window), n + 1),
    );
    if let (Some(early), Some(late)) = (early, late) {
        let level = late as i64 - early as i64;
        let per_million = slope(&samples, warm_sent) * 1_000_000.0;
        println!(
            "soak, {label}: median RSS {:.2} MiB over the {window} messages after the warm-up, {:.2} MiB over the last {window}: {:+.2} MiB; trend after the warm-up {:+.2} MiB per million messages; target (the median level): under 1 MiB: {}",
            mib(early as i64),
            mib(late as i64),
            mib(level),
            mib(per_million as i64),
            if level < 1024 * 1024 { "met" } else { "MISSED" }
        );
    }
    // The trend, a tenth of the run at a time.
    let step = (samples.len() / 10).max(1);
    let trend: Vec<String> = samples
        .iter()
        .step_by(step)
        .map(|&(done, rss)| format!("{}k: {:.2}", done / 1000, mib(rss as i64)))
        .collect();
    println!(
        "soak, {label}: RSS (MiB) by messages sent: {}",
        trend.join(", ")
    );
    Ok(())
}

/// The median RSS (bytes) of the samples taken with `from..to` messages sent, if any.
fn median(samples: &[(usize, u64)], from: usize, to: usize) -> Option<u64> {
    let mut window: Vec<u64> = samples
        .iter()
        .filter(|&&(done, _)| (from..to).contains(&done))
        .map(|&(_, rss)| rss)
        .collect();
    window.sort_unstable();
    window.get(window.len() / 2).copied()
}

/// The least-squares slope of RSS (bytes) over messages sent, from `from` messages on:
/// bytes per message (0 with fewer than two distinct points).
fn slope(samples: &[(usize, u64)], from: usize) -> f64 {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|&&(done, _)| done >= from)
        .map(|&(done, rss)| (done as f64, rss as f64))
        .collect();
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

#[cfg(test)]
mod tests {
    use super::{median, slope};

    #[test]
    fn the_median_reads_a_window_and_the_slope_a_trend() {
        let samples: Vec<(usize, u64)> = (0..100)
            .map(|i| (i * 1_000, 1_000 + 2 * i as u64 * 1_000))
            .collect();
        // Samples at 10k..20k: RSS 21,000..39,000, median the 6th of 10.
        assert_eq!(median(&samples, 10_000, 20_000), Some(31_000));
        assert_eq!(median(&samples, 200_000, 300_000), None);
        // RSS grows 2 bytes per message.
        assert!((slope(&samples, 0) - 2.0).abs() < 1e-9);
        assert!((slope(&samples, 50_000) - 2.0).abs() < 1e-9);
        assert_eq!(slope(&samples[..1], 0), 0.0);
    }
}
