//! [`DispatcherConfig`]: batch size, poll interval, lease, concurrency, retry policies,
//! circuit-breaker probes, delivery order and the shutdown drain.

use std::time::Duration;

use crate::error::OutboxError;
use crate::ordering::Ordering;
use crate::retry::RetryPolicies;

/// Dispatcher settings. Build with [`DispatcherConfig::new`] and the `with_*` setters.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    pub(super) batch_size: usize,
    pub(super) poll_interval: Duration,
    pub(super) lease: Duration,
    pub(super) concurrency: usize,
    pub(super) retry: RetryPolicies,
    pub(super) probe_initial: Duration,
    pub(super) probe_max: Duration,
    pub(super) store_backoff_max: Duration,
    pub(super) ordering: Ordering,
    pub(super) drain_timeout: Duration,
}

/// Default of [`DispatcherConfig::with_drain_timeout`]: 10 seconds.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

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
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }
}

impl DispatcherConfig {
    /// The defaults: batches of 500 messages, 500 ms poll interval, 30 s lease, 2 batches
    /// in flight, the default [`RetryPolicies`], circuit probes from 500 ms up to 30 s,
    /// unordered, a 10 s drain at shutdown.
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
    /// [`WakeHandle::wake`](super::WakeHandle::wake) cuts the wait short.
    #[must_use]
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// How long a claim is held before another dispatcher may reclaim it (default 30 s).
    /// It must be at least twice the publisher's
    /// [`publish_timeout`](crate::EventPublisher::publish_timeout):
    /// [`Dispatcher::run`](super::Dispatcher::run) refuses to start otherwise. A claimed
    /// batch that waited so long for a publisher that less than one publish timeout of
    /// its lease is left is released instead of published.
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
    /// The delay doubles after every failed probe or trial publish and returns to the
    /// first one when the circuit closes.
    #[must_use]
    pub fn with_probe_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.probe_initial = initial;
        self.probe_max = max.max(initial);
        self
    }

    /// Delivery order (default [`Ordering::Unordered`]). With [`Ordering::PerKey`] the
    /// dispatcher claims through [`OutboxStore::claim_ordered`](crate::OutboxStore::claim_ordered)
    /// and publishes each batch in waves, one message per key per wave, so a failed
    /// message stops the rest of its key (they are released without charge); see
    /// [`crate::ordering`].
    #[must_use]
    pub fn with_ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
    }

    /// How long a shutdown may take (default 10 s): when
    /// [`run`](super::Dispatcher::run)'s token is cancelled the dispatcher stops
    /// claiming, lets the publishes in flight finish, releases (without charging an
    /// attempt) the claimed batches no publisher has started, and when this time is up
    /// abandons the publishes still waiting for the broker and releases their messages
    /// too (a message the broker took meanwhile is published again later:
    /// at-least-once). Keep it below the platform's grace period before `SIGKILL`
    /// (Kubernetes' `terminationGracePeriodSeconds`, 30 s by default) with room for the
    /// final completion.
    #[must_use]
    pub fn with_drain_timeout(mut self, d: Duration) -> Self {
        self.drain_timeout = d;
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

    /// The shutdown drain limit.
    pub fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }

    /// Checks the lease against a publisher's longest publish.
    ///
    /// # Errors
    /// [`OutboxError::Config`] when `publish_timeout` is set and the lease is shorter
    /// than twice it.
    pub fn check_lease(&self, publish_timeout: Option<Duration>) -> Result<(), OutboxError> {
        match publish_timeout {
            Some(publish) if self.lease < publish.saturating_mul(2) => {
                Err(OutboxError::Config(format!(
                    "the lease ({:?}) must be at least twice the publisher's publish timeout ({publish:?}: its connect timeout plus its confirm or ack timeout), or another relay could reclaim messages still being published; raise the lease or lower the publisher's timeouts",
                    self.lease
                )))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_must_cover_two_publishes() {
        let config = DispatcherConfig::new().with_lease(Duration::from_secs(30));
        assert!(config.check_lease(None).is_ok());
        assert!(config.check_lease(Some(Duration::from_secs(15))).is_ok());
        let err = config
            .check_lease(Some(Duration::from_secs(16)))
            .expect_err("30 s < 2 x 16 s");
        assert!(
            matches!(&err, OutboxError::Config(m) if m.contains("lease") && m.contains("16s")),
            "{err}"
        );
    }
}
