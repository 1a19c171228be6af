//! The WAL relay loop.
//!
//! One session at a time reads the slot (PostgreSQL lets one walsender hold it; a
//! second relay waits as a standby and takes over when the first one's session ends).
//! Changes arrive in commit order. Inserted rows are gathered into a batch until it is
//! full or nothing more is waiting, then published; the position confirmed to the
//! server (the slot's `confirmed_flush_lsn`) is the end of the last transaction whose
//! rows were all published and recorded, so a crash replays from there (at least
//! once; the message ids are stable, so broker deduplication and the inbox absorb the
//! repeats).
//!
//! What happens to a message, by what went wrong (the polling dispatcher's rules,
//! without claims):
//! - **published**: its row is marked `Sent` (or deleted) in one statement per batch;
//! - **undecodable row** or **a verdict about the message** (unroutable, oversized,
//!   invalid): `Dead` with `last_error`, the stream goes on;
//! - **another transient failure**: the batch stops at that message and is published
//!   again from it after the event type's backoff (the messages after it again too,
//!   so per-key order holds); after `max_attempts`, `Dead`;
//! - **the broker cannot take messages** (an outage, a destination refusing): reading
//!   pauses, the broker is probed with backoff, then the batch is published again from
//!   the first unconfirmed message. No attempt is charged; nothing goes dead.
//! - **the database** (recording `Sent`/`Dead`) failing transiently is retried until it
//!   lands; failing permanently stops the relay ([`WalError::Store`]).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt as _;
use outbox_core::{
    EventPublisher, MessageStatus, OutboxMessage, OutboxStore as _, PublishError, PublishOutcome,
    RetryPolicies, SentRetention,
};
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use sqlx::AssertSqlSafe;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use super::pgoutput::{self, Change, Relation, Row};
use super::{WalConfig, WalError, admin};
use crate::PgOutbox;
use crate::error::db;
use crate::sql::quoted_schema;

/// The Prometheus gauge of the WAL the slot retains, in bytes.
pub const WAL_RETAINED_BYTES: &str = "outbox_wal_retained_bytes";

/// Settings of a [`WalRelay`] beside its [`WalConfig`].
#[derive(Debug, Clone)]
pub struct WalRelayConfig {
    url: String,
    batch_size: usize,
    retry: RetryPolicies,
    probe_cap: Duration,
    gauge_interval: Duration,
    standby_interval: Duration,
    crash_loop_limit: u32,
}

impl WalRelayConfig {
    /// Reads through a replication connection to `url` (the same database URL as the
    /// store's), with the defaults below.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            batch_size: 500,
            retry: RetryPolicies::default(),
            probe_cap: Duration::from_secs(30),
            gauge_interval: Duration::from_secs(5),
            standby_interval: Duration::from_secs(1),
            crash_loop_limit: outbox_core::DEFAULT_CRASH_LOOP_LIMIT,
        }
    }

    /// Starts of the relay that may end (the process dies) while it publishes one
    /// message alone, before that message goes `Dead` as a suspected crash loop
    /// [default: [`DEFAULT_CRASH_LOOP_LIMIT`](outbox_core::DEFAULT_CRASH_LOOP_LIMIT)].
    #[must_use]
    pub fn with_crash_loop_limit(mut self, limit: u32) -> Self {
        self.crash_loop_limit = limit.max(1);
        self
    }

    /// Most messages published in one call [default: 500].
    #[must_use]
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Backoff and attempts per event type [default: [`RetryPolicies::default`]].
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicies) -> Self {
        self.retry = retry;
        self
    }

    /// How often the retained-WAL gauge is refreshed [default: 5 s].
    #[must_use]
    pub fn with_gauge_interval(mut self, every: Duration) -> Self {
        self.gauge_interval = every.max(Duration::from_millis(100));
        self
    }

    /// How often a standby relay looks whether the slot is free [default: 1 s].
    #[must_use]
    pub fn with_standby_interval(mut self, every: Duration) -> Self {
        self.standby_interval = every.max(Duration::from_millis(50));
        self
    }
}

/// Counters of a finished [`WalRelay::run`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalRelayStats {
    /// Messages confirmed by the broker.
    pub published: u64,
    /// Messages moved to Dead.
    pub dead: u64,
    /// Replication sessions started (1 plus reconnects and takeovers).
    pub sessions: u64,
}

#[derive(Debug, Default)]
struct Counters {
    published: AtomicU64,
    dead: AtomicU64,
    sessions: AtomicU64,
    circuit_open: AtomicBool,
    standby: AtomicBool,
    /// -1: unknown.
    retained: AtomicI64,
}

/// A live view of a running [`WalRelay`] (for health checks). Cheap to clone.
#[derive(Debug, Clone)]
pub struct WalStatsHandle(Arc<Counters>);

impl WalStatsHandle {
    /// Messages published so far.
    pub fn published(&self) -> u64 {
        self.0.published.load(Ordering::Relaxed)
    }
    /// Whether the broker is taken to be unavailable (reading paused).
    pub fn circuit_open(&self) -> bool {
        self.0.circuit_open.load(Ordering::Relaxed)
    }
    /// Whether another session holds the slot and this relay waits.
    pub fn standby(&self) -> bool {
        self.0.standby.load(Ordering::Relaxed)
    }
    /// WAL retained by the slot at the last refresh, in bytes.
    pub fn retained_bytes(&self) -> Option<u64> {
        u64::try_from(self.0.retained.load(Ordering::Relaxed)).ok()
    }
    fn snapshot(&self) -> WalRelayStats {
        WalRelayStats {
            published: self.published(),
            dead: self.0.dead.load(Ordering::Relaxed),
            sessions: self.0.sessions.load(Ordering::Relaxed),
        }
    }
}

/// How a session starts. A new session (after a crash, a takeover, a restart) reads
/// again from the confirmed position, which trails what its predecessor did:
/// - `catching_up`: rows the table already records (`Sent`, `Dead`) are skipped, until
///   a batch has none of them;
/// - `careful_left`: the first messages are published one at a time, each recorded at
///   once, so that a message that makes the relay die is the first pending one at the
///   next start;
/// - `guarded`: that first pending message is counted (`unfinished_alone`) before it
///   is published and uncounted when its publish comes back; past the crash-loop limit
///   it goes `Dead` instead. Restarts during a broker outage never count: the publish
///   comes back (unavailable) and the count is reset.
struct SessionStart {
    catching_up: bool,
    careful_left: usize,
    guarded: bool,
}

impl SessionStart {
    fn new(careful: usize) -> Self {
        Self {
            catching_up: true,
            careful_left: careful,
            guarded: false,
        }
    }
}

/// One change of the outbox table to act on, in commit order.
enum Item {
    Message(Box<OutboxMessage>),
    /// A row that does not decode: it goes dead.
    Poison {
        id: Uuid,
        reason: String,
    },
    /// An update back to `New` (a replayed dead letter): read again from the table.
    Replay(Uuid),
}

/// How a publishing round ended short of the batch's end.
enum Pause {
    Outage(String),
    Retry(Duration),
}

/// The WAL relay over `P`. See the [module docs](self).
pub struct WalRelay<P> {
    outbox: PgOutbox,
    wal: WalConfig,
    publisher: Arc<P>,
    config: WalRelayConfig,
    counters: Arc<Counters>,
}

impl<P: EventPublisher> WalRelay<P> {
    /// A relay reading `wal`'s slot for `outbox`'s table and publishing with
    /// `publisher`.
    pub fn new(
        outbox: PgOutbox,
        wal: WalConfig,
        publisher: Arc<P>,
        config: WalRelayConfig,
    ) -> Self {
        let counters = Arc::new(Counters::default());
        counters.retained.store(-1, Ordering::Relaxed);
        Self {
            outbox,
            wal,
            publisher,
            config,
            counters,
        }
    }

    /// A live view of the counters.
    pub fn stats(&self) -> WalStatsHandle {
        WalStatsHandle(Arc::clone(&self.counters))
    }

    /// Reads and publishes until `shutdown` is cancelled: then the batch being
    /// published is finished (or, during an outage, left unconfirmed for the next
    /// session), the confirmed position is reported to the server and the session
    /// ends. Connection failures are retried with backoff; a slot held by another
    /// session is waited for.
    ///
    /// # Errors
    /// [`WalError::WalLevel`], [`WalError::SlotMissing`] (also when the slot is
    /// dropped while the relay runs), [`WalError::PublicationMissing`],
    /// [`WalError::WrongPlugin`], [`WalError::Url`], a permanent
    /// [`WalError::Store`] (a statement recording outcomes refused), or a stream
    /// failure that retrying cannot help (authentication, TLS, a malformed message).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<WalRelayStats, WalError> {
        let gauge = self.spawn_gauge(shutdown.clone());
        let result = self.run_sessions(&shutdown).await;
        gauge.abort();
        result.map(|()| self.stats().snapshot())
    }

    async fn run_sessions(&self, shutdown: &CancellationToken) -> Result<(), WalError> {
        let mut backoff = Duration::from_millis(500);
        let mut waiting_logged = false;
        while !shutdown.is_cancelled() {
            let (confirmed, active) = match admin::preflight(self.outbox.pool(), &self.wal).await {
                Ok(x) => x,
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, "cannot check the replication slot; retrying");
                    self.pause(shutdown, &mut backoff).await;
                    continue;
                }
                Err(e) => {
                    error!(error = %e, "the WAL relay stops");
                    return Err(e);
                }
            };
            if let Some(pid) = active {
                self.counters.standby.store(true, Ordering::Relaxed);
                if !waiting_logged {
                    info!(
                        slot = self.wal.slot(),
                        pid, "the replication slot is read by another session; standing by"
                    );
                    waiting_logged = true;
                }
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = tokio::time::sleep(self.config.standby_interval) => {}
                }
                continue;
            }
            let start = confirmed
                .as_deref()
                .and_then(|s| s.parse::<Lsn>().ok())
                .unwrap_or(Lsn::ZERO);
            let sessions_before = self.counters.sessions.load(Ordering::Relaxed);
            match self.session(start, shutdown).await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_retryable() => {
                    if self.counters.sessions.load(Ordering::Relaxed) != sessions_before {
                        // It had been reading: reconnect soon, not at the last backoff.
                        backoff = Duration::from_millis(500);
                    }
                    // The slot taken meanwhile, a server restart, a dropped connection:
                    // the next preflight tells which.
                    warn!(error = %e, "the replication session ended; reconnecting");
                    waiting_logged = false;
                    self.pause(shutdown, &mut backoff).await;
                }
                Err(e) => {
                    error!(error = %e, "the WAL relay stops");
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    async fn pause(&self, shutdown: &CancellationToken, backoff: &mut Duration) {
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(*backoff) => {}
        }
        *backoff = outbox_core::retry::outage_backoff(*backoff, Duration::from_secs(10));
    }

    fn spawn_gauge(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let pool = self.outbox.pool().clone();
        let slot = self.wal.slot().to_owned();
        let counters = Arc::clone(&self.counters);
        let every = self.config.gauge_interval;
        tokio::spawn(async move {
            loop {
                match admin::retained_bytes(&pool, &slot).await {
                    Ok(Some(bytes)) => {
                        counters.retained.store(bytes, Ordering::Relaxed);
                        #[allow(clippy::cast_precision_loss)] // reason: a gauge of bytes
                        metrics::gauge!(WAL_RETAINED_BYTES).set(bytes as f64);
                    }
                    Ok(None) => counters.retained.store(-1, Ordering::Relaxed),
                    Err(e) => debug!(error = %e, "cannot read the retained WAL"),
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
            }
        })
    }

    /// One replication session from `start`: `Ok` after a graceful stop.
    async fn session(&self, start: Lsn, shutdown: &CancellationToken) -> Result<(), WalError> {
        let cfg = super::connect::replication_config(&self.config.url, &self.wal, start)?;
        let mut client = ReplicationClient::connect(cfg)
            .await
            .map_err(WalError::Stream)?;
        client.wait_started().await.map_err(WalError::Stream)?;
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        self.counters.standby.store(false, Ordering::Relaxed);
        info!(slot = self.wal.slot(), from = %start, "reading the replication slot");

        let mut relations: HashMap<u32, Relation> = HashMap::new();
        let mut batch: Vec<Item> = Vec::new();
        let mut in_tx = false;
        // End of the last transaction received: once every item before it is handled,
        // the position to confirm.
        let mut last_commit: Option<Lsn> = None;
        let mut start_state = SessionStart::new(self.config.batch_size);
        loop {
            let next = if batch.len() >= self.config.batch_size {
                None
            } else if batch.is_empty() {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => {
                        self.finish(&mut client, last_commit).await;
                        return Ok(());
                    }
                    ev = client.recv() => Some(ev),
                }
            } else {
                client.recv().now_or_never()
            };
            let Some(event) = next else {
                if !self.flush(&mut batch, &mut start_state, shutdown).await? {
                    // Stopped during an outage: what was not confirmed is read again by
                    // the next session.
                    self.finish(&mut client, None).await;
                    return Ok(());
                }
                if let Some(lsn) = last_commit {
                    client.update_applied_lsn(lsn);
                }
                continue;
            };
            let event = match event {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    return Err(WalError::Stream(pgwire_replication::PgWireError::Io(
                        Arc::new(std::io::Error::other("the replication stream ended")),
                    )));
                }
                Err(e) => return Err(WalError::Stream(e)),
            };
            match event {
                ReplicationEvent::Begin { .. } => in_tx = true,
                ReplicationEvent::Commit { end_lsn, .. } => {
                    in_tx = false;
                    last_commit = Some(end_lsn);
                    if batch.is_empty() {
                        client.update_applied_lsn(end_lsn);
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } => {
                    // Nothing pending and no transaction open: everything before the
                    // server's position is handled, so confirm it (an idle outbox must
                    // not make the slot retain the WAL of other tables).
                    if batch.is_empty() && !in_tx {
                        client.update_applied_lsn(wal_end);
                    }
                }
                ReplicationEvent::XLogData { data, .. } => {
                    match pgoutput::decode(&data).map_err(|e| WalError::Malformed(e.to_string()))? {
                        Change::Relation(rel) => {
                            relations.insert(rel.oid, rel);
                        }
                        Change::Insert { oid, tuple } => {
                            if let Some(rel) = self.ours(&relations, oid)
                                && let Some(item) = insert_item(rel, &tuple)
                            {
                                batch.push(item);
                            }
                        }
                        Change::Update { oid, tuple } => {
                            if let Some(rel) = self.ours(&relations, oid) {
                                let row = Row::new(rel, &tuple);
                                if row.status() == Ok(MessageStatus::New.code())
                                    && let Ok(id) = row.id()
                                    && !batch
                                        .iter()
                                        .any(|i| matches!(i, Item::Message(m) if m.id == id))
                                {
                                    batch.push(Item::Replay(id));
                                }
                            }
                        }
                        Change::Other => {}
                    }
                }
                ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
            }
        }
    }

    fn ours<'r>(&self, relations: &'r HashMap<u32, Relation>, oid: u32) -> Option<&'r Relation> {
        relations
            .get(&oid)
            .filter(|r| r.schema == self.outbox.schema() && r.name == "outbox_messages")
    }

    /// Reports `applied` (when given) to the server, waits briefly until it was sent,
    /// and ends the session.
    async fn finish(&self, client: &mut ReplicationClient, applied: Option<Lsn>) {
        if let Some(lsn) = applied {
            client.update_applied_lsn(lsn);
            let metrics = client.metrics();
            let deadline = Instant::now() + Duration::from_secs(3);
            while metrics.last_applied_lsn() < lsn && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if tokio::time::timeout(Duration::from_secs(5), client.shutdown())
            .await
            .is_err()
        {
            warn!("the replication session did not end in time; leaving it");
        }
        info!(slot = self.wal.slot(), "replication session ended");
    }

    /// Publishes `batch` in order and records the outcomes. `Ok(false)`: shutdown
    /// came during an outage or a backoff, and not everything was confirmed.
    async fn flush(
        &self,
        batch: &mut Vec<Item>,
        state: &mut SessionStart,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        let items = std::mem::take(batch);
        let mut messages = Vec::with_capacity(items.len());
        let mut dead = Vec::new();
        for item in items {
            match item {
                Item::Message(m) => messages.push(*m),
                Item::Poison { id, reason } => {
                    warn!(%id, %reason, "poison row: it cannot be decoded, it is dead");
                    outbox_core::metrics::dead_poison();
                    dead.push((id, format!("undecodable row: {reason}")));
                }
                Item::Replay(id) => match self.outbox.get(id).await {
                    Ok(Some(m)) if m.status == MessageStatus::New => messages.push(m),
                    Ok(_) => {}
                    Err(e) => return Err(e.into()),
                },
            }
        }
        if !self.record(&[], &dead, shutdown).await? {
            return Ok(false);
        }
        if state.catching_up && !messages.is_empty() {
            let pending = self.still_pending(&messages).await?;
            let before = messages.len();
            messages.retain(|m| pending.contains(&m.id));
            if messages.len() == before {
                state.catching_up = false;
            } else {
                info!(
                    skipped = before - messages.len(),
                    "skipped rows the previous session published and recorded already"
                );
            }
        }
        outbox_core::metrics::claimed(messages.len());
        // The crash-loop guard: the session's first pending message is the one a
        // relay that died publishing alone left behind (see `SessionStart`).
        let mut guarded = None;
        if !state.guarded && !messages.is_empty() {
            state.guarded = true;
            let first = &messages[0];
            let alone = self.bump_alone(first.id).await?;
            if alone > i64::from(self.config.crash_loop_limit) {
                let times = alone - 1;
                warn!(id = %first.id, event_type = %first.event_type, times, "suspected crash loop: the relay ended every time it published this message alone; it is dead");
                outbox_core::metrics::dead(&first.event_type);
                let error = format!(
                    "suspected crash loop: published alone {times} times without an outcome (the relay ended each time)"
                );
                if !self.record(&[], &[(first.id, error)], shutdown).await? {
                    return Ok(false);
                }
                messages.remove(0);
            } else {
                guarded = Some(first.id);
            }
        }
        let mut attempts: Vec<u32> = messages
            .iter()
            .map(|m| u32::try_from(m.attempts).unwrap_or(0))
            .collect();
        let mut start = 0;
        let mut outage_delay = Duration::from_millis(500);
        while start < messages.len() {
            // While careful, one message at a time, each recorded at once: a message
            // that kills the relay is then the first pending one at the next start.
            let end = if state.careful_left > 0 {
                start + 1
            } else {
                messages.len()
            };
            let slice = &messages[start..end];
            let began = Instant::now();
            let outcomes = self.publish(slice).await;
            outbox_core::metrics::publish_duration(began.elapsed());
            let mut sent = Vec::new();
            let mut dead = Vec::new();
            let mut pause = None;
            let mut done = 0;
            for (m, outcome) in slice.iter().zip(outcomes) {
                match outcome {
                    Some(PublishOutcome::Published) => sent.push(m.id),
                    Some(PublishOutcome::Permanent(e)) => {
                        outbox_core::metrics::publish_failed(e.kind(), &m.event_type);
                        outbox_core::metrics::dead(&m.event_type);
                        warn!(id = %m.id, event_type = %m.event_type, error = %e, "permanent publish failure, message is dead");
                        dead.push((m.id, e.to_string()));
                    }
                    Some(o @ PublishOutcome::Transient(_))
                        if o.is_outage() || o.is_refused_by_destination() =>
                    {
                        pause = Some(Pause::Outage(match o {
                            PublishOutcome::Transient(e) => e.to_string(),
                            _ => String::new(),
                        }));
                        break;
                    }
                    Some(PublishOutcome::Transient(e)) => {
                        outbox_core::metrics::publish_failed(e.kind(), &m.event_type);
                        let a = &mut attempts[start + done];
                        *a += 1;
                        let policy = self.config.retry.for_event_type(&m.event_type);
                        if policy.should_retry(*a) {
                            outbox_core::metrics::retried(&m.event_type);
                            debug!(id = %m.id, attempts = *a, error = %e, "publish failed, will retry");
                            pause = Some(Pause::Retry(policy.delay(*a)));
                            break;
                        }
                        outbox_core::metrics::dead(&m.event_type);
                        warn!(id = %m.id, event_type = %m.event_type, attempts = *a, error = %e, "attempts exhausted, message is dead");
                        dead.push((
                            m.id,
                            format!("attempts exhausted ({a}/{}): {e}", policy.max_attempts()),
                        ));
                    }
                    None => {
                        pause = Some(Pause::Outage("the publisher gave no outcome".into()));
                        break;
                    }
                    Some(other) => {
                        pause = Some(Pause::Outage(format!("unknown outcome {other:?}")));
                        break;
                    }
                }
                done += 1;
            }
            outbox_core::metrics::commit_to_publish(
                slice.iter().map(|m| (&m.created_at, sent.contains(&m.id))),
            );
            if !self.record(&sent, &dead, shutdown).await? {
                return Ok(false);
            }
            start += done;
            state.careful_left = state.careful_left.saturating_sub(done);
            if let Some(id) = guarded.take() {
                // The publish of the guarded message came back: whatever it was (an
                // outage too), the relay did not die of it.
                self.reset_alone(id).await?;
            }
            let delay = match pause {
                None => {
                    if self.counters.circuit_open.swap(false, Ordering::Relaxed) {
                        info!("the broker takes messages again; reading resumes");
                        metrics::gauge!(outbox_core::metrics::CIRCUIT_OPEN).set(0.0);
                    }
                    continue;
                }
                Some(Pause::Retry(delay)) => delay,
                Some(Pause::Outage(reason)) => {
                    if !self.counters.circuit_open.swap(true, Ordering::Relaxed) {
                        warn!(error = %reason, unconfirmed = messages.len() - start, "the broker cannot take messages: reading pauses, nothing is charged");
                        metrics::gauge!(outbox_core::metrics::CIRCUIT_OPEN).set(1.0);
                    }
                    let d = outage_delay;
                    outage_delay = outbox_core::retry::outage_backoff(d, self.config.probe_cap);
                    d
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return Ok(false),
                () = tokio::time::sleep(delay) => {}
            }
            // During an outage: probe until the broker is ready, then publish the rest
            // of the batch again.
            while self.counters.circuit_open.load(Ordering::Relaxed) {
                let ready = tokio::time::timeout(
                    self.publisher
                        .publish_timeout()
                        .unwrap_or(Duration::from_secs(15)),
                    self.publisher.check_ready(),
                )
                .await;
                if matches!(ready, Ok(Ok(()))) {
                    break;
                }
                let d = outage_delay;
                outage_delay = outbox_core::retry::outage_backoff(d, self.config.probe_cap);
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(false),
                    () = tokio::time::sleep(d) => {}
                }
            }
        }
        Ok(true)
    }

    /// One `publish_batch` call bounded by the publisher's publish timeout, one outcome
    /// per message (`None`: none given). `Err`: the publisher panicked.
    async fn call(&self, msgs: &[OutboxMessage]) -> Result<Vec<Option<PublishOutcome>>, ()> {
        let n = msgs.len();
        let fut = AssertUnwindSafe(self.publisher.publish_batch(msgs)).catch_unwind();
        let result = match self.publisher.publish_timeout() {
            Some(limit) => match tokio::time::timeout(limit, fut).await {
                Ok(r) => r,
                Err(_) => {
                    return Ok((0..n)
                        .map(|_| {
                            Some(PublishOutcome::Transient(PublishError::unavailable(
                                format!("no outcome within the publish timeout ({limit:?})"),
                                None,
                            )))
                        })
                        .collect());
                }
            },
            None => fut.await,
        };
        result
            .map(|outcomes| {
                let mut v: Vec<Option<PublishOutcome>> = outcomes.into_iter().map(Some).collect();
                v.resize_with(n, || None);
                v
            })
            .map_err(drop)
    }

    /// [`call`](Self::call); a panic is narrowed down to the message that panics alone
    /// (a permanent failure of that message).
    async fn publish(&self, messages: &[OutboxMessage]) -> Vec<Option<PublishOutcome>> {
        if let Ok(outcomes) = self.call(messages).await {
            return outcomes;
        }
        error!(
            messages = messages.len(),
            "the publisher panicked on a batch: publishing its messages one at a time"
        );
        let mut outcomes = Vec::with_capacity(messages.len());
        for m in messages {
            outcomes.push(match self.call(std::slice::from_ref(m)).await {
                Ok(mut one) => one.pop().flatten(),
                Err(()) => Some(PublishOutcome::Permanent(PublishError::Other {
                    kind: outbox_core::ErrorKind::Permanent,
                    message: "the publisher panicked on this message alone".into(),
                    source: None,
                })),
            });
        }
        outcomes
    }

    /// Counts one more start whose first pending message is `id`; returns the count
    /// (0 when the row is no longer pending).
    async fn bump_alone(&self, id: Uuid) -> Result<i64, WalError> {
        let sql = format!(
            "UPDATE {}.outbox_messages SET unfinished_alone = unfinished_alone + 1 \
             WHERE id = $1 AND status = 0 RETURNING unfinished_alone::bigint",
            quoted_schema(self.outbox.schema())
        );
        let n: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.outbox.pool())
            .await
            .map_err(db("wal crash-loop guard"))?;
        Ok(n.unwrap_or(0))
    }

    async fn reset_alone(&self, id: Uuid) -> Result<(), WalError> {
        let sql = format!(
            "UPDATE {}.outbox_messages SET unfinished_alone = 0 \
             WHERE id = $1 AND status = 0 AND unfinished_alone <> 0",
            quoted_schema(self.outbox.schema())
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(id)
            .execute(self.outbox.pool())
            .await
            .map_err(db("wal crash-loop guard"))?;
        Ok(())
    }

    /// The ids of `messages` whose rows are still `New` in the table.
    async fn still_pending(
        &self,
        messages: &[OutboxMessage],
    ) -> Result<std::collections::HashSet<Uuid>, WalError> {
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
        let sql = format!(
            "SELECT id FROM {}.outbox_messages WHERE id = ANY($1) AND status = 0",
            quoted_schema(self.outbox.schema())
        );
        let pending: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(ids)
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal pending"))?;
        Ok(pending.into_iter().collect())
    }

    /// Records published messages (`Sent`, or deleted) and dead ones, retrying a
    /// database that is unavailable. `Ok(false)`: shutdown came first.
    async fn record(
        &self,
        sent: &[Uuid],
        dead: &[(Uuid, String)],
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        if sent.is_empty() && dead.is_empty() {
            return Ok(true);
        }
        let schema = quoted_schema(self.outbox.schema());
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.record_once(&schema, sent, dead).await {
                Ok(()) => break,
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, "cannot record outcomes; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(false),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = outbox_core::retry::outage_backoff(backoff, Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
        self.counters
            .published
            .fetch_add(sent.len() as u64, Ordering::Relaxed);
        self.counters
            .dead
            .fetch_add(dead.len() as u64, Ordering::Relaxed);
        outbox_core::metrics::completed(sent.len(), 0, 0);
        Ok(true)
    }

    async fn record_once(
        &self,
        schema: &str,
        sent: &[Uuid],
        dead: &[(Uuid, String)],
    ) -> Result<(), WalError> {
        if !sent.is_empty() {
            let sql = match self.outbox.sent_retention() {
                SentRetention::Delete => format!(
                    "DELETE FROM {schema}.outbox_messages WHERE id = ANY($1) AND status = 0"
                ),
                _ => format!(
                    "UPDATE {schema}.outbox_messages \
                     SET status = 1, sent_at = now(), attempts = attempts + 1, last_error = NULL \
                     WHERE id = ANY($1) AND status = 0"
                ),
            };
            sqlx::query(AssertSqlSafe(sql))
                .bind(sent)
                .execute(self.outbox.pool())
                .await
                .map_err(db("wal record sent"))?;
        }
        if !dead.is_empty() {
            let (ids, errors): (Vec<Uuid>, Vec<String>) = dead.iter().cloned().unzip();
            let sql = format!(
                "UPDATE {schema}.outbox_messages AS m \
                 SET status = 3, last_error = d.error, attempts = m.attempts + 1 \
                 FROM unnest($1::uuid[], $2::text[]) AS d(id, error) \
                 WHERE m.id = d.id AND m.status = 0"
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(ids)
                .bind(errors)
                .execute(self.outbox.pool())
                .await
                .map_err(db("wal record dead"))?;
        }
        Ok(())
    }
}

/// The item of an inserted row: a message to publish if it is `New`, a poison row if
/// it does not decode (and has a readable id), nothing otherwise.
fn insert_item(rel: &Relation, tuple: &[pgoutput::Value]) -> Option<Item> {
    let row = Row::new(rel, tuple);
    match row.message() {
        Ok(m) if m.status == MessageStatus::New => Some(Item::Message(Box::new(m))),
        Ok(_) => None,
        Err(reason) => match row.id() {
            Ok(id) => Some(Item::Poison { id, reason }),
            Err(e) => {
                error!(reason = %reason, id_error = %e, "an inserted row without a readable id: skipped");
                None
            }
        },
    }
}
