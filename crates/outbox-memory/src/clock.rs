//! [`Clock`]: the "database clock" of the in-memory stores.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Where the in-memory stores take `now()` from: every time they record (`created_at`,
/// `visible_at`, `lease_until`, `sent_at`, inbox records) comes from it, as the SQL
/// stores take theirs from the database. Cheap to clone; clones share one time.
///
/// - [`Clock::tokio`] (the default) follows [`tokio::time::Instant`]: wall-clock time
///   at creation plus the tokio time elapsed since. Under `tokio::time::pause()` it
///   stands still and moves with `tokio::time::advance` and the runtime's auto-advance,
///   so leases, backoffs and delays expire in virtual time together with the
///   dispatcher's sleeps.
/// - [`Clock::manual`] moves only with [`advance`](Self::advance).
#[derive(Debug, Clone)]
pub struct Clock(Arc<Source>);

#[derive(Debug)]
enum Source {
    Tokio {
        base: DateTime<Utc>,
        started: tokio::time::Instant,
    },
    Manual(Mutex<DateTime<Utc>>),
}

impl Default for Clock {
    fn default() -> Self {
        Self::tokio()
    }
}

impl Clock {
    /// A clock that follows tokio's time (paused or not), starting at the current
    /// wall-clock time.
    pub fn tokio() -> Self {
        Self(Arc::new(Source::Tokio {
            base: Utc::now(),
            started: tokio::time::Instant::now(),
        }))
    }

    /// A clock that stands at `start` until [`advance`](Self::advance) moves it.
    pub fn manual(start: DateTime<Utc>) -> Self {
        Self(Arc::new(Source::Manual(Mutex::new(start))))
    }

    /// The current time.
    pub fn now(&self) -> DateTime<Utc> {
        match &*self.0 {
            Source::Tokio { base, started } => after(*base, started.elapsed()),
            Source::Manual(at) => *at.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        }
    }

    /// Moves a [`manual`](Self::manual) clock forward by `by`; returns `false` (and does
    /// nothing) for a [`tokio`](Self::tokio) clock, which moves with
    /// `tokio::time::advance` instead.
    pub fn advance(&self, by: Duration) -> bool {
        match &*self.0 {
            Source::Tokio { .. } => false,
            Source::Manual(at) => {
                let mut at = at.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                *at = after(*at, by);
                true
            }
        }
    }
}

/// `at + by`, saturating at the largest representable time.
pub(crate) fn after(at: DateTime<Utc>, by: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(by)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `at - by`, saturating at the smallest representable time.
pub(crate) fn before(at: DateTime<Utc>, by: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(by)
        .ok()
        .and_then(|d| at.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_tokio_clock_follows_paused_time() {
        let clock = Clock::tokio();
        let t0 = clock.now();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.now() - t0, chrono::TimeDelta::seconds(90));
        assert!(!clock.advance(Duration::from_secs(1)));
    }

    #[test]
    fn the_manual_clock_moves_only_when_told() {
        let start = Utc::now();
        let clock = Clock::manual(start);
        assert_eq!(clock.now(), start);
        assert!(clock.advance(Duration::from_millis(1500)));
        assert_eq!(clock.now() - start, chrono::TimeDelta::milliseconds(1500));
        assert_eq!(after(start, Duration::MAX), DateTime::<Utc>::MAX_UTC);
    }
}
