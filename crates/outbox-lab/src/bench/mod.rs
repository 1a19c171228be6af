//! `cargo xtask bench`: relay throughput PostgreSQL → RabbitMQ (default) or NATS
//! JetStream (`--transport nats`) next to two ceilings measured in the same run:
//!
//! 1. **broker ceiling**: the raw client publishing the same number of 256-byte
//!    messages with the same metadata the relay sends, pipelined, without a database.
//!    RabbitMQ: lapin, persistent and mandatory to the same kind of exchange and queue,
//!    with publisher confirms, same properties and CloudEvents headers. NATS: async-nats
//!    JetStream publishes to the same kind of stream (file storage, 2-minute duplicate
//!    window), same `Nats-Msg-Id`, `Content-Type` and `ce-*` headers, awaiting PubAcks;
//! 2. **store ceiling**: the outbox store's claim + complete loop with a publisher that
//!    confirms instantly (no broker);
//! 3. **relay**: the real dispatcher with the RabbitMQ or NATS publisher.
//!
//! With `--database mysql` each round also measures the store ceiling and the relay on
//! MySQL / MariaDB, reported beside PostgreSQL's (see `mysql_rounds`).
//!
//! For reference it also runs the relay with the database out of the phase (messages
//! claimed from PostgreSQL before the clock starts, completions recorded nowhere), which
//! separates the cost of the dispatcher and publisher from the database's.
//!
//! The relay's ratio to the lower ceiling is the figure of merit (target ≥ 0.9). Each
//! round measures the store ceiling, then the broker ceiling and the relay in turns
//! (the ceiling first in odd rounds, the relay first in even ones: the order within a
//! round moves the ratio, on some days one way, on others the other), and the figure
//! is the geometric mean of the rounds' ratios, each relay
//! paired with the ceilings of its own round. With an even number of rounds (6 by
//! default) the order effect cancels; the report also gives the ratio by order.
//!
//! Every timed phase starts after a PostgreSQL `CHECKPOINT`, a `sync` and a wait for
//! idle cores, so no phase pays for the setup of another, and every broker phase right
//! after an untimed publish of the same size (then purged). The report says how busy the
//! relay's publishers were and how long a batch took to be confirmed, with and without
//! the database in the phase: whether the relay waited on the store or on the broker.
//! With `RUST_LOG=warn,outboxkit_core=info` each claim, publish and completion span is
//! printed as it closes, with its busy and idle time.
//!
//! - `phases`: the timed phases' building blocks (fresh tables, preloads, a quiet
//!   machine, the dispatcher over a database or over messages claimed in advance);
//! - `stores`: the databases the phases run on (PostgreSQL, MySQL / MariaDB);
//! - `mysql_rounds` (`--database mysql`): the MySQL phases of a round and their report;
//! - `ceilings`: the raw clients publishing what the relay publishes;
//! - `broker`: the bench's exchange and queue or stream, warmed up, purged, removed;
//! - `report`: the rounds, their medians and the figure of merit;
//! - `consumer_bench` (`--consumer`), `relay_latency_bench` (`--relay-process`,
//!   `--backlog`), `wal_throughput` (`--relay-process`'s throughput phase: the polling
//!   and the WAL relay draining a backlog, `--wal-throughput-messages`,
//!   `--wal-throughput-only`), `soak` (`--soak`) and `statements` (`--statements`):
//!   the benchmark's other measurements.

mod broker;
mod ceilings;
mod consumer_bench;
mod mysql_rounds;
mod phases;
mod relay_latency_bench;
mod report;
mod soak;
mod statements;
mod stores;
mod wal_throughput;

pub(crate) use outboxkit_core::TransportKind;
use std::sync::Arc;
use std::time::Duration;
pub use stores::DatabaseKind;

use anyhow::Context as _;
use clap::Parser;
use outboxkit_core::{EventPublisher, OnDead, Ordering, OutboxStore, SentRetention};
use outboxkit_nats::{NatsConfig, NatsPublisher};
use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};

use crate::common;
// The phases' and the report's names, as `consumer_bench` and `relay_latency_bench`
// use them (`super::quiesce`, ...).
use broker::{Broker, rabbit_admin_with_exchange};
use phases::{
    commit_to_publish, drop_schema, fresh_outbox, fresh_outbox_keeping, instant_publisher, payload,
    preload, preload_keyed, quiesce, run_dispatcher, run_dispatcher_with, run_preclaimed,
    steady_latency,
};
use report::{Round, rate};
use stores::BenchStore as _;

/// Relay benchmark: PostgreSQL → RabbitMQ or NATS JetStream, with both ceilings measured
/// in the same run.
#[derive(Debug, Clone, Parser)]
pub struct Args {
    /// The broker.
    #[arg(long, value_enum, default_value_t = TransportKind::Rabbit)]
    transport: TransportKind,
    /// The database: PostgreSQL alone, or `mysql` to measure MySQL / MariaDB
    /// (`MYSQL_URL`) beside it in every round: its store ceiling and its relay to the
    /// same broker. The relay benchmark only (not `--consumer`, `--relay-process`,
    /// `--backlog`, `--soak` or `--ordered`).
    #[arg(long, value_enum, default_value_t = DatabaseKind::Postgres)]
    database: DatabaseKind,
    /// Messages per phase.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 256)]
    payload_bytes: usize,
    /// Dispatcher batch size (messages per claim).
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Steady-state latency phase: messages per second written while the relay runs.
    #[arg(long, default_value_t = 2_000)]
    steady_rate: u64,
    /// Steady-state latency phase: seconds.
    #[arg(long, default_value_t = 5)]
    steady_secs: u64,
    /// Rounds to run. The broker ceiling and the relay take turns running first, so use
    /// an even number: the order of the two phases within a round measurably moves
    /// their ratio.
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    /// Batches in flight per dispatcher.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// What the store ceiling's and the relay's completions do with sent messages: keep
    /// (the library's default) or delete. The latency phases always keep them: their
    /// latency is read from `sent_at`.
    #[arg(long, default_value_t = SentRetention::Keep)]
    sent_retention: SentRetention,
    /// Measure ordered delivery per partition key instead (`Ordering::PerKey`) with 1,
    /// 10, 1,000 and 10,000 distinct keys, beside the unordered relay on the same data.
    #[arg(long)]
    ordered: bool,
    /// Run on the 3-node clusters of `cargo xtask services --cluster` instead of the
    /// single servers: every node's URL, quorum queues instead of classic ones, streams
    /// with 3 replicas. `cargo xtask bench -- --cluster` runs the same measurement on the
    /// single servers first, so one run shows what the replication costs.
    #[arg(long)]
    cluster: bool,
    /// Measure the consumer side instead (RabbitMQ or NATS → inbox → PostgreSQL): the
    /// raw consumer, the idempotent consumer per message and batched, with and without
    /// versions, a set-based batch handler, and the durable receiver and processor (see
    /// `consumer_bench.rs`). Uses `--messages`, `--payload-bytes`, `--rounds` and
    /// `--batch-size` (publishing only).
    #[arg(long)]
    consumer: bool,
    /// Measure `outbox relay` as its own process instead (default settings, the release
    /// binary next to this one): its idle PostgreSQL transactions per second,
    /// commit-to-publish at 20 and 500 msg/s, and what the notification trigger costs 4
    /// concurrent producers (see `relay_latency_bench.rs`); then the WAL relay's, and
    /// the throughput of the polling and the WAL relay draining a backlog beside the
    /// broker ceiling (see `wal_throughput.rs`).
    #[arg(long)]
    relay_process: bool,
    /// `--relay-process`'s throughput phase: the backlog of messages the polling relay
    /// and the WAL relay each drain as their own processes, in rounds, beside the broker
    /// ceiling (see `wal_throughput.rs`); 0 skips the phase.
    #[arg(long, value_name = "M", default_value_t = 50_000)]
    wal_throughput_messages: usize,
    /// With `--relay-process`: run its throughput phase only (not the idle, latency,
    /// trigger-cost and WAL latency phases).
    #[arg(long, requires = "relay_process")]
    wal_throughput_only: bool,
    /// Measure a backlog of N pending rows instead: the relay's gauges and `outbox
    /// stats` on it, and the relay draining `--messages` of it against a table of
    /// `--messages` rows (`--rounds` rounds). Combines with `--relay-process`.
    #[arg(long, value_name = "N")]
    backlog: Option<usize>,
    /// Measure the memory of `outbox relay` as its own process instead, while it relays
    /// N messages (e.g. 2000000) with nothing scraping `/metrics`: its RSS after the
    /// first 100,000 and at the end, for the polling and the WAL relay (see `soak.rs`).
    #[arg(long, value_name = "N")]
    soak: Option<usize>,
    /// With `--soak`: which relays (`both`: the polling relay, then the WAL relay).
    #[arg(long, value_enum, default_value_t = soak::SoakSource::Both, requires = "soak")]
    soak_source: soak::SoakSource,
    /// Measure the relay under vacuum pressure instead: the steady phase
    /// (`--steady-rate` messages/s for `--steady-secs`, e.g. 1000 and 120) twice, first
    /// as usual, then while another session holds a REPEATABLE READ snapshot open for the
    /// whole phase, so that nothing completed can be vacuumed or marked dead in the
    /// index (autovacuum is off on the bench's tables either way). Commit-to-publish
    /// over the whole phase and over its last fifth, and the ratio (see `phases.rs`).
    #[arg(long)]
    hold_xmin: bool,
    /// Measure how long the producer's and the relay's large statements take instead
    /// (`enqueue_batch` of 500 and 5,000 messages, the completion of 500), counting
    /// those of 40 ms or more: the Nagle stalls of a connection without `TCP_NODELAY`
    /// (see `statements.rs`). PostgreSQL; uses `--payload-bytes`.
    #[arg(long)]
    statements: bool,
}

/// The `bench` binary: runs the benchmark `args` asks for (see the
/// [module docs](self)) and prints its report.
///
/// # Errors
/// When a service cannot be reached, a phase fails its checks (dead or retried
/// messages, a relay that does not finish within 10 minutes) or a broker stops
/// confirming.
pub async fn main(args: Args) -> anyhow::Result<()> {
    if args.cluster {
        anyhow::ensure!(
            outboxkit_testkit::cluster::running(),
            "the clusters are not running: start them with `cargo xtask services --cluster`"
        );
        common::use_cluster();
        println!(
            "on the 3-node clusters (quorum queues, R3 streams): {} and {}",
            common::amqp_url(),
            common::nats_url()
        );
    }
    let mysql = args.database == DatabaseKind::Mysql;
    anyhow::ensure!(
        !mysql
            || !(args.consumer
                || args.relay_process
                || args.backlog.is_some()
                || args.soak.is_some()
                || args.ordered
                || args.statements),
        "--database mysql measures the relay benchmark only: not with --consumer, --relay-process, --backlog, --soak, --ordered or --statements"
    );
    if args.consumer {
        return consumer_bench::run(&args).await;
    }
    if args.statements {
        return statements::run(args.payload_bytes).await;
    }
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let broker = Broker::setup(args.transport, &tag).await?;
    let result = match &broker {
        Broker::Rabbit { exchange, .. } => {
            let publisher = RabbitPublisher::connect(
                RabbitConfig::new(common::amqp_url())
                    .with_exchange(exchange)
                    .with_declare_exchange(false),
            )
            .await?;
            run(&args, &broker, Arc::new(publisher)).await
        }
        Broker::Nats { prefix, .. } => {
            let publisher = NatsPublisher::connect(
                NatsConfig::new(common::nats_url()).with_subject_prefix(prefix),
            )
            .await?;
            run(&args, &broker, Arc::new(publisher)).await
        }
    };
    broker.cleanup().await?;
    result
}

/// `--hold-xmin`: the steady phase as usual, then with the xmin horizon held for its
/// whole length; the relay's commit-to-publish in both, overall and in the last fifth
/// of the messages (where walking the completed rows' remains would show most).
async fn held_horizon<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: Arc<P>,
) -> anyhow::Result<()> {
    let body = payload(args.payload_bytes);
    println!(
        "relay under vacuum pressure, PostgreSQL → {}: {} messages/s for {} s of {} bytes, batch {}, {} batches in flight, autovacuum off on the table, {} CPUs",
        broker.name(),
        args.steady_rate,
        args.steady_secs,
        body.len(),
        args.batch_size,
        args.concurrency,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let mut p99s = Vec::new();
    for (name, hold) in [("as usual", false), ("xmin horizon held", true)] {
        let latencies = phases::steady_run(Arc::clone(&publisher), args, &body, hold).await?;
        broker.purge().await?;
        let fifth = &latencies[latencies.len() - latencies.len() / 5..];
        let (Some((p50, p99)), Some((last_p50, last_p99))) =
            (common::percentiles(&latencies), common::percentiles(fifth))
        else {
            anyhow::bail!("{name}: no message was sent");
        };
        println!(
            "{name}: {} sent; commit-to-publish p50 {} p99 {}; last fifth p50 {} p99 {}",
            latencies.len(),
            common::ms(p50),
            common::ms(p99),
            common::ms(last_p50),
            common::ms(last_p99)
        );
        p99s.push(last_p99);
    }
    println!(
        "last fifth's p99 with the horizon held / as usual: {:.2} (target: at most 2)",
        p99s[1].as_secs_f64() / p99s[0].as_secs_f64().max(1e-6)
    );
    Ok(())
}

/// `--ordered`: per-key ordering with 1, 10, 1,000 and 10,000 keys against the unordered relay
/// on the same data, each preceded by the store-only (instant publisher) rate.
async fn run_ordered<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: Arc<P>,
) -> anyhow::Result<()> {
    let body = payload(args.payload_bytes);
    let n = args.messages;
    println!(
        "ordered relay benchmark, PostgreSQL → {}: {n} messages of {} bytes, batch {}, {} batches in flight, sent retention {}, {} CPUs, median of {} rounds",
        broker.name(),
        body.len(),
        args.batch_size,
        args.concurrency,
        args.sent_retention,
        std::thread::available_parallelism().map_or(0, usize::from),
        args.rounds.max(1)
    );
    let per_key = Ordering::PerKey {
        on_dead: OnDead::Block,
    };
    let mut rows = Vec::new();
    for keys in [None, Some(1), Some(10), Some(1000), Some(10_000)] {
        let mut store_runs = Vec::new();
        let mut relay_runs = Vec::new();
        let ordering = if keys.is_some() {
            per_key
        } else {
            Ordering::Unordered
        };
        for _ in 0..args.rounds.max(1) {
            let db = fresh_outbox_keeping("ostore", args.sent_retention).await?;
            preload_keyed(&db, n, &body, keys).await?;
            quiesce(&db).await;
            store_runs.push(
                run_dispatcher_with(&db, instant_publisher(), args, ordering)
                    .await?
                    .elapsed,
            );
            drop_schema(&db).await;
            let db = fresh_outbox_keeping("orelay", args.sent_retention).await?;
            preload_keyed(&db, n, &body, keys).await?;
            quiesce(&db).await;
            relay_runs.push(
                run_dispatcher_with(&db, Arc::clone(&publisher), args, ordering)
                    .await?
                    .elapsed,
            );
            drop_schema(&db).await;
            broker.purge().await?;
        }
        store_runs.sort();
        relay_runs.sort();
        let (store, relay) = (
            store_runs[store_runs.len() / 2],
            relay_runs[relay_runs.len() / 2],
        );
        let label = keys.map_or("unordered".to_owned(), |k| format!("PerKey, {k} keys"));
        println!(
            "{label}: store {:.0}/s, relay {:.0}/s",
            rate(n, store),
            rate(n, relay)
        );
        rows.push((label, rate(n, store), rate(n, relay)));
    }
    let unordered_relay = rows[0].2;
    println!();
    println!("| mode | store only (claim + complete) msg/s | relay msg/s | relay vs unordered |");
    println!("|---|---:|---:|---:|");
    for (label, store, relay) in &rows {
        println!(
            "| {label} | {store:.0} | {relay:.0} | {:.2} |",
            relay / unordered_relay
        );
    }
    Ok(())
}

/// The rounds, the steady-state phase and the report, with `publisher` as the relay's.
async fn run<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: Arc<P>,
) -> anyhow::Result<()> {
    if args.ordered {
        return run_ordered(args, broker, publisher).await;
    }
    if let Some(n) = args.soak {
        return soak::run(broker, &payload(args.payload_bytes), n, args.soak_source).await;
    }
    if args.relay_process || args.backlog.is_some() {
        return relay_latency_bench::run(args, broker, publisher).await;
    }
    if args.hold_xmin {
        return held_horizon(args, broker, publisher).await;
    }
    let body = payload(args.payload_bytes);
    let n = args.messages;
    let mysql = match args.database {
        DatabaseKind::Mysql => Some(mysql_rounds::server().await?),
        DatabaseKind::Postgres => None,
    };
    println!(
        "outbox relay benchmark, PostgreSQL{} → {}: {n} messages of {} bytes, batch {}, {} batches in flight, sent retention {}, {} CPUs",
        mysql
            .as_ref()
            .map_or_else(String::new, |server| format!(" and {server}")),
        broker.name(),
        body.len(),
        args.batch_size,
        args.concurrency,
        args.sent_retention,
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let cpu = || common::CpuTimes::now_with(broker.comm());

    // Several rounds; the broker ceiling and the relay swap places every round, because
    // the order within a round moves their ratio (by up to 15-20% on the development
    // machine, warm-up or not; the first phase was the slower one on some days, the
    // second on others): with an even number of rounds each runs first equally often.
    if !args.rounds.is_multiple_of(2) {
        println!(
            "note: {} rounds: the relay runs second in one round more than the ceiling, so the order effect does not cancel",
            args.rounds
        );
    }
    let mut rounds = Vec::new();
    let mut latency = None;
    let mut sent = 0;
    let mut peak_rss = 0;
    let baseline_rss = common::rss_bytes();
    let mut settled = Duration::ZERO;
    let mut mysql_rounds = Vec::new();
    for round in 0..args.rounds.max(1) {
        // MySQL's phases after PostgreSQL's in odd rounds, before them in even ones.
        let mysql_first = round % 2 == 1;
        let mut mysql_round = None;
        if mysql.is_some() && mysql_first {
            mysql_round = Some(mysql_rounds::round(args, broker, &publisher, &body).await?);
        }
        let store_db = fresh_outbox_keeping("store", args.sent_retention).await?;
        preload(&store_db, n, &body).await?;
        settled = settled.max(quiesce(&store_db).await);
        let cpu0 = cpu();
        let store = run_dispatcher(&store_db, instant_publisher(), args).await?;
        let store_cpu = cpu().since(cpu0);
        drop_schema(&store_db).await;

        let relay_db = fresh_outbox_keeping("relay", args.sent_retention).await?;
        preload(&relay_db, n, &body).await?;
        let reference_db = fresh_outbox("reference").await?;
        preload(&reference_db, n, &body).await?;
        let mut ceiling = None;
        let mut relay = None;
        let mut reference = None;
        // Ceiling, relay, reference in even rounds, the reverse in odd ones: each pair
        // runs in both orders equally often over an even number of rounds.
        let order = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for phase in order {
            settled = settled.max(quiesce(&relay_db).await);
            broker.warm_up(args, body.as_bytes()).await?;
            let cpu0 = cpu();
            match phase {
                0 => {
                    let elapsed = broker.ceiling(args, body.as_bytes(), false).await?;
                    ceiling = Some((elapsed, cpu().since(cpu0)));
                }
                1 => {
                    let run = run_dispatcher(&relay_db, Arc::clone(&publisher), args).await?;
                    relay = Some((run, cpu().since(cpu0)));
                }
                _ => {
                    let elapsed = broker.reference_relay(args, &reference_db).await?;
                    reference = Some((elapsed, cpu().since(cpu0)));
                }
            }
            broker.purge().await?;
        }
        let reference_sent = reference_db.rows(true).await?;
        drop_schema(&reference_db).await;
        anyhow::ensure!(
            reference_sent == n as i64,
            "the reference relay marked {reference_sent} of {n} sent"
        );
        // The same relay with the database out of the phase: the messages of a third
        // table are claimed before the clock starts.
        let pre_db = fresh_outbox("preclaimed").await?;
        preload(&pre_db, n, &body).await?;
        let claimed = pre_db.claim(n, Duration::from_secs(3600)).await?.messages;
        drop_schema(&pre_db).await;
        settled = settled.max(quiesce(&relay_db).await);
        broker.warm_up(args, body.as_bytes()).await?;
        let cpu0 = cpu();
        let pipeline = run_preclaimed(claimed, Arc::clone(&publisher), args).await?;
        let pipeline_cpu = cpu().since(cpu0);
        broker.purge().await?;
        settled = settled.max(quiesce(&relay_db).await);
        broker.warm_up(args, body.as_bytes()).await?;
        let bare = broker.ceiling(args, body.as_bytes(), true).await?;
        broker.purge().await?;
        latency = commit_to_publish(&relay_db).await?;
        // Sent rows under Keep; rows left (none expected) under Delete.
        sent = relay_db
            .rows(args.sent_retention != SentRetention::Delete)
            .await?;
        drop_schema(&relay_db).await;
        let (broker_elapsed, broker_cpu) = ceiling.context("broker phase ran")?;
        let (relay, relay_cpu) = relay.context("relay phase ran")?;
        let (reference, reference_cpu) = reference.context("reference phase ran")?;
        if round == 0 {
            // Later rounds start with the heap the pre-claimed phase left behind.
            peak_rss = relay.peak_rss;
        }
        let r = Round {
            relay_first: round % 2 == 1,
            store: store.elapsed,
            store_cpu,
            broker: broker_elapsed,
            broker_cpu,
            relay: relay.elapsed,
            relay_cpu,
            relay_publishing: relay.publishing,
            pipeline: pipeline.elapsed,
            pipeline_cpu,
            pipeline_publishing: pipeline.publishing,
            bare,
            reference,
            reference_cpu,
        };
        println!(
            "round {}: store {:.0}/s, broker {:.0}/s, relay {:.0}/s, reference relay {:.0}/s, relay without database {:.0}/s, ratio {:.2} ({} first)",
            round + 1,
            rate(n, r.store),
            rate(n, r.broker),
            rate(n, r.relay),
            rate(n, r.reference),
            rate(n, r.pipeline),
            r.ratio(n),
            if r.relay_first { "relay" } else { "ceiling" }
        );
        if mysql.is_some() && !mysql_first {
            mysql_round = Some(mysql_rounds::round(args, broker, &publisher, &body).await?);
        }
        if let (Some(server), Some(my)) = (&mysql, mysql_round) {
            my.print(server, n, &r);
            mysql_rounds.push(my);
        }
        rounds.push(r);
    }
    let steady = steady_latency(Arc::clone(&publisher), args, &body).await?;
    broker.purge().await?;
    report::print(
        args,
        broker,
        &rounds,
        report::Totals {
            latency,
            steady,
            sent,
            settled,
            peak_rss,
            baseline_rss,
        },
    );
    if let Some(server) = &mysql {
        mysql_rounds::print(args, broker, server, &rounds, &mysql_rounds);
    }
    Ok(())
}
