//! `--database mysql`: in every round of the relay benchmark, the store ceiling (claim +
//! complete with an instantly confirming publisher) and the relay to the same broker on
//! MySQL / MariaDB, run the same way as PostgreSQL's (fresh tables, the same preload, a
//! quiet machine, the same dispatcher settings), and reported beside them with the
//! ratio MySQL / PostgreSQL (issue 30's target for the relay: ≥ 0.8).
//!
//! The MySQL phases run after PostgreSQL's in odd rounds and before them in even ones,
//! so that with an even number of rounds neither database always runs first.

use std::sync::Arc;
use std::time::Duration;

use outboxkit_core::{EventPublisher, SentRetention};
use outboxkit_mysql::MySqlOutbox;

use super::phases::Publishing;
use super::report::{Round, median, print_cpu, rate};
use super::stores::BenchStore as _;
use super::{Args, Broker, commit_to_publish, drop_schema, instant_publisher, preload, quiesce};
use crate::common;

/// One round's MySQL phases.
pub(super) struct MySqlRound {
    store: Duration,
    store_cpu: common::CpuTimes,
    relay: Duration,
    relay_cpu: common::CpuTimes,
    relay_publishing: Publishing,
    /// Commit-to-publish p50 and p99 of the relay's backlog.
    latency: Option<(Duration, Duration)>,
    /// Rows marked Sent (rows left, under `SentRetention::Delete`) after the relay.
    sent: i64,
}

/// The server's name and version, e.g. `MariaDB 10.11.6` (`MySQL 8.0.36`).
pub(super) async fn server() -> anyhow::Result<String> {
    let db = MySqlOutbox::fresh("version", SentRetention::Keep).await?;
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(db.pool())
        .await?;
    drop_schema(&db).await;
    Ok(label(&version))
}

/// `10.11.6-MariaDB-0+deb12u1` → `MariaDB 10.11.6`; `8.0.36` → `MySQL 8.0.36`.
fn label(version: &str) -> String {
    let number = version.split('-').next().unwrap_or(version);
    if version.contains("MariaDB") {
        format!("MariaDB {number}")
    } else {
        format!("MySQL {number}")
    }
}

/// The store ceiling and the relay on MySQL, each on fresh tables of `n` messages.
pub(super) async fn round<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: &Arc<P>,
    body: &str,
) -> anyhow::Result<MySqlRound> {
    let n = args.messages;
    let cpu = || common::CpuTimes::now_with(broker.comm());
    let store_db = MySqlOutbox::fresh("store", args.sent_retention).await?;
    preload(&store_db, n, body).await?;
    quiesce(&store_db).await;
    let cpu0 = cpu();
    let store = super::run_dispatcher(&store_db, instant_publisher(), args).await?;
    let store_cpu = cpu().since(cpu0);
    drop_schema(&store_db).await;

    let relay_db = MySqlOutbox::fresh("relay", args.sent_retention).await?;
    preload(&relay_db, n, body).await?;
    quiesce(&relay_db).await;
    broker.warm_up(args, body.as_bytes()).await?;
    let cpu0 = cpu();
    let relay = super::run_dispatcher(&relay_db, Arc::clone(publisher), args).await?;
    let relay_cpu = cpu().since(cpu0);
    broker.purge().await?;
    let latency = commit_to_publish(&relay_db).await?;
    let sent = relay_db
        .rows(args.sent_retention != SentRetention::Delete)
        .await?;
    drop_schema(&relay_db).await;
    Ok(MySqlRound {
        store: store.elapsed,
        store_cpu,
        relay: relay.elapsed,
        relay_cpu,
        relay_publishing: relay.publishing,
        latency,
        sent,
    })
}

impl MySqlRound {
    /// The round's line, after PostgreSQL's.
    pub(super) fn print(&self, server: &str, n: usize, pg: &Round) {
        println!(
            "  {server}: store {:.0}/s, relay {:.0}/s, relay {server} / PostgreSQL {:.2}",
            rate(n, self.store),
            rate(n, self.relay),
            rate(n, self.relay) / rate(n, pg.relay)
        );
    }
}

/// The MySQL phases beside PostgreSQL's: medians, the geometric mean of the rounds'
/// ratios, CPU and the publishers' load in the round with the median MySQL relay.
pub(super) fn print(args: &Args, broker: &Broker, server: &str, pg: &[Round], my: &[MySqlRound]) {
    let n = args.messages;
    let geomean = |ratios: Vec<f64>| -> f64 {
        (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len().max(1) as f64).exp()
    };
    let pg_store = median(pg.iter().map(|r| r.store).collect());
    let pg_relay = median(pg.iter().map(|r| r.relay).collect());
    let my_store = median(my.iter().map(|r| r.store).collect());
    let my_relay = median(my.iter().map(|r| r.relay).collect());
    let store_ratio = geomean(
        pg.iter()
            .zip(my)
            .map(|(p, m)| rate(n, m.store) / rate(n, p.store))
            .collect(),
    );
    let relay_ratio = geomean(
        pg.iter()
            .zip(my)
            .map(|(p, m)| rate(n, m.relay) / rate(n, p.relay))
            .collect(),
    );
    println!();
    println!(
        "{server} beside PostgreSQL, medians of {} rounds (messages/s; ratio: geometric mean of the rounds' ratios):",
        my.len()
    );
    println!("| phase | PostgreSQL | {server} | {server} / PostgreSQL |");
    println!("|---|---:|---:|---:|");
    println!(
        "| store ceiling (claim + complete, no broker) | {:.0} | {:.0} | {store_ratio:.2} |",
        rate(n, pg_store),
        rate(n, my_store)
    );
    println!(
        "| relay → {} | {:.0} | {:.0} | {relay_ratio:.2} (target ≥ 0.80) |",
        broker.name(),
        rate(n, pg_relay),
        rate(n, my_relay)
    );
    let mid = {
        let mut by_relay: Vec<&MySqlRound> = my.iter().collect();
        by_relay.sort_by_key(|r| r.relay);
        by_relay[by_relay.len() / 2]
    };
    println!(
        "CPU seconds per {server} phase in the round with its median relay time ({} / database / this process):",
        broker.name()
    );
    for (phase, cpu, d) in [
        ("store ceiling", mid.store_cpu, mid.store),
        ("relay", mid.relay_cpu, mid.relay),
    ] {
        print_cpu(phase, cpu, d);
    }
    println!(
        "publishers in that round: busy {:.0}% of the {server} relay phase, a batch confirmed {} after its first send",
        100.0 * mid.relay_publishing.busy,
        common::ms(mid.relay_publishing.per_batch),
    );
    let last = my.last();
    if args.sent_retention == SentRetention::Delete {
        println!(
            "rows left in the {server} outbox after the relay: {} of {n} (sent rows are deleted)",
            last.map_or(0, |r| r.sent)
        );
    } else {
        println!(
            "{server} messages marked Sent: {} of {n}",
            last.map_or(0, |r| r.sent)
        );
    }
    if let Some((p50, p99)) = last.and_then(|r| r.latency) {
        println!(
            "{server} commit-to-publish latency, backlog of {n} pre-inserted (last round): p50 {} p99 {}",
            common::ms(p50),
            common::ms(p99)
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn servers_are_named_from_their_version() {
        assert_eq!(super::label("10.11.6-MariaDB-0+deb12u1"), "MariaDB 10.11.6");
        assert_eq!(super::label("8.0.36"), "MySQL 8.0.36");
    }
}
