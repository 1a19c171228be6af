//! The timed phases' building blocks: fresh outbox tables, preloads, a quiet machine
//! before each phase, the dispatcher over a database (PostgreSQL, or MySQL / MariaDB:
//! see `stores`) or over messages claimed in advance, and the commit-to-publish latency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use async_trait::async_trait;
use outboxkit_core::{
    BlockedKey, ClaimedBatch, CompleteReport, Completion, Dispatcher, DispatcherConfig,
    EventPublisher, MessageFilter, NewMessage, OnDead, Ordering, OutboxError, OutboxMessage,
    OutboxProducer, OutboxStats, OutboxStore, ReplayReport, SentRetention,
};
use outboxkit_memory::MemoryPublisher;
use outboxkit_postgres::PgOutbox;
use tokio_util::sync::CancellationToken;

use super::Args;
use super::stores::BenchStore;
use crate::common;

/// Confirms everything at once, recording nothing: isolates the store's claim +
/// complete cost.
pub(super) fn instant_publisher() -> Arc<MemoryPublisher> {
    Arc::new(MemoryPublisher::new().with_recording(false))
}

pub(super) fn payload(bytes: usize) -> String {
    // A JSON string value padded to the requested total size.
    let pad = bytes.saturating_sub(r#"{"pad":""}"#.len());
    format!(r#"{{"pad":"{}"}}"#, "x".repeat(pad))
}

/// The longest a timed phase waits for a quiet machine (see `common::settle`).
pub(super) const SETTLE_MAX: Duration = Duration::from_secs(10);

/// Before a timed phase: flushes what the setup wrote (PostgreSQL `CHECKPOINT`, see
/// [`BenchStore::flush`], then the kernel's dirty pages with `sync`), so that the
/// writeback of a 20,000-row preload does not land in whichever phase comes first; then
/// waits for idle cores. Returns the time spent.
pub(super) async fn quiesce<D: BenchStore>(outbox: &D) -> Duration {
    let started = Instant::now();
    outbox.flush().await;
    let _ = tokio::task::spawn_blocking(|| std::process::Command::new("sync").status()).await;
    common::settle(SETTLE_MAX).await;
    started.elapsed()
}

pub(super) async fn fresh_outbox(tag: &str) -> anyhow::Result<PgOutbox> {
    fresh_outbox_keeping(tag, SentRetention::Keep).await
}

/// [`fresh_outbox`] whose completions treat sent rows as `retention` says.
pub(super) async fn fresh_outbox_keeping(
    tag: &str,
    retention: SentRetention,
) -> anyhow::Result<PgOutbox> {
    PgOutbox::fresh(tag, retention).await
}

pub(super) async fn preload<D: BenchStore>(
    outbox: &D,
    n: usize,
    payload: &str,
) -> anyhow::Result<()> {
    preload_keyed(outbox, n, payload, None).await
}

/// Writes `n` messages in one transaction; with `keys`, message `i` gets partition key
/// `k{i % keys}`.
pub(super) async fn preload_keyed<D: BenchStore>(
    outbox: &D,
    n: usize,
    payload: &str,
    keys: Option<usize>,
) -> anyhow::Result<()> {
    let messages = (0..n)
        .map(|i| {
            let mut msg = NewMessage::builder("bench", i.to_string(), "BenchEvent")
                .payload_json(payload.to_owned());
            if let Some(keys) = keys {
                msg = msg.partition_key(format!("k{}", i % keys.max(1)));
            }
            msg.build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    outbox.load(&messages).await
}

pub(super) async fn drop_schema<D: BenchStore>(outbox: &D) {
    outbox.drop_schema().await;
}

pub(super) struct RelayRun {
    pub(super) elapsed: Duration,
    pub(super) peak_rss: u64,
    pub(super) publishing: Publishing,
}

/// Where the publishers' time went in a relay phase (from `DispatcherStats`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Publishing {
    /// Share of the phase the publishers spent publishing (1.0: always busy).
    pub(super) busy: f64,
    /// Mean time from a batch's first send to its last confirmation.
    pub(super) per_batch: Duration,
}

impl Publishing {
    fn of(stats: &outboxkit_core::DispatcherStats, elapsed: Duration, publishers: usize) -> Self {
        let publishing = Duration::from_micros(stats.publish_micros);
        Self {
            busy: publishing.as_secs_f64() / (elapsed.as_secs_f64() * publishers.max(1) as f64),
            per_batch: publishing / u32::try_from(stats.batches.max(1)).unwrap_or(u32::MAX),
        }
    }
}

pub(super) async fn run_dispatcher<D: BenchStore, P: EventPublisher>(
    outbox: &D,
    publisher: Arc<P>,
    args: &Args,
) -> anyhow::Result<RelayRun> {
    run_dispatcher_with(outbox, publisher, args, Ordering::Unordered).await
}

pub(super) async fn run_dispatcher_with<D: BenchStore, P: EventPublisher>(
    outbox: &D,
    publisher: Arc<P>,
    args: &Args,
    ordering: Ordering,
) -> anyhow::Result<RelayRun> {
    run_store(Arc::new(outbox.clone()), publisher, args, ordering).await
}

/// The pipeline without the database: the same dispatcher and publisher, relaying
/// messages that were claimed from PostgreSQL before the clock started.
pub(super) async fn run_preclaimed<P: EventPublisher>(
    claimed: Vec<OutboxMessage>,
    publisher: Arc<P>,
    args: &Args,
) -> anyhow::Result<RelayRun> {
    let store = Arc::new(PreclaimedStore(std::sync::Mutex::new(claimed.into())));
    run_store(store, publisher, args, Ordering::Unordered).await
}

/// Hands out messages claimed in advance and records completions nowhere: the
/// dispatcher's and publisher's cost without the database's. (Not `outboxkit_memory`'s
/// `MemoryOutbox`: its claims and completions cost about 2.5 µs a message, 7 times this.)
pub(super) struct PreclaimedStore(std::sync::Mutex<std::collections::VecDeque<OutboxMessage>>);

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
    // Nothing is ever held: completions are recorded nowhere.
    async fn claim_held(
        &self,
        _: &[String],
        _: Duration,
        _: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        Ok(ClaimedBatch::default())
    }
    async fn release_held(&self, _: &str, _: usize) -> Result<u64, OutboxError> {
        Ok(0)
    }
    async fn held_destinations(&self, _: &str, _: usize) -> Result<Vec<String>, OutboxError> {
        Ok(Vec::new())
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

pub(super) fn unsupported() -> OutboxError {
    OutboxError::Config("not supported by the bench's pre-claimed store".to_owned())
}

pub(super) async fn run_store<S: OutboxStore, P: EventPublisher>(
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
    let dispatcher = Dispatcher::new(store, publisher, config)?;
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

pub(super) async fn commit_to_publish<D: BenchStore>(
    outbox: &D,
) -> anyhow::Result<Option<(Duration, Duration)>> {
    Ok(common::percentiles(&outbox.sent_latencies_ms().await?))
}

/// Writes `rate` messages per second for `secs` seconds (10 ms ticks, one transaction
/// per tick, waking the relay after each commit) while the relay runs; returns the
/// commit-to-publish latency percentiles (database clock: `sent_at - created_at`).
pub(super) async fn steady_latency<P: EventPublisher>(
    publisher: Arc<P>,
    args: &Args,
    payload: &str,
) -> anyhow::Result<Option<(Duration, Duration)>> {
    Ok(common::percentiles(
        &steady_run(publisher, args, payload, false).await?,
    ))
}

/// The steady phase of [`steady_latency`]; with `hold_xmin`, while another session
/// holds a REPEATABLE READ snapshot open from before the first message to after the
/// last (as a long report or `pg_dump` would), so that no completed row's remains can
/// be removed or even marked dead in the index. Returns each message's
/// commit-to-publish latency in milliseconds, in the order they were written.
pub(super) async fn steady_run<P: EventPublisher>(
    publisher: Arc<P>,
    args: &Args,
    payload: &str,
    hold_xmin: bool,
) -> anyhow::Result<Vec<f64>> {
    let outbox = fresh_outbox("steady").await?;
    let horizon = if hold_xmin {
        let mut conn = outbox.pool().acquire().await?.detach();
        sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class;")
            .execute(&mut conn)
            .await?;
        Some(conn)
    } else {
        None
    };
    let dispatcher = Dispatcher::new(
        Arc::new(outbox.clone()),
        publisher,
        DispatcherConfig::new()
            .with_batch_size(args.batch_size)
            .with_concurrency(args.concurrency),
    )?;
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
        let mut tx = outbox.begin().await?;
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
    drop(horizon);
    let latencies: Vec<f64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT extract(epoch FROM sent_at - created_at)::float8 * 1000
           FROM {}.outbox_messages WHERE status = 1 ORDER BY seq",
        outbox.schema()
    )))
    .fetch_all(outbox.pool())
    .await?;
    drop_schema(&outbox).await;
    Ok(latencies)
}
