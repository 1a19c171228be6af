//! [`WalRelayConfig`] and the relay's counters ([`WalRelayStats`], [`WalStatsHandle`]).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outboxkit_core::{OnDead, Ordering as Order, RetryPolicies};

use crate::wal::WalError;

/// The Prometheus gauge of the WAL the slot retains, in bytes.
pub const WAL_RETAINED_BYTES: &str = "outbox_wal_retained_bytes";

/// Settings of a [`WalRelay`](super::WalRelay) beside its [`WalConfig`](crate::wal::WalConfig):
/// plain data, made with [`new`](Self::new) and the `with_*` setters (which never
/// fail), checked by [`validate`](Self::validate), which
/// [`WalRelay::new`](super::WalRelay::new) calls before anything starts.
#[derive(Debug, Clone)]
pub struct WalRelayConfig {
    pub(super) url: String,
    pub(super) batch_size: usize,
    pub(super) part_size: usize,
    pub(super) retry: RetryPolicies,
    pub(super) probe_cap: Duration,
    pub(super) gauge_interval: Duration,
    pub(super) standby_interval: Duration,
    pub(super) crash_loop_limit: u32,
    pub(super) ordering: Order,
    pub(super) lease: Duration,
    pub(super) linger: Duration,
    pub(super) concurrency: usize,
}

impl WalRelayConfig {
    /// Reads through a replication connection to `url` (the same database URL as the
    /// store's), with the defaults below.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            batch_size: 500,
            part_size: Self::DEFAULT_PART_SIZE,
            retry: RetryPolicies::default(),
            probe_cap: Duration::from_secs(30),
            gauge_interval: Duration::from_secs(5),
            standby_interval: Duration::from_secs(1),
            crash_loop_limit: outboxkit_core::DEFAULT_CRASH_LOOP_LIMIT,
            ordering: Order::Unordered,
            lease: Duration::from_secs(30),
            linger: Duration::ZERO,
            concurrency: Self::DEFAULT_CONCURRENCY,
        }
    }

    /// Default [concurrency](Self::with_concurrency): 4 batches in flight.
    pub const DEFAULT_CONCURRENCY: usize = 4;

    /// Most batches published and not yet confirmed at once [default:
    /// [`DEFAULT_CONCURRENCY`](Self::DEFAULT_CONCURRENCY); at least 1].
    ///
    /// Past a session's careful start, the relay publishes a batch by a task of its
    /// own and goes on reading and publishing while the broker confirms it; outcomes
    /// are handled and recorded in commit order, and the slot's position confirmed
    /// behind them. A message committed while a batch waits for its confirm is then
    /// published at once instead of after it (RabbitMQ confirms persistent messages
    /// after its disk write). 1 publishes one batch at a time. With
    /// [per-key order](Self::with_ordering), a batch holding a key that is in
    /// flight waits until it is confirmed. A RabbitMQ publisher sends concurrent
    /// batches on different channels (`RabbitConfig::with_channels`, 2 by
    /// default): batches beyond its channels wait for one. docs/wal.md (How it works).
    #[must_use]
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Longest accepted [linger](Self::with_linger): 1 s.
    pub const MAX_LINGER: Duration = Duration::from_secs(1);

    /// How long a batch gathers more changes after the end of its first transaction
    /// before it is published, when the relay had been waiting for the stream (an idle
    /// or lightly loaded outbox) [default: 0; at most [`MAX_LINGER`](Self::MAX_LINGER)].
    /// A deadline, not a pause renewed by each change: a steady stream does not hold
    /// the batch longer.
    ///
    /// At 0 such a batch takes what has arrived and goes out at once: each message of
    /// a light load is published as soon as it is read (here at 500 msg/s: commit to
    /// a subscriber p50 0.4-0.9 ms). Every batch costs PostgreSQL a visibility check
    /// and a recording (`UPDATE ... Sent`), so at moderate rates a linger makes fuller
    /// batches and less database work per message, adding up to the linger (and
    /// tokio's 1 ms timer tick) to each message's latency: at 500 msg/s, 2 ms made 2.2
    /// messages per batch instead of 1-1.3, PostgreSQL's CPU serving the relay
    /// 0.28-0.32x the polling relay's instead of 0.38-0.53x, and p50 3.2-3.7 ms. When
    /// changes are already waiting (the relay is behind the stream), a batch waits up
    /// to 1 ms for the next one whatever this is. docs/wal.md (Measurements).
    #[must_use]
    pub fn with_linger(mut self, linger: Duration) -> Self {
        self.linger = linger.min(Self::MAX_LINGER);
        self
    }

    /// How long the sweeper's claim of a parked row holds it [default: 30 s]: a relay
    /// that dies while publishing parked rows leaves them to the next session (or a
    /// standby) after this long. Longer than the publish timeout.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(100));
        self
    }

    /// Delivery order [default: [`Ordering::Unordered`](outboxkit_core::Ordering)]: the
    /// dispatcher's setting
    /// ([`DispatcherConfig::with_ordering`](outboxkit_core::DispatcherConfig::with_ordering)),
    /// of which the WAL relay takes `Unordered` and `PerKey { on_dead: OnDead::Skip }`:
    /// a dead message never stops its key here, so `OnDead::Block` is refused by
    /// [`validate`](Self::validate) (field `ordering`).
    ///
    /// Unordered, a batch is published as one pipelined call in commit order: when one
    /// message fails (its destination refuses it, a transient error) while a later
    /// message of its key in the same call, or in a batch in flight beside it (see
    /// [`with_concurrency`](Self::with_concurrency)), is confirmed, that later one
    /// arrives first (and again after it, unless the broker drops the republish as a
    /// duplicate: JetStream within its window). Per key, each call holds at most one
    /// message per key (waves, as the polling relay's `Ordering::PerKey`), so a key's next message is published
    /// only after the previous one was confirmed: first deliveries are in order per
    /// key, at the cost of one broker round trip per message of a key (a batch of one
    /// hot key is published one message at a time). Either way a parked message's
    /// later messages of its key wait behind it, and a dead message does not stop its
    /// key (`OnDead::Skip`).
    #[must_use]
    pub fn with_ordering(mut self, ordering: Order) -> Self {
        self.ordering = ordering;
        self
    }

    /// The delivery order ([`with_ordering`](Self::with_ordering)).
    pub fn ordering(&self) -> Order {
        self.ordering
    }

    /// Whether first deliveries are in order per key.
    pub(super) fn per_key(&self) -> bool {
        self.ordering.is_ordered()
    }

    /// Starts of the relay that may end (the process dies) while it publishes one
    /// message alone, before that message goes `Dead` as a suspected crash loop
    /// [default: [`DEFAULT_CRASH_LOOP_LIMIT`](outboxkit_core::DEFAULT_CRASH_LOOP_LIMIT)].
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

    /// Default [part size](Self::with_part_size): 5,000 rows.
    pub const DEFAULT_PART_SIZE: usize = 5_000;

    /// Rows of one producer transaction held as whole messages [default:
    /// [`DEFAULT_PART_SIZE`](Self::DEFAULT_PART_SIZE); at least 1].
    ///
    /// A transaction of more rows than this is held as its rows' ids only (16 bytes a
    /// row) while it is received, and published in parts of this many rows, each
    /// read back from the table by id (one query) as committed: a row updated later in
    /// the transaction goes out as updated, a row deleted later does not go out. A
    /// part's memory is its messages' (payloads included), so the relay's memory does
    /// not grow with the transaction's payloads: 1,000,000 rows in one transaction
    /// peaked at the resident set given in docs/wal.md (Large transactions). The slot's
    /// position is confirmed only at the transaction's end: a relay stopped or killed
    /// between parts reads the transaction again from its start, and the new session
    /// skips every row the table already records (`Sent`, `Dead`, parked), so only
    /// the part in flight at a kill is published again.
    #[must_use]
    pub fn with_part_size(mut self, n: usize) -> Self {
        self.part_size = n.max(1);
        self
    }

    /// Backoff and attempts per event type [default: [`RetryPolicies::default`]]. A
    /// single [`RetryPolicy`](outboxkit_core::RetryPolicy) is accepted too, for every
    /// event type: the same shape as the dispatcher's and the inbox processor's
    /// `with_retry`.
    #[must_use]
    pub fn with_retry(mut self, retry: impl Into<RetryPolicies>) -> Self {
        self.retry = retry.into();
        self
    }

    /// The retry policies ([`with_retry`](Self::with_retry)).
    pub fn retry(&self) -> &RetryPolicies {
        &self.retry
    }

    /// Checks the settings, as [`WalRelay::new`](super::WalRelay::new) does.
    ///
    /// # Errors
    /// [`WalError::InvalidConfig`] naming the setting: `url` empty, `ordering`
    /// `PerKey { on_dead: OnDead::Block }` (the WAL relay never stops a key at a dead
    /// message: use `OnDead::Skip`).
    pub fn validate(&self) -> Result<(), WalError> {
        if self.url.trim().is_empty() {
            return Err(WalError::InvalidConfig {
                field: "url",
                reason: "the database URL is empty".into(),
            });
        }
        if let Order::PerKey {
            on_dead: OnDead::Block,
        } = self.ordering
        {
            return Err(WalError::InvalidConfig {
                field: "ordering",
                reason: "the WAL relay never stops a key at a dead message: use Ordering::PerKey { on_dead: OnDead::Skip }".into(),
            });
        }
        Ok(())
    }

    /// How often the slot and the publication are checked while the relay runs (what
    /// the operator must fix stops it: see [`WalRelay::run`](super::WalRelay::run))
    /// and the retained-WAL gauge is refreshed [default: 5 s].
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

/// Counters of a finished [`WalRelay::run`](super::WalRelay::run).
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
pub(super) struct Counters {
    pub(super) published: AtomicU64,
    pub(super) dead: AtomicU64,
    pub(super) sessions: AtomicU64,
    pub(super) circuit_open: AtomicBool,
    pub(super) standby: AtomicBool,
    /// -1: unknown.
    pub(super) retained: AtomicI64,
    /// Since when reading the slot has failed (retried), the last failure, and the
    /// sessions started until then: a session started since, or standing by, ends it.
    failing: Mutex<Option<(Instant, String, u64)>>,
}

impl Counters {
    /// Reading the slot failed with `error`, to be retried.
    pub(super) fn session_failed(&self, error: &impl std::fmt::Display) {
        let sessions = self.sessions.load(Ordering::Relaxed);
        let mut failing = self.failing();
        let since = match failing.as_ref() {
            Some((since, _, before)) if *before == sessions => *since,
            _ => Instant::now(),
        };
        *failing = Some((since, error.to_string(), sessions));
    }

    fn failing(&self) -> std::sync::MutexGuard<'_, Option<(Instant, String, u64)>> {
        self.failing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A live view of a running [`WalRelay`](super::WalRelay) (for health checks). Cheap to clone.
#[derive(Debug, Clone)]
pub struct WalStatsHandle(pub(super) Arc<Counters>);

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
    /// While the relay retries to read the slot (the server restarting or refusing
    /// connections, the replication connection lost, too many walsenders): for how
    /// long, and the last failure. `None` while a session reads or the relay stands by.
    pub fn session_failing(&self) -> Option<(Duration, String)> {
        let sessions = self.0.sessions.load(Ordering::Relaxed);
        match self.0.failing().as_ref() {
            Some((since, error, before)) if *before == sessions && !self.standby() => {
                Some((since.elapsed(), error.clone()))
            }
            _ => None,
        }
    }
    pub(super) fn snapshot(&self) -> WalRelayStats {
        WalRelayStats {
            published: self.published(),
            dead: self.0.dead.load(Ordering::Relaxed),
            sessions: self.0.sessions.load(Ordering::Relaxed),
        }
    }
}
