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
//! With `RUST_LOG=warn,outbox_core=info` each claim, publish and completion span is
//! printed as it closes, with its busy and idle time.

#[path = "../common.rs"]
mod common;
#[path = "../consumer_bench.rs"]
mod consumer_bench;
#[path = "../relay_latency_bench.rs"]
mod relay_latency_bench;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use clap::Parser;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use outbox_core::{
    BlockedKey, ClaimedBatch, CompleteReport, Completion, Dispatcher, DispatcherConfig,
    EventPublisher, MessageFilter, NewMessage, OnDead, Ordering, OutboxError, OutboxMessage,
    OutboxStats, OutboxStore, ReplayReport, SentRetention,
};
use outbox_memory::MemoryPublisher;
use outbox_postgres::{PgConfig, PgOutbox};
use tokio_util::sync::CancellationToken;
use transport_nats::async_nats;
use transport_nats::async_nats::jetstream;
use transport_nats::{NatsConfigBuilder, NatsPublisher, StreamSetup};
use transport_rabbit::{RabbitConfig, RabbitPublisher};

/// The broker the relay publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    /// RabbitMQ (lapin): publisher confirms.
    Rabbit,
    /// NATS JetStream (async-nats): PubAcks, `Nats-Msg-Id` deduplication.
    Nats,
}

/// Relay benchmark: PostgreSQL → RabbitMQ or NATS JetStream, with both ceilings measured
/// in the same run.
#[derive(Debug, Parser)]
struct Args {
    /// The broker.
    #[arg(long, value_enum, default_value_t = Transport::Rabbit)]
    transport: Transport,
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
    /// concurrent producers (see `relay_latency_bench.rs`).
    #[arg(long)]
    relay_process: bool,
    /// Measure a backlog of N pending rows instead: the relay's gauges and `outbox
    /// stats` on it, and the relay draining `--messages` of it against a table of
    /// `--messages` rows (`--rounds` rounds). Combines with `--relay-process`.
    #[arg(long, value_name = "N")]
    backlog: Option<usize>,
}

/// Confirms everything at once, recording nothing: isolates the store's claim +
/// complete cost.
fn instant_publisher() -> Arc<MemoryPublisher> {
    Arc::new(MemoryPublisher::new().with_recording(false))
}

fn payload(bytes: usize) -> String {
    // A JSON string value padded to the requested total size.
    let pad = bytes.saturating_sub(r#"{"pad":""}"#.len());
    format!(r#"{{"pad":"{}"}}"#, "x".repeat(pad))
}

/// The longest a timed phase waits for a quiet machine (see `common::settle`).
const SETTLE_MAX: Duration = Duration::from_secs(10);

/// Before a timed phase: flushes what the setup wrote (PostgreSQL `CHECKPOINT`, then
/// the kernel's dirty pages with `sync`), so that the writeback of a 20,000-row preload
/// does not land in whichever phase comes first; then waits for idle cores. Returns the
/// time spent.
async fn quiesce(outbox: &PgOutbox) -> Duration {
    let started = Instant::now();
    if let Err(e) = sqlx::query("CHECKPOINT").execute(outbox.pool()).await {
        eprintln!("note: CHECKPOINT failed ({e}); the setup's writes may land in a phase");
    }
    let _ = tokio::task::spawn_blocking(|| std::process::Command::new("sync").status()).await;
    common::settle(SETTLE_MAX).await;
    started.elapsed()
}

async fn fresh_outbox(tag: &str) -> anyhow::Result<PgOutbox> {
    let schema = format!(
        "bench_{tag}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let outbox = PgOutbox::connect(
        &PgConfig::new(common::database_url())
            .with_schema(&schema)
            .with_max_connections(8)
            // `--payload-bytes` chooses the size; the broker's limit is the one that
            // counts here, not enqueue's 1 MiB default.
            .with_max_payload_bytes(usize::MAX),
    )
    .await?;
    outbox.migrate().await?;
    // A bench table lives for seconds: autovacuum starting on it (a preload of 20,000
    // rows crosses its insert threshold) would land in a random phase of a random
    // round. Production tables keep autovacuum.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {schema}.outbox_messages SET (autovacuum_enabled = false)"
    )))
    .execute(outbox.pool())
    .await?;
    Ok(outbox)
}

async fn preload(outbox: &PgOutbox, n: usize, payload: &str) -> anyhow::Result<()> {
    preload_keyed(outbox, n, payload, None).await
}

/// Writes `n` messages; with `keys`, message `i` gets partition key `k{i % keys}`.
async fn preload_keyed(
    outbox: &PgOutbox,
    n: usize,
    payload: &str,
    keys: Option<usize>,
) -> anyhow::Result<()> {
    let mut tx = outbox.pool().begin().await?;
    let mut batch = Vec::with_capacity(1000);
    for i in 0..n {
        let mut msg = NewMessage::builder("bench", i.to_string(), "BenchEvent")
            .payload_json(payload.to_owned());
        if let Some(keys) = keys {
            msg = msg.partition_key(format!("k{}", i % keys.max(1)));
        }
        batch.push(msg.build()?);
        if batch.len() == 1000 || i + 1 == n {
            outbox.enqueue_batch(&mut tx, &batch).await?;
            batch.clear();
        }
    }
    tx.commit().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ANALYZE {}.outbox_messages",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await?;
    Ok(())
}

async fn drop_schema(outbox: &PgOutbox) {
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA {} CASCADE",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await;
}

struct Round {
    /// Whether the relay ran before the broker ceiling in this round.
    relay_first: bool,
    store: Duration,
    store_cpu: common::CpuTimes,
    broker: Duration,
    broker_cpu: common::CpuTimes,
    relay: Duration,
    relay_cpu: common::CpuTimes,
    relay_publishing: Publishing,
    pipeline: Duration,
    pipeline_cpu: common::CpuTimes,
    pipeline_publishing: Publishing,
    bare: Duration,
}

impl Round {
    /// The relay's rate over the lower of the two ceilings measured in this round.
    fn ratio(&self, n: usize) -> f64 {
        rate(n, self.relay) / rate(n, self.store).min(rate(n, self.broker))
    }
}

struct RelayRun {
    elapsed: Duration,
    peak_rss: u64,
    publishing: Publishing,
}

/// Where the publishers' time went in a relay phase (from `DispatcherStats`).
#[derive(Debug, Clone, Copy)]
struct Publishing {
    /// Share of the phase the publishers spent publishing (1.0: always busy).
    busy: f64,
    /// Mean time from a batch's first send to its last confirmation.
    per_batch: Duration,
}

impl Publishing {
    fn of(stats: &outbox_core::DispatcherStats, elapsed: Duration, publishers: usize) -> Self {
        let publishing = Duration::from_micros(stats.publish_micros);
        Self {
            busy: publishing.as_secs_f64() / (elapsed.as_secs_f64() * publishers.max(1) as f64),
            per_batch: publishing / u32::try_from(stats.batches.max(1)).unwrap_or(u32::MAX),
        }
    }
}

async fn run_dispatcher<P: EventPublisher>(
    outbox: &PgOutbox,
    publisher: Arc<P>,
    args: &Args,
) -> anyhow::Result<RelayRun> {
    run_dispatcher_with(outbox, publisher, args, Ordering::Unordered).await
}

async fn run_dispatcher_with<P: EventPublisher>(
    outbox: &PgOutbox,
    publisher: Arc<P>,
    args: &Args,
    ordering: Ordering,
) -> anyhow::Result<RelayRun> {
    run_store(Arc::new(outbox.clone()), publisher, args, ordering).await
}

/// The pipeline without the database: the same dispatcher and publisher, relaying
/// messages that were claimed from PostgreSQL before the clock started.
async fn run_preclaimed<P: EventPublisher>(
    claimed: Vec<OutboxMessage>,
    publisher: Arc<P>,
    args: &Args,
) -> anyhow::Result<RelayRun> {
    let store = Arc::new(PreclaimedStore(std::sync::Mutex::new(claimed.into())));
    run_store(store, publisher, args, Ordering::Unordered).await
}

/// Hands out messages claimed in advance and records completions nowhere: the
/// dispatcher's and publisher's cost without the database's. (Not `outbox_memory`'s
/// `MemoryOutbox`: its claims and completions cost about 2.5 µs a message, 7 times this.)
struct PreclaimedStore(std::sync::Mutex<std::collections::VecDeque<OutboxMessage>>);

#[async_trait]
impl OutboxStore for PreclaimedStore {
    async fn claim(&self, batch: usize, _: Duration) -> Result<ClaimedBatch, OutboxError> {
        let mut queue = self
            .0
            .lock()
            .map_err(|_| OutboxError::Config("the pre-claimed queue is poisoned".to_owned()))?;
        let n = batch.min(queue.len());
        Ok(ClaimedBatch::new(queue.drain(..n).collect(), Vec::new()))
    }
    async fn claim_ordered(
        &self,
        _: usize,
        _: Duration,
        _: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        Err(unsupported())
    }
    async fn blocked_keys(&self, _: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        Err(unsupported())
    }
    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        Ok(CompleteReport {
            applied: completions.len() as u64,
            fenced: Vec::new(),
        })
    }
    async fn get(&self, _: uuid::Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        Err(unsupported())
    }
    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        Err(unsupported())
    }
    async fn dead_letters(
        &self,
        _: &MessageFilter,
        _: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        Err(unsupported())
    }
    async fn replay(&self, _: &MessageFilter, _: bool) -> Result<ReplayReport, OutboxError> {
        Err(unsupported())
    }
    async fn purge_sent(&self, _: Duration, _: usize) -> Result<u64, OutboxError> {
        Err(unsupported())
    }
}

fn unsupported() -> OutboxError {
    OutboxError::Config("not supported by the bench's pre-claimed store".to_owned())
}

async fn run_store<S: OutboxStore, P: EventPublisher>(
    store: Arc<S>,
    publisher: Arc<P>,
    args: &Args,
    ordering: Ordering,
) -> anyhow::Result<RelayRun> {
    let config = DispatcherConfig::new()
        .with_batch_size(args.batch_size)
        .with_concurrency(args.concurrency)
        .with_ordering(ordering)
        .with_poll_interval(Duration::from_millis(50));
    let dispatcher = Dispatcher::new(store, publisher, config);
    let token = CancellationToken::new();
    let started = Instant::now();
    let runner = {
        let d = dispatcher.clone();
        let t = token.clone();
        tokio::spawn(async move { d.run(t).await })
    };
    let mut peak_rss = common::rss_bytes();
    let deadline = started + Duration::from_secs(600);
    while dispatcher.stats().published < args.messages as u64 {
        if Instant::now() > deadline {
            token.cancel();
            bail!(
                "relay did not finish within 10 minutes: {:?}",
                dispatcher.stats()
            );
        }
        peak_rss = peak_rss.max(common::rss_bytes());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    // Before the shutdown, so the publishers' idle tail is not counted.
    let publishing = Publishing::of(&dispatcher.stats(), elapsed, args.concurrency);
    token.cancel();
    runner.await??;
    let stats = dispatcher.stats();
    if stats.dead > 0 || stats.retried > 0 {
        bail!("relay had failures: {stats:?}");
    }
    Ok(RelayRun {
        elapsed,
        peak_rss,
        publishing,
    })
}

async fn commit_to_publish(outbox: &PgOutbox) -> anyhow::Result<Option<(Duration, Duration)>> {
    let rows: Vec<f64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM sent_at - created_at)::float8 * 1000 FROM {}.outbox_messages WHERE status = 1",
        outbox.schema()
    )))
    .fetch_all(outbox.pool())
    .await?;
    Ok(common::percentiles(&rows))
}

/// The properties and headers the relay's publisher sends for a `BenchEvent` (CloudEvents
/// attributes as AMQP long-string headers), so the ceiling publishes identical messages.
fn same_properties_as_the_relay(body: &[u8]) -> BasicProperties {
    let msg = OutboxMessage::claimed_from(
        NewMessage::builder("bench", "0", "BenchEvent")
            .payload_json(String::from_utf8_lossy(body).into_owned())
            .build()
            .expect("the bench payload is JSON"),
        chrono::Utc::now(),
    );
    let mut headers = std::collections::BTreeMap::new();
    for (name, value) in
        outbox_core::wire::encode_headers(&msg, outbox_core::wire::Binding::Amqp, None)
    {
        headers.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(msg.id.to_string().into())
        .with_timestamp(u64::try_from(msg.occurred_at.timestamp()).unwrap_or(0))
        .with_type("BenchEvent".into())
        .with_headers(FieldTable::from(headers))
}

/// Raw lapin: `concurrency` channels, each publishing windows of `batch_size` messages
/// and then awaiting their confirms together.
async fn rabbit_ceiling(
    args: &Args,
    exchange: &str,
    body: &[u8],
    bare: bool,
) -> anyhow::Result<Duration> {
    let conn = Connection::connect(&common::amqp_url(), ConnectionProperties::default()).await?;
    let per_channel = args.messages.div_ceil(args.concurrency);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.concurrency {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let exchange = exchange.to_owned();
        let body = body.to_vec();
        let batch = args.batch_size;
        let count = per_channel.min(args.messages - c * per_channel);
        tasks.push(tokio::spawn(async move {
            let mut sent = 0;
            while sent < count {
                let window = batch.min(count - sent);
                // Each send is polled once as soon as it is built (queuing its frames
                // for lapin's I/O thread), then all are awaited together: the relay's
                // RabbitMQ publisher sends the same way.
                let mut sends = Vec::with_capacity(window);
                let mut confirms = Vec::with_capacity(window);
                for _ in 0..window {
                    let props = if bare {
                        BasicProperties::default().with_delivery_mode(2)
                    } else {
                        same_properties_as_the_relay(&body)
                    };
                    let mut send = Box::pin(channel.basic_publish(
                        exchange.as_str().into(),
                        "BenchEvent".into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &body,
                        props,
                    ));
                    match futures::poll!(send.as_mut()) {
                        std::task::Poll::Ready(confirm) => confirms.push(confirm?),
                        std::task::Poll::Pending => sends.push(send),
                    }
                }
                for send in futures::future::join_all(sends).await {
                    confirms.push(send?);
                }
                for confirm in futures::future::join_all(confirms).await {
                    let confirmation = confirm?;
                    anyhow::ensure!(confirmation.is_ack(), "broker nacked a message");
                }
                sent += window;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    conn.close(200, "bench done".into()).await.ok();
    Ok(elapsed)
}

/// Writes `rate` messages per second for `secs` seconds (10 ms ticks, one transaction
/// per tick, waking the relay after each commit) while the relay runs; returns the
/// commit-to-publish latency percentiles (database clock: `sent_at - created_at`).
async fn steady_latency<P: EventPublisher>(
    publisher: Arc<P>,
    args: &Args,
    payload: &str,
) -> anyhow::Result<Option<(Duration, Duration)>> {
    let outbox = fresh_outbox("steady").await?;
    let dispatcher = Dispatcher::new(
        Arc::new(outbox.clone()),
        publisher,
        DispatcherConfig::new()
            .with_batch_size(args.batch_size)
            .with_concurrency(args.concurrency),
    );
    let wake = dispatcher.wake_handle();
    let token = CancellationToken::new();
    let runner = {
        let d = dispatcher.clone();
        let t = token.clone();
        tokio::spawn(async move { d.run(t).await })
    };
    let total = args.steady_rate * args.steady_secs;
    let per_tick = (args.steady_rate / 100).max(1);
    let mut written = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while written < total {
        tick.tick().await;
        let batch: Vec<NewMessage> = (0..per_tick.min(total - written))
            .map(|i| {
                NewMessage::builder("bench", (written + i).to_string(), "BenchEvent")
                    .payload_json(payload.to_owned())
                    .build()
            })
            .collect::<Result<_, _>>()?;
        let mut tx = outbox.pool().begin().await?;
        outbox.enqueue_batch(&mut tx, &batch).await?;
        tx.commit().await?;
        wake.wake();
        written += batch.len() as u64;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while dispatcher.stats().published < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    token.cancel();
    runner.await??;
    let latency = commit_to_publish(&outbox).await?;
    drop_schema(&outbox).await;
    Ok(latency)
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// The headers the relay's NATS publisher sends for a `BenchEvent`: `Nats-Msg-Id` (a
/// fresh id, so the stream tracks every message in its duplicate window as it does for
/// the relay), `Content-Type` and the CloudEvents `ce-*` headers.
fn same_headers_as_the_relay(body: &[u8]) -> async_nats::HeaderMap {
    let msg = OutboxMessage::claimed_from(
        NewMessage::builder("bench", "0", "BenchEvent")
            .payload_json(String::from_utf8_lossy(body).into_owned())
            .build()
            .expect("the bench payload is JSON"),
        chrono::Utc::now(),
    );
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg.id.to_string().as_str());
    headers.insert("Content-Type", "application/json");
    for (name, value) in
        outbox_core::wire::encode_headers(&msg, outbox_core::wire::Binding::Nats, None)
    {
        headers.insert(name.as_str(), value.as_str());
    }
    headers
}

/// Raw async-nats JetStream: `concurrency` tasks, each publishing windows of
/// `batch_size` messages and then awaiting their PubAcks together.
async fn nats_ceiling(
    args: &Args,
    js: &jetstream::Context,
    subject: &str,
    body: &[u8],
    bare: bool,
) -> anyhow::Result<Duration> {
    let per_task = args.messages.div_ceil(args.concurrency);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.concurrency {
        let js = js.clone();
        let subject = subject.to_owned();
        let body = bytes::Bytes::copy_from_slice(body);
        let batch = args.batch_size;
        let count = per_task.min(args.messages - c * per_task);
        tasks.push(tokio::spawn(async move {
            let mut sent = 0;
            while sent < count {
                let window = batch.min(count - sent);
                let mut acks = Vec::with_capacity(window);
                for _ in 0..window {
                    let message = if bare {
                        jetstream::message::PublishMessage::build().payload(body.clone())
                    } else {
                        jetstream::message::PublishMessage::build()
                            .payload(body.clone())
                            .headers(same_headers_as_the_relay(&body))
                    };
                    acks.push(js.send_publish(subject.clone(), message).await?);
                }
                for ack in
                    futures::future::join_all(acks.into_iter().map(IntoFuture::into_future)).await
                {
                    let ack = ack?;
                    anyhow::ensure!(
                        !ack.duplicate,
                        "the stream dropped a message as a duplicate"
                    );
                }
                sent += window;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}

/// The broker side of the benchmark: where the ceiling and the relay publish, and how
/// to empty and remove it.
enum Broker {
    /// A durable topic exchange with one durable queue bound to everything.
    Rabbit {
        exchange: String,
        queue: String,
        admin: Connection,
        channel: lapin::Channel,
    },
    /// A file-storage stream (2-minute duplicate window) capturing `bench.<tag>.>`.
    Nats {
        js: jetstream::Context,
        stream: String,
        prefix: String,
    },
}

/// An admin connection to RabbitMQ and a channel on it, with the durable topic
/// `exchange` declared (the relay and the bench's publishers publish to it).
async fn rabbit_admin_with_exchange(
    exchange: &str,
) -> anyhow::Result<(Connection, lapin::Channel)> {
    let admin = Connection::connect(&common::amqp_url(), ConnectionProperties::default())
        .await
        .context("connect to RabbitMQ (is it running? `cargo xtask services`)")?;
    let channel = admin.create_channel().await?;
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((admin, channel))
}

impl Broker {
    async fn setup(transport: Transport, tag: &str) -> anyhow::Result<Self> {
        match transport {
            Transport::Rabbit => {
                let exchange = format!("bench.{tag}");
                let queue = format!("bench.{tag}.sink");
                let (admin, channel) = rabbit_admin_with_exchange(&exchange).await?;
                channel
                    .queue_declare(
                        queue.as_str().into(),
                        QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                channel
                    .queue_bind(
                        queue.as_str().into(),
                        exchange.as_str().into(),
                        "#".into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await?;
                Ok(Self::Rabbit {
                    exchange,
                    queue,
                    admin,
                    channel,
                })
            }
            Transport::Nats => {
                let client = async_nats::connect(common::nats_url()).await.context(
                    "connect to NATS (is it running with JetStream? `cargo xtask services`)",
                )?;
                let js = jetstream::new(client);
                let stream = format!("BENCH_{tag}");
                let prefix = format!("bench.{tag}");
                StreamSetup::new(&stream)
                    .with_subject(format!("{prefix}.>"))
                    .apply_with(&js, Duration::from_secs(10))
                    .await?;
                Ok(Self::Nats { js, stream, prefix })
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "RabbitMQ",
            Self::Nats { .. } => "NATS",
        }
    }

    /// The process name of the broker, for CPU accounting.
    fn comm(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "beam.smp",
            Self::Nats { .. } => "nats-server",
        }
    }

    fn ceiling_label(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "broker ceiling (raw lapin, pipelined confirms)",
            Self::Nats { .. } => "broker ceiling (raw JetStream, pipelined PubAcks)",
        }
    }

    fn bare_label(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "(reference) raw lapin, bodies without headers",
            Self::Nats { .. } => "(reference) raw JetStream, bodies without headers",
        }
    }

    /// An untimed publish of the phase's size, then a purge: every timed broker phase
    /// starts on a broker that has just done the same work, as a running relay's broker
    /// has, and on an empty sink. It narrows the effect of the phases' order within a
    /// round but does not remove it (hence the balanced order of the rounds).
    async fn warm_up(&self, args: &Args, body: &[u8]) -> anyhow::Result<()> {
        self.ceiling(args, body, false).await?;
        self.purge().await
    }

    /// The raw broker rate; fails (instead of hanging) when the broker stops
    /// confirming for 5 minutes.
    async fn ceiling(&self, args: &Args, body: &[u8], bare: bool) -> anyhow::Result<Duration> {
        let run = async {
            match self {
                Self::Rabbit { exchange, .. } => rabbit_ceiling(args, exchange, body, bare).await,
                Self::Nats { js, prefix, .. } => {
                    nats_ceiling(args, js, &format!("{prefix}.BenchEvent"), body, bare).await
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(300), run)
            .await
            .context("the broker ceiling got no confirmations for 5 minutes (broker blocked? check its alarms)")?
    }

    /// Empties the queue or stream between phases; fails instead of hanging after a
    /// minute.
    async fn purge(&self) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(60), self.purge_now())
            .await
            .context("purging the bench sink took over a minute")?
    }

    async fn purge_now(&self) -> anyhow::Result<()> {
        match self {
            Self::Rabbit { queue, channel, .. } => {
                channel
                    .queue_purge(queue.as_str().into(), Default::default())
                    .await?;
            }
            Self::Nats { js, stream, .. } => {
                js.get_stream(stream).await?.purge().await?;
            }
        }
        Ok(())
    }

    async fn cleanup(self) -> anyhow::Result<()> {
        match self {
            Self::Rabbit {
                exchange,
                queue,
                admin,
                channel,
            } => {
                channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await?;
                channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await?;
                admin.close(200, "bench done".into()).await.ok();
            }
            Self::Nats { js, stream, .. } => {
                js.delete_stream(&stream).await?;
            }
        }
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin=off".into()),
        )
        .init();
    let args = Args::parse();
    if args.consumer {
        return consumer_bench::run(&args).await;
    }
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let broker = Broker::setup(args.transport, &tag).await?;
    let result = match &broker {
        Broker::Rabbit { exchange, .. } => {
            let publisher = RabbitPublisher::connect(
                RabbitConfig::builder(common::amqp_url())
                    .with_exchange(exchange)
                    .with_declare_exchange(false)
                    .build()?,
            )
            .await?;
            run(&args, &broker, Arc::new(publisher)).await
        }
        Broker::Nats { prefix, .. } => {
            let publisher = NatsPublisher::connect(
                NatsConfigBuilder::new(common::nats_url())
                    .with_subject_prefix(prefix)
                    .build()?,
            )
            .await?;
            run(&args, &broker, Arc::new(publisher)).await
        }
    };
    broker.cleanup().await?;
    result
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
            let db = fresh_outbox("ostore")
                .await?
                .with_sent_retention(args.sent_retention);
            preload_keyed(&db, n, &body, keys).await?;
            quiesce(&db).await;
            store_runs.push(
                run_dispatcher_with(&db, instant_publisher(), args, ordering)
                    .await?
                    .elapsed,
            );
            drop_schema(&db).await;
            let db = fresh_outbox("orelay")
                .await?
                .with_sent_retention(args.sent_retention);
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
    if args.relay_process || args.backlog.is_some() {
        return relay_latency_bench::run(args, broker, publisher).await;
    }
    let body = payload(args.payload_bytes);
    let n = args.messages;
    println!(
        "outbox relay benchmark, PostgreSQL → {}: {n} messages of {} bytes, batch {}, {} batches in flight, sent retention {}, {} CPUs",
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
    for round in 0..args.rounds.max(1) {
        let store_db = fresh_outbox("store")
            .await?
            .with_sent_retention(args.sent_retention);
        preload(&store_db, n, &body).await?;
        settled = settled.max(quiesce(&store_db).await);
        let cpu0 = cpu();
        let store = run_dispatcher(&store_db, instant_publisher(), args).await?;
        let store_cpu = cpu().since(cpu0);
        drop_schema(&store_db).await;

        let relay_db = fresh_outbox("relay")
            .await?
            .with_sent_retention(args.sent_retention);
        preload(&relay_db, n, &body).await?;
        let mut ceiling = None;
        let mut relay = None;
        for phase in 0..2 {
            settled = settled.max(quiesce(&relay_db).await);
            broker.warm_up(args, body.as_bytes()).await?;
            if (phase + round) % 2 == 0 {
                let cpu0 = cpu();
                let elapsed = broker.ceiling(args, body.as_bytes(), false).await?;
                ceiling = Some((elapsed, cpu().since(cpu0)));
            } else {
                let cpu0 = cpu();
                let run = run_dispatcher(&relay_db, Arc::clone(&publisher), args).await?;
                relay = Some((run, cpu().since(cpu0)));
            }
            broker.purge().await?;
        }
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
        let counted = if args.sent_retention == SentRetention::Delete {
            ""
        } else {
            "WHERE status = 1"
        };
        sent = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.outbox_messages {counted}",
            relay_db.schema()
        )))
        .fetch_one(relay_db.pool())
        .await?;
        drop_schema(&relay_db).await;
        let (broker_elapsed, broker_cpu) = ceiling.context("broker phase ran")?;
        let (relay, relay_cpu) = relay.context("relay phase ran")?;
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
        };
        println!(
            "round {}: store {:.0}/s, broker {:.0}/s, relay {:.0}/s, relay without database {:.0}/s, ratio {:.2} ({} first)",
            round + 1,
            rate(n, r.store),
            rate(n, r.broker),
            rate(n, r.relay),
            rate(n, r.pipeline),
            r.ratio(n),
            if r.relay_first { "relay" } else { "ceiling" }
        );
        rounds.push(r);
    }
    let median = |f: &dyn Fn(&Round) -> Duration| -> Duration {
        let mut v: Vec<Duration> = rounds.iter().map(f).collect();
        v.sort();
        let k = v.len() / 2;
        if v.len().is_multiple_of(2) {
            (v[k - 1] + v[k]) / 2
        } else {
            v[k]
        }
    };
    let store = median(&|r| r.store);
    let broker_median = median(&|r| r.broker);
    let relay = median(&|r| r.relay);
    let pipeline = median(&|r| r.pipeline);
    let bare = median(&|r| r.bare);
    // The round whose relay time is the median (the upper one of an even count): its
    // CPU figures are printed.
    let mid = {
        let mut by_relay: Vec<&Round> = rounds.iter().collect();
        by_relay.sort_by_key(|r| r.relay);
        by_relay[by_relay.len() / 2]
    };
    let (store_cpu, broker_cpu, relay_cpu, pipeline_cpu) = (
        mid.store_cpu,
        mid.broker_cpu,
        mid.relay_cpu,
        mid.pipeline_cpu,
    );

    let steady = steady_latency(Arc::clone(&publisher), args, &body).await?;
    broker.purge().await?;

    let (store_rate, broker_rate, relay_rate) =
        (rate(n, store), rate(n, broker_median), rate(n, relay));
    let ceiling = store_rate.min(broker_rate);
    println!();
    println!("medians of {} rounds:", rounds.len());
    println!("| phase                                   | messages/s | elapsed   |");
    println!("|-----------------------------------------|-----------:|----------:|");
    println!(
        "| store ceiling (claim + complete, no broker) | {store_rate:>10.0} | {:>9} |",
        common::ms(store)
    );
    println!(
        "| {} | {broker_rate:>10.0} | {:>9} |",
        broker.ceiling_label(),
        common::ms(broker_median)
    );
    println!(
        "| relay PostgreSQL → {:<20} | {relay_rate:>10.0} | {:>9} |",
        broker.name(),
        common::ms(relay)
    );
    println!(
        "| (reference) relay without the database in the phase | {:>10.0} | {:>9} |",
        rate(n, pipeline),
        common::ms(pipeline)
    );
    println!(
        "| {} | {:>10.0} | {:>9} |",
        broker.bare_label(),
        rate(n, bare),
        common::ms(bare)
    );
    println!();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "CPU seconds per phase in the round with the median relay time ({} / PostgreSQL / this process):",
        broker.name()
    );
    for (phase, cpu, d) in [
        ("store ceiling", store_cpu, mid.store),
        ("broker ceiling", broker_cpu, mid.broker),
        ("relay", relay_cpu, mid.relay),
        ("relay, no db", pipeline_cpu, mid.pipeline),
    ] {
        let busy = cpu.broker + cpu.database + cpu.relay;
        println!(
            "  {phase:<15} {:.2} / {:.2} / {:.2} s, {:.0}% of {cores} cores",
            cpu.broker,
            cpu.database,
            cpu.relay,
            100.0 * busy / d.as_secs_f64() / cores as f64,
        );
    }
    // Whether the relay waited on the database (publishers idle) or on the broker
    // (publishers busy, each batch taking longer to be confirmed).
    let (with_db, no_db) = (mid.relay_publishing, mid.pipeline_publishing);
    println!(
        "publishers in that round: busy {:.0}% of the relay phase, a batch confirmed {} after its first send (no database in the phase: {:.0}%, {})",
        100.0 * with_db.busy,
        common::ms(with_db.per_batch),
        100.0 * no_db.busy,
        common::ms(no_db.per_batch),
    );
    println!();
    // The figure of merit pairs each relay with the ceilings measured in its own round,
    // and averages the rounds' ratios geometrically: with as many rounds run relay-first
    // as ceiling-first, the effect of the order cancels out.
    let geomean = |rs: &[&Round]| -> Option<f64> {
        (!rs.is_empty())
            .then(|| (rs.iter().map(|r| r.ratio(n).ln()).sum::<f64>() / rs.len() as f64).exp())
    };
    let all: Vec<&Round> = rounds.iter().collect();
    let (relay_first, ceiling_first): (Vec<&Round>, Vec<&Round>) =
        rounds.iter().partition(|r| r.relay_first);
    let show = |g: Option<f64>| g.map_or_else(|| "-".to_owned(), |g| format!("{g:.2}"));
    println!(
        "relay / lower ceiling = {} (target ≥ 0.90): geometric mean of the {} rounds' ratios; \
         rounds with the relay first {}, with the ceiling first {}; ratio of the medians {:.2}",
        show(geomean(&all)),
        rounds.len(),
        show(geomean(&relay_first)),
        show(geomean(&ceiling_first)),
        relay_rate / ceiling
    );
    println!(
        "each timed phase started after a checkpoint and sync, on idle cores (longest wait {}), \
         each broker phase right after an untimed warm-up of the same size",
        common::ms(settled)
    );
    if args.sent_retention == SentRetention::Delete {
        println!("rows left in the outbox after the relay: {sent} of {n} (sent rows are deleted)");
        println!(
            "commit-to-publish latency of the backlog: not measured (it is read from sent_at, and sent rows are deleted)"
        );
    } else {
        println!("messages marked Sent: {sent} of {n}");
    }
    if let Some((p50, p99)) = latency {
        println!(
            "commit-to-publish latency, backlog of {n} pre-inserted (last round): p50 {} p99 {}",
            common::ms(p50),
            common::ms(p99)
        );
    }
    if let Some((p50, p99)) = steady {
        println!(
            "commit-to-publish latency, steady {} messages/s for {} s (sent rows kept): p50 {} p99 {}",
            args.steady_rate,
            args.steady_secs,
            common::ms(p50),
            common::ms(p99)
        );
    }
    println!(
        "relay process peak RSS in the first round {:.1} MiB (baseline before the relay {:.1} MiB)",
        peak_rss as f64 / 1048576.0,
        baseline_rss as f64 / 1048576.0
    );
    Ok(())
}
