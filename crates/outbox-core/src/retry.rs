//! Retry policy: exponential backoff with jitter and a cap, and per-event-type overrides.

use std::collections::HashMap;
use std::time::Duration;

/// Exponential backoff with full-range additive jitter and a cap.
///
/// After the `n`-th failed attempt (`n` ≥ 1) the next attempt is delayed by
/// `min(base^n seconds, cap) + uniform(0, jitter)`. With the defaults (base 3, cap 300 s,
/// jitter 2.5 s, 8 attempts) the delays are about 3 s, 9 s, 27 s, 81 s, 243 s, 300 s,
/// 300 s, and the eighth failure is final (about 16 minutes of retrying in all).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    base: f64,
    cap: Duration,
    jitter: Duration,
    max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: 3.0,
            cap: Duration::from_secs(300),
            jitter: Duration::from_millis(2500),
            max_attempts: 8,
        }
    }
}

impl RetryPolicy {
    /// The default policy (base 3, cap 300 s, jitter ≤ 2.5 s, 8 attempts).
    pub fn new() -> Self {
        Self::default()
    }

    /// Growth factor per attempt, in seconds^attempt (default 3.0; values below 1.0 are
    /// raised to 1.0).
    pub fn with_base(mut self, base: f64) -> Self {
        self.base = if base.is_finite() { base.max(1.0) } else { 3.0 };
        self
    }

    /// Upper bound of the exponential part (default 300 s).
    pub fn with_cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// Upper bound of the random jitter added to each delay (default 2.5 s).
    pub fn with_jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Attempts before a message goes `Dead` (default 8; at least 1).
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// Attempts before a message goes `Dead`.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Whether a message that has failed `attempts` times (counting the current one) may
    /// be tried again.
    pub fn should_retry(&self, attempts: u32) -> bool {
        attempts < self.max_attempts
    }

    /// The exponential part of the delay after `attempts` failures, without jitter.
    pub fn base_delay(&self, attempts: u32) -> Duration {
        let exp = i32::try_from(attempts).unwrap_or(i32::MAX);
        let secs = self.base.powi(exp);
        if !secs.is_finite() || secs >= self.cap.as_secs_f64() {
            self.cap
        } else {
            Duration::from_secs_f64(secs)
        }
    }

    /// The delay after `attempts` failures: [`base_delay`](Self::base_delay) plus a
    /// uniform jitter in `[0, jitter]`.
    pub fn delay(&self, attempts: u32) -> Duration {
        let jitter = if self.jitter.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(rand::random_range(0.0..=self.jitter.as_secs_f64()))
        };
        self.base_delay(attempts) + jitter
    }
}

/// The next wait while a database or broker stays unreachable: 100 ms first, then
/// doubling, never above `max`. Start from `Duration::ZERO`; reset to it on success.
/// (Outages are not a message's fault, so they use this, not a [`RetryPolicy`].)
pub fn outage_backoff(current: Duration, max: Duration) -> Duration {
    if current.is_zero() {
        Duration::from_millis(100).min(max)
    } else {
        (current * 2).min(max)
    }
}

/// The default [`RetryPolicy`] plus overrides by event type.
#[derive(Debug, Clone, Default)]
pub struct RetryPolicies {
    default: RetryPolicy,
    by_event_type: HashMap<String, RetryPolicy>,
}

impl RetryPolicies {
    /// Uses `policy` for every event type without an override.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            default: policy,
            by_event_type: HashMap::new(),
        }
    }

    /// Overrides the policy for one event type.
    #[must_use]
    pub fn with_override(mut self, event_type: impl Into<String>, policy: RetryPolicy) -> Self {
        self.by_event_type.insert(event_type.into(), policy);
        self
    }

    /// The policy for `event_type`.
    pub fn for_event_type(&self, event_type: &str) -> &RetryPolicy {
        self.by_event_type.get(event_type).unwrap_or(&self.default)
    }
}

/// One policy for every event type: what `with_retry(policy)` means on the
/// dispatcher, the WAL relay and the inbox processor, which all take
/// `impl Into<RetryPolicies>`. Same as [`RetryPolicies::new`].
impl From<RetryPolicy> for RetryPolicies {
    fn from(policy: RetryPolicy) -> Self {
        Self::new(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_design() {
        let p = RetryPolicy::default();
        assert_eq!(p.max_attempts(), 8);
        assert_eq!(p.base_delay(1), Duration::from_secs(3));
        assert_eq!(p.base_delay(2), Duration::from_secs(9));
        assert_eq!(p.base_delay(5), Duration::from_secs(243));
        assert_eq!(p.base_delay(6), Duration::from_secs(300));
        assert_eq!(p.base_delay(60), Duration::from_secs(300));
        assert!(p.should_retry(7));
        assert!(!p.should_retry(8));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RetryPolicy::default();
        for attempt in 1..10 {
            let d = p.delay(attempt);
            let base = p.base_delay(attempt);
            assert!(
                d >= base && d <= base + Duration::from_millis(2500),
                "{d:?}"
            );
        }
        let none = p.clone().with_jitter(Duration::ZERO);
        assert_eq!(none.delay(3), Duration::from_secs(27));
    }

    #[test]
    fn outage_backoff_doubles_from_100ms_up_to_the_cap() {
        let max = Duration::from_secs(1);
        let mut d = Duration::ZERO;
        let mut seen = Vec::new();
        for _ in 0..6 {
            d = outage_backoff(d, max);
            seen.push(d.as_millis());
        }
        assert_eq!(seen, [100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn overrides_apply_by_event_type() {
        let policies = RetryPolicies::default()
            .with_override("Flaky", RetryPolicy::new().with_max_attempts(2));
        assert_eq!(policies.for_event_type("Flaky").max_attempts(), 2);
        assert_eq!(policies.for_event_type("Other").max_attempts(), 8);
    }

    #[test]
    fn one_policy_converts_to_policies_for_every_event_type() {
        let policies = RetryPolicies::from(RetryPolicy::new().with_max_attempts(3));
        assert_eq!(policies.for_event_type("Any").max_attempts(), 3);
        assert_eq!(policies.for_event_type("Other").max_attempts(), 3);
    }
}
