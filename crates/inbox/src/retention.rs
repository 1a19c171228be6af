//! Inbox retention: purge inbox records older than the dedup window and processed
//! durable-inbox messages, in small batches.

use std::time::Duration;

use outboxkit_core::inbox::DurableInbox;
use outboxkit_core::{InboxStore, OutboxError};
use tracing::warn;

/// Inbox retention settings (named apart from the outbox's [`SentRetention`](outboxkit_core::SentRetention) and the NATS stream's `StreamRetention`).
///
/// The **dedup window** is how long an inbox record `(message_id, consumer)` is kept.
/// A duplicate that arrives after its record was purged is processed again, so the
/// window must exceed the longest time a duplicate can still arrive: broker
/// redelivery, a relay's republish after a lease expiry, and any replay of dead
/// letters or of a stream you may run.
#[derive(Debug, Clone)]
pub struct InboxRetention {
    dedup_window: Duration,
    processed_retention: Duration,
    batch_size: usize,
}

impl Default for InboxRetention {
    fn default() -> Self {
        Self {
            dedup_window: Duration::from_secs(7 * 24 * 3600),
            processed_retention: Duration::from_secs(24 * 3600),
            batch_size: 1000,
        }
    }
}

/// What a purge removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Inbox records removed.
    pub inbox_records: u64,
    /// Processed durable-inbox messages removed.
    pub processed_messages: u64,
}

impl InboxRetention {
    /// Defaults: a 7-day dedup window, processed durable-inbox messages kept 1 day,
    /// batches of 1,000 rows.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long inbox records are kept (default 7 days).
    #[must_use]
    pub fn with_dedup_window(mut self, window: Duration) -> Self {
        self.dedup_window = window;
        self
    }

    /// How long processed durable-inbox messages are kept (default 1 day).
    #[must_use]
    pub fn with_processed_retention(mut self, keep: Duration) -> Self {
        self.processed_retention = keep;
        self
    }

    /// Rows deleted per statement (default 1,000), so a purge never holds long locks.
    #[must_use]
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// The dedup window.
    pub fn dedup_window(&self) -> Duration {
        self.dedup_window
    }

    /// Logs a warning, and returns `false`, when the dedup window is shorter than
    /// `horizon`, the longest time after which a duplicate may still arrive.
    pub fn check_horizon(&self, horizon: Duration) -> bool {
        if self.dedup_window < horizon {
            warn!(
                dedup_window_s = self.dedup_window.as_secs(),
                horizon_s = horizon.as_secs(),
                "inbox dedup window is shorter than the redelivery/replay horizon: late duplicates will be processed again"
            );
            return false;
        }
        true
    }

    /// Purges inbox records older than the dedup window, batch after batch until none
    /// is left.
    ///
    /// # Errors
    /// The store's error; what was purged before it stays purged.
    pub async fn purge_records<S: InboxStore>(&self, store: &S) -> Result<u64, OutboxError> {
        let mut total = 0;
        loop {
            let n = store.purge(self.dedup_window, self.batch_size).await?;
            total += n;
            if n < self.batch_size as u64 {
                return Ok(total);
            }
        }
    }

    /// Purges inbox records and processed durable-inbox messages.
    ///
    /// # Errors
    /// The store's error.
    pub async fn purge<S: DurableInbox>(&self, store: &S) -> Result<PurgeReport, OutboxError> {
        let inbox_records = self.purge_records(store).await?;
        let mut processed_messages = 0;
        loop {
            let n = store
                .purge_processed(self.processed_retention, self.batch_size)
                .await?;
            processed_messages += n;
            if n < self.batch_size as u64 {
                break;
            }
        }
        Ok(PurgeReport {
            inbox_records,
            processed_messages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horizon_check_flags_short_windows() {
        let r = InboxRetention::new().with_dedup_window(Duration::from_secs(3600));
        assert!(r.check_horizon(Duration::from_secs(60)));
        assert!(!r.check_horizon(Duration::from_secs(7200)));
    }
}
