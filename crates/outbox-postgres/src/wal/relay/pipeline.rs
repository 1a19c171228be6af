//! Batches in flight: once a session is past its careful start, a batch is published
//! by a task of its own and the stream goes on reading, gathering and publishing the
//! next batches while the broker confirms it (up to `WalRelayConfig::with_concurrency`
//! batches in flight, 4 by default).
//!
//! Before, each batch waited for the last one's confirms: to RabbitMQ, whose confirm of
//! a persistent message follows its disk write (about 5 ms here, 15-20 ms in the tail),
//! a message committed during a confirm waited for it before it was even sent.
//!
//! What keeps the guarantees:
//! - Outcomes are handled strictly in launch order ([`Pipeline::landed`]), and recorded
//!   as before (one recording in flight, in stream order); each batch carries the
//!   stream position after it, confirmed once its outcomes are recorded.
//! - A message parked by a failure (a refusal, a transient error) parks its key's
//!   messages in the batches launched before the failure was known, even those the
//!   broker took (published again after it: a duplicate, never a reordering), as a
//!   round does within a batch. Batches launched after it see the key parked and
//!   hold its messages back at once.
//! - With per-key order, a batch waits until no batch in flight holds one of its keys,
//!   so a key's next message is sent only after its last one was confirmed.
//! - A broker outage met by one batch puts its unconfirmed messages and every later
//!   batch's messages back together, in order, behind the probe (the broker may have
//!   taken some of them: duplicates, as within a batch).
//! - The careful start, the crash-loop guard, catching up, replayed and poison rows take
//!   the slow path, after every batch in flight was handled.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use outboxkit_core::{OutboxMessage, PublishOutcome};
use pgwire_replication::Lsn;
use tokio::task::JoinHandle;

use super::park::ParkedRow;

/// A batch published by a task of its own.
pub(super) struct InFlight {
    /// Its place in launch order.
    pub(super) seq: u64,
    /// The messages published, in stream order, and their ordering keys.
    pub(super) messages: Arc<[OutboxMessage]>,
    pub(super) keys: Arc<[String]>,
    /// Messages held back when it was launched (parked), recorded with its outcomes.
    pub(super) held: Vec<ParkedRow>,
    /// The stream's position after its last transaction.
    pub(super) upto: Option<Lsn>,
    task: JoinHandle<Vec<Option<PublishOutcome>>>,
}

/// The batches in flight, oldest first. Dropped (the session ends), their tasks are
/// aborted: what was not recorded is read again by the next session.
pub(super) struct Pipeline {
    batches: VecDeque<InFlight>,
    /// Most batches in flight.
    depth: usize,
    /// With per-key order: the messages in flight per ordering key.
    keys: Option<HashMap<String, usize>>,
    launched: u64,
    /// Keys parked by a failure while batches were in flight, and the last batch
    /// launched then: that batch and the ones before it were published without
    /// knowing, and their messages of the key are parked behind. Bounded: a failure
    /// is forgotten once no batch launched before it is in flight (see
    /// [`handled`](Self::handled)).
    failed: HashMap<String, u64>,
}

impl Pipeline {
    /// Up to `depth` batches in flight (at least 1); with `per_key` order, the keys in
    /// flight are counted for [`holds_any`](Self::holds_any).
    pub(super) fn new(depth: usize, per_key: bool) -> Self {
        Self {
            batches: VecDeque::new(),
            depth: depth.max(1),
            keys: per_key.then(HashMap::new),
            launched: 0,
            failed: HashMap::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Whether another batch must wait for the oldest to be handled.
    pub(super) fn is_full(&self) -> bool {
        self.batches.len() >= self.depth
    }

    /// Whether a batch in flight holds a message of one of `keys` (per-key order
    /// only: otherwise `false`).
    pub(super) fn holds_any(&self, keys: &[String]) -> bool {
        self.keys
            .as_ref()
            .is_some_and(|counts| !counts.is_empty() && keys.iter().any(|k| counts.contains_key(k)))
    }

    fn count(&mut self, keys: &[String], up: bool) {
        let Some(counts) = self.keys.as_mut() else {
            return;
        };
        for k in keys {
            if up {
                *counts.entry(k.clone()).or_default() += 1;
            } else if let Some(n) = counts.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    counts.remove(k);
                }
            }
        }
    }

    /// Whether the oldest batch's publish has come back.
    pub(super) fn front_finished(&self) -> bool {
        self.batches.front().is_some_and(|b| b.task.is_finished())
    }

    /// Adds a batch whose publish `task` was started.
    pub(super) fn push(
        &mut self,
        messages: Arc<[OutboxMessage]>,
        keys: Arc<[String]>,
        held: Vec<ParkedRow>,
        upto: Option<Lsn>,
        task: JoinHandle<Vec<Option<PublishOutcome>>>,
    ) {
        self.launched += 1;
        self.count(&keys, true);
        self.batches.push_back(InFlight {
            seq: self.launched,
            messages,
            keys,
            held,
            upto,
            task,
        });
    }

    /// Waits for the oldest batch's publish to come back and takes it out, with one
    /// outcome per message (`None`: none came). Pending for ever when nothing is in
    /// flight. Cancel-safe: the batch leaves only with its outcomes.
    pub(super) async fn landed(&mut self) -> (InFlight, Vec<Option<PublishOutcome>>) {
        let Some(front) = self.batches.front_mut() else {
            return std::future::pending().await;
        };
        let joined = (&mut front.task).await;
        let batch = self
            .batches
            .pop_front()
            .unwrap_or_else(|| unreachable!("the front batch was just awaited"));
        self.count(&batch.keys, false);
        let outcomes = match joined {
            Ok(outcomes) => outcomes,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Aborted: only by `Drop`, never seen here.
            Err(_) => batch.messages.iter().map(|_| None).collect(),
        };
        (batch, outcomes)
    }

    /// A message of `key` was parked by a failure: messages of the key in batches
    /// already launched are parked behind it.
    pub(super) fn failed(&mut self, key: &str) {
        self.failed.insert(key.to_owned(), self.launched);
    }

    /// Whether the message of `key` in batch `seq` was launched before a failure of
    /// its key was known (see [`failed`](Self::failed)).
    pub(super) fn parks_behind(&self, key: &str, seq: u64) -> bool {
        self.failed.get(key).is_some_and(|&last| seq <= last)
    }

    /// Forgets failures no batch in flight was launched before: only a batch launched
    /// at or before a failure parks behind it, so the failures remembered are those of
    /// keys in the batches in flight (at most `depth` batches' messages), however long
    /// the pipeline stays busy.
    pub(super) fn handled(&mut self) {
        match self.batches.front() {
            Some(oldest) => {
                let oldest = oldest.seq;
                self.failed.retain(|_, last| *last >= oldest);
            }
            None => self.failed.clear(),
        }
    }

    /// Takes every batch in flight out, oldest first (an outage: see `land`).
    pub(super) fn take_all(&mut self) -> Vec<InFlight> {
        self.failed.clear();
        if let Some(counts) = self.keys.as_mut() {
            counts.clear();
        }
        self.batches.drain(..).collect()
    }
}

impl InFlight {
    /// Waits for the batch's publish to come back, ignoring its outcomes.
    pub(super) async fn abandon(self) {
        if let Err(e) = self.task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        for b in &self.batches {
            b.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(pipeline: &mut Pipeline) {
        pipeline.push(
            Arc::from(Vec::new()),
            Arc::from(Vec::new()),
            Vec::new(),
            None,
            tokio::spawn(async { Vec::new() }),
        );
    }

    /// Under steady load the pipeline is never empty: a failure is forgotten once
    /// every batch launched before it was handled, so the failures remembered stay
    /// within what is in flight (here 4 batches, a new key failing in each of 10,000).
    #[tokio::test]
    async fn failures_are_forgotten_while_batches_stay_in_flight() {
        let mut pipeline = Pipeline::new(4, false);
        for _ in 0..3 {
            launch(&mut pipeline);
        }
        for i in 0..10_000 {
            launch(&mut pipeline);
            let (landed, _) = pipeline.landed().await;
            let key = format!("k{i}");
            pipeline.failed(&key);
            // Launched before the failure was known: parked behind it.
            assert!(pipeline.parks_behind(&key, landed.seq + 3));
            pipeline.handled();
            assert!(
                pipeline.failed.len() <= 4,
                "{} failures remembered after {} batches",
                pipeline.failed.len(),
                i + 1
            );
            assert!(!pipeline.is_empty());
        }
        // The last failure holds while a batch launched before it is in flight.
        let newest = pipeline.launched;
        assert!(pipeline.parks_behind("k9999", newest));
        assert!(!pipeline.parks_behind("k9999", newest + 1));
    }
}
