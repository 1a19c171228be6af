//! The relay loop: claim a batch, publish it with pipelined confirms, write every outcome
//! back in one round trip, repeat.
//!
//! - `config`: [`DispatcherConfig`];
//! - `stats`: [`DispatcherStats`] and [`BatchReport`];
//! - `circuit`: the circuit breaker (closed, open, half-open with a one-message trial);
//! - `publish`: one publisher call under the publish timeout and isolated from panics,
//!   and the waves of per-key mode;
//! - `decide`: each message's outcome turned into its completion.

mod circuit;
pub mod config;
mod decide;
mod publish;
pub mod stats;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{Mutex, Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, error, info, info_span, warn};

pub use config::{DEFAULT_DRAIN_TIMEOUT, DEFAULT_MIN_POLL_INTERVAL, DispatcherConfig};
pub use stats::{BatchReport, DispatcherStats};

use crate::error::{ErrorKind, OutboxError, PublishError};
use crate::ordering::Ordering;
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::{ClaimedBatch, Completion, OutboxStore};
use circuit::Circuit;
use stats::Counters;
use std::sync::atomic::Ordering::Relaxed;

/// Wakes a dispatcher that is waiting for its poll interval, e.g. right after a
/// transaction that enqueued messages commits. Cheap to clone.
#[derive(Debug, Clone)]
pub struct WakeHandle(Arc<Notify>);

impl WakeHandle {
    /// Ends the current poll wait of every pipeline of the dispatcher.
    pub fn wake(&self) {
        self.0.notify_waiters();
    }
}

/// The relay: moves committed outbox messages to the broker.
///
/// Three stages run at once so the broker stays busy while the database works: a
/// claimer claims batches (committing each claim before anything is published), up to
/// `concurrency` publishers publish them (the publisher pipelines confirms), and a
/// completer records every outcome, fenced by claim token, merging what is waiting into
/// one statement. A full batch is followed at once by the next claim; otherwise the
/// claimer waits (adaptively: 10 ms after a claim that found messages, doubling while
/// claims find nothing, up to `poll_interval`) or until a [`WakeHandle::wake`]. Several
/// dispatchers, in one process or many, may share a database: claims never overlap.
///
/// What happens to a message, by what went wrong:
/// - **poison row** (the store could not decode it, or its crash-loop guard caught it):
///   `Dead` alone with `last_error` saying why; the rest of the batch is published;
/// - **a verdict about the message** (unroutable, oversized, invalid header or subject,
///   or a publisher panic on this message alone): `Dead` at once, only this message;
/// - **any other transient failure** of one message: `Processing → New` with backoff
///   from the event type's [`RetryPolicy`](crate::RetryPolicy); after `max_attempts`,
///   `Dead`;
/// - **the broker cannot take messages** (unreachable, no confirmation in time, blocked
///   by a resource alarm, a full queue or stream, a publisher call longer than its
///   publish timeout): the **circuit opens**: unpublished messages are released without
///   charging an attempt, claiming stops, the publisher is probed with exponential
///   backoff, then one message is published alone as a trial, and claiming resumes when
///   it succeeds. An outage of any length never dead-letters anything;
/// - **database failure**: the pipeline backs off exponentially (up to 30 s) and
///   retries; completion of a published batch is retried until it lands or the lease
///   runs out (the message is then republished after reclaim: at-least-once). A
///   completion that fails permanently (a trigger or constraint that rejects it) stops
///   the dispatcher at once: [`run`](Self::run) returns the error after releasing what
///   it holds, rather than publishing messages whose outcome it cannot record.
///
/// Shutdown ([`run`](Self::run)'s token): the claimer stops claiming, publishes in flight
/// finish, batches not yet started are released, and whatever is still waiting for the
/// broker when the drain timeout ([`DispatcherConfig::with_drain_timeout`]) is up is
/// released too; then `run` returns.
pub struct Dispatcher<S, P> {
    store: Arc<S>,
    publisher: Arc<P>,
    config: Arc<DispatcherConfig>,
    wake: Arc<Notify>,
    counters: Arc<Counters>,
    circuit: Arc<Circuit>,
}

impl<S, P> Clone for Dispatcher<S, P> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            publisher: Arc::clone(&self.publisher),
            config: Arc::clone(&self.config),
            wake: Arc::clone(&self.wake),
            counters: Arc::clone(&self.counters),
            circuit: Arc::clone(&self.circuit),
        }
    }
}

impl<S, P> std::fmt::Debug for Dispatcher<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("config", &self.config)
            .field("stats", &self.counters.snapshot())
            .finish_non_exhaustive()
    }
}

/// Upper bound of completions merged into one statement by the completer.
const MAX_MERGED_COMPLETIONS: usize = 5_000;

/// How long the last completions may take once the drain timeout is up.
const FINAL_COMPLETION_GRACE: Duration = Duration::from_secs(5);

/// A claimed batch on its way to a publisher.
struct Claimed {
    batch: ClaimedBatch,
    claimed_at: Instant,
}

/// A published batch on its way to the completer.
struct Finished {
    completions: Vec<Completion>,
    report: BatchReport,
    claimed_at: Instant,
}

/// How [`Dispatcher::publish_and_decide`] treats the circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Release without trying while the circuit is open; an outage opens it.
    Normal,
    /// The half-open trial: publish although the circuit is open, then close it or
    /// keep it open.
    Trial,
    /// [`Dispatcher::run_batch`]: publish whatever the circuit says; an outage opens it.
    Once,
}

/// Shared by the stages: whether the dispatcher is stopping (shutdown or a fatal error)
/// and when the drain ends.
#[derive(Debug, Clone)]
struct Stop {
    token: CancellationToken,
    drain_started: Arc<OnceLock<Instant>>,
    drain_timeout: Duration,
}

impl Stop {
    fn new(token: CancellationToken, drain_timeout: Duration) -> Self {
        Self {
            token,
            drain_started: Arc::default(),
            drain_timeout,
        }
    }

    fn is_stopping(&self) -> bool {
        self.token.is_cancelled()
    }

    async fn stopping(&self) {
        self.token.cancelled().await;
    }

    /// When the drain ends; `None` while not stopping.
    fn deadline(&self) -> Option<Instant> {
        self.is_stopping()
            .then(|| *self.drain_started.get_or_init(Instant::now) + self.drain_timeout)
    }

    /// Resolves when the dispatcher is stopping and the drain timeout is up.
    async fn drain_expired(&self) {
        self.token.cancelled().await;
        let started = *self.drain_started.get_or_init(Instant::now);
        tokio::time::sleep_until(started + self.drain_timeout).await;
    }
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// A dispatcher over `store` and `publisher`.
    pub fn new(store: Arc<S>, publisher: Arc<P>, config: DispatcherConfig) -> Self {
        let circuit = Circuit::new(config.probe_initial, config.probe_max);
        Self {
            store,
            publisher,
            config: Arc::new(config),
            wake: Arc::new(Notify::new()),
            counters: Arc::new(Counters::default()),
            circuit: Arc::new(circuit),
        }
    }

    /// A handle that ends the poll wait early.
    pub fn wake_handle(&self) -> WakeHandle {
        WakeHandle(Arc::clone(&self.wake))
    }

    /// Counters since creation.
    pub fn stats(&self) -> DispatcherStats {
        self.counters.snapshot()
    }

    /// Whether the circuit is open (the broker could not take messages and no trial
    /// publish has succeeded since).
    pub fn circuit_open(&self) -> bool {
        self.circuit.is_open()
    }

    /// Runs the relay until `shutdown` is cancelled, then drains (see the type's docs)
    /// and returns the counters.
    ///
    /// Three stages overlap so the broker stays busy while the database works:
    /// one **claimer** claims batches (at most `concurrency` claimed batches wait), up
    /// to `concurrency` **publishers** publish them, and one **completer** records the
    /// outcomes, merging whatever completions are waiting into one statement.
    ///
    /// # Errors
    /// [`OutboxError::Config`] at once when the lease is shorter than twice the
    /// publisher's [`publish_timeout`](EventPublisher::publish_timeout). Otherwise only
    /// a failure that retrying cannot fix: a claim or a completion the database rejects
    /// (for example a trigger that raises). Outages are waited out.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<DispatcherStats, OutboxError> {
        self.config.check_lease(self.publisher.publish_timeout())?;
        info!(
            batch_size = self.config.batch_size,
            concurrency = self.config.concurrency,
            lease_ms = self.config.lease.as_millis() as u64,
            drain_timeout_ms = self.config.drain_timeout.as_millis() as u64,
            "dispatcher started"
        );
        let stop = Stop::new(shutdown.child_token(), self.config.drain_timeout);
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
        let stats = self.stats();
        match &result {
            Ok(()) => info!(?stats, "dispatcher stopped"),
            Err(e) => error!(error = %e, ?stats, "dispatcher stopped by a fatal error"),
        }
        result.map(|()| stats)
    }

    fn count_claimed(&self, batch: &ClaimedBatch) {
        self.counters.batches.fetch_add(1, Relaxed);
        crate::metrics::claimed(batch.len());
        self.counters.claimed.fetch_add(batch.len() as u64, Relaxed);
    }

    /// Stage 1: claims batches while there is work, hands them to the publishers; while
    /// the circuit is open, probes and publishes trials instead.
    async fn claimer(
        &self,
        claimed_tx: mpsc::Sender<Claimed>,
        done_tx: mpsc::Sender<Finished>,
        stop: Stop,
    ) -> Result<(), OutboxError> {
        let mut store_backoff = Duration::ZERO;
        let mut poll_wait = self.config.poll_interval;
        while !stop.is_stopping() {
            let step = if self.circuit.is_open() {
                self.half_open(&done_tx, &stop).await
            } else {
                // Register interest before claiming so a wake during the claim is not lost.
                let notified = self.wake.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                match self.claim(self.config.batch_size).await {
                    Ok(batch) => {
                        let full = batch.len() >= self.config.batch_size;
                        poll_wait = self.config.next_poll_wait(poll_wait, batch.len());
                        if !batch.is_empty() {
                            self.count_claimed(&batch);
                            let claimed = Claimed {
                                batch,
                                claimed_at: Instant::now(),
                            };
                            if claimed_tx.send(claimed).await.is_err() {
                                break; // publishers are gone: the run is over
                            }
                        }
                        if !full {
                            tokio::select! {
                                () = stop.stopping() => {}
                                () = &mut notified => poll_wait = self.config.min_poll_interval,
                                () = tokio::time::sleep(poll_wait) => {}
                            }
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            };
            match step {
                Ok(()) => store_backoff = Duration::ZERO,
                Err(e) if e.kind().is_retryable() => {
                    store_backoff =
                        crate::retry::outage_backoff(store_backoff, self.config.store_backoff_max);
                    warn!(error = %e, backoff_ms = store_backoff.as_millis() as u64, "claim failed, backing off");
                    tokio::select! {
                        () = stop.stopping() => {}
                        () = tokio::time::sleep(store_backoff) => {}
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The circuit is open: waits the probe delay, asks the publisher whether the broker
    /// is ready, and if so claims one message and publishes it alone (half-open). Its
    /// outcome closes the circuit or keeps it open with a longer delay.
    async fn half_open(
        &self,
        done_tx: &mpsc::Sender<Finished>,
        stop: &Stop,
    ) -> Result<(), OutboxError> {
        let delay = self.circuit.next_delay().await;
        tokio::select! {
            () = stop.stopping() => return Ok(()),
            () = tokio::time::sleep(delay) => {}
        }
        if let Err(e) = self.publisher.check_ready().await {
            warn!(error = %e, waited_ms = delay.as_millis() as u64, "broker still unavailable");
            return Ok(());
        }
        let batch = self.claim(1).await?;
        if batch.is_empty() {
            self.circuit.close().await;
            info!("broker ready again (nothing to publish as a trial), circuit closed");
            return Ok(());
        }
        self.count_claimed(&batch);
        let claimed = Claimed {
            batch,
            claimed_at: Instant::now(),
        };
        let finished = self.publish_and_decide(claimed, Mode::Trial, stop).await;
        // The completer is gone only when the run is over.
        let _ = done_tx.send(finished).await;
        Ok(())
    }

    /// Stage 2: publishes claimed batches (several at once), decides each outcome. While
    /// stopping, batches not yet started are released instead.
    async fn publisher_stage(
        &self,
        claimed_rx: Arc<Mutex<mpsc::Receiver<Claimed>>>,
        done_tx: mpsc::Sender<Finished>,
        stop: Stop,
    ) {
        let micros = |since: std::time::Instant| {
            u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
        };
        loop {
            let waiting = std::time::Instant::now();
            let next = claimed_rx.lock().await.recv().await;
            self.counters
                .claim_wait_micros
                .fetch_add(micros(waiting), Relaxed);
            let Some(claimed) = next else { break };
            crate::metrics::claim_wait(waiting.elapsed());
            let finished = if stop.is_stopping() {
                self.release(claimed, "stopping: released without publishing")
            } else if self
                .publisher
                .publish_timeout()
                .is_some_and(|limit| claimed.claimed_at.elapsed() + limit > self.config.lease)
            {
                self.release(
                    claimed,
                    "the batch waited so long for a publisher that its lease could run out during the publish: released without publishing",
                )
            } else {
                let publishing = std::time::Instant::now();
                let finished = self.publish_and_decide(claimed, Mode::Normal, &stop).await;
                self.counters
                    .publish_micros
                    .fetch_add(micros(publishing), Relaxed);
                finished
            };
            if done_tx.send(finished).await.is_err() {
                break;
            }
        }
    }

    /// Hands a claimed batch back without publishing it (its poison rows are still
    /// recorded).
    fn release(&self, claimed: Claimed, why: &'static str) -> Finished {
        let Claimed { batch, claimed_at } = claimed;
        if !batch.messages.is_empty() {
            warn!(messages = batch.messages.len(), "{why}");
        }
        let outcomes = batch.messages.iter().map(|_| None).collect();
        let (completions, report) = self.decide(&batch.messages, outcomes, &batch.poison);
        Finished {
            completions,
            report,
            claimed_at,
        }
    }

    /// Publishes a claimed batch (see [`Mode`] for the circuit) and decides every
    /// outcome. A publish still running when the drain ends is abandoned and its
    /// messages released.
    async fn publish_and_decide(&self, claimed: Claimed, mode: Mode, stop: &Stop) -> Finished {
        let Claimed { batch, claimed_at } = claimed;
        let ClaimedBatch {
            messages, poison, ..
        } = batch;
        let started = std::time::Instant::now();
        let outcomes: Vec<Option<PublishOutcome>> = if messages.is_empty() {
            Vec::new()
        } else if mode == Mode::Normal && self.circuit.is_open() {
            // The broker is known to be unable to take messages: hand the batch back.
            messages
                .iter()
                .map(|_| {
                    Some(PublishOutcome::Transient(PublishError::unavailable(
                        "circuit open",
                        None,
                    )))
                })
                .collect()
        } else {
            let span = info_span!(
                "outbox.publish",
                messages = messages.len(),
                trial = mode == Mode::Trial
            );
            tokio::select! {
                outcomes = self.publish(&messages, &poison).instrument(span) => {
                    crate::metrics::publish_duration(started.elapsed());
                    outcomes
                }
                () = stop.drain_expired() => {
                    warn!(
                        messages = messages.len(),
                        "drain timeout: a publish still waiting for the broker is abandoned and its messages released"
                    );
                    messages.iter().map(|_| None).collect()
                }
            }
        };
        crate::metrics::commit_to_publish(messages.iter().zip(&outcomes).map(|(m, o)| {
            (
                &m.created_at,
                o.as_ref().is_some_and(PublishOutcome::is_published),
            )
        }));
        let (completions, report) = self.decide(&messages, outcomes, &poison);
        if mode == Mode::Trial {
            if report.outage {
                warn!(
                    "trial publish failed: the broker still cannot take messages, circuit stays open"
                );
            } else {
                self.circuit.close().await;
                info!("trial publish succeeded, circuit closed");
            }
        } else if report.outage && self.circuit.trip() {
            self.counters.circuit_opened.fetch_add(1, Relaxed);
            warn!(
                released = report.released,
                "the broker cannot take messages: circuit opened, messages released without charge"
            );
        }
        Finished {
            completions,
            report,
            claimed_at,
        }
    }

    /// Stage 3: records outcomes, merging the completions that are waiting. A completion
    /// the store rejects for good stops the dispatcher: claiming stops, what is held is
    /// released, and the error is returned once the other stages are done.
    async fn completer(
        &self,
        mut done_rx: mpsc::Receiver<Finished>,
        stop: Stop,
    ) -> Result<(), OutboxError> {
        let mut fatal = None;
        while let Some(first) = done_rx.recv().await {
            let mut oldest = first.claimed_at;
            let mut completions = first.completions;
            let mut reports = vec![first.report];
            while completions.len() < MAX_MERGED_COMPLETIONS {
                let Ok(more) = done_rx.try_recv() else { break };
                oldest = oldest.min(more.claimed_at);
                completions.extend(more.completions);
                reports.push(more.report);
            }
            if completions.is_empty() {
                for report in reports {
                    self.counters.record(&report);
                }
                continue;
            }
            let result = if fatal.is_some() {
                // One attempt each: the store is known to reject completions.
                self.complete_once(&completions, &stop).await
            } else {
                self.complete_with_retry(&completions, oldest, &stop).await
            };
            match result {
                Ok(done) => {
                    let fenced = done.fenced.len();
                    if fenced > 0 {
                        warn!(
                            fenced,
                            "completion fenced: another dispatcher reclaimed these messages after our lease expired"
                        );
                    }
                    for mut report in reports {
                        report.fenced = 0;
                        self.counters.record(&report);
                    }
                    if self.config.ordering.is_ordered() {
                        // The completed keys are free again: claim their next messages
                        // now rather than after the poll interval.
                        self.wake.notify_waiters();
                    }
                    self.counters.fenced.fetch_add(fenced as u64, Relaxed);
                    crate::metrics::completed(0, 0, fenced);
                }
                Err(e) if e.kind().is_retryable() => {
                    // The messages stay Processing and are reclaimed after their lease
                    // (published again: at-least-once). Keep draining the publishers.
                    error!(error = %e, messages = completions.len(), "could not record outcomes; they will be reclaimed after the lease");
                }
                Err(e) => {
                    error!(error = %e, messages = completions.len(), "the store rejected the completions: stopping (claiming stops, held batches are released)");
                    if fatal.is_none() {
                        stop.token.cancel();
                        fatal = Some(e);
                    }
                }
            }
        }
        fatal.map_or(Ok(()), Err)
    }

    async fn claim(&self, batch_size: usize) -> Result<ClaimedBatch, OutboxError> {
        let span = info_span!(
            "outbox.claim",
            batch_size,
            ordered = self.config.ordering.is_ordered()
        );
        match self.config.ordering {
            Ordering::Unordered => {
                self.store
                    .claim(batch_size, self.config.lease)
                    .instrument(span)
                    .await
            }
            Ordering::PerKey { on_dead } => {
                self.store
                    .claim_ordered(batch_size, self.config.lease, on_dead)
                    .instrument(span)
                    .await
            }
        }
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
            .publish_and_decide(Claimed { batch, claimed_at }, Mode::Once, &stop)
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

    /// One completion attempt; once stopping, bounded by the drain deadline plus a
    /// short grace.
    async fn complete_once(
        &self,
        completions: &[Completion],
        stop: &Stop,
    ) -> Result<crate::store::CompleteReport, OutboxError> {
        if completions.is_empty() {
            return Ok(crate::store::CompleteReport::default());
        }
        let attempt = self
            .store
            .complete(completions)
            .instrument(info_span!("outbox.complete", messages = completions.len()));
        match stop.deadline() {
            None => attempt.await,
            Some(deadline) => tokio::time::timeout_at(deadline + FINAL_COMPLETION_GRACE, attempt)
                .await
                .unwrap_or_else(|_| {
                    Err(OutboxError::Database {
                        kind: ErrorKind::Unavailable,
                        operation: "complete",
                        source: "no answer from the database before the drain deadline".into(),
                    })
                }),
        }
    }

    /// Completes, retrying retryable failures while the lease lasts (and, once
    /// stopping, until the drain deadline).
    async fn complete_with_retry(
        &self,
        completions: &[Completion],
        claimed_at: Instant,
        stop: &Stop,
    ) -> Result<crate::store::CompleteReport, OutboxError> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.complete_once(completions, stop).await {
                Ok(report) => return Ok(report),
                Err(e)
                    if e.kind().is_retryable()
                        && claimed_at.elapsed() + delay < self.config.lease
                        && stop
                            .deadline()
                            .is_none_or(|deadline| Instant::now() + delay < deadline) =>
                {
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "completion failed, retrying");
                    tokio::time::sleep(delay).await;
                    delay = crate::retry::outage_backoff(delay, Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests;
