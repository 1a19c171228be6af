//! `--soak N`: the memory of `outbox relay` as its own process (default settings, the
//! release binary) while it relays N messages with nothing scraping its `/metrics`.
//!
//! Producers keep a few thousand messages pending (transactions of 500 rows) for the
//! relay to take; the relay's resident set size (`VmRSS`) is sampled every second. The
//! first fifth of the messages (at least 50,000) is the warm-up (pools, buffers, the
//! allocator's arenas); the report gives the RSS at its end and at the end of the run,
//! the growth in between and what it comes to per message. The relay's metrics
//! recorder once kept every histogram sample until a scrape drained it (about 23 bytes
//! per message, without bound); the target is a growth under 1 MiB after the warm-up.
//!
//! The database is one of its own (dropped at the end). PostgreSQL here runs with
//! `autovacuum = off` (a CI setting): the sent rows stay, which costs the database, not
//! the relay's memory.

use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::broker::Broker;
use super::relay_latency_bench::{create_db, message, spawn_relay, stop};
use crate::common;

/// Messages kept pending for the relay, at most.
const PENDING: i64 = 5_000;
/// Rows per producer transaction.
const CHUNK: usize = 500;

/// Runs the soak over `n` messages of `body`.
pub(crate) async fn run(broker: &Broker, body: &str, n: usize) -> anyhow::Result<()> {
    let admin = sqlx::PgPool::connect(&common::database_url()).await?;
    let db = create_db(&admin).await?;
    println!(
        "soak: `outbox relay` (default settings, nothing scraping /metrics) → {}, {n} messages of {} bytes, database {} of its own",
        broker.name(),
        body.len(),
        db.name
    );
    let result = phases(&db, broker, body, n).await;
    db.outbox.pool().close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {} WITH (FORCE)",
        db.name
    )))
    .execute(&admin)
    .await?;
    result
}

async fn sent(db: &super::relay_latency_bench::Db) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox.outbox_messages WHERE status = 1")
            .fetch_one(db.outbox.pool())
            .await?,
    )
}

async fn phases(
    db: &super::relay_latency_bench::Db,
    broker: &Broker,
    body: &str,
    n: usize,
) -> anyhow::Result<()> {
    let relay = spawn_relay(db, broker, &[])?;
    let pid = relay.id().to_string();
    let warm_up = (n / 5).max(50_000).min(n);
    let started = Instant::now();
    let mut written = 0usize;
    let mut samples: Vec<(i64, u64)> = Vec::new();
    let mut next_sample = Instant::now();
    let mut warm_rss = None;
    loop {
        let done = sent(db).await?;
        if Instant::now() >= next_sample {
            let rss = common::rss_of(&pid);
            anyhow::ensure!(rss > 0, "the relay is gone");
            samples.push((done, rss));
            if warm_rss.is_none() && done >= i64::try_from(warm_up).unwrap_or(i64::MAX) {
                warm_rss = Some((done, rss));
            }
            next_sample += Duration::from_secs(1);
        }
        if done >= i64::try_from(n).unwrap_or(i64::MAX) {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(3_600),
            "the soak did not finish within an hour ({done} of {n} sent)"
        );
        if written < n && (written as i64) - done < PENDING {
            let chunk = CHUNK.min(n - written);
            let msgs: Vec<_> = (written..written + chunk)
                .map(|i| message("soak", i as u64, body))
                .collect::<anyhow::Result<_>>()?;
            let mut tx = db.outbox.begin().await?;
            db.outbox.enqueue_batch(&mut tx, &msgs).await?;
            tx.commit().await?;
            written += chunk;
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let elapsed = started.elapsed();
    let end_rss = common::rss_of(&pid);
    stop(relay).await?;
    let (warm_sent, warm_rss) = warm_rss.context("no sample after the warm-up")?;
    let peak = samples.iter().map(|&(_, rss)| rss).max().unwrap_or(end_rss);
    let after = (n as i64 - warm_sent).max(1);
    let growth = end_rss as i64 - warm_rss as i64;
    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    println!(
        "soak: {n} messages in {:.0} s ({:.0} msg/s); relay RSS {:.1} MiB after the warm-up ({warm_sent} sent), {:.1} MiB at the end, peak {:.1} MiB",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        mib(warm_rss as i64),
        mib(end_rss as i64),
        mib(peak as i64),
    );
    println!(
        "soak: growth after the warm-up {:+.2} MiB over {after} messages ({:+.1} bytes per message); target: under 1 MiB: {}",
        mib(growth),
        growth as f64 / after as f64,
        if growth < 1024 * 1024 {
            "met"
        } else {
            "MISSED"
        }
    );
    // The trend, a tenth of the run at a time.
    let step = (samples.len() / 10).max(1);
    let trend: Vec<String> = samples
        .iter()
        .step_by(step)
        .map(|&(done, rss)| format!("{}k: {:.1}", done / 1000, mib(rss as i64)))
        .collect();
    println!("soak: RSS (MiB) by messages sent: {}", trend.join(", "));
    Ok(())
}
