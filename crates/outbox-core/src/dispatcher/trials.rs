//! The trial task: the trials of held destinations, the release of their held rows
//! once a trial is confirmed, and the circuits brought in from the table (see
//! `destinations`).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{Instrument as _, info_span, warn};

use super::Dispatcher;
use super::destinations::{MAX_CIRCUITS, RELEASE_CHUNK};
use super::publisher_stage::Mode;
use super::run::{Claimed, Finished, Stop};
use crate::error::OutboxError;
use crate::ordering::Ordering;
use crate::publisher::EventPublisher;
use crate::store::{ClaimedBatch, OutboxStore};

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// The trial task: until stopping, releases what confirmed trials freed, brings in
    /// circuits from the table, and publishes the trials that are due (one held message
    /// of each destination, all in one batch).
    pub(super) async fn trials(
        &self,
        done_tx: mpsc::Sender<Finished>,
        stop: Stop,
    ) -> Result<(), OutboxError> {
        let mut store_backoff = Duration::ZERO;
        while !stop.is_stopping() {
            let wait = match self.trial_step(&done_tx, &stop).await {
                Ok(wait) => {
                    store_backoff = Duration::ZERO;
                    wait
                }
                Err(e) if e.kind().is_retryable() => {
                    store_backoff =
                        crate::retry::outage_backoff(store_backoff, self.config.store_backoff_max);
                    warn!(error = %e, backoff_ms = store_backoff.as_millis() as u64, "held destinations: a store call failed, backing off");
                    store_backoff
                }
                Err(e) => return Err(e),
            };
            if wait.is_zero() {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                () = stop.stopping() => {}
                () = self.destinations.woken() => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
        Ok(())
    }

    /// One round; returns how long to wait before the next.
    async fn trial_step(
        &self,
        done_tx: &mpsc::Sender<Finished>,
        stop: &Stop,
    ) -> Result<Duration, OutboxError> {
        let rescan = self.config.probe_max;
        if self.circuit.is_open() {
            // The broker takes nothing: the claimer probes it; trials wait.
            return Ok(self.config.probe_initial);
        }
        let mut wait = rescan;
        // Releases: one chunk per closed circuit a round, so trials go on beside a large
        // release.
        for dest in self.destinations.releasing() {
            let released = self
                .store
                .release_held(&dest, RELEASE_CHUNK)
                .instrument(info_span!("outbox.release_held", destination = %dest))
                .await?;
            if released > 0 {
                self.counters.held_released.fetch_add(released, Relaxed);
                // The released rows are claimable now.
                self.wake.notify_waiters();
            }
            if released < RELEASE_CHUNK as u64 {
                self.destinations.released(&dest);
            } else {
                wait = Duration::ZERO;
            }
            if stop.is_stopping() {
                return Ok(Duration::ZERO);
            }
        }
        self.adopt(rescan).await?;
        let (due, next) = self.destinations.due_trials();
        if let Some(next) = next {
            wait = wait.min(next);
        }
        if due.is_empty() {
            return Ok(wait);
        }
        let order = match self.config.ordering {
            Ordering::Unordered => None,
            Ordering::PerKey { on_dead } => Some(on_dead),
        };
        // One claim per destination, so that each trial is known by the circuit it
        // was held for (the publisher may name its routing key otherwise now).
        let mut claimed = Claimed::new(ClaimedBatch::default());
        for dest in &due {
            let batch = match self
                .store
                .claim_held(std::slice::from_ref(dest), self.config.lease, order)
                .instrument(info_span!("outbox.claim_held", destination = %dest))
                .await
            {
                Ok(batch) => batch,
                // What is claimed already is tried; the rest waits for the next round.
                Err(e) if !claimed.batch.is_empty() => {
                    warn!(error = %e, destination = %dest, "held destinations: a trial's claim failed; the trials claimed before it go on");
                    break;
                }
                Err(e) => return Err(e),
            };
            if batch.messages.is_empty() {
                self.destinations.forget(dest);
            }
            claimed
                .held
                .extend(std::iter::repeat_n(dest.clone(), batch.messages.len()));
            claimed.batch.messages.extend(batch.messages);
            claimed.batch.poison.extend(batch.poison);
        }
        if claimed.batch.is_empty() {
            return Ok(wait);
        }
        self.count_claimed(&claimed.batch);
        self.counters
            .destination_trials
            .fetch_add(claimed.batch.messages.len() as u64, Relaxed);
        let finished = self.publish_and_decide(claimed, Mode::Held, stop).await;
        // The completer is gone only when the run is over.
        let _ = done_tx.send(finished).await;
        Ok(wait.min(Duration::from_secs_f64(
            1.0 / super::destinations::TRIALS_PER_SECOND,
        )))
    }

    /// Brings in destinations that hold rows in the table but have no circuit in memory
    /// (held before a restart, by another relay, or beyond [`MAX_CIRCUITS`]), a page at
    /// a time, while there is room.
    async fn adopt(&self, rescan: Duration) -> Result<(), OutboxError> {
        let Some((room, known, after)) = self.destinations.adoption(rescan) else {
            return Ok(());
        };
        let page = room.min(MAX_CIRCUITS);
        let listed = self
            .store
            .held_destinations(&after, page)
            .instrument(info_span!("outbox.held_destinations", limit = page))
            .await?;
        let all = listed.len() < page;
        let last = if all { None } else { listed.last().cloned() };
        let found: Vec<String> = listed.into_iter().filter(|d| !known.contains(d)).collect();
        self.destinations.adopted(found, last, all);
        Ok(())
    }
}
