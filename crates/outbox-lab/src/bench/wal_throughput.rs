//! `--relay-process`'s throughput phase (issue 32): the polling relay and the WAL relay
//! (`outbox relay --source wal`), each the release `outbox` as its own process with
//! default settings, draining the same backlog in the same run, and the broker's own
//! publish rate (the ceiling of `ceilings.rs`) beside them.
//!
//! Each round runs three phases: the polling relay, the WAL relay and the broker
//! ceiling, in that order in odd rounds and the reverse in even ones (the two relays
//! take turns going first; with an even number of rounds, [`ROUNDS`], each goes first
//! equally often). A relay phase:
//! 1. a fresh schema in the `--relay-process` database (`wtp_{tag}_{source}{round}`,
//!    autovacuum off, as the other phases' tables);
//! 2. for the WAL relay, `outbox wal setup` (publication, slot, trigger disabled)
//!    *before* anything is committed: a slot sees only what commits after it;
//! 3. the backlog: `--wal-throughput-messages` messages (default 50,000) of
//!    `--payload-bytes`, committed by [`PRODUCERS`] connections in transactions of
//!    [`ROWS_PER_TX`] rows, then `ANALYZE`;
//! 4. an untimed broker warm-up (`--messages` messages, then purged) and the quiet
//!    machine of the other phases (`CHECKPOINT`, `sync`, idle cores);
//! 5. `outbox relay` (or `outbox relay --source wal`) started, and the clock with it;
//!    every [`POLL`] the pending rows are counted until none is left; then the rows'
//!    `sent_at` (database clock, this host's: one machine) give the time from the
//!    process start to the first row recorded `Sent` (the relay's start: connections,
//!    the slot's session, the WAL relay's first small rounds), and from the first to the
//!    last: the drain rate is messages / (last − first), the total rate messages /
//!    (last − process start). The relay's own CPU (`/proc/<pid>/stat`) and
//!    PostgreSQL's and the broker's over the phase are reported per message;
//! 6. the relay stopped (SIGTERM), `outbox wal drop --force` (also when the phase
//!    failed or panicked: a guard), the schema dropped, the sink purged.
//!
//! The ceiling phase publishes the same number of messages with the raw client
//! (`Broker::ceiling`, `--concurrency` publishers of `--batch-size` windows, the
//! relay's defaults too), after the same warm-up and quiet machine.
//!
//! The report gives every round's rates, the medians, the ratio WAL / polling (issue
//! 32's target to NATS: ≥ 1.2) and WAL / broker ceiling (target to RabbitMQ: ≥ 0.95).
//! On a 2-core machine the relay, the walsender, PostgreSQL, the broker and this
//! process share the cores.

use outboxkit_core::OutboxProducer;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use outboxkit_postgres::{PgConfig, PgOutbox};
use sqlx::AssertSqlSafe;

use super::relay_latency_bench::{Db, message, outbox_command, spawn_relay, stop};
use super::report::median;
use super::{Args, Broker, rate};

/// Rounds (even: each relay goes first in half of them).
pub(super) const ROUNDS: usize = 4;
/// Producer connections committing the backlog.
const PRODUCERS: usize = 4;
/// Rows per producer transaction.
const ROWS_PER_TX: usize = 100;
/// How often the pending rows are counted while a relay drains the backlog.
const POLL: Duration = Duration::from_millis(500);
/// How long a relay may take to drain the backlog.
const DRAIN_LIMIT: Duration = Duration::from_secs(600);

/// Where the relay reads the backlog from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    Polling,
    Wal,
}

impl Source {
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Polling => "polling relay",
            Self::Wal => "WAL relay",
        }
    }

    /// `outbox relay`'s arguments for this source.
    pub(super) fn relay_args(self) -> &'static [&'static str] {
        match self {
            Self::Polling => &[],
            Self::Wal => &["--source", "wal"],
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Self::Polling => "p",
            Self::Wal => "w",
        }
    }
}

/// One relay phase's timings and CPU seconds.
#[derive(Debug, Clone, Copy)]
struct Drain {
    /// Process start to the first row recorded `Sent`.
    start: Duration,
    /// First row recorded `Sent` to the last.
    drain: Duration,
    /// Process start to the last row recorded `Sent`.
    total: Duration,
    relay_cpu: f64,
    database_cpu: f64,
    broker_cpu: f64,
    /// How long the quiet-machine wait before the phase took (10 s: the cores never
    /// went idle, something else was running).
    settled: Duration,
}

/// Runs the rounds in `db`'s database and prints the report.
pub(super) async fn run(args: &Args, db: &Db, broker: &Broker, body: &str) -> anyhow::Result<()> {
    let m = args.wal_throughput_messages;
    println!(
        "throughput, out of process: a backlog of {m} messages of {} bytes ({PRODUCERS} producers, {ROWS_PER_TX} rows per transaction, committed before the relay starts; for the WAL relay after `outbox wal setup`), drained by `outbox relay` (defaults) and `outbox relay --source wal` → {}, beside the {}; {ROUNDS} rounds, {} CPUs",
        body.len(),
        broker.name(),
        broker.ceiling_label(),
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let tag = uuid::Uuid::new_v4().simple().to_string()[..6].to_owned();
    let mut ceiling_args = args.clone();
    ceiling_args.messages = m;
    let (mut polling, mut wal, mut ceiling) = (Vec::new(), Vec::new(), Vec::new());
    let mut settled = Vec::new();
    for round in 0..ROUNDS {
        let order = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for phase in order {
            match phase {
                0 | 1 => {
                    let source = if phase == 0 {
                        Source::Polling
                    } else {
                        Source::Wal
                    };
                    let schema = format!("wtp_{tag}_{}{}", source.tag(), round + 1);
                    let d = relay_phase(args, db, broker, body, &schema, source).await?;
                    if source == Source::Polling {
                        polling.push(d);
                    } else {
                        wal.push(d);
                    }
                }
                _ => {
                    broker.warm_up(args, body.as_bytes()).await?;
                    let waited = super::quiesce(&db.outbox).await;
                    settled.push(waited);
                    let elapsed = broker
                        .ceiling(&ceiling_args, body.as_bytes(), false)
                        .await?;
                    broker.purge().await?;
                    ceiling.push(elapsed);
                }
            }
        }
        let (p, w, c) = (polling[round], wal[round], ceiling[round]);
        println!(
            "round {}: polling relay {:.0} msg/s (first to last Sent; {:.0} msg/s from process start, first Sent after {}), WAL relay {:.0} msg/s ({:.0} msg/s from process start, first Sent after {}), broker ceiling {:.0} msg/s; WAL / polling {:.2}, WAL / ceiling {:.2} ({})",
            round + 1,
            rate(m, p.drain),
            rate(m, p.total),
            crate::common::ms(p.start),
            rate(m, w.drain),
            rate(m, w.total),
            crate::common::ms(w.start),
            rate(m, c),
            rate(m, w.drain) / rate(m, p.drain),
            rate(m, w.drain) / rate(m, c),
            if round % 2 == 0 {
                "polling relay first"
            } else {
                "WAL relay first, after the ceiling"
            }
        );
    }
    report(m, broker, &polling, &wal, &ceiling);
    settled.extend(polling.iter().chain(&wal).map(|d| d.settled));
    let noisy = settled
        .iter()
        .filter(|d| **d >= super::phases::SETTLE_MAX)
        .count();
    println!(
        "  quiet machine before the phases: waited {} at most; {noisy} of {} phases started without the cores going idle (another load on the machine){}",
        crate::common::ms(settled.iter().copied().max().unwrap_or_default()),
        settled.len(),
        std::fs::read_to_string("/proc/loadavg")
            .map(|l| format!("; load average now {}", l.trim()))
            .unwrap_or_default()
    );
    Ok(())
}

/// Medians, ranges, ratios against issue 32's targets, and CPU per message.
fn report(m: usize, broker: &Broker, polling: &[Drain], wal: &[Drain], ceiling: &[Duration]) {
    let rates = |v: Vec<Duration>| {
        let mut r: Vec<f64> = v.iter().map(|d| rate(m, *d)).collect();
        r.sort_by(f64::total_cmp);
        (rate(m, median(v)), r[0], r[r.len() - 1])
    };
    let drains = |d: &[Drain]| rates(d.iter().map(|d| d.drain).collect());
    let totals = |d: &[Drain]| rates(d.iter().map(|d| d.total).collect());
    let starts = |d: &[Drain]| median(d.iter().map(|d| d.start).collect());
    let (p, p_lo, p_hi) = drains(polling);
    let (w, w_lo, w_hi) = drains(wal);
    let (pt, pt_lo, pt_hi) = totals(polling);
    let (wt, wt_lo, wt_hi) = totals(wal);
    let (c, c_lo, c_hi) = rates(ceiling.to_vec());
    println!(
        "medians of {} rounds, {m} messages → {}:",
        polling.len(),
        broker.name()
    );
    println!(
        "  polling relay: {p:.0} msg/s first to last Sent (range {p_lo:.0} – {p_hi:.0}), {pt:.0} msg/s from process start ({pt_lo:.0} – {pt_hi:.0}), first Sent {} after start",
        crate::common::ms(starts(polling))
    );
    println!(
        "  WAL relay:     {w:.0} msg/s first to last Sent (range {w_lo:.0} – {w_hi:.0}), {wt:.0} msg/s from process start ({wt_lo:.0} – {wt_hi:.0}), first Sent {} after start",
        crate::common::ms(starts(wal))
    );
    println!(
        "  {}: {c:.0} msg/s (range {c_lo:.0} – {c_hi:.0})",
        broker.ceiling_label()
    );
    let target = |ratio: f64, goal: f64| {
        if ratio >= goal { "met" } else { "not met" }
    };
    let (ratio, total_ratio) = (w / p, wt / pt);
    let (vs_ceiling, total_vs_ceiling) = (w / c, wt / c);
    match broker {
        Broker::Nats { .. } => {
            println!(
                "  WAL / polling: {ratio:.2} first to last, {total_ratio:.2} from process start (issue 32: ≥ 1.2 to NATS: {}); WAL / ceiling {vs_ceiling:.2} ({total_vs_ceiling:.2})",
                target(ratio, 1.2)
            );
        }
        Broker::Rabbit { .. } => {
            println!(
                "  WAL / ceiling: {vs_ceiling:.2} first to last, {total_vs_ceiling:.2} from process start (issue 32: ≥ 0.95 to RabbitMQ: {}); WAL / polling {ratio:.2} ({total_ratio:.2})",
                target(vs_ceiling, 0.95)
            );
        }
    }
    let per_message = |d: &[Drain], f: fn(&Drain) -> f64| {
        let mut v: Vec<f64> = d.iter().map(|d| f(d) * 1e6 / m as f64).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (label, d) in [("polling relay", polling), ("WAL relay", wal)] {
        println!(
            "  CPU per message, {label} (median; process start to last Sent): the relay process {:.1} µs, PostgreSQL {:.1} µs (walsender included), {} {:.1} µs",
            per_message(d, |d| d.relay_cpu),
            per_message(d, |d| d.database_cpu),
            broker.name(),
            per_message(d, |d| d.broker_cpu),
        );
    }
}

/// `outbox wal drop --force` for a schema when dropped, unless [`disarm`](Self::disarm)ed
/// first: the slot and the publication never outlive a phase, also when it fails or
/// panics.
pub(super) struct SlotGuard {
    url: String,
    schema: String,
    armed: bool,
}

impl SlotGuard {
    /// `outbox wal setup` for `schema` (publication, slot, trigger disabled), and the
    /// guard that drops them.
    pub(super) fn setup(url: &str, schema: &str) -> anyhow::Result<Self> {
        let guard = Self {
            url: url.to_owned(),
            schema: schema.to_owned(),
            armed: true,
        };
        let status = outbox_command(url, schema)?
            .args(["wal", "setup"])
            .stdout(std::process::Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "`outbox wal setup` failed: {status}");
        Ok(guard)
    }

    fn drop_slot(&self) -> anyhow::Result<()> {
        let status = outbox_command(&self.url, &self.schema)?
            .args(["wal", "drop", "--force"])
            .stdout(std::process::Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "`outbox wal drop` failed: {status}");
        Ok(())
    }

    pub(super) fn disarm(mut self) -> anyhow::Result<()> {
        self.armed = false;
        self.drop_slot()
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if self.armed
            && let Err(e) = self.drop_slot()
        {
            eprintln!(
                "note: dropping the slot of schema {} failed: {e:#}; check pg_replication_slots",
                self.schema
            );
        }
    }
}

/// One relay phase in a fresh schema `schema` (steps 1 to 6 of the module docs).
async fn relay_phase(
    args: &Args,
    db: &Db,
    broker: &Broker,
    body: &str,
    schema: &str,
    source: Source,
) -> anyhow::Result<Drain> {
    let outbox = PgOutbox::connect(
        &PgConfig::new(db.url.clone())
            .with_schema(schema)
            .with_max_connections(PRODUCERS as u32 + 2),
    )
    .await?;
    let phase = Db {
        outbox,
        url: db.url.clone(),
        name: db.name.clone(),
    };
    let result = async {
        phase.outbox.migrate().await?;
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {schema}.outbox_messages SET (autovacuum_enabled = false)"
        )))
        .execute(phase.pool())
        .await?;
        let guard = match source {
            Source::Polling => None,
            Source::Wal => Some(SlotGuard::setup(&phase.url, schema)?),
        };
        let drained = drain(args, &phase, broker, body, source).await;
        let dropped = guard.map_or(Ok(()), SlotGuard::disarm);
        let drained = drained?;
        dropped?;
        anyhow::Ok(drained)
    }
    .await;
    broker.purge().await?;
    super::drop_schema(&phase.outbox).await;
    phase.outbox.pool().close().await;
    result
}

/// Steps 3 to 6 but the slot's removal: the backlog, the quiet machine, the relay timed.
async fn drain(
    args: &Args,
    phase: &Db,
    broker: &Broker,
    body: &str,
    source: Source,
) -> anyhow::Result<Drain> {
    let m = args.wal_throughput_messages;
    backlog(phase, m, body).await?;
    broker.warm_up(args, body.as_bytes()).await?;
    let settled = super::quiesce(&phase.outbox).await;
    let extra = source.relay_args();
    let cpu0 = crate::common::CpuTimes::now_with(broker.comm());
    let started = SystemTime::now();
    let relay = spawn_relay(phase, broker, extra)?;
    let pid = relay.id();
    let waited = async {
        let deadline = Instant::now() + DRAIN_LIMIT;
        loop {
            let pending: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT count(*) FROM {}.outbox_messages WHERE phase = 0",
                phase.schema()
            )))
            .fetch_one(phase.pool())
            .await?;
            if pending == 0 {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the {} left {pending} of {m} messages pending after {DRAIN_LIMIT:?}",
                source.label()
            );
            // Not more often: each count reads the backlog's index (and its dead
            // entries), CPU the relays' phases would share; the rates come from the
            // rows' `sent_at`, not from when the count sees the end.
            tokio::time::sleep(POLL).await;
        }
        anyhow::Ok(process_cpu(pid))
    }
    .await;
    let cpu = crate::common::CpuTimes::now_with(broker.comm()).since(cpu0);
    stop(relay).await?;
    let relay_cpu = waited?;
    let (sent, first, last): (i64, Option<f64>, Option<f64>) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE status = 1),
                    extract(epoch FROM min(sent_at))::float8,
                    extract(epoch FROM max(sent_at))::float8
               FROM {}.outbox_messages",
            phase.schema()
        )))
        .fetch_one(phase.pool())
        .await?;
    anyhow::ensure!(
        sent == i64::try_from(m)?,
        "the {} recorded {sent} of {m} messages Sent (the others dead?)",
        source.label()
    );
    let (first, last) = (first.context("no sent_at")?, last.context("no sent_at")?);
    let started = started
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_secs_f64();
    let secs = |s: f64| Duration::from_secs_f64(s.max(0.0));
    Ok(Drain {
        start: secs(first - started),
        drain: secs(last - first),
        total: secs(last - started),
        relay_cpu,
        database_cpu: cpu.database,
        broker_cpu: cpu.broker,
        settled,
    })
}

/// `m` messages from [`PRODUCERS`] connections in transactions of [`ROWS_PER_TX`] rows,
/// then `ANALYZE`.
async fn backlog(phase: &Db, m: usize, body: &str) -> anyhow::Result<()> {
    let mut producers = tokio::task::JoinSet::new();
    let per = m.div_ceil(PRODUCERS);
    for p in 0..PRODUCERS {
        let (outbox, body) = (phase.outbox.clone(), body.to_owned());
        let range = (p * per)..((p + 1) * per).min(m);
        producers.spawn(async move {
            let ids: Vec<usize> = range.collect();
            for chunk in ids.chunks(ROWS_PER_TX) {
                let messages = chunk
                    .iter()
                    .map(|&i| message("bench", i as u64, &body))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let mut tx = outbox.begin().await?;
                outbox.enqueue_batch(&mut tx, &messages).await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = producers.join_next().await {
        done??;
    }
    sqlx::query(AssertSqlSafe(format!(
        "ANALYZE {}.outbox_messages",
        phase.schema()
    )))
    .execute(phase.pool())
    .await?;
    Ok(())
}

/// CPU seconds (user + system) process `pid` used so far; 0 when `/proc` cannot say.
fn process_cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    (ticks(11).unwrap_or(0.0) + ticks(12).unwrap_or(0.0)) / 100.0
}
