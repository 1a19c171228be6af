//! [`DispatcherConfig`]: batch size, poll interval, lease, concurrency, retry policies,
//! circuit-breaker probes, delivery order and the shutdown drain.

use std::time::Duration;

use crate::error::OutboxError;
use crate::ordering::Ordering;
use crate::retry::RetryPolicies;

/// Dispatcher settings: plain data. Made with [`DispatcherConfig::new`] and the `with_*`
/// setters (which never fail), read with the getters named after each setting, checked
/// by [`validate`](Self::validate), which [`Dispatcher::new`](super::Dispatcher::new)
/// calls: an invalid setting is refused where the dispatcher is built, before anything
/// runs.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    pub(super) batch_size: usize,
    pub(super) poll_interval: Duration,
    pub(super) min_poll_interval: Duration,
    pub(super) lease: Duration,
    pub(super) concurrency: usize,
    pub(super) retry: RetryPolicies,
    pub(super) probe_initial: Duration,
    pub(super) probe_max: Duration,
    pub(super) store_backoff_max: Duration,
    pub(super) ordering: Ordering,
    pub(super) drain_timeout: Duration,
    pub(super) push_wake: bool,
}

/// Default of [`DispatcherConfig::with_min_poll_interval`]: 10 milliseconds.
pub const DEFAULT_MIN_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// Default of [`DispatcherConfig::with_drain_timeout`]: 10 seconds.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            batch_size: 500,
            poll_interval: Duration::from_millis(500),
            min_poll_interval: DEFAULT_MIN_POLL_INTERVAL,
            lease: Duration::from_secs(30),
            concurrency: 2,
            retry: RetryPolicies::default(),
            probe_initial: Duration::from_millis(500),
            probe_max: Duration::from_secs(30),
            store_backoff_max: Duration::from_secs(30),
            ordering: Ordering::Unordered,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            push_wake: true,
        }
    }
}

impl DispatcherConfig {
    /// The defaults: batches of 500 messages, adaptive polling from 10 ms up to 500 ms,
    /// 30 s lease, 2 batches
    /// in flight, the default [`RetryPolicies`], circuit probes from 500 ms up to 30 s,
    /// unordered, a 10 s drain at shutdown, the store's push wake-up on.
    pub fn new() -> Self {
        Self::default()
    }

    /// Messages claimed per batch (default 500; 0 is refused by
    /// [`validate`](Self::validate)).
    #[must_use]
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// The longest wait between polls when there is nothing to claim (default 500 ms).
    /// Polling is adaptive: after a claim that found messages (but not a full batch) the
    /// next poll comes after [`with_min_poll_interval`](Self::with_min_poll_interval),
    /// and each poll that finds nothing doubles the wait up to this interval, so a busy
    /// relay picks up new messages within milliseconds and an idle one polls at this
    /// rate. [`WakeHandle::wake`](super::WakeHandle::wake) (for example from the store's
    /// push wake-up, see [`with_push_wake`](Self::with_push_wake)) cuts any wait short.
    #[must_use]
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// The first wait after a claim that found messages (default 10 ms, never above
    /// the poll interval); see [`with_poll_interval`](Self::with_poll_interval).
    #[must_use]
    pub fn with_min_poll_interval(mut self, d: Duration) -> Self {
        self.min_poll_interval = d;
        self
    }

    /// How long a claim is held before another dispatcher may reclaim it (default 30 s).
    /// It must be at least twice the publisher's
    /// [`publish_timeout`](crate::EventPublisher::publish_timeout):
    /// [`Dispatcher::new`](super::Dispatcher::new) refuses it otherwise, and 0 always. A claimed
    /// batch that waited so long for a publisher that less than one publish timeout of
    /// its lease is left is released instead of published.
    #[must_use]
    pub fn with_lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }

    /// Batches being published at once (default 2; 0 is refused by
    /// [`validate`](Self::validate)); as many more may wait claimed. Claiming and
    /// completing overlap with publishing in any case.
    #[must_use]
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// Backoff and attempts of a message whose publish failed transiently, by event
    /// type (default: [`RetryPolicies::default`]). A single
    /// [`RetryPolicy`](crate::RetryPolicy) is accepted too: it applies to every event
    /// type (`From<RetryPolicy> for RetryPolicies`). The same shape as the WAL relay's
    /// and the inbox processor's `with_retry`.
    #[must_use]
    pub fn with_retry(mut self, retry: impl Into<RetryPolicies>) -> Self {
        self.retry = retry.into();
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

    /// Whether [`Dispatcher::run`](super::Dispatcher::run) starts the store's push
    /// wake-up ([`OutboxStore::spawn_wake_source`](crate::OutboxStore::spawn_wake_source):
    /// PostgreSQL's `LISTEN`, the in-memory store's commits), from its first claim that
    /// finds less than a full batch for as long as it runs, so
    /// that a committed message is claimed at once rather than at the next poll (default
    /// `true`). With `false`, or over a store without one (MySQL, SQL Server), the
    /// dispatcher polls; [`WakeHandle::wake`](super::WakeHandle::wake) still works.
    /// PostgreSQL's listener holds one connection of the store's pool while it runs.
    #[must_use]
    pub fn with_push_wake(mut self, on: bool) -> Self {
        self.push_wake = on;
        self
    }

    /// Whether the store's push wake-up is started (see
    /// [`with_push_wake`](Self::with_push_wake)).
    pub fn push_wake(&self) -> bool {
        self.push_wake
    }

    /// The delivery order.
    pub fn ordering(&self) -> Ordering {
        self.ordering
    }

    /// The wait before the next poll: after a claim that found `claimed` rows, given
    /// the wait before it (`previous`): short again after activity, doubling while idle.
    pub(super) fn next_poll_wait(&self, previous: Duration, claimed: usize) -> Duration {
        let floor = self.min_poll_interval.min(self.poll_interval);
        if claimed > 0 {
            floor
        } else {
            previous.saturating_mul(2).clamp(floor, self.poll_interval)
        }
    }

    /// Messages per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The longest wait between polls ([`with_poll_interval`](Self::with_poll_interval)).
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// The first wait after a claim that found messages
    /// ([`with_min_poll_interval`](Self::with_min_poll_interval)).
    pub fn min_poll_interval(&self) -> Duration {
        self.min_poll_interval
    }

    /// Batches published at once ([`with_concurrency`](Self::with_concurrency)).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// The retry policies ([`with_retry`](Self::with_retry)).
    pub fn retry(&self) -> &RetryPolicies {
        &self.retry
    }

    /// The circuit-breaker probe backoff, first delay and cap
    /// ([`with_probe_backoff`](Self::with_probe_backoff)).
    pub fn probe_backoff(&self) -> (Duration, Duration) {
        (self.probe_initial, self.probe_max)
    }

    /// Lease per claim.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The shutdown drain limit.
    pub fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }

    /// Checks every setting, as [`Dispatcher::new`](super::Dispatcher::new) does
    /// (which also checks the lease against its publisher: see
    /// [`check_lease`](Self::check_lease)).
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] naming the setting: `batch_size` or
    /// `concurrency` 0, `lease` 0.
    pub fn validate(&self) -> Result<(), OutboxError> {
        let invalid = |field, reason| Err(OutboxError::invalid_config(field, reason));
        if self.batch_size == 0 {
            return invalid("batch_size", "must be at least 1");
        }
        if self.concurrency == 0 {
            return invalid("concurrency", "must be at least 1");
        }
        if self.lease.is_zero() {
            return invalid("lease", "must be longer than 0");
        }
        Ok(())
    }

    /// Checks the lease against a publisher's longest publish.
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] (field `lease`) when `publish_timeout` is set
    /// and the lease is shorter than twice it.
    pub fn check_lease(&self, publish_timeout: Option<Duration>) -> Result<(), OutboxError> {
        match publish_timeout {
            Some(publish) if self.lease < publish.saturating_mul(2) => {
                Err(OutboxError::invalid_config(
                    "lease",
                    format!(
                        "the lease ({:?}) must be at least twice the publisher's publish timeout ({publish:?}: its connect timeout plus its confirm or ack timeout), or another relay could reclaim messages still being published; raise the lease or lower the publisher's timeouts",
                        self.lease
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_is_short_after_activity_and_backs_off_when_idle() {
        let config = DispatcherConfig::new();
        let ms = |d: Duration| d.as_millis();
        let mut wait = config.poll_interval;
        assert_eq!(ms(config.next_poll_wait(wait, 3)), 10, "messages found");
        wait = config.next_poll_wait(wait, 3);
        let mut idle = Vec::new();
        for _ in 0..8 {
            wait = config.next_poll_wait(wait, 0);
            idle.push(ms(wait));
        }
        assert_eq!(idle, [20, 40, 80, 160, 320, 500, 500, 500]);
        let slow = DispatcherConfig::new().with_poll_interval(Duration::from_millis(5));
        assert_eq!(
            ms(slow.next_poll_wait(Duration::ZERO, 1)),
            5,
            "never above the interval"
        );
    }

    #[test]
    fn the_lease_must_cover_two_publishes() {
        let config = DispatcherConfig::new().with_lease(Duration::from_secs(30));
        assert!(config.check_lease(None).is_ok());
        assert!(config.check_lease(Some(Duration::from_secs(15))).is_ok());
        let err = config
            .check_lease(Some(Duration::from_secs(16)))
            .expect_err("30 s < 2 x 16 s");
        assert!(
            matches!(&err, OutboxError::InvalidConfig { field: "lease", reason } if reason.contains("16s")),
            "{err}"
        );
    }

    #[test]
    fn validate_names_the_invalid_setting() {
        let field = |config: DispatcherConfig| match config.validate() {
            Err(OutboxError::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        };
        assert!(DispatcherConfig::new().validate().is_ok());
        assert_eq!(
            field(DispatcherConfig::new().with_batch_size(0)),
            "batch_size"
        );
        assert_eq!(
            field(DispatcherConfig::new().with_concurrency(0)),
            "concurrency"
        );
        assert_eq!(
            field(DispatcherConfig::new().with_lease(Duration::ZERO)),
            "lease"
        );
    }
}
