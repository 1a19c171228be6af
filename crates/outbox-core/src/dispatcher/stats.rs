//! What a dispatcher did: [`DispatcherStats`] since it was created, [`BatchReport`] per
//! batch.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

/// Counters of a dispatcher since it was created (monotonic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatcherStats {
    /// Batches claimed (non-empty).
    pub batches: u64,
    /// Rows claimed (messages and poison rows).
    pub claimed: u64,
    /// Messages confirmed by the broker and marked Sent.
    pub published: u64,
    /// Messages scheduled for another attempt.
    pub retried: u64,
    /// Messages moved to Dead (poison rows included).
    pub dead: u64,
    /// Of `dead`: poison rows, moved to Dead without being published (undecodable, or
    /// caught by the store's crash-loop guard).
    pub poison: u64,
    /// Messages handed back without charging an attempt (outage or shutdown).
    pub released: u64,
    /// Messages held without charging an attempt because their destination refused
    /// messages (a full queue or stream): out of the claim path until its trial succeeds
    /// ([`CompletionOutcome::Hold`](crate::CompletionOutcome::Hold)).
    pub deferred: u64,
    /// Completions that changed nothing because another claim took over (stale lease).
    pub fenced: u64,
    /// Times the circuit opened because the broker could not take messages.
    pub circuit_opened: u64,
    /// Times a destination's circuit opened because it refused messages.
    pub destination_circuits_opened: u64,
    /// Trials of held destinations published (one held message alone each).
    pub destination_trials: u64,
    /// Of `destination_trials`: those the destination refused again (at most
    /// [`TRIALS_PER_SECOND`](crate::dispatcher::TRIALS_PER_SECOND) a second, over a
    /// burst).
    pub destination_trials_refused: u64,
    /// Held messages released once their destination's trial was confirmed.
    pub held_released: u64,
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
pub(super) struct Counters {
    pub(super) batches: AtomicU64,
    pub(super) claimed: AtomicU64,
    pub(super) published: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead: AtomicU64,
    pub(super) poison: AtomicU64,
    pub(super) released: AtomicU64,
    pub(super) deferred: AtomicU64,
    pub(super) fenced: AtomicU64,
    pub(super) circuit_opened: AtomicU64,
    pub(super) destination_circuits_opened: AtomicU64,
    pub(super) destination_trials: AtomicU64,
    pub(super) refused_trials: AtomicU64,
    pub(super) held_released: AtomicU64,
    pub(super) publish_micros: AtomicU64,
    pub(super) claim_wait_micros: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> DispatcherStats {
        let get = |c: &AtomicU64| c.load(Relaxed);
        DispatcherStats {
            batches: get(&self.batches),
            claimed: get(&self.claimed),
            published: get(&self.published),
            retried: get(&self.retried),
            dead: get(&self.dead),
            poison: get(&self.poison),
            released: get(&self.released),
            deferred: get(&self.deferred),
            fenced: get(&self.fenced),
            circuit_opened: get(&self.circuit_opened),
            destination_circuits_opened: get(&self.destination_circuits_opened),
            destination_trials: get(&self.destination_trials),
            destination_trials_refused: get(&self.refused_trials),
            held_released: get(&self.held_released),
            publish_micros: get(&self.publish_micros),
            claim_wait_micros: get(&self.claim_wait_micros),
        }
    }

    /// Adds a batch's recorded outcomes.
    pub(super) fn record(&self, report: &BatchReport) {
        self.published.fetch_add(report.published as u64, Relaxed);
        self.retried.fetch_add(report.retried as u64, Relaxed);
        self.dead.fetch_add(report.dead as u64, Relaxed);
        self.poison.fetch_add(report.poison as u64, Relaxed);
        self.released.fetch_add(report.released as u64, Relaxed);
        self.deferred.fetch_add(report.deferred as u64, Relaxed);
        self.fenced.fetch_add(report.fenced as u64, Relaxed);
        crate::metrics::completed(report.published, report.released, report.fenced);
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Rows claimed (messages and poison rows).
    pub claimed: usize,
    /// Marked Sent.
    pub published: usize,
    /// Scheduled for retry.
    pub retried: usize,
    /// Moved to Dead (poison rows included).
    pub dead: usize,
    /// Of `dead`: poison rows, never published.
    pub poison: usize,
    /// Released without charge.
    pub released: usize,
    /// Held without charge for their destination.
    pub deferred: usize,
    /// Completions fenced out.
    pub fenced: usize,
    /// Whether the broker could not take messages (the circuit opens).
    pub outage: bool,
}
