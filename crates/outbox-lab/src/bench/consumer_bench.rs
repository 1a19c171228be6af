//! `cargo xtask bench -- --consumer`: consumer throughput RabbitMQ (default) or NATS
//! JetStream (`--transport nats`) → PostgreSQL, phase by phase, each against the
//! `raw` ceiling of its own round:
//!
//! 1. **raw**: the project's consumer (`run`) with a handler that only answers `Ack`, no
//!    database: the consume + ack ceiling;
//! 2. **per-message**: `IdempotentConsumer` (defaults) through `run`, one handler doing
//!    one `INSERT` into a projection table, one transaction per delivery;
//! 3. **per-message, versioned**: the same, each message its own aggregate at
//!    `aggregate_version` 1 (so each takes the version row path: lock + record, and no
//!    message is stale);
//! 4. **batched**: the same consumer through `run_batched` (the transports' default
//!    batch settings), the per-message handler;
//! 5. **batched, versioned**;
//! 6. **batched, batch handler**: a handler overriding `handle_batch` with one set-based
//!    `INSERT … SELECT FROM UNNEST($1::uuid[])`;
//! 7. **durable receive**: `DurableReceiver` through `run_batched` until all are stored,
//!    then **durable process**: an `InboxProcessor` (defaults) applying them to the
//!    projection with the per-message handler.
//!
//! Before each phase, N messages go onto a fresh queue (RabbitMQ: a durable classic
//! queue bound to the bench exchange, declared before publishing) or a fresh stream
//! (NATS: file storage, one subject), published by the relay's own publisher, so the
//! wire format is the relay's; each phase also gets a fresh PostgreSQL schema. Then a
//! `CHECKPOINT`, a `sync` and a wait for idle cores, as in the relay phases. A phase's
//! clock runs from the first handler call to the acknowledgement of the N-th message
//! (counted in the handler wrapper, after the inbox's commit); then the consumer is
//! cancelled and the database checked: N projection rows for exactly the published
//! ids, N inbox records, no duplicate, no failure record. A check that fails fails the
//! run.
//!
//! The inbox's pool (8 connections, the `PgConfig` default) connects through
//! `RoundTripCounter`, a proxy in this process that counts PostgreSQL round trips: the
//! proxy's own CPU is in this process's figure and it adds one local hop to each round
//! trip (the same for every database phase).

use outboxkit_core::Consumer as _;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use async_trait::async_trait;
use hdrhistogram::Histogram;
use lapin::Connection;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use outboxkit_core::consumer::{BatchDeliveryHandler, DeliveryHandler, HandlerDecision};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{EventPublisher, NewMessage, OutboxMessage};
use outboxkit_inbox::{
    BatchHandlerError, ConsumerConfig, DurableReceiver, Handler, HandlerContext, HandlerError,
    IdempotentConsumer, InboxProcessor, Pipeline, ProcessorConfig,
};
use outboxkit_nats::async_nats::jetstream;
use outboxkit_nats::{NatsConfig, NatsConsumer, NatsConsumerConfig, NatsPublisher, StreamSetup};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};
use outboxkit_testkit::pg::RoundTripCounter;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Args, TransportKind, common, drop_schema, fresh_outbox, payload, quiesce, rate};

/// The inbox consumer name of the projection handler.
const CONSUMER: &str = "projection";
/// The event type of every bench message.
const EVENT_TYPE: &str = "BenchEvent";
/// The inbox pool's size: `PgConfig`'s default.
const POOL_SIZE: u32 = 8;
/// The longest a phase may take before the run fails.
const PHASE_LIMIT: Duration = Duration::from_secs(600);

/// The timed phases, in the order they run in every round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Raw,
    PerMessage,
    PerMessageVersioned,
    Batched,
    BatchedVersioned,
    BatchHandler,
    DurableReceive,
    DurableProcess,
}

impl Phase {
    const ALL: [Self; 8] = [
        Self::Raw,
        Self::PerMessage,
        Self::PerMessageVersioned,
        Self::Batched,
        Self::BatchedVersioned,
        Self::BatchHandler,
        Self::DurableReceive,
        Self::DurableProcess,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Raw => "raw (consume + ack, no database)",
            Self::PerMessage => "per-message",
            Self::PerMessageVersioned => "per-message, versioned",
            Self::Batched => "batched",
            Self::BatchedVersioned => "batched, versioned",
            Self::BatchHandler => "batched, batch handler",
            Self::DurableReceive => "durable receive (batched)",
            Self::DurableProcess => "durable process (InboxProcessor)",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::PerMessage => "per-msg",
            Self::PerMessageVersioned => "per-msg v",
            Self::Batched => "batched",
            Self::BatchedVersioned => "batched v",
            Self::BatchHandler => "batch handler",
            Self::DurableReceive => "durable receive",
            Self::DurableProcess => "durable process",
        }
    }

    /// Whether its latency is per batch call rather than per delivery.
    fn per_batch(self) -> bool {
        !matches!(
            self,
            Self::Raw | Self::PerMessage | Self::PerMessageVersioned
        )
    }

    fn versioned(self) -> bool {
        matches!(self, Self::PerMessageVersioned | Self::BatchedVersioned)
    }
}

/// What one phase measured.
#[derive(Debug, Clone, Copy)]
struct Measured {
    elapsed: Duration,
    round_trips: u64,
    cpu: common::CpuTimes,
    p50: Duration,
    p99: Duration,
}

/// Runs the consumer phases and prints the report.
pub(crate) async fn run(args: &Args) -> anyhow::Result<()> {
    let tag = Uuid::new_v4().simple().to_string()[..8].to_owned();
    let bus = Bus::setup(args.transport, &tag).await?;
    let result = run_rounds(args, &bus).await;
    bus.cleanup().await?;
    result
}

async fn run_rounds(args: &Args, bus: &Bus) -> anyhow::Result<()> {
    let n = args.messages;
    let body = payload(args.payload_bytes);
    let rounds = args.rounds.max(1);
    let (prefetch, batching) = match args.transport {
        TransportKind::Rabbit => (
            "prefetch 100",
            "batch = prefetch (100), linger 3 ms, 2 batches in flight",
        ),
        TransportKind::Nats => (
            "concurrency (max_ack_pending) 100",
            "batch = concurrency (100), linger 3 ms, 2 batches in flight",
        ),
    };
    println!(
        "inbox consumer benchmark, {} → PostgreSQL: {n} messages of {} bytes per phase, consumer defaults ({prefetch}; batched: {batching}), inbox pool {POOL_SIZE} connections, processor defaults (batch 100), {} CPUs, median of {rounds} rounds",
        bus.name(),
        body.len(),
        std::thread::available_parallelism().map_or(0, usize::from),
    );
    let url = common::database_url();
    let base = outboxkit_postgres::parse_url(&url)?;
    let counter =
        RoundTripCounter::start(&format!("{}:{}", base.get_host(), base.get_port())).await;
    let counter = Arc::new(counter);
    let mut results: BTreeMap<Phase, Vec<Measured>> = BTreeMap::new();
    let mut ratios: BTreeMap<Phase, Vec<f64>> = BTreeMap::new();
    let mut settled = Duration::ZERO;
    for round in 0..rounds {
        let mut this_round = Vec::new();
        for phase in Phase::ALL {
            if phase == Phase::DurableProcess {
                continue; // measured with DurableReceive
            }
            let key = format!("r{}p{}", round + 1, phase as u8);
            let ctx = PhaseContext {
                args,
                bus,
                counter: Arc::clone(&counter),
                base: base.clone(),
                body: &body,
                key,
            };
            let (measured, waited) = ctx
                .run(phase)
                .await
                .with_context(|| format!("round {}, phase {}", round + 1, phase.label()))?;
            settled = settled.max(waited);
            this_round.extend(measured);
        }
        let raw = this_round
            .iter()
            .find(|(p, _)| *p == Phase::Raw)
            .map(|(_, m)| rate(n, m.elapsed))
            .context("the raw phase ran")?;
        let line: Vec<String> = this_round
            .iter()
            .map(|(p, m)| format!("{} {:.0}/s", p.short(), rate(n, m.elapsed)))
            .collect();
        println!("round {}: {}", round + 1, line.join(", "));
        for (phase, m) in this_round {
            ratios
                .entry(phase)
                .or_default()
                .push(rate(n, m.elapsed) / raw);
            results.entry(phase).or_default().push(m);
        }
    }

    println!();
    println!("medians of {rounds} rounds (each figure its own median):");
    println!(
        "| phase | messages/s | vs raw | PG round trips/msg | PG CPU µs/msg | bench CPU µs/msg | {} CPU µs/msg | handler p50 | handler p99 |",
        bus.name()
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let per_msg = |secs: f64| secs * 1e6 / n as f64;
    for (phase, runs) in &results {
        let elapsed = median_by(runs, |m| m.elapsed.as_secs_f64());
        let ratio = median(ratios.get(phase).cloned().unwrap_or_default());
        let trips = median_by(runs, |m| m.round_trips as f64) / n as f64;
        let pg = median_by(runs, |m| per_msg(m.cpu.database));
        let me = median_by(runs, |m| per_msg(m.cpu.relay));
        let broker = median_by(runs, |m| per_msg(m.cpu.broker));
        let p50 = median_by(runs, |m| m.p50.as_secs_f64());
        let p99 = median_by(runs, |m| m.p99.as_secs_f64());
        let unit = if phase.per_batch() { " ᵇ" } else { "" };
        println!(
            "| {} | {:.0} | {ratio:.2} | {trips:.2} | {pg:.0} | {me:.0} | {broker:.0} | {}{unit} | {}{unit} |",
            phase.label(),
            n as f64 / elapsed,
            common::ms(Duration::from_secs_f64(p50)),
            common::ms(Duration::from_secs_f64(p99)),
        );
    }
    println!();
    println!(
        "ᵇ per batch call (run_batched: one handle_batch of the transport, i.e. one transaction; durable process: one InboxProcessor::run_once, claim + process + complete); otherwise per delivery (one DeliveryHandler::handle, its transactions included)"
    );
    println!(
        "a phase runs from the first handler call to the N-th acknowledged message (durable process: to the N-th message done); CPU and round trips over the same span plus the consumer's start"
    );
    println!(
        "each phase on a fresh queue/stream and schema, after a checkpoint and sync, on idle cores (longest wait {}); every phase checked: {n} projection rows of the published ids, {n} inbox records, no duplicate, no failure",
        common::ms(settled)
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        len if len.is_multiple_of(2) => f64::midpoint(v[len / 2 - 1], v[len / 2]),
        len => v[len / 2],
    }
}

fn median_by(runs: &[Measured], f: impl Fn(&Measured) -> f64) -> f64 {
    median(runs.iter().map(f).collect())
}

/// Everything one phase needs.
struct PhaseContext<'a> {
    args: &'a Args,
    bus: &'a Bus,
    counter: Arc<RoundTripCounter>,
    base: sqlx::postgres::PgConnectOptions,
    body: &'a str,
    /// Names the phase's queue or stream and its messages' routing key.
    key: String,
}

impl PhaseContext<'_> {
    /// Runs `phase` (and, for `DurableReceive`, `DurableProcess` after it) on a fresh
    /// source and schema; returns what it measured and how long it waited for idle
    /// cores.
    async fn run(&self, phase: Phase) -> anyhow::Result<(Vec<(Phase, Measured)>, Duration)> {
        let n = self.args.messages;
        let db = Database::create(&self.counter, &self.base).await?;
        let outcome = async {
            let source = self.bus.prepare(&self.key).await?;
            let published = self.publish(phase.versioned()).await?;
            let waited = quiesce(&db.admin).await;
            let measured = match phase {
                Phase::Raw => {
                    let handler = Arc::new(Timed::new(AckOnly, n));
                    let m = self.consume(&source, &handler, false).await?;
                    ensure!(
                        handler.acked.load(Ordering::SeqCst) == n as u64,
                        "raw: {} acks for {n} messages",
                        handler.acked.load(Ordering::SeqCst)
                    );
                    vec![(phase, m)]
                }
                Phase::PerMessage
                | Phase::PerMessageVersioned
                | Phase::Batched
                | Phase::BatchedVersioned
                | Phase::BatchHandler => {
                    let pipeline = if phase == Phase::BatchHandler {
                        Pipeline::new().on(EVENT_TYPE, CONSUMER, ProjectBatch(db.schema.clone()))
                    } else {
                        Pipeline::new().on(EVENT_TYPE, CONSUMER, Project(db.schema.clone()))
                    };
                    let consumer = IdempotentConsumer::new(
                        Arc::clone(&db.inbox),
                        pipeline,
                        ConsumerConfig::new(),
                    )?;
                    let handler = Arc::new(Timed::new(consumer, n));
                    let batched = !matches!(phase, Phase::PerMessage | Phase::PerMessageVersioned);
                    let m = self.consume(&source, &handler, batched).await?;
                    db.check(&published, phase.versioned()).await?;
                    vec![(phase, m)]
                }
                Phase::DurableReceive | Phase::DurableProcess => {
                    let receiver = DurableReceiver::new(Arc::clone(&db.inbox));
                    let handler = Arc::new(Timed::new(receiver, n));
                    let received = self.consume(&source, &handler, true).await?;
                    let stored: i64 = db.scalar("SELECT count(*) FROM {s}.inbox_messages").await?;
                    ensure!(
                        stored == n as i64,
                        "durable receive: {stored} messages stored of {n}"
                    );
                    quiesce(&db.admin).await;
                    let processed = self.process(&db).await?;
                    db.check(&published, false).await?;
                    let done: i64 = db
                        .scalar("SELECT count(*) FROM {s}.inbox_messages WHERE status = 1")
                        .await?;
                    ensure!(
                        done == n as i64,
                        "durable process: {done} messages done of {n}"
                    );
                    vec![
                        (Phase::DurableReceive, received),
                        (Phase::DurableProcess, processed),
                    ]
                }
            };
            anyhow::Ok((measured, waited))
        }
        .await;
        // Cleaned up whatever happened.
        let removed = self.bus.remove(&self.key).await;
        db.drop().await;
        let result = outcome?;
        removed?;
        Ok(result)
    }

    /// Publishes N messages with the phase's routing key through the relay's publisher;
    /// returns their ids.
    async fn publish(&self, versioned: bool) -> anyhow::Result<Vec<Uuid>> {
        let n = self.args.messages;
        let now = chrono::Utc::now();
        let mut ids = Vec::with_capacity(n);
        let mut batch = Vec::with_capacity(self.args.batch_size);
        for i in 0..n {
            let msg = if versioned {
                NewMessage::builder("bench", Uuid::new_v4().to_string(), EVENT_TYPE)
                    .aggregate_version(1)
            } else {
                NewMessage::builder("bench", i.to_string(), EVENT_TYPE)
            }
            .routing_key(&self.key)
            .payload_json(self.body.to_owned())
            .build()?;
            ids.push(msg.id);
            batch.push(OutboxMessage::claimed_from(msg, now));
            if batch.len() == self.args.batch_size.max(1) || i + 1 == n {
                let outcomes = self.bus.publish(&batch).await;
                ensure!(
                    outcomes.len() == batch.len() && outcomes.iter().all(|o| o.is_published()),
                    "publishing the phase's messages failed: {:?}",
                    outcomes.iter().find(|o| !o.is_published())
                );
                batch.clear();
            }
        }
        Ok(ids)
    }

    /// Consumes the phase's source with `handler` until it has acknowledged N messages,
    /// then cancels the consumer.
    async fn consume<H>(
        &self,
        source: &Source,
        handler: &Arc<Timed<H>>,
        batched: bool,
    ) -> anyhow::Result<Measured>
    where
        H: DeliveryHandler + BatchDeliveryHandler,
    {
        let token = CancellationToken::new();
        let cpu0 = self.cpu();
        let trips0 = self.counter.count();
        let runner =
            self.bus
                .spawn_consumer(source, Arc::clone(handler), batched, token.clone())?;
        let limit = Instant::now() + PHASE_LIMIT;
        let done = loop {
            if let Some(done) = handler.done.get() {
                break *done;
            }
            if runner.is_finished() || Instant::now() > limit {
                token.cancel();
                let ended = runner.await;
                bail!(
                    "the consumer stopped or timed out after {} of {} acks ({} other decisions): {ended:?}",
                    handler.acked.load(Ordering::SeqCst),
                    self.args.messages,
                    handler.other.load(Ordering::SeqCst)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let cpu = self.cpu().since(cpu0);
        let round_trips = self.counter.count() - trips0;
        token.cancel();
        runner.await??;
        let other = handler.other.load(Ordering::SeqCst);
        ensure!(
            other == 0,
            "{other} deliveries were not acknowledged at once"
        );
        let first = *handler.first.get().context("the handler ran")?;
        let (p50, p99) = handler.percentiles();
        Ok(Measured {
            elapsed: done.duration_since(first),
            round_trips,
            cpu,
            p50,
            p99,
        })
    }

    /// Runs an `InboxProcessor` (defaults) over the stored messages until all are done,
    /// one `run_once` after another as `InboxProcessor::run` does with full batches.
    async fn process(&self, db: &Database) -> anyhow::Result<Measured> {
        let n = self.args.messages;
        let processor = InboxProcessor::new(
            Arc::clone(&db.inbox),
            Pipeline::new().on(EVENT_TYPE, CONSUMER, Project(db.schema.clone())),
            ProcessorConfig::new(),
        )?;
        let mut latency = histogram();
        let cpu0 = self.cpu();
        let trips0 = self.counter.count();
        let started = Instant::now();
        let mut done = 0;
        while done < n {
            ensure!(
                started.elapsed() < PHASE_LIMIT,
                "durable process: {done} of {n} done in {PHASE_LIMIT:?}"
            );
            let call = Instant::now();
            let report = processor.run_once().await?;
            latency.saturating_record(micros(call.elapsed()));
            ensure!(
                report.retried == 0 && report.dead == 0 && report.fenced == 0,
                "durable process: {report:?}"
            );
            done += report.done;
            if report.claimed == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let elapsed = started.elapsed();
        let cpu = self.cpu().since(cpu0);
        let (p50, p99) = quantiles(&latency);
        Ok(Measured {
            elapsed,
            round_trips: self.counter.count() - trips0,
            cpu,
            p50,
            p99,
        })
    }

    fn cpu(&self) -> common::CpuTimes {
        common::CpuTimes::now_with(self.bus.comm())
    }
}

/// A phase's schema: the admin pool (checkpoints, checks) and the inbox on a pool that
/// connects through the round-trip counter.
struct Database {
    admin: PgOutbox,
    pool: PgPool,
    inbox: Arc<PgInbox>,
    schema: String,
}

impl Database {
    async fn create(
        counter: &RoundTripCounter,
        base: &sqlx::postgres::PgConnectOptions,
    ) -> anyhow::Result<Self> {
        let admin = fresh_outbox("consumer").await?;
        let schema = admin.schema().to_owned();
        // As in the relay phases: no autovacuum starting on a table of seconds in a
        // random phase.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {schema}.projection (message_id uuid NOT NULL, version bigint);
             ALTER TABLE {schema}.projection SET (autovacuum_enabled = false);
             ALTER TABLE {schema}.inbox_records SET (autovacuum_enabled = false);
             ALTER TABLE {schema}.inbox_versions SET (autovacuum_enabled = false);
             ALTER TABLE {schema}.inbox_messages SET (autovacuum_enabled = false);"
        )))
        .execute(admin.pool())
        .await?;
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(Duration::from_secs(10))
            // As `PgOutbox::connect`: no ping before each acquire.
            .test_before_acquire(false)
            .connect_with(counter.options(base))
            .await?;
        let inbox = Arc::new(
            PgOutbox::new(pool.clone(), &PgConfig::default().with_schema(&schema))?.inbox(),
        );
        Ok(Self {
            admin,
            pool,
            inbox,
            schema,
        })
    }

    /// A count, `{s}` in `sql` standing for the schema.
    async fn scalar(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(
            sqlx::query_scalar(AssertSqlSafe(sql.replace("{s}", &self.schema)))
                .fetch_one(self.admin.pool())
                .await?,
        )
    }

    /// Exactly-once: one projection row per published id and none else, one inbox
    /// record each, no failure; with versions, one version row each.
    async fn check(&self, published: &[Uuid], versioned: bool) -> anyhow::Result<()> {
        let n = published.len() as i64;
        let (rows, distinct, ours): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT message_id), count(*) FILTER (WHERE message_id = ANY($1))
             FROM {}.projection",
            self.schema
        )))
        .bind(published)
        .fetch_one(self.admin.pool())
        .await?;
        ensure!(
            rows == n && distinct == n && ours == n,
            "projection: {rows} rows, {distinct} distinct ids, {ours} of the published ones, for {n} messages"
        );
        let records = self
            .scalar("SELECT count(*) FROM {s}.inbox_records WHERE consumer = 'projection'")
            .await?;
        ensure!(records == n, "{records} inbox records for {n} messages");
        let failures = self
            .scalar("SELECT count(*) FROM {s}.inbox_failures")
            .await?;
        ensure!(failures == 0, "{failures} inbox failure records");
        if versioned {
            let versions = self
                .scalar("SELECT count(*) FROM {s}.inbox_versions")
                .await?;
            ensure!(versions == n, "{versions} version rows for {n} aggregates");
        }
        Ok(())
    }

    async fn drop(self) {
        self.pool.close().await;
        drop_schema(&self.admin).await;
        self.admin.pool().close().await;
    }
}

/// The projection: one `INSERT` per message.
struct Project(String);

#[async_trait]
impl Handler<PgInbox> for Project {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.projection (message_id, version) VALUES ($1, $2)",
            self.0
        )))
        .bind(msg.id)
        .bind(msg.aggregate_version)
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The same projection, a batch with one set-based `INSERT`.
struct ProjectBatch(String);

#[async_trait]
impl Handler<PgInbox> for ProjectBatch {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        Project(self.0.clone()).handle(conn, msg, ctx).await
    }

    async fn handle_batch(
        &self,
        conn: &mut PgConnection,
        msgs: &[(&IncomingMessage, HandlerContext)],
    ) -> Result<(), BatchHandlerError> {
        let ids: Vec<Uuid> = msgs.iter().map(|(m, _)| m.id).collect();
        let versions: Vec<Option<i64>> = msgs.iter().map(|(m, _)| m.aggregate_version).collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.projection (message_id, version) SELECT * FROM UNNEST($1::uuid[], $2::bigint[])",
            self.0
        )))
        .bind(&ids)
        .bind(&versions)
        .execute(conn)
        .await
        .map_err(|e| BatchHandlerError::new(0, e.into()))?;
        Ok(())
    }
}

/// The raw phase's handler: acknowledges everything.
struct AckOnly;

#[async_trait]
impl DeliveryHandler for AckOnly {
    async fn handle(&self, _: &IncomingMessage) -> HandlerDecision {
        HandlerDecision::Ack
    }
}

#[async_trait]
impl BatchDeliveryHandler for AckOnly {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        vec![HandlerDecision::Ack; msgs.len()]
    }
}

/// Wraps the transport-facing handler: times each call, counts the acknowledgements
/// (given after the inbox's commit) and notes when the N-th came.
struct Timed<H> {
    inner: H,
    target: u64,
    acked: AtomicU64,
    other: AtomicU64,
    first: OnceLock<Instant>,
    done: OnceLock<Instant>,
    latency: Mutex<Histogram<u64>>,
}

impl<H> Timed<H> {
    fn new(inner: H, target: usize) -> Self {
        Self {
            inner,
            target: target as u64,
            acked: AtomicU64::new(0),
            other: AtomicU64::new(0),
            first: OnceLock::new(),
            done: OnceLock::new(),
            latency: Mutex::new(histogram()),
        }
    }

    fn start(&self) -> Instant {
        let now = Instant::now();
        self.first.get_or_init(|| now);
        now
    }

    fn finish(&self, started: Instant, decisions: &[HandlerDecision]) {
        let took = started.elapsed();
        self.latency
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .saturating_record(micros(took));
        let acks = decisions
            .iter()
            .filter(|d| **d == HandlerDecision::Ack)
            .count() as u64;
        self.other
            .fetch_add(decisions.len() as u64 - acks, Ordering::SeqCst);
        let before = self.acked.fetch_add(acks, Ordering::SeqCst);
        if before < self.target && before + acks >= self.target {
            let _ = self.done.set(Instant::now());
        }
    }

    fn percentiles(&self) -> (Duration, Duration) {
        quantiles(
            &self
                .latency
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

#[async_trait]
impl<H: DeliveryHandler> DeliveryHandler for Timed<H> {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let started = self.start();
        let decision = self.inner.handle(msg).await;
        self.finish(started, &[decision]);
        decision
    }
}

#[async_trait]
impl<H: BatchDeliveryHandler> BatchDeliveryHandler for Timed<H> {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        let started = self.start();
        let decisions = self.inner.handle_batch(msgs).await;
        self.finish(started, &decisions);
        decisions
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

fn quantiles(h: &Histogram<u64>) -> (Duration, Duration) {
    (
        Duration::from_micros(h.value_at_quantile(0.50)),
        Duration::from_micros(h.value_at_quantile(0.99)),
    )
}

/// Where one phase's messages wait: a queue, or a stream with its subject.
enum Source {
    Queue(String),
    Stream { stream: String, subject: String },
}

/// The broker side: the relay's publisher, and the phases' queues or streams.
#[allow(clippy::large_enum_variant)] // reason: one value per run, never moved in a loop
enum Bus {
    /// A durable topic exchange; each phase's queue is bound with its own key.
    Rabbit {
        exchange: String,
        config: RabbitConfig,
        publisher: RabbitPublisher,
        admin: Connection,
        channel: lapin::Channel,
    },
    /// Each phase's stream (file storage) captures `{prefix}.{key}`.
    Nats {
        prefix: String,
        config: NatsConfig,
        publisher: NatsPublisher,
        js: jetstream::Context,
    },
}

impl Bus {
    async fn setup(transport: TransportKind, tag: &str) -> anyhow::Result<Self> {
        match transport {
            TransportKind::Rabbit => {
                let exchange = format!("bench.consumer.{tag}");
                let (admin, channel) = super::rabbit_admin_with_exchange(&exchange).await?;
                let config = RabbitConfig::new(common::amqp_url())
                    .with_exchange(&exchange)
                    .with_declare_exchange(false);
                let publisher = RabbitPublisher::connect(config.clone()).await?;
                Ok(Self::Rabbit {
                    exchange,
                    config,
                    publisher,
                    admin,
                    channel,
                })
            }
            TransportKind::Nats => {
                let client = common::nats_connect().await.context(
                    "connect to NATS (is it running with JetStream? `cargo xtask services`)",
                )?;
                let prefix = format!("benchc.{tag}");
                let config = NatsConfig::new(common::nats_url()).with_subject_prefix(&prefix);
                let publisher = NatsPublisher::connect(config.clone()).await?;
                Ok(Self::Nats {
                    prefix,
                    config,
                    publisher,
                    js: jetstream::new(client),
                })
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "RabbitMQ",
            Self::Nats { .. } => "NATS",
        }
    }

    fn comm(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "beam.smp",
            Self::Nats { .. } => "nats-server",
        }
    }

    fn stream_name(key: &str) -> String {
        format!("BENCHC_{key}")
    }

    /// Creates the phase's queue (bound with `key`) or stream (on `{prefix}.{key}`).
    async fn prepare(&self, key: &str) -> anyhow::Result<Source> {
        match self {
            Self::Rabbit {
                exchange, channel, ..
            } => {
                let queue = format!("{exchange}.{key}");
                super::broker::declare_bound_queue(channel, &queue, exchange, key).await?;
                Ok(Source::Queue(queue))
            }
            Self::Nats { prefix, js, .. } => {
                let stream = Self::stream_name(key);
                let subject = format!("{prefix}.{key}");
                StreamSetup::new(&stream)
                    .with_subject(&subject)
                    .with_replicas(super::broker::replicas())
                    .apply_with(js, Duration::from_secs(10))
                    .await?;
                Ok(Source::Stream { stream, subject })
            }
        }
    }

    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<outboxkit_core::PublishOutcome> {
        match self {
            Self::Rabbit { publisher, .. } => publisher.publish_batch(batch).await,
            Self::Nats { publisher, .. } => publisher.publish_batch(batch).await,
        }
    }

    /// Starts the project's consumer on `source`: `run`, or `run_batched`.
    fn spawn_consumer<H>(
        &self,
        source: &Source,
        handler: Arc<Timed<H>>,
        batched: bool,
        token: CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>>
    where
        H: DeliveryHandler + BatchDeliveryHandler,
    {
        Ok(match (self, source) {
            (Self::Rabbit { config, .. }, Source::Queue(queue)) => {
                let consumer = RabbitConsumer::new(
                    RabbitConsumerConfig::new(config.clone(), queue.as_str())
                        .with_declare_queue(false),
                )?;
                tokio::spawn(async move {
                    if batched {
                        consumer.run_batched(handler, token).await?;
                    } else {
                        consumer.run(handler, token).await?;
                    }
                    Ok(())
                })
            }
            (Self::Nats { config, .. }, Source::Stream { stream, subject }) => {
                let consumer = NatsConsumer::new(
                    NatsConsumerConfig::new(config.clone(), stream.as_str(), "bench")
                        .with_filter_subject(subject.as_str()),
                )?;
                tokio::spawn(async move {
                    if batched {
                        consumer.run_batched(handler, token).await?;
                    } else {
                        consumer.run(handler, token).await?;
                    }
                    Ok(())
                })
            }
            _ => bail!("a source of the other broker"),
        })
    }

    /// Deletes the phase's queue or stream.
    async fn remove(&self, key: &str) -> anyhow::Result<()> {
        match self {
            Self::Rabbit {
                exchange, channel, ..
            } => {
                channel
                    .queue_delete(
                        format!("{exchange}.{key}").as_str().into(),
                        QueueDeleteOptions::default(),
                    )
                    .await?;
            }
            Self::Nats { js, .. } => {
                let stream = Self::stream_name(key);
                if let Err(e) = js.delete_stream(&stream).await {
                    // Not created (the phase failed before): nothing to remove.
                    if js.get_stream(&stream).await.is_ok() {
                        return Err(e.into());
                    }
                }
            }
        }
        Ok(())
    }

    async fn cleanup(self) -> anyhow::Result<()> {
        match self {
            Self::Rabbit {
                exchange,
                admin,
                channel,
                ..
            } => {
                channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await?;
                admin.close(200, "bench done".into()).await.ok();
            }
            Self::Nats { .. } => {}
        }
        Ok(())
    }
}
