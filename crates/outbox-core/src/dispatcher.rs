//! The relay loop: claim a batch, publish it with pipelined confirms, write every outcome
//! back in one round trip, repeat.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use tokio::sync::{Mutex, Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, error, info, info_span, warn};

use crate::error::{OutboxError, PublishError};
use crate::message::OutboxMessage;
use crate::ordering::{OnDead, OrderKey, Ordering};
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::retry::RetryPolicies;
use crate::store::{Completion, CompletionOutcome, OutboxStore};

/// Dispatcher settings. Build with [`DispatcherConfig::new`] and the `with_*` setters.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    batch_size: usize,
    poll_interval: Duration,
    lease: Duration,
    concurrency: usize,
    retry: RetryPolicies,
    probe_initial: Duration,
    probe_max: Duration,
    store_backoff_max: Duration,
    ordering: Ordering,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            batch_size: 500,
            poll_interval: Duration::from_millis(500),
            lease: Duration::from_secs(30),
            concurrency: 2,
            retry: RetryPolicies::default(),
            probe_initial: Duration::from_millis(500),
            probe_max: Duration::from_secs(30),
            store_backoff_max: Duration::from_secs(30),
            ordering: Ordering::Unordered,
        }
    }
}

impl DispatcherConfig {
    /// The defaults: batches of 500 messages, 500 ms poll interval, 30 s lease, 2 batches
    /// in flight, the default [`RetryPolicies`], circuit probes from 500 ms up to 30 s.
    pub fn new() -> Self {
        Self::default()
    }

    /// Messages claimed per batch (default 500, at least 1).
    #[must_use]
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Wait between polls when the last batch was not full (default 500 ms).
    /// [`WakeHandle::wake`] cuts the wait short.
    #[must_use]
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// How long a claim is held before another dispatcher may reclaim it (default 30 s).
    /// It must exceed the longest publish of a batch, confirms included.
    #[must_use]
    pub fn with_lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }

    /// Batches being published at once (default 2, at least 1); as many more may wait
    /// claimed. Claiming and completing overlap with publishing in any case.
    #[must_use]
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Retry policies (default: [`RetryPolicies::default`]).
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicies) -> Self {
        self.retry = retry;
        self
    }

    /// Circuit-breaker probe backoff: first delay and cap (defaults 500 ms and 30 s).
    #[must_use]
    pub fn with_probe_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.probe_initial = initial;
        self.probe_max = max.max(initial);
        self
    }

    /// Delivery order (default [`Ordering::Unordered`]). With [`Ordering::PerKey`] the
    /// dispatcher claims through [`OutboxStore::claim_ordered`] and publishes
    /// each batch in waves, one message per key per wave, so a failed message stops the
    /// rest of its key (they are released without charge); see [`crate::ordering`].
    #[must_use]
    pub fn with_ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
    }

    /// The delivery order.
    pub fn ordering(&self) -> Ordering {
        self.ordering
    }

    /// Messages per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Lease per claim.
    pub fn lease(&self) -> Duration {
        self.lease
    }
}

/// Counters of a dispatcher since it was created (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatcherStats {
    /// Batches claimed (non-empty).
    pub batches: u64,
    /// Messages claimed.
    pub claimed: u64,
    /// Messages confirmed by the broker and marked Sent.
    pub published: u64,
    /// Messages scheduled for another attempt.
    pub retried: u64,
    /// Messages moved to Dead.
    pub dead: u64,
    /// Messages handed back without charging an attempt (outage or shutdown).
    pub released: u64,
    /// Completions that changed nothing because another claim took over (stale lease).
    pub fenced: u64,
    /// Times the circuit opened because the broker was unreachable.
    pub circuit_opened: u64,
    /// Time publishers spent publishing batches, awaiting the broker's confirmations
    /// included, in microseconds, summed over the concurrent publishers.
    pub publish_micros: u64,
    /// Time publishers spent waiting for a claimed batch, in microseconds, summed over
    /// the concurrent publishers. With a backlog this is time the relay waited on the
    /// store; without one it is idle time. Beside `publish_micros` it tells whether a
    /// busy relay is bound by the broker or by the database.
    pub claim_wait_micros: u64,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    claimed: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    released: AtomicU64,
    fenced: AtomicU64,
    circuit_opened: AtomicU64,
    publish_micros: AtomicU64,
    claim_wait_micros: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> DispatcherStats {
        let get = |c: &AtomicU64| c.load(Relaxed);
        DispatcherStats {
            batches: get(&self.batches),
            claimed: get(&self.claimed),
            published: get(&self.published),
            retried: get(&self.retried),
            dead: get(&self.dead),
            released: get(&self.released),
            fenced: get(&self.fenced),
            circuit_opened: get(&self.circuit_opened),
            publish_micros: get(&self.publish_micros),
            claim_wait_micros: get(&self.claim_wait_micros),
        }
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Messages claimed.
    pub claimed: usize,
    /// Marked Sent.
    pub published: usize,
    /// Scheduled for retry.
    pub retried: usize,
    /// Moved to Dead.
    pub dead: usize,
    /// Released without charge.
    pub released: usize,
    /// Completions fenced out.
    pub fenced: usize,
    /// Whether the publisher reported the broker unreachable.
    pub outage: bool,
}

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
/// claimer waits `poll_interval` or a [`WakeHandle::wake`]. Several dispatchers, in one
/// process or many, may share a database: claims never overlap.
///
/// Failures:
/// - transient publish failure: `Processing → New` with backoff from the event type's
///   [`RetryPolicy`](crate::RetryPolicy); after `max_attempts`, `Dead`;
/// - permanent failure: `Dead` at once, with `last_error`;
/// - broker unreachable: the **circuit opens**: unpublished messages are released
///   without charging an attempt, claiming stops, the publisher is probed with
///   exponential backoff, and claiming resumes when a probe succeeds. An outage of any
///   length never dead-letters anything;
/// - database failure: the pipeline backs off exponentially (up to 30 s) and retries;
///   completion of a published batch is retried until it lands or the lease runs out
///   (the message is then republished after reclaim: at-least-once).
///
/// Shutdown ([`run`](Self::run)'s token): the claimer stops claiming; the batches
/// already claimed are published and completed; then `run` returns.
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

/// A claimed batch on its way to a publisher.
struct Claimed {
    messages: Vec<OutboxMessage>,
    claimed_at: tokio::time::Instant,
}

/// A published batch on its way to the completer.
struct Finished {
    completions: Vec<Completion>,
    report: BatchReport,
    claimed_at: tokio::time::Instant,
}

#[derive(Debug, Default)]
struct Circuit {
    open: AtomicBool,
    probe: Mutex<()>,
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// A dispatcher over `store` and `publisher`.
    pub fn new(store: Arc<S>, publisher: Arc<P>, config: DispatcherConfig) -> Self {
        Self {
            store,
            publisher,
            config: Arc::new(config),
            wake: Arc::new(Notify::new()),
            counters: Arc::new(Counters::default()),
            circuit: Arc::new(Circuit::default()),
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

    /// Whether the circuit is open (the broker was found unreachable and not yet back).
    pub fn circuit_open(&self) -> bool {
        self.circuit.open.load(Acquire)
    }

    /// Runs the relay until `shutdown` is cancelled, then returns the counters.
    ///
    /// Three stages overlap so the broker stays busy while the database works:
    /// one **claimer** claims batches (at most `concurrency` claimed batches wait), up
    /// to `concurrency` **publishers** publish them, and one **completer** records the
    /// outcomes, merging whatever completions are waiting into one statement.
    ///
    /// # Errors
    /// Only for a failure that retrying cannot fix (a corrupt row, a rejected
    /// statement); outages are waited out.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<DispatcherStats, OutboxError> {
        info!(
            batch_size = self.config.batch_size,
            concurrency = self.config.concurrency,
            lease_ms = self.config.lease.as_millis() as u64,
            "dispatcher started"
        );
        let (claimed_tx, claimed_rx) = mpsc::channel::<Claimed>(self.config.concurrency);
        let (done_tx, done_rx) = mpsc::channel::<Finished>(self.config.concurrency * 2);
        let claimed_rx = Arc::new(Mutex::new(claimed_rx));

        let mut tasks = tokio::task::JoinSet::new();
        {
            let this = self.clone();
            let token = shutdown.clone();
            tasks.spawn(async move { this.claimer(claimed_tx, token).await });
        }
        for _ in 0..self.config.concurrency {
            let this = self.clone();
            let rx = Arc::clone(&claimed_rx);
            let tx = done_tx.clone();
            tasks.spawn(async move {
                this.publisher_stage(rx, tx).await;
                Ok(())
            });
        }
        drop(done_tx);
        {
            let this = self.clone();
            tasks.spawn(async move { this.completer(done_rx).await });
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
                shutdown.cancel();
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        let stats = self.stats();
        info!(?stats, "dispatcher stopped");
        result.map(|()| stats)
    }

    /// Stage 1: claims batches while there is work, hands them to the publishers.
    async fn claimer(
        &self,
        claimed_tx: mpsc::Sender<Claimed>,
        shutdown: CancellationToken,
    ) -> Result<(), OutboxError> {
        let mut store_backoff = Duration::ZERO;
        while !shutdown.is_cancelled() {
            if self.circuit_open() {
                self.probe_until_ready(&shutdown).await;
                continue;
            }
            // Register interest before claiming so a wake during the claim is not lost.
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let claim = self.claim().await;
            let full = match claim {
                Ok(messages) => {
                    store_backoff = Duration::ZERO;
                    let full = messages.len() >= self.config.batch_size;
                    if !messages.is_empty() {
                        self.counters.batches.fetch_add(1, Relaxed);
                        crate::metrics::claimed(messages.len());
                        self.counters
                            .claimed
                            .fetch_add(messages.len() as u64, Relaxed);
                        let batch = Claimed {
                            messages,
                            claimed_at: tokio::time::Instant::now(),
                        };
                        if claimed_tx.send(batch).await.is_err() {
                            break; // publishers are gone: the run is over
                        }
                    }
                    full
                }
                Err(e) if e.kind().is_retryable() => {
                    store_backoff =
                        crate::retry::outage_backoff(store_backoff, self.config.store_backoff_max);
                    warn!(error = %e, backoff_ms = store_backoff.as_millis() as u64, "claim failed, backing off");
                    tokio::select! {
                        () = shutdown.cancelled() => {}
                        () = tokio::time::sleep(store_backoff) => {}
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            if !full {
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    () = &mut notified => {}
                    () = tokio::time::sleep(self.config.poll_interval) => {}
                }
            }
        }
        Ok(())
    }

    /// Stage 2: publishes claimed batches (several at once), decides each outcome.
    async fn publisher_stage(
        &self,
        claimed_rx: Arc<Mutex<mpsc::Receiver<Claimed>>>,
        done_tx: mpsc::Sender<Finished>,
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
            let Some(batch) = next else { break };
            crate::metrics::claim_wait(waiting.elapsed());
            let publishing = std::time::Instant::now();
            let finished = self.publish_and_decide(batch).await;
            self.counters
                .publish_micros
                .fetch_add(micros(publishing), Relaxed);
            if done_tx.send(finished).await.is_err() {
                break;
            }
        }
    }

    async fn publish_and_decide(&self, batch: Claimed) -> Finished {
        let Claimed {
            messages,
            claimed_at,
        } = batch;
        let publish_started = (!self.circuit_open()).then(std::time::Instant::now);
        let outcomes = if self.circuit_open() {
            // The broker is known to be down: hand the batch back without trying.
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
            let span = info_span!("outbox.publish", messages = messages.len());
            match self.config.ordering {
                Ordering::Unordered => {
                    let outcomes = self
                        .publisher
                        .publish_batch(&messages)
                        .instrument(span)
                        .await;
                    if outcomes.len() != messages.len() {
                        warn!(
                            expected = messages.len(),
                            got = outcomes.len(),
                            "publisher broke its contract: outcome count differs; unmatched messages are released"
                        );
                    }
                    outcomes.into_iter().map(Some).collect()
                }
                Ordering::PerKey { on_dead } => {
                    self.publish_in_waves(&messages, on_dead)
                        .instrument(span)
                        .await
                }
            }
        };
        if let Some(started) = publish_started {
            crate::metrics::publish_duration(started.elapsed());
        }
        crate::metrics::commit_to_publish(messages.iter().zip(&outcomes).map(|(m, o)| {
            (
                &m.created_at,
                o.as_ref().is_some_and(PublishOutcome::is_published),
            )
        }));
        let (completions, report) = self.decide(&messages, outcomes);
        if report.outage && !self.circuit.open.swap(true, AcqRel) {
            crate::metrics::circuit(true);
            self.counters.circuit_opened.fetch_add(1, Relaxed);
            warn!(
                released = report.released,
                "broker unreachable: circuit opened, messages released without charge"
            );
        }
        Finished {
            completions,
            report,
            claimed_at,
        }
    }

    /// Stage 3: records outcomes, merging the completions that are waiting.
    async fn completer(&self, mut done_rx: mpsc::Receiver<Finished>) -> Result<(), OutboxError> {
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
            match self
                .complete_with_retry(&completions, oldest, self.config.lease)
                .await
            {
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
                        self.record(&report);
                    }
                    if self.config.ordering.is_ordered() {
                        // The completed keys are free again: claim their next messages
                        // now rather than after the poll interval.
                        self.wake.notify_waiters();
                    }
                    self.counters.fenced.fetch_add(fenced as u64, Relaxed);
                    crate::metrics::completed(0, 0, fenced);
                }
                Err(e) => {
                    // The messages stay Processing and are reclaimed after their lease
                    // (published again: at-least-once). Keep draining the publishers.
                    error!(error = %e, messages = completions.len(), "could not record outcomes; they will be reclaimed after the lease");
                    if !e.kind().is_retryable() && fatal.is_none() {
                        fatal = Some(e);
                    }
                }
            }
        }
        fatal.map_or(Ok(()), Err)
    }

    fn record(&self, report: &BatchReport) {
        let c = &self.counters;
        c.published.fetch_add(report.published as u64, Relaxed);
        c.retried.fetch_add(report.retried as u64, Relaxed);
        c.dead.fetch_add(report.dead as u64, Relaxed);
        c.released.fetch_add(report.released as u64, Relaxed);
        c.fenced.fetch_add(report.fenced as u64, Relaxed);
        crate::metrics::completed(report.published, report.released, report.fenced);
    }

    async fn probe_until_ready(&self, shutdown: &CancellationToken) {
        let _guard = self.circuit.probe.lock().await;
        let mut delay = self.config.probe_initial;
        while self.circuit_open() && !shutdown.is_cancelled() {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            match self.publisher.check_ready().await {
                Ok(()) => {
                    self.circuit.open.store(false, Release);
                    crate::metrics::circuit(false);
                    info!("broker reachable again, circuit closed");
                }
                Err(e) => {
                    delay = crate::retry::outage_backoff(delay, self.config.probe_max);
                    warn!(error = %e, next_probe_ms = delay.as_millis() as u64, "broker still unreachable");
                }
            }
        }
    }

    async fn claim(&self) -> Result<Vec<OutboxMessage>, OutboxError> {
        let span = info_span!(
            "outbox.claim",
            batch_size = self.config.batch_size,
            ordered = self.config.ordering.is_ordered()
        );
        match self.config.ordering {
            Ordering::Unordered => {
                self.store
                    .claim(self.config.batch_size, self.config.lease)
                    .instrument(span)
                    .await
            }
            Ordering::PerKey { on_dead } => {
                self.store
                    .claim_ordered(self.config.batch_size, self.config.lease, on_dead)
                    .instrument(span)
                    .await
            }
        }
    }

    /// Claims, publishes and completes one batch. Useful for tools and tests;
    /// [`run`](Self::run) does the same, with its stages overlapping.
    ///
    /// # Errors
    /// A store error from the claim (nothing was claimed) or from completion after the
    /// lease ran out (the messages will be reclaimed and republished).
    pub async fn run_batch(&self) -> Result<BatchReport, OutboxError> {
        let messages = self.claim().await?;
        if messages.is_empty() {
            return Ok(BatchReport::default());
        }
        self.counters.batches.fetch_add(1, Relaxed);
        crate::metrics::claimed(messages.len());
        self.counters
            .claimed
            .fetch_add(messages.len() as u64, Relaxed);
        let claimed_at = tokio::time::Instant::now();
        let finished = self
            .publish_and_decide(Claimed {
                messages,
                claimed_at,
            })
            .await;
        let done = self
            .complete_with_retry(&finished.completions, claimed_at, self.config.lease)
            .await?;
        let mut report = finished.report;
        report.fenced = done.fenced.len();
        if report.fenced > 0 {
            warn!(
                fenced = report.fenced,
                "completion fenced: another dispatcher reclaimed these messages after our lease expired"
            );
        }
        self.record(&report);
        Ok(report)
    }

    /// Per-key mode: publishes `messages` (in `seq` order) in waves, the first message
    /// of every key, then the second, ..., awaiting every confirmation of a wave before
    /// the next, so a key never has a later message sent after an earlier one failed.
    /// A key stops at its first unpublished message (under [`OnDead::Skip`] a permanent
    /// failure does not stop it); an outage stops every key. `None` = not attempted.
    async fn publish_in_waves(
        &self,
        messages: &[OutboxMessage],
        on_dead: OnDead,
    ) -> Vec<Option<PublishOutcome>> {
        let mut waves: Vec<Vec<usize>> = Vec::new();
        {
            let mut depth: std::collections::HashMap<OrderKey<'_>, usize> =
                std::collections::HashMap::with_capacity(messages.len());
            for (i, m) in messages.iter().enumerate() {
                let d = depth.entry(m.order_key()).or_insert(0);
                if waves.len() <= *d {
                    waves.push(Vec::new());
                }
                waves[*d].push(i);
                *d += 1;
            }
        }
        let mut outcomes: Vec<Option<PublishOutcome>> = messages.iter().map(|_| None).collect();
        if waves.len() == 1 {
            // Every key appears once: one pipelined publish, as in unordered mode.
            let got = self.publisher.publish_batch(messages).await;
            for (slot, o) in outcomes.iter_mut().zip(got) {
                *slot = Some(o);
            }
            return outcomes;
        }
        let mut stopped: HashSet<OrderKey<'_>> = HashSet::new();
        for wave in waves {
            let go: Vec<usize> = wave
                .into_iter()
                .filter(|&i| !stopped.contains(&messages[i].order_key()))
                .collect();
            if go.is_empty() {
                continue;
            }
            let batch: Vec<OutboxMessage> = go.iter().map(|&i| messages[i].clone()).collect();
            let mut got = self.publisher.publish_batch(&batch).await.into_iter();
            let mut outage = false;
            for &i in &go {
                let outcome = got.next();
                let keeps_going = match &outcome {
                    Some(PublishOutcome::Published) => true,
                    Some(PublishOutcome::Permanent(_)) => on_dead == OnDead::Skip,
                    Some(o) => {
                        outage |= o.is_outage();
                        false
                    }
                    None => false,
                };
                if !keeps_going {
                    stopped.insert(messages[i].order_key());
                }
                outcomes[i] = outcome;
            }
            if outage {
                break; // the broker is unreachable: everything left is released
            }
        }
        outcomes
    }

    fn decide(
        &self,
        claimed: &[OutboxMessage],
        outcomes: Vec<Option<PublishOutcome>>,
    ) -> (Vec<Completion>, BatchReport) {
        let mut report = BatchReport {
            claimed: claimed.len(),
            ..BatchReport::default()
        };
        let mut outcomes = outcomes.into_iter();
        let mut completions = Vec::with_capacity(claimed.len());
        for msg in claimed {
            let Some(token) = msg.claim_token else {
                continue;
            };
            let outcome = match outcomes.next().flatten() {
                None => {
                    report.released += 1;
                    CompletionOutcome::Release
                }
                Some(PublishOutcome::Published) => {
                    report.published += 1;
                    CompletionOutcome::Sent
                }
                Some(o @ PublishOutcome::Transient(_)) if o.is_outage() => {
                    crate::metrics::publish_failed(crate::ErrorKind::Unavailable, &msg.event_type);
                    report.outage = true;
                    report.released += 1;
                    CompletionOutcome::Release
                }
                Some(PublishOutcome::Transient(e)) => {
                    crate::metrics::publish_failed(e.kind(), &msg.event_type);
                    let policy = self.config.retry.for_event_type(&msg.event_type);
                    let attempts = u32::try_from(msg.attempts).unwrap_or(0);
                    if policy.should_retry(attempts) {
                        report.retried += 1;
                        crate::metrics::retried(&msg.event_type);
                        let delay = policy.delay(attempts);
                        debug!(id = %msg.id, event_type = %msg.event_type, tenant = msg.tenant_id.as_deref().unwrap_or(""), aggregate_type = %msg.aggregate_type, aggregate_id = %msg.aggregate_id, version = msg.aggregate_version, attempts, delay_ms = delay.as_millis() as u64, error = %e, "publish failed, will retry");
                        CompletionOutcome::Retry {
                            delay,
                            error: e.to_string(),
                        }
                    } else {
                        report.dead += 1;
                        crate::metrics::dead(&msg.event_type);
                        warn!(id = %msg.id, event_type = %msg.event_type, tenant = msg.tenant_id.as_deref().unwrap_or(""), aggregate_type = %msg.aggregate_type, aggregate_id = %msg.aggregate_id, version = msg.aggregate_version, attempts, error = %e, "attempts exhausted, message is dead");
                        CompletionOutcome::Dead {
                            error: format!(
                                "attempts exhausted ({attempts}/{}): {e}",
                                policy.max_attempts()
                            ),
                        }
                    }
                }
                Some(PublishOutcome::Permanent(e)) => {
                    report.dead += 1;
                    crate::metrics::publish_failed(e.kind(), &msg.event_type);
                    crate::metrics::dead(&msg.event_type);
                    warn!(id = %msg.id, event_type = %msg.event_type, tenant = msg.tenant_id.as_deref().unwrap_or(""), aggregate_type = %msg.aggregate_type, aggregate_id = %msg.aggregate_id, version = msg.aggregate_version, attempts = msg.attempts, error = %e, "permanent publish failure, message is dead");
                    CompletionOutcome::Dead {
                        error: e.to_string(),
                    }
                }
            };
            completions.push(Completion {
                id: msg.id,
                claim_token: token,
                outcome,
            });
        }
        (completions, report)
    }

    async fn complete_with_retry(
        &self,
        completions: &[Completion],
        claimed_at: tokio::time::Instant,
        lease: Duration,
    ) -> Result<crate::store::CompleteReport, OutboxError> {
        let mut delay = Duration::from_millis(100);
        loop {
            let result = self
                .store
                .complete(completions)
                .instrument(info_span!("outbox.complete", messages = completions.len()))
                .await;
            match result {
                Ok(report) => return Ok(report),
                Err(e) if e.kind().is_retryable() && claimed_at.elapsed() + delay < lease => {
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "completion failed, retrying");
                    tokio::time::sleep(delay).await;
                    delay = crate::retry::outage_backoff(delay, Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        }
    }
}
