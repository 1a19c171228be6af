//! Stage 1, the claimer: claims batches while there is work and hands them to the
//! publishers; while the circuit is open, probes the publisher and publishes a one-message
//! trial instead (half-open).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{Instrument as _, info, info_span, warn};

use super::Dispatcher;
use super::publisher_stage::Mode;
use super::run::{Claimed, Finished, Stop};
use crate::error::{OutboxError, PublishError};
use crate::ordering::Ordering;
use crate::publisher::EventPublisher;
use crate::store::{ClaimedBatch, OutboxStore};

/// How many claims of poison rows alone a half-open trial goes through looking for a
/// message to try, before it waits for the next probe.
const MAX_POISON_BEFORE_TRIAL: usize = 10;

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// Stage 1: claims batches while there is work, hands them to the publishers; while
    /// the circuit is open, probes and publishes trials instead.
    pub(super) async fn claimer(
        &self,
        claimed_tx: mpsc::Sender<Claimed>,
        done_tx: mpsc::Sender<Finished>,
        stop: Stop,
    ) -> Result<(), OutboxError> {
        let mut store_backoff = Duration::ZERO;
        let mut poll_wait = self.config.poll_interval;
        // Nothing is claimed that cannot be published: a relay (re)started while the
        // broker is unreachable or frozen would otherwise hold rows it cannot publish
        // until it is killed again, each time a claim without an outcome. Until the
        // publisher is ready the circuit is open: probed with backoff, nothing claimed.
        if let Err(e) = self.ready().await {
            self.circuit.trip();
            warn!(error = %e, "the broker cannot take messages yet: nothing is claimed until it can (probing with backoff)");
        }
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
                            let claimed = Claimed::new(batch);
                            if claimed_tx.send(claimed).await.is_err() {
                                break; // publishers are gone: the run is over
                            }
                        }
                        if !full {
                            stop.went_idle.notify_one();
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
        if let Err(e) = self.ready().await {
            warn!(error = %e, waited_ms = delay.as_millis() as u64, "broker still unavailable");
            return Ok(());
        }
        // The trial needs a message to publish: a claim that finds only poison rows
        // (recorded dead here, as ever) proves nothing about the broker, so claim again.
        let mut batch = self.claim(1).await?;
        for _ in 0..MAX_POISON_BEFORE_TRIAL {
            let only_poison = batch.messages.is_empty() && !batch.poison.is_empty();
            if !only_poison {
                break;
            }
            self.count_claimed(&batch);
            let (completions, report) = self.decide(&[], Vec::new(), &batch.poison, &[]);
            let finished = Finished {
                completions,
                report,
                claimed_at: Instant::now(),
            };
            let _ = done_tx.send(finished).await;
            batch = self.claim(1).await?;
        }
        if batch.messages.is_empty() {
            if batch.poison.is_empty() {
                self.circuit.close().await;
                info!("broker ready again (nothing to publish as a trial), circuit closed");
            }
            // Only poison again: the circuit stays open until a message is tried.
            return Ok(());
        }
        self.count_claimed(&batch);
        let claimed = Claimed::new(batch);
        let finished = self.publish_and_decide(claimed, Mode::Trial, stop).await;
        // The completer is gone only when the run is over.
        let _ = done_tx.send(finished).await;
        Ok(())
    }

    /// The publisher's [`check_ready`](EventPublisher::check_ready), given up after its
    /// publish timeout (30 s when it states none): a broker that accepts connections
    /// and answers nothing is not ready.
    async fn ready(&self) -> Result<(), PublishError> {
        let limit = self
            .publisher
            .publish_timeout()
            .unwrap_or(Duration::from_secs(30));
        tokio::time::timeout(limit, self.publisher.check_ready())
            .await
            .unwrap_or(Err(PublishError::Timeout(limit)))
    }

    pub(super) async fn claim(&self, batch_size: usize) -> Result<ClaimedBatch, OutboxError> {
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

    pub(super) fn count_claimed(&self, batch: &ClaimedBatch) {
        self.counters.batches.fetch_add(1, Relaxed);
        crate::metrics::claimed(batch.len());
        self.counters.claimed.fetch_add(batch.len() as u64, Relaxed);
    }
}
