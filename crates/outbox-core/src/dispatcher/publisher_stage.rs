//! Stage 2, the publishers: each publishes a claimed batch (see `publish` and `waves`)
//! and decides every outcome (`decide`), or releases the batch unpublished; the
//! circuit is tripped or, after a trial, closed here.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::{Mutex, mpsc};
use tracing::{Instrument as _, info, info_span, warn};

use super::Dispatcher;
use super::run::{Claimed, Finished, Stop};
use crate::error::PublishError;
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::{ClaimedBatch, OutboxStore};

/// How [`Dispatcher::publish_and_decide`] treats the circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Release without trying while the circuit is open; an outage opens it.
    Normal,
    /// The half-open trial: publish although the circuit is open, then close it or
    /// keep it open.
    Trial,
    /// [`Dispatcher::run_batch`]: publish whatever the circuit says; an outage opens it.
    Once,
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// Stage 2: publishes claimed batches (several at once), decides each outcome. While
    /// stopping, batches not yet started are released instead.
    pub(super) async fn publisher_stage(
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
    pub(super) async fn publish_and_decide(
        &self,
        claimed: Claimed,
        mode: Mode,
        stop: &Stop,
    ) -> Finished {
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
}
