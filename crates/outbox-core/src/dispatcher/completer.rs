//! Stage 3, the completer: records the outcomes, merging the completions that are waiting
//! into one statement, retrying while the lease lasts; a completion the store rejects for
//! good stops the dispatcher.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{Instrument as _, error, info_span, warn};

use super::Dispatcher;
use super::run::{Finished, Stop};
use crate::error::{ErrorKind, OutboxError};
use crate::publisher::EventPublisher;
use crate::store::{Completion, OutboxStore};

/// Upper bound of completions merged into one statement by the completer.
const MAX_MERGED_COMPLETIONS: usize = 5_000;

/// How long the last completions may take once the drain timeout is up.
const FINAL_COMPLETION_GRACE: Duration = Duration::from_secs(5);

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// Stage 3: records outcomes, merging the completions that are waiting. A completion
    /// the store rejects for good stops the dispatcher: claiming stops, what is held is
    /// released, and the error is returned once the other stages are done.
    pub(super) async fn completer(
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
    pub(super) async fn complete_with_retry(
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
