//! `--relay-process` and `--backlog N`: the relay as users run it, and its cost at a
//! large backlog.
//!
//! **`--relay-process`** runs `outbox relay` (the release binary next to this one) as a
//! child process with default settings: only the database URL, the schema, the broker
//! (URL, exchange or subject prefix) and the endpoint's address (`127.0.0.1:0`, so that
//! it never collides) are given. This process is the producer. It measures:
//! 1. the idle relay's PostgreSQL transactions per second: the database's
//!    `xact_commit + xact_rollback` (`pg_stat_database`) over a window with the relay
//!    idle, minus the same over an equal window before it started (the bench's own two
//!    reads are in both);
//! 2. commit-to-publish at 20 and 500 messages/s, one single-row transaction per message
//!    on a fixed schedule, from a pool of connections (so a slow commit does not delay
//!    the next one): `sent_at - created_at` (database clock, from the producer's
//!    transaction start to the relay's recording of the broker's confirm),
//!    split where the producer's commit returned (this host's wall clock): the
//!    producer's transaction, and the relay's part after it; and from the commit
//!    returning to a subscriber of the broker receiving the message (the publish as a
//!    consumer sees it, without the relay's recording: see `broker::Receipts`); then
//!    the 500 msg/s rate once more with the trigger disabled and the relay polling
//!    every 10 ms, which leaves only what no wake-up can remove;
//! 3. what the notification trigger costs producers: 4 writers of single-row
//!    transactions with the trigger, without it (`DISABLE TRIGGER`) and with the same
//!    trigger minus its `pg_notify` (so the notification's commit lock is told apart
//!    from the trigger's own work), in alternating windows, while a connection LISTENs
//!    (the relay stopped, so its publishing takes no CPU from the writers);
//! 4. the WAL relay (`outbox wal setup`, `outbox relay --source wal`, issue 32):
//!    commit-to-publish at 20 and 500 messages/s as in 2, PostgreSQL's CPU per message
//!    in the 500 msg/s phase beside the polling relay's, and the 4 writers' rate with
//!    the WAL relay running against the rate with no relay and no trigger (windows of
//!    the one, then of the other).
//! 5. throughput: the polling relay and the WAL relay each draining a backlog of
//!    `--wal-throughput-messages` (default 50,000; 0 skips it) in interleaved rounds,
//!    beside the broker ceiling (see `wal_throughput.rs`). `--wal-throughput-only` runs
//!    this phase alone.
//!
//! **`--backlog N`** preloads N pending rows with one `INSERT … SELECT generate_series`,
//! times the relay's periodic health-check queries (`pending_stats`, the gauges, and
//! `oldest_claimable_wait`) beside the exact counts they replaced and `outbox stats`
//! (a child process, exact), then drains `--messages` messages with the bench's relay
//! (the same dispatcher and publisher as the throughput rounds) from the backlog and
//! from a table of `--messages` rows, in rounds of alternating order.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};
use outboxkit_core::{EventPublisher, NewMessage, OutboxAdmin as _, OutboxProducer};
use outboxkit_postgres::PgOutbox;
use std::process::{Child, Command};
use uuid::Uuid;

use super::broker::Receipts;
use super::{Args, Broker, common};

/// The producer rates of the latency phase, messages per second.
const RATES: [u64; 2] = [20, 500];
/// How long each rate is produced.
const RATE_SECS: u64 = 10;
/// The idle windows (baseline and relay): [`IDLE_WINDOWS`] of this length each, long
/// against PostgreSQL's once-a-second flush of a backend's statistics; the median
/// window counts, so that another client's burst in one window does not (an odd
/// number of windows: with 4, one burst in the baseline's second window, seen in every
/// run, was the upper median).
const IDLE_WINDOW: Duration = Duration::from_secs(5);
const IDLE_WINDOWS: usize = 5;
/// Concurrent producers in the NOTIFY-cost phase, and the length of each window.
const WRITERS: usize = 4;
const WRITER_WINDOW: Duration = Duration::from_secs(5);

/// Runs the phases `args` asks for.
pub(crate) async fn run<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: Arc<P>,
) -> anyhow::Result<()> {
    let body = super::payload(args.payload_bytes);
    if args.relay_process {
        relay_process(args, broker, &body).await?;
    }
    if let Some(n) = args.backlog {
        backlog(args, broker, publisher, n, &body).await?;
    }
    Ok(())
}

/// The release build's `outbox`, next to this executable.
fn outbox_bin() -> anyhow::Result<PathBuf> {
    let path = std::env::current_exe()
        .context("where is this executable?")?
        .with_file_name("outbox");
    anyhow::ensure!(
        path.is_file(),
        "{} not found: build it with `cargo build --release -p outboxkit-cli --bin outbox` \
         (`cargo xtask bench` does)",
        path.display()
    );
    Ok(path)
}

/// `outbox` with no configuration from the environment, the database at `url` and
/// `schema`.
pub(super) fn outbox_command(url: &str, schema: &str) -> anyhow::Result<Command> {
    let mut c = Command::new(outbox_bin()?);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("OUTBOX_") {
            c.env_remove(key);
        }
    }
    c.env("RUST_LOG", "warn")
        .args(["--database-url", url, "--schema", schema]);
    Ok(c)
}

/// `outbox relay` with default settings but `extra`, publishing where the bench's
/// broker listens.
pub(super) fn spawn_relay(outbox: &Db, broker: &Broker, extra: &[&str]) -> anyhow::Result<Child> {
    let mut c = outbox_command(&outbox.url, outbox.schema())?;
    c.args(["relay", "--listen", "127.0.0.1:0"]).args(extra);
    match broker {
        Broker::Rabbit { exchange, .. } => {
            c.args(["--transport", "rabbit", "--broker-url", &common::amqp_url()])
                .args(["--exchange", exchange]);
        }
        Broker::Nats { prefix, .. } => {
            c.args(["--transport", "nats", "--broker-url", &common::nats_url()])
                .args(["--subject-prefix", prefix]);
        }
    }
    c.spawn().context("start `outbox relay`")
}

/// SIGTERM, then up to 20 s for the relay to drain and exit.
pub(super) async fn stop(mut child: Child) -> anyhow::Result<()> {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            eprintln!("note: the relay did not stop within 20 s of SIGTERM; killed");
            child.kill()?;
            child.wait()?;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Transactions committed or rolled back in the bench's database so far.
async fn xacts(outbox: &PgOutbox) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database
          WHERE datname = current_database()",
    )
    .fetch_one(outbox.pool())
    .await?)
}

/// Transactions per second in the database, and PostgreSQL's CPU seconds per second:
/// the median of [`IDLE_WINDOWS`] windows of [`IDLE_WINDOW`] (by transactions), with
/// every window's transactions per second.
async fn xact_rate(outbox: &PgOutbox) -> anyhow::Result<(f64, f64, Vec<f64>)> {
    let mut windows = Vec::new();
    for _ in 0..IDLE_WINDOWS {
        let (x0, c0) = (xacts(outbox).await?, common::CpuTimes::now());
        tokio::time::sleep(IDLE_WINDOW).await;
        let (x1, c1) = (xacts(outbox).await?, common::CpuTimes::now());
        let secs = IDLE_WINDOW.as_secs_f64();
        windows.push(((x1 - x0) as f64 / secs, c1.since(c0).database / secs));
    }
    let all = windows.iter().map(|w| w.0).collect();
    windows.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (tps, cpu) = windows[windows.len() / 2];
    Ok((tps, cpu, all))
}

pub(super) fn message(aggregate: &str, i: u64, body: &str) -> anyhow::Result<NewMessage> {
    Ok(NewMessage::builder(aggregate, i.to_string(), "BenchEvent")
        .payload_json(body.to_owned())
        .build()?)
}

/// One single-row transaction.
async fn write_one(outbox: &PgOutbox, msg: &NewMessage) -> anyhow::Result<()> {
    let mut tx = outbox.begin().await?;
    outbox.enqueue(&mut tx, msg).await?;
    tx.commit().await?;
    Ok(())
}

/// Messages of `aggregate` recorded Sent.
async fn sent(outbox: &PgOutbox, aggregate: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.outbox_messages WHERE aggregate_type = $1 AND status = 1",
        outbox.schema()
    )))
    .bind(aggregate)
    .fetch_one(outbox.pool())
    .await?)
}

async fn wait_sent(
    outbox: &PgOutbox,
    aggregate: &str,
    n: u64,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let done = sent(outbox, aggregate).await?;
        if done >= i64::try_from(n)? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the relay published {done} of {n} `{aggregate}` messages within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes `rate` single-row transactions per second for `secs` seconds on a fixed
/// schedule; returns how far behind schedule the last write started, and when each
/// message's commit returned to this producer (wall clock, by aggregate id).
async fn produce(
    outbox: &PgOutbox,
    aggregate: &str,
    rate: u64,
    secs: u64,
    body: &str,
) -> anyhow::Result<(Duration, HashMap<u64, SystemTime>)> {
    let total = rate * secs;
    let start = tokio::time::Instant::now();
    let mut writes = tokio::task::JoinSet::new();
    let mut behind = Duration::ZERO;
    let mut committed = HashMap::new();
    for i in 0..total {
        let at = start + Duration::from_secs_f64(i as f64 / rate as f64);
        tokio::time::sleep_until(at).await;
        behind = tokio::time::Instant::now() - at;
        let (outbox, msg) = (outbox.clone(), message(aggregate, i, body)?);
        writes.spawn(async move {
            write_one(&outbox, &msg).await?;
            anyhow::Ok((i, SystemTime::now()))
        });
        while let Some(done) = writes.try_join_next() {
            let (i, at) = done??;
            committed.insert(i, at);
        }
    }
    while let Some(done) = writes.join_next().await {
        let (i, at) = done??;
        committed.insert(i, at);
    }
    Ok((behind, committed))
}

/// p50, p99 and max of a set of latencies.
#[derive(Debug, Clone, Copy)]
struct Spread {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

impl Spread {
    fn of(ms: &[f64]) -> anyhow::Result<Self> {
        let (p50, p99) = common::percentiles(ms).context("no latencies")?;
        let max = ms.iter().copied().fold(0.0_f64, f64::max);
        Ok(Self {
            p50,
            p99,
            max: Duration::from_secs_f64(max.max(0.0) / 1000.0),
        })
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {} p99 {} max {}",
            common::ms(self.p50),
            common::ms(self.p99),
            common::ms(self.max)
        )
    }
}

/// One published message of a latency phase: its outbox id, aggregate id (its number
/// in the phase), `created_at` and `sent_at` (seconds since the epoch).
struct SentRow {
    id: Uuid,
    number: String,
    created: f64,
    sent: f64,
}

/// The messages of `aggregate` recorded `Sent`.
async fn sent_rows(outbox: &PgOutbox, aggregate: &str) -> anyhow::Result<Vec<SentRow>> {
    let rows: Vec<(Uuid, String, f64, f64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, aggregate_id, extract(epoch FROM created_at)::float8,
                extract(epoch FROM sent_at)::float8
           FROM {}.outbox_messages WHERE aggregate_type = $1 AND status = 1",
        outbox.schema()
    )))
    .bind(aggregate)
    .fetch_all(outbox.pool())
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, number, created, sent)| SentRow {
            id,
            number,
            created,
            sent,
        })
        .collect())
}

/// The latencies of a phase (see [`latencies`]).
struct Latencies {
    /// `sent_at - created_at`.
    total: Spread,
    /// `created_at` to the producer's commit returning.
    producer: Spread,
    /// The producer's commit returning to `sent_at`.
    relay: Spread,
    /// The producer's commit returning to a subscriber receiving the message.
    received: Spread,
    /// `created_at` to a subscriber receiving the message.
    received_total: Spread,
    received_count: usize,
    rows: usize,
}

/// Commit-to-publish of `rows` (`sent_at - created_at`), and the same split where the
/// producer's commit returned (`committed`, this host's wall clock, which is also the
/// database's: one machine): the producer's transaction (`created_at` to its commit
/// returning) and the relay's part (commit returned to the broker's confirm
/// recorded); and the commit returning to a subscriber's receipt (`received`, the same
/// clock).
fn latencies(
    rows: &[SentRow],
    committed: &HashMap<u64, SystemTime>,
    received: &HashMap<Uuid, SystemTime>,
) -> anyhow::Result<Latencies> {
    let (mut total, mut producer, mut relay) = (Vec::new(), Vec::new(), Vec::new());
    let (mut got, mut got_total) = (Vec::new(), Vec::new());
    for row in rows {
        total.push((row.sent - row.created) * 1000.0);
        let seen = received.get(&row.id).and_then(epoch_secs);
        if let Some(seen) = seen {
            got_total.push((seen - row.created) * 1000.0);
        }
        if let Some(returned) = returned_at(row, committed).and_then(epoch_secs) {
            producer.push((returned - row.created) * 1000.0);
            relay.push((row.sent - returned) * 1000.0);
            if let Some(seen) = seen {
                got.push((seen - returned) * 1000.0);
            }
        }
    }
    Ok(Latencies {
        total: Spread::of(&total)?,
        producer: Spread::of(&producer)?,
        relay: Spread::of(&relay)?,
        received: Spread::of(&got).context("no message reached the bench's subscriber")?,
        received_total: Spread::of(&got_total)?,
        received_count: got_total.len(),
        rows: rows.len(),
    })
}

/// Seconds since the Unix epoch (`None` before it).
fn epoch_secs(at: &SystemTime) -> Option<f64> {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}

/// When `row`'s commit returned to its producer (`committed` is keyed by the number
/// the producer wrote as the aggregate id).
fn returned_at<'a>(
    row: &SentRow,
    committed: &'a HashMap<u64, SystemTime>,
) -> Option<&'a SystemTime> {
    row.number
        .parse::<u64>()
        .ok()
        .and_then(|i| committed.get(&i))
}

/// Writes `{dir}/{aggregate}.csv` (`BENCH_LATENCY_DUMP=dir`): one line per message,
/// in seconds since the Unix epoch, `created` (the row's `created_at`, the producer's
/// transaction start), `returned` (its commit returned to the producer), `received`
/// (a subscriber of the broker got it) and `sent` (the relay recorded it); an empty
/// field when not known. For looking at a tail: when its messages were committed,
/// whether they come together.
fn dump(
    dir: &std::path::Path,
    aggregate: &str,
    rows: &[SentRow],
    committed: &HashMap<u64, SystemTime>,
    received: &HashMap<Uuid, SystemTime>,
) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let secs = |at: Option<&SystemTime>| {
        at.and_then(epoch_secs)
            .map(|s| format!("{s:.6}"))
            .unwrap_or_default()
    };
    let mut csv = String::from("created,returned,received,sent\n");
    for row in rows {
        let returned = returned_at(row, committed);
        let _ = writeln!(
            csv,
            "{:.6},{},{},{:.6}",
            row.created,
            secs(returned),
            secs(received.get(&row.id)),
            row.sent
        );
    }
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{aggregate}.csv"));
    std::fs::write(&path, csv).with_context(|| format!("write {}", path.display()))
}

/// The latency phase's outbox, in a database of its own: PostgreSQL counts
/// transactions per database, so the idle relay's are counted apart from any other
/// client's.
pub(super) struct Db {
    pub(super) outbox: PgOutbox,
    pub(super) url: String,
    pub(super) name: String,
}

impl std::ops::Deref for Db {
    type Target = PgOutbox;
    fn deref(&self) -> &PgOutbox {
        &self.outbox
    }
}

/// `DATABASE_URL` with the database `name`.
fn url_with_database(name: &str) -> anyhow::Result<String> {
    let url = common::database_url();
    let (base, query) = url
        .split_once('?')
        .map_or((url.as_str(), None), |(b, q)| (b, Some(q)));
    let (server, _) = base
        .rsplit_once('/')
        .context("DATABASE_URL has no database")?;
    Ok(match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    })
}

pub(super) async fn create_db(admin: &sqlx::PgPool) -> anyhow::Result<Db> {
    let name = format!(
        "bench_proc_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(admin)
        .await?;
    let url = url_with_database(&name)?;
    // The relay gets `url`; this process's own connections carry its application name.
    let outbox = PgOutbox::connect(
        &outboxkit_postgres::PgConfig::new(common::with_application_name(&url, BENCH_APPLICATION))
            .with_schema("outbox")
            .with_max_connections(8),
    )
    .await?;
    outbox.migrate().await?;
    // As in the other phases: no autovacuum in a random window. Autovacuum's own
    // transactions count in the database's statistics too, and the new database's
    // catalogs, just written by the migrations, are what it would visit first: vacuumed
    // and analyzed now, it has nothing left to do there.
    sqlx::query("ALTER TABLE outbox.outbox_messages SET (autovacuum_enabled = false)")
        .execute(outbox.pool())
        .await?;
    sqlx::query("VACUUM (ANALYZE)")
        .execute(outbox.pool())
        .await?;
    Ok(Db { outbox, url, name })
}

async fn relay_process(args: &Args, broker: &Broker, body: &str) -> anyhow::Result<()> {
    let admin = sqlx::PgPool::connect(&common::database_url()).await?;
    let db = create_db(&admin).await?;
    println!(
        "out-of-process relay: `outbox relay` (default settings) → {}, database {} of its own, this process producing single-row transactions of {} bytes",
        broker.name(),
        db.name,
        body.len()
    );
    let result = async {
        if !args.wal_throughput_only {
            relay_process_phases(&db, broker, body).await?;
        }
        if args.wal_throughput_messages > 0 {
            super::wal_throughput::run(args, &db, broker, body).await?;
        }
        anyhow::Ok(())
    }
    .await;
    db.outbox.pool().close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {} WITH (FORCE)",
        db.name
    )))
    .execute(&admin)
    .await?;
    result
}

async fn relay_process_phases(outbox: &Db, broker: &Broker, body: &str) -> anyhow::Result<()> {
    super::quiesce(&outbox.outbox).await;
    let (base_tps, base_cpu, base_all) = xact_rate(outbox).await?;

    let relay = spawn_relay(outbox, broker, &[])?;
    // The relay is stopped whether the phases succeed or not.
    let mut idle = 0.0;
    let measured = async {
        wait_ready(outbox, "probe", body).await?;
        let (idle_tps, idle_cpu, idle_all) = xact_rate(outbox).await?;
        idle = idle_tps - base_tps;
        println!(
            "idle relay: {:.2} PostgreSQL transactions/s: xact_commit + xact_rollback of its database, median of {IDLE_WINDOWS} windows of {} s with the relay idle ({:.2}/s; windows {:.2?}) minus the same before it started ({:.2}/s; windows {:.2?}); PostgreSQL CPU {:.1}% of a core with it, {:.1}% without",
            idle_tps - base_tps,
            IDLE_WINDOW.as_secs(),
            idle_tps,
            idle_all,
            base_tps,
            base_all,
            100.0 * idle_cpu,
            100.0 * base_cpu
        );

        for rate in RATES {
            rate_phase_cpu(outbox, broker, &format!("rate{rate}"), rate, body).await?;
        }
        anyhow::Ok(())
    }
    .await;
    stop(relay).await?;
    measured?;
    if idle > 2.0 {
        // Over the target of 2: what a longer fallback poll would give.
        let relay = spawn_relay(outbox, broker, &["--poll-interval", "1s"])?;
        let measured = async {
            wait_ready(outbox, "probe1s", body).await?;
            xact_rate(outbox).await
        }
        .await;
        stop(relay).await?;
        let (tps, _, windows) = measured?;
        println!(
            "idle relay with --poll-interval 1s (the only setting changed): {:.2} PostgreSQL transactions/s (windows {windows:.2?})",
            tps - base_tps
        );
    }
    without_notifications(outbox, broker, body).await?;
    notify_cost(outbox, body).await?;
    wal_phases(outbox, broker, body).await
}

/// The WAL relay's phases (4. in the module docs): the slot set up for the bench's
/// schema, removed again whatever happens.
async fn wal_phases(outbox: &Db, broker: &Broker, body: &str) -> anyhow::Result<()> {
    let wal = |verb: &str| -> anyhow::Result<()> {
        let status = outbox_command(&outbox.url, outbox.schema())?
            .args(["wal", verb])
            .stdout(std::process::Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "`outbox wal {verb}` failed: {status}");
        Ok(())
    };
    wal("setup").context("the WAL phases need wal_level = logical (`cargo xtask services`)")?;
    let measured = async {
        let relay = spawn_relay(outbox, broker, &["--source", "wal"])?;
        let running = async {
            wait_ready(outbox, "probe_wal", body).await?;
            println!("the WAL relay (`outbox relay --source wal`, trigger disabled by `outbox wal setup`):");
            for rate in RATES {
                rate_phase_cpu(outbox, broker, &format!("wal{rate}"), rate, body).await?;
            }
            let mut with_relay = Vec::new();
            for _ in 0..3 {
                with_relay.push(writers_rate(outbox, body).await?);
            }
            anyhow::Ok(with_relay)
        }
        .await;
        stop(relay).await?;
        let with_relay = running?;
        super::quiesce(&outbox.outbox).await;
        let mut alone = Vec::new();
        for _ in 0..3 {
            alone.push(writers_rate(outbox, body).await?);
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "producers, {WRITERS} concurrent writers of single-row transactions, windows of {} s: {:.0} tx/s with the WAL relay running, {:.0} tx/s with no relay and no trigger: ratio {:.3} (target ≥ 0.95; windows {:?} then {:?})",
            WRITER_WINDOW.as_secs(),
            mean(&with_relay),
            mean(&alone),
            mean(&with_relay) / mean(&alone),
            with_relay.iter().map(|r| r.round()).collect::<Vec<_>>(),
            alone.iter().map(|r| r.round()).collect::<Vec<_>>(),
        );
        anyhow::Ok(())
    }
    .await;
    wal("drop")?;
    measured
}

/// The application name of this bench's own connections to the database of
/// [`create_db`], which tells them from the relay's in [`RelayBackends`].
const BENCH_APPLICATION: &str = "outbox-bench";

/// [`rate_phase`], and PostgreSQL's CPU over it per message: all of it, and the part
/// serving the relay ([`RelayBackends`]).
async fn rate_phase_cpu(
    outbox: &PgOutbox,
    broker: &Broker,
    aggregate: &str,
    rate: u64,
    body: &str,
) -> anyhow::Result<()> {
    let cpu0 = common::CpuTimes::now_with(broker.comm());
    let relay0 = RelayBackends::now(outbox).await?;
    rate_phase(outbox, broker, aggregate, rate, body).await?;
    let relay = RelayBackends::now(outbox).await?.since(&relay0);
    let cpu = common::CpuTimes::now_with(broker.comm()).since(cpu0);
    let per_message = |secs: f64| secs * 1e6 / (rate * RATE_SECS) as f64;
    println!(
        "  PostgreSQL CPU over that phase: {:.1} µs per message (the producer's inserts included), of which {:.1} µs serving the relay (its connections and its walsender)",
        per_message(cpu.database),
        per_message(relay),
    );
    Ok(())
}

/// CPU seconds used so far by each PostgreSQL process serving the relay: the backends
/// connected to the bench's database under another application name than
/// [`BENCH_APPLICATION`] (the relay's pool, its walsender). A process that ends between
/// two readings loses its share; one that starts between them counts from zero.
struct RelayBackends(HashMap<i32, f64>);

impl RelayBackends {
    async fn now(outbox: &PgOutbox) -> anyhow::Result<Self> {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name <> $1",
        )
        .bind(BENCH_APPLICATION)
        .fetch_all(outbox.pool())
        .await?;
        Ok(Self(
            pids.into_iter()
                .filter_map(|pid| Some((pid, common::process_cpu(pid.unsigned_abs())?)))
                .collect(),
        ))
    }

    /// CPU seconds used since `start`.
    fn since(&self, start: &Self) -> f64 {
        self.0
            .iter()
            .map(|(pid, secs)| secs - start.0.get(pid).copied().unwrap_or(0.0))
            .sum()
    }
}

/// Empties the broker's sink, then produces `rate` messages/s of `aggregate` for
/// [`RATE_SECS`], waits until the relay has published them all and prints their
/// commit-to-publish, split where the producer's commit returned, and the same commit
/// to when a subscriber of the broker received the message ([`Receipts`]).
async fn rate_phase(
    outbox: &PgOutbox,
    broker: &Broker,
    aggregate: &str,
    rate: u64,
    body: &str,
) -> anyhow::Result<()> {
    // On an empty sink: the bench's queue has no consumer, and one that grows over the
    // run (100,000 messages and more by the last phases) made RabbitMQ's queue process
    // pause 15-55 ms for a garbage collection of its heap twice a second, holding back
    // the confirms of whichever relay ran last (found with `erlang:system_monitor`'s
    // `long_gc`, see docs/wal.md). A queue with a consumer stays short.
    broker.purge().await?;
    common::settle(Duration::from_secs(10)).await;
    // The subscription ends whether the phase succeeds or not.
    let receipts = Receipts::start(broker).await?;
    let produced = async {
        let (behind, committed) = produce(outbox, aggregate, rate, RATE_SECS, body).await?;
        wait_sent(outbox, aggregate, rate * RATE_SECS, Duration::from_secs(60)).await?;
        let rows = sent_rows(outbox, aggregate).await?;
        anyhow::Ok((behind, committed, rows))
    }
    .await;
    let ids: Vec<Uuid> = match &produced {
        Ok((_, _, rows)) => rows.iter().map(|r| r.id).collect(),
        Err(_) => Vec::new(),
    };
    let received = receipts.finish(&ids).await;
    let (behind, committed, rows) = produced?;
    if let Some(dir) = std::env::var_os("BENCH_LATENCY_DUMP") {
        dump(&PathBuf::from(dir), aggregate, &rows, &committed, &received)?;
    }
    let l = latencies(&rows, &committed, &received)?;
    println!(
        "commit-to-publish at {rate} msg/s for {RATE_SECS} s ({} single-row transactions; the last started {} behind schedule): {}; of which the producer's transaction (start to its commit returning): {}; the relay (commit returned to confirm recorded): {}",
        rate * RATE_SECS,
        common::ms(behind),
        l.total,
        l.producer,
        l.relay,
    );
    println!(
        "  commit returned to received by a subscriber of the broker: {} ({} of {} received; transaction start to received: {})",
        l.received, l.received_count, l.rows, l.received_total,
    );
    Ok(())
}

/// The 500 msg/s phase once more without push wake-up: the notification trigger
/// disabled and the relay polling every 10 ms. What is left of the latency is the
/// producer's commit, the claim, the broker's confirm and the completion: the part no
/// wake-up can remove.
async fn without_notifications(outbox: &Db, broker: &Broker, body: &str) -> anyhow::Result<()> {
    let trigger = |switch: &str| {
        format!(
            "ALTER TABLE {}.outbox_messages {switch} TRIGGER outbox_messages_notify",
            outbox.schema()
        )
    };
    sqlx::query(sqlx::AssertSqlSafe(trigger("DISABLE")))
        .execute(outbox.pool())
        .await?;
    let relay = spawn_relay(outbox, broker, &["--poll-interval", "10ms"])?;
    let rate = RATES[RATES.len() - 1];
    let measured = async {
        wait_ready(outbox, "probe_poll", body).await?;
        println!("without notifications (trigger disabled, relay with --poll-interval 10ms):");
        rate_phase(outbox, broker, &format!("poll{rate}"), rate, body).await
    }
    .await;
    stop(relay).await?;
    sqlx::query(sqlx::AssertSqlSafe(trigger("ENABLE")))
        .execute(outbox.pool())
        .await?;
    measured
}

/// Returns once the relay has published a first message (it connects to the broker
/// lazily), and 6 s more: past its first health check, with its connections open.
async fn wait_ready(outbox: &PgOutbox, aggregate: &str, body: &str) -> anyhow::Result<()> {
    write_one(outbox, &message(aggregate, 0, body)?).await?;
    wait_sent(outbox, aggregate, 1, Duration::from_secs(30)).await?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    Ok(())
}

/// Single-row transactions per second from [`WRITERS`] concurrent writers over
/// [`WRITER_WINDOW`].
async fn writers_rate(outbox: &PgOutbox, body: &str) -> anyhow::Result<f64> {
    let count = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + WRITER_WINDOW;
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..WRITERS {
        let (outbox, count, body) = (outbox.clone(), Arc::clone(&count), body.to_owned());
        tasks.spawn(async move {
            let mut i = 0;
            while Instant::now() < deadline {
                write_one(&outbox, &message(&format!("writer{w}"), i, &body)?).await?;
                count.fetch_add(1, AtomicOrdering::Relaxed);
                i += 1;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(count.load(AtomicOrdering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

async fn notify_cost(outbox: &PgOutbox, body: &str) -> anyhow::Result<()> {
    let schema = outbox.schema();
    let table = format!("{schema}.outbox_messages");
    // The same statement trigger minus its `pg_notify`: what the trigger costs apart
    // from the notification's commit lock.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION {schema}.outbox_messages_notify_probe() RETURNS trigger
             LANGUAGE plpgsql AS $$
         BEGIN
             IF EXISTS (SELECT 1 FROM inserted) THEN
                 PERFORM 1;
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER outbox_messages_notify_probe
             AFTER INSERT ON {table}
             REFERENCING NEW TABLE AS inserted
             FOR EACH STATEMENT EXECUTE FUNCTION {schema}.outbox_messages_notify_probe();
         ALTER TABLE {table} DISABLE TRIGGER outbox_messages_notify_probe;"
    )))
    .execute(outbox.pool())
    .await?;
    let mut listener = sqlx::postgres::PgListener::connect_with(outbox.pool()).await?;
    listener.listen(outboxkit_postgres::NOTIFY_CHANNEL).await?;
    let notified = Arc::new(AtomicU64::new(0));
    let drain = {
        let notified = Arc::clone(&notified);
        tokio::spawn(async move {
            while let Ok(Some(_)) = listener.try_recv().await {
                notified.fetch_add(1, AtomicOrdering::Relaxed);
            }
        })
    };
    super::quiesce(outbox).await;
    let switch = |trigger: &str, on: bool| {
        let switch = if on { "ENABLE" } else { "DISABLE" };
        format!("ALTER TABLE {table} {switch} TRIGGER {trigger}")
    };
    // Windows with the notification trigger, with the probe trigger alone and with
    // neither, in an order that lets none of them always go first.
    const NOTIFY: usize = 0;
    const PROBE: usize = 1;
    const NONE: usize = 2;
    let mut rates: [Vec<f64>; 3] = Default::default();
    for variant in [
        NOTIFY, PROBE, NONE, NONE, PROBE, NOTIFY, PROBE, NOTIFY, NONE,
    ] {
        for statement in [
            switch("outbox_messages_notify", variant == NOTIFY),
            switch("outbox_messages_notify_probe", variant == PROBE),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(outbox.pool())
                .await?;
        }
        rates[variant].push(writers_rate(outbox, body).await?);
    }
    drain.abort();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TRIGGER outbox_messages_notify_probe ON {table};
         DROP FUNCTION {schema}.outbox_messages_notify_probe();
         {};",
        switch("outbox_messages_notify", true)
    )))
    .execute(outbox.pool())
    .await?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let [on, probe, off] = [0, 1, 2].map(|v| mean(&rates[v]));
    let windows = |v: &[f64]| v.iter().map(|r| r.round()).collect::<Vec<_>>();
    println!(
        "producers, {WRITERS} concurrent writers of single-row transactions, {} windows of {} s each: {on:.0} tx/s with the notification trigger, {off:.0} tx/s without: ratio {:.3}; with the same trigger minus its pg_notify {probe:.0} tx/s: ratio {:.3} (windows with {:?}, without {:?}, minus pg_notify {:?}; {} notifications received)",
        rates.iter().map(Vec::len).sum::<usize>(),
        WRITER_WINDOW.as_secs(),
        on / off,
        probe / off,
        windows(&rates[NOTIFY]),
        windows(&rates[NONE]),
        windows(&rates[PROBE]),
        notified.load(AtomicOrdering::Relaxed)
    );
    Ok(())
}

/// `n` pending rows in one statement, then `ANALYZE`.
async fn preload_sql(outbox: &PgOutbox, n: usize, body: &str) -> anyhow::Result<()> {
    let s = outbox.schema();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {s}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'bench', g::text, 'BenchEvent', $1::text::json
           FROM generate_series(1, $2) g"
    )))
    .bind(body)
    .bind(i64::try_from(n)?)
    .execute(outbox.pool())
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {s}.outbox_messages")))
        .execute(outbox.pool())
        .await?;
    Ok(())
}

/// Runs `f` `times` times; returns the durations in order.
async fn timed<F, Fut, T>(times: usize, mut f: F) -> anyhow::Result<Vec<Duration>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let mut out = Vec::with_capacity(times);
    for _ in 0..times {
        let started = Instant::now();
        f().await?;
        out.push(started.elapsed());
    }
    Ok(out)
}

fn show(ds: &[Duration]) -> String {
    ds.iter()
        .map(|d| common::ms(*d))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The gauges' query before they were bounded: exact counts through the partial
/// indexes and the oldest pending `created_at` over every pending row.
async fn exact_gauges(outbox: &PgOutbox) -> anyhow::Result<()> {
    let s = outbox.schema();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {s}.outbox_messages WHERE phase = 0 AND status = 0),
                (SELECT count(*) FROM {s}.outbox_messages WHERE phase = 0 AND status = 9),
                (SELECT count(*) FROM {s}.outbox_messages WHERE phase = 3),
                extract(epoch FROM now() -
                    (SELECT min(created_at) FROM {s}.outbox_messages WHERE phase = 0))::float8"
    )))
    .fetch_one(outbox.pool())
    .await?;
    Ok(())
}

async fn backlog<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: Arc<P>,
    n: usize,
    body: &str,
) -> anyhow::Result<()> {
    let m = args.messages;
    println!(
        "backlog: {n} pending rows against {m}, messages of {} bytes, relay → {}, batch {}, {} batches in flight",
        body.len(),
        broker.name(),
        args.batch_size,
        args.concurrency
    );
    let big = super::fresh_outbox("backlog").await?;
    let result = backlog_phases(args, broker, publisher, &big, n, body).await;
    super::drop_schema(&big).await;
    result
}

async fn backlog_phases<P: EventPublisher>(
    args: &Args,
    broker: &Broker,
    publisher: Arc<P>,
    big: &PgOutbox,
    n: usize,
    body: &str,
) -> anyhow::Result<()> {
    let m = args.messages;
    let started = Instant::now();
    preload_sql(big, n, body).await?;
    println!(
        "preloaded {n} rows (one INSERT … SELECT generate_series, then ANALYZE) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    super::quiesce(big).await;

    let gauges = timed(5, || async { Ok(big.pending_stats().await?) }).await?;
    let stats = big.pending_stats().await?;
    let claimable = timed(5, || async { Ok(big.oldest_claimable_wait(None).await?) }).await?;
    let exact = timed(3, || exact_gauges(big)).await?;
    let cli_stats = timed(3, || async {
        let mut stats = outbox_command(&common::database_url(), big.schema())?;
        stats.arg("stats").stdout(std::process::Stdio::null());
        let status = tokio::task::spawn_blocking(move || stats.status()).await??;
        anyhow::ensure!(status.success(), "`outbox stats` failed: {status}");
        Ok(())
    })
    .await?;
    println!(
        "at {n} pending rows: the relay's gauges (pending_stats: pending {} , dead {}, oldest age {:?}) took {}; \
         oldest_claimable_wait {}; the same gauges counted exactly (the query before they were bounded) {}; \
         `outbox stats` (exact, a child process) {}",
        stats.new + stats.processing,
        stats.dead,
        stats.oldest_pending_age.map(|d| d.as_secs()),
        show(&gauges),
        show(&claimable),
        show(&exact),
        show(&cli_stats)
    );

    let rounds = args.rounds.max(1);
    let (mut small_runs, mut big_runs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for big_first in [round % 2 == 1, round % 2 == 0] {
            if big_first {
                super::quiesce(big).await;
                let run = super::run_dispatcher(big, Arc::clone(&publisher), args).await?;
                big_runs.push(run.elapsed);
            } else {
                let small = super::fresh_outbox("backlog_small").await?;
                let run = async {
                    preload_sql(&small, m, body).await?;
                    super::quiesce(&small).await;
                    super::run_dispatcher(&small, Arc::clone(&publisher), args).await
                }
                .await;
                super::drop_schema(&small).await;
                small_runs.push(run?.elapsed);
            }
            broker.purge().await?;
        }
        println!(
            "round {}: {m} of {m} rows {:.0}/s, {m} of the backlog {:.0}/s ({} first)",
            round + 1,
            super::rate(m, small_runs[round]),
            super::rate(m, big_runs[round]),
            if round % 2 == 1 {
                "backlog"
            } else {
                "small table"
            }
        );
    }
    let (small, large) = (
        super::report::median(small_runs),
        super::report::median(big_runs),
    );
    println!(
        "relay rate, medians of {rounds} rounds: {:.0} msg/s draining {m} of a {n}-row backlog, {:.0} msg/s draining a {m}-row table: ratio {:.2}",
        super::rate(m, large),
        super::rate(m, small),
        small.as_secs_f64() / large.as_secs_f64()
    );
    Ok(())
}
