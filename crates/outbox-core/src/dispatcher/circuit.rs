//! The circuit breaker: closed while the broker takes messages; open (nothing is
//! claimed, nothing charged) from the first outage until a probe and a trial publish
//! succeed.
//!
//! States, as in the classic breaker (Nygard, *Release It!*):
//! - **closed**: batches are claimed and published;
//! - **open**: a publish reported the broker unable to take messages
//!   ([`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable): unreachable, slow,
//!   blocked by an alarm, a queue or stream full). Batches still queued are released
//!   without trying; the claimer waits the probe delay and asks
//!   [`check_ready`](crate::EventPublisher::check_ready);
//! - **half-open**: when the probe succeeds the claimer claims one message and publishes
//!   it alone. Published (or judged on its own merits): the circuit closes. Another
//!   outage: it stays open and the delay doubles, up to the cap.
//!
//! The delay persists across trials, so a broker that accepts connections but refuses
//! messages (a full queue answers `check_ready` happily) is tried at a falling rate, one
//! message at a time, instead of with whole batches.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{AcqRel, Acquire};
use std::time::Duration;

use tokio::sync::Mutex;

#[derive(Debug)]
pub(super) struct Circuit {
    open: AtomicBool,
    /// The next probe delay.
    delay: Mutex<Duration>,
    initial: Duration,
    max: Duration,
}

impl Circuit {
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            open: AtomicBool::new(false),
            delay: Mutex::new(initial),
            initial,
            max,
        }
    }

    pub(super) fn is_open(&self) -> bool {
        self.open.load(Acquire)
    }

    /// Opens the circuit; `true` when it was closed.
    pub(super) fn trip(&self) -> bool {
        let opened = !self.open.swap(true, AcqRel);
        if opened {
            crate::metrics::circuit(true);
        }
        opened
    }

    /// Closes the circuit and resets the probe delay.
    pub(super) async fn close(&self) {
        *self.delay.lock().await = self.initial;
        if self.open.swap(false, AcqRel) {
            crate::metrics::circuit(false);
        }
    }

    /// The delay before the next probe; the one after it is twice as long (capped).
    pub(super) async fn next_delay(&self) -> Duration {
        let mut delay = self.delay.lock().await;
        let now = *delay;
        *delay = now.saturating_mul(2).min(self.max);
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_probe_delay_doubles_until_the_circuit_closes() {
        let c = Circuit::new(Duration::from_millis(500), Duration::from_secs(2));
        assert!(c.trip(), "closed -> open");
        assert!(!c.trip(), "already open");
        let delays = [
            c.next_delay().await,
            c.next_delay().await,
            c.next_delay().await,
            c.next_delay().await,
        ];
        assert_eq!(
            delays.map(|d| d.as_millis()),
            [500, 1000, 2000, 2000],
            "doubling, capped"
        );
        c.close().await;
        assert!(!c.is_open());
        assert_eq!(c.next_delay().await, Duration::from_millis(500), "reset");
    }
}
