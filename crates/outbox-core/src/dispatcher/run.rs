//! Driving the dispatcher: [`run`](Dispatcher::run) starts the three stages (claimer,
//! publishers, completer) and joins them; [`run_batch`](Dispatcher::run_batch) takes one
//! batch through the same steps in sequence. Also what the stages hand each other and
//! [`Stop`], which tells them when to stop and when the drain ends.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{Mutex, Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::publisher_stage::Mode;
use super::{BatchReport, Dispatcher, DispatcherStats};
use crate::error::OutboxError;
use crate::publisher::EventPublisher;
use crate::store::{ClaimedBatch, Completion, OutboxStore};

/// A claimed batch on its way to a publisher.
pub(super) struct Claimed {
    pub(super) batch: ClaimedBatch,
    pub(super) claimed_at: Instant,
    /// The trials of held destinations ([`Mode::Held`](super::publisher_stage::Mode)):
    /// the destination each message was held for, in order (its circuit, whatever the
    /// publisher names for it now). Empty otherwise.
    pub(super) held: Vec<String>,
}

impl Claimed {
    /// `batch`, claimed now.
    pub(super) fn new(batch: ClaimedBatch) -> Self {
        Self {
            batch,
            claimed_at: Instant::now(),
            held: Vec::new(),
        }
    }
}

/// A published batch on its way to the completer.
pub(super) struct Finished {
    pub(super) completions: Vec<Completion>,
    pub(super) report: BatchReport,
    pub(super) claimed_at: Instant,
}

/// Shared by the stages: whether the dispatcher is stopping (shutdown or a fatal error)
/// and when the drain ends.
#[derive(Debug, Clone)]
pub(super) struct Stop {
    pub(super) token: CancellationToken,
    drain_started: Arc<OnceLock<Instant>>,
    drain_timeout: Duration,
    /// Notified by the claimer whenever a claim found less than a full batch (it is
    /// about to wait): the store's push wake-up starts on the first one.
    pub(super) went_idle: Arc<Notify>,
}

impl Stop {
    pub(super) fn new(token: CancellationToken, drain_timeout: Duration) -> Self {
        Self {
            token,
            drain_started: Arc::default(),
            drain_timeout,
            went_idle: Arc::default(),
        }
    }

    pub(super) fn is_stopping(&self) -> bool {
        self.token.is_cancelled()
    }

    pub(super) async fn stopping(&self) {
        self.token.cancelled().await;
    }

    /// When the drain ends; `None` while not stopping.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.is_stopping()
            .then(|| *self.drain_started.get_or_init(Instant::now) + self.drain_timeout)
    }

    /// Resolves when the dispatcher is stopping and the drain timeout is up.
    pub(super) async fn drain_expired(&self) {
        self.token.cancelled().await;
        let started = *self.drain_started.get_or_init(Instant::now);
        tokio::time::sleep_until(started + self.drain_timeout).await;
    }
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// Runs the relay until `shutdown` is cancelled, then drains (see the type's docs)
    /// and returns the counters.
    ///
    /// Three stages overlap so the broker stays busy while the database works:
    /// one **claimer** claims batches (at most `concurrency` claimed batches wait), up
    /// to `concurrency` **publishers** publish them, and one **completer** records the
    /// outcomes, merging whatever completions are waiting into one statement. From the
    /// first claim that finds less than a full batch until it stops, the store's push
    /// wake-up ([`OutboxStore::spawn_wake_source`]) wakes the claimer when messages are
    /// committed, unless
    /// [`DispatcherConfig::with_push_wake`](super::DispatcherConfig::with_push_wake) turned
    /// it off.
    ///
    /// # Errors
    /// Only a failure that retrying cannot fix: a claim or a completion the database
    /// rejects (for example a trigger that raises). Outages are waited out. (The
    /// configuration was checked by [`Dispatcher::new`].)
    pub async fn run(&self, shutdown: CancellationToken) -> Result<DispatcherStats, OutboxError> {
        info!(
            batch_size = self.config.batch_size,
            concurrency = self.config.concurrency,
            lease_ms = self.config.lease.as_millis() as u64,
            drain_timeout_ms = self.config.drain_timeout.as_millis() as u64,
            "dispatcher started"
        );
        let stop = Stop::new(shutdown.child_token(), self.config.drain_timeout);
        // The store's push wake-up lives as long as this run: it starts when the
        // claimer first finds less than a full batch (a relay busy with a backlog claims
        // at once anyway, and the source's start, on PostgreSQL a connection, LISTEN
        // and a self-test, does not compete with its first claims), stops with the
        // claimer (at shutdown or a fatal error), and is joined before `run` returns; a
        // run future dropped before it ends stops it too (the guard cancels `stop`'s
        // token, a child of `shutdown`).
        let _stop_when_dropped = stop.token.clone().drop_guard();
        let wake_source = self.config.push_wake.then(|| {
            let this = self.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = stop.stopping() => None,
                    () = stop.went_idle.notified() => this
                        .store
                        .spawn_wake_source(this.wake_handle(), stop.token.child_token()),
                }
            })
        });
        let (claimed_tx, claimed_rx) = mpsc::channel::<Claimed>(self.config.concurrency);
        let (done_tx, done_rx) = mpsc::channel::<Finished>(self.config.concurrency * 2);
        let claimed_rx = Arc::new(Mutex::new(claimed_rx));

        let mut tasks = tokio::task::JoinSet::new();
        {
            let this = self.clone();
            let tx = done_tx.clone();
            let stop = stop.clone();
            tasks.spawn(async move { this.claimer(claimed_tx, tx, stop).await });
        }
        for _ in 0..self.config.concurrency {
            let this = self.clone();
            let rx = Arc::clone(&claimed_rx);
            let tx = done_tx.clone();
            let stop = stop.clone();
            tasks.spawn(async move {
                this.publisher_stage(rx, tx, stop).await;
                Ok(())
            });
        }
        {
            let this = self.clone();
            let tx = done_tx.clone();
            let stop = stop.clone();
            tasks.spawn(async move { this.trials(tx, stop).await });
        }
        drop(done_tx);
        {
            let this = self.clone();
            let stop = stop.clone();
            tasks.spawn(async move { this.completer(done_rx, stop).await });
        }

        let mut result = Ok(());
        while let Some(joined) = tasks.join_next().await {
            let outcome = joined.unwrap_or_else(|e| {
                Err(OutboxError::Config(format!(
                    "dispatcher task panicked: {e}"
                )))
            });
            if let Err(e) = outcome {
                // A fatal error in one stage stops the claimer; the others drain.
                stop.token.cancel();
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        if let Some(starter) = wake_source {
            stop.token.cancel();
            let source = match starter.await {
                Ok(Some(source)) => source.await,
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = source {
                warn!(error = %e, "the store's wake-up task failed");
            }
        }
        let stats = self.stats();
        match &result {
            Ok(()) => info!(?stats, "dispatcher stopped"),
            Err(e) => error!(error = %e, ?stats, "dispatcher stopped by a fatal error"),
        }
        result.map(|()| stats)
    }

    /// Claims, publishes and completes one batch. Useful for tools and tests;
    /// [`run`](Self::run) does the same, with its stages overlapping. The circuit is
    /// not consulted.
    ///
    /// # Errors
    /// A store error from the claim (nothing was claimed) or from completion after the
    /// lease ran out (the messages will be reclaimed and republished).
    pub async fn run_batch(&self) -> Result<BatchReport, OutboxError> {
        let batch = self.claim(self.config.batch_size).await?;
        if batch.is_empty() {
            return Ok(BatchReport::default());
        }
        self.count_claimed(&batch);
        let claimed_at = Instant::now();
        let stop = Stop::new(CancellationToken::new(), self.config.drain_timeout);
        let finished = self
            .publish_and_decide(
                Claimed {
                    batch,
                    claimed_at,
                    held: Vec::new(),
                },
                Mode::Once,
                &stop,
            )
            .await;
        let done = self
            .complete_with_retry(&finished.completions, claimed_at, &stop)
            .await?;
        let mut report = finished.report;
        report.fenced = done.fenced.len();
        if report.fenced > 0 {
            warn!(
                fenced = report.fenced,
                "completion fenced: another dispatcher reclaimed these messages after our lease expired"
            );
        }
        self.counters.record(&report);
        Ok(report)
    }
}
