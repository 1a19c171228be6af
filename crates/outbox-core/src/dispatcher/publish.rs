//! One publisher call, bounded by the publisher's publish timeout and isolated from
//! panics, and the waves of per-key mode.
//!
//! Every function here returns one `Option<PublishOutcome>` per message, in the
//! messages' order (`None`: not attempted, released without charge), so an outcome can
//! only ever be paired with its own message.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;

use futures::FutureExt as _;
use tokio::time::Instant;
use tracing::{error, warn};

use super::Dispatcher;
use crate::error::{ErrorKind, PublishError};
use crate::message::OutboxMessage;
use crate::ordering::{OnDead, OrderKey, Ordering};
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::{OutboxStore, PoisonRow};

/// What one call of the publisher came to.
enum Call {
    Done(Vec<Option<PublishOutcome>>),
    TimedOut,
    Panicked(String),
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// Publishes `messages` in the configured order, under one deadline of the
    /// publisher's publish timeout. In per-key mode under [`OnDead::Block`] a message
    /// behind one of the claim's `poison` rows of its key is not published (`None`):
    /// the poison row goes `Dead` and blocks it.
    pub(super) async fn publish(
        &self,
        messages: &[OutboxMessage],
        poison: &[PoisonRow],
    ) -> Vec<Option<PublishOutcome>> {
        let deadline = self.publisher.publish_timeout().map(|t| Instant::now() + t);
        match self.config.ordering {
            Ordering::Unordered => self.publish_guarded(messages, deadline).await,
            Ordering::PerKey { on_dead } => {
                let mut dead_from: HashMap<OrderKey<'_>, i64> = HashMap::new();
                if on_dead == OnDead::Block {
                    for row in poison {
                        let seq = dead_from.entry(row.order_key()).or_insert(row.seq);
                        *seq = (*seq).min(row.seq);
                    }
                }
                let held =
                    |m: &OutboxMessage| dead_from.get(&m.order_key()).is_some_and(|&s| m.seq > s);
                if !messages.iter().any(held) {
                    return self.publish_in_waves(messages, on_dead, deadline).await;
                }
                let go: Vec<usize> = (0..messages.len())
                    .filter(|&i| !held(&messages[i]))
                    .collect();
                warn!(
                    held = messages.len() - go.len(),
                    "messages behind a poison row of their key are released, not published (OnDead::Block)"
                );
                let batch: Vec<OutboxMessage> = go.iter().map(|&i| messages[i].clone()).collect();
                let mut outcomes: Vec<Option<PublishOutcome>> =
                    messages.iter().map(|_| None).collect();
                let got = self.publish_in_waves(&batch, on_dead, deadline).await;
                for (i, outcome) in go.into_iter().zip(got) {
                    outcomes[i] = outcome;
                }
                outcomes
            }
        }
    }

    /// One `publish_batch` call, padded or cut to one outcome per message.
    async fn call(&self, messages: &[OutboxMessage], deadline: Option<Instant>) -> Call {
        let publish = AssertUnwindSafe(self.publisher.publish_batch(messages)).catch_unwind();
        let result = match deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, publish).await {
                Ok(result) => result,
                Err(_) => return Call::TimedOut,
            },
            None => publish.await,
        };
        match result {
            Ok(outcomes) => {
                if outcomes.len() != messages.len() {
                    warn!(
                        expected = messages.len(),
                        got = outcomes.len(),
                        "publisher broke its contract: outcome count differs; unmatched messages are released"
                    );
                }
                let mut outcomes: Vec<Option<PublishOutcome>> =
                    outcomes.into_iter().map(Some).collect();
                outcomes.resize_with(messages.len(), || None);
                Call::Done(outcomes)
            }
            Err(panic) => Call::Panicked(
                panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned()),
            ),
        }
    }

    /// Publishes `messages` in one call. A call that outlives the publish timeout is an
    /// outage of the whole batch. A call that panics is repeated one message at a time,
    /// so that only a message whose publish panics alone is judged for it (a
    /// permanent failure: it goes `Dead`), never the rest of its batch.
    pub(super) async fn publish_guarded(
        &self,
        messages: &[OutboxMessage],
        deadline: Option<Instant>,
    ) -> Vec<Option<PublishOutcome>> {
        let timed_out = || {
            let limit = self.publisher.publish_timeout().unwrap_or_default();
            Some(PublishOutcome::Transient(PublishError::unavailable(
                format!("the publisher gave no outcome within its publish timeout ({limit:?})"),
                None,
            )))
        };
        let panicked = |text: &str| {
            Some(PublishOutcome::Permanent(PublishError::Other {
                kind: ErrorKind::Permanent,
                message: format!("the publisher panicked on this message alone: {text}"),
                source: None,
            }))
        };
        match self.call(messages, deadline).await {
            Call::Done(outcomes) => outcomes,
            Call::TimedOut => messages.iter().map(|_| timed_out()).collect(),
            Call::Panicked(text) if messages.len() == 1 => vec![panicked(&text)],
            Call::Panicked(text) => {
                error!(
                    messages = messages.len(),
                    panic = %text,
                    "the publisher panicked on a batch: publishing its messages one at a time to find the poison message"
                );
                let mut outcomes = Vec::with_capacity(messages.len());
                for msg in messages {
                    outcomes.push(match self.call(std::slice::from_ref(msg), deadline).await {
                        Call::Done(mut one) => one.pop().flatten(),
                        Call::TimedOut => timed_out(),
                        Call::Panicked(text) => {
                            error!(id = %msg.id, panic = %text, "the publisher panics on this message alone: it is dead");
                            panicked(&text)
                        }
                    });
                }
                outcomes
            }
        }
    }

    /// Per-key mode: publishes `messages` (in `seq` order) in waves, the first message
    /// of every key, then the second, ..., awaiting every confirmation of a wave before
    /// the next, so a key never has a later message sent after an earlier one failed.
    /// A key stops at its first unpublished message (under [`OnDead::Skip`] a permanent
    /// failure does not stop it); an outage stops every key. `None` = not attempted.
    async fn publish_in_waves(
        &self,
        messages: &[OutboxMessage],
        on_dead: OnDead,
        deadline: Option<Instant>,
    ) -> Vec<Option<PublishOutcome>> {
        let mut waves: Vec<Vec<usize>> = Vec::new();
        {
            let mut depth: HashMap<OrderKey<'_>, usize> = HashMap::with_capacity(messages.len());
            for (i, m) in messages.iter().enumerate() {
                let d = depth.entry(m.order_key()).or_insert(0);
                if waves.len() <= *d {
                    waves.push(Vec::new());
                }
                waves[*d].push(i);
                *d += 1;
            }
        }
        if waves.len() == 1 {
            // Every key appears once: one pipelined publish, as in unordered mode.
            return self.publish_guarded(messages, deadline).await;
        }
        let mut outcomes: Vec<Option<PublishOutcome>> = messages.iter().map(|_| None).collect();
        let mut stopped: HashSet<OrderKey<'_>> = HashSet::new();
        for wave in waves {
            let go: Vec<usize> = wave
                .into_iter()
                .filter(|&i| !stopped.contains(&messages[i].order_key()))
                .collect();
            if go.is_empty() {
                continue;
            }
            let batch: Vec<OutboxMessage> = go.iter().map(|&i| messages[i].clone()).collect();
            let got = self.publish_guarded(&batch, deadline).await;
            let mut outage = false;
            for (&i, outcome) in go.iter().zip(got) {
                let keeps_going = match &outcome {
                    Some(PublishOutcome::Published) => true,
                    Some(PublishOutcome::Permanent(_)) => on_dead == OnDead::Skip,
                    Some(o) => {
                        outage |= o.is_outage();
                        false
                    }
                    None => false,
                };
                if !keeps_going {
                    stopped.insert(messages[i].order_key());
                }
                outcomes[i] = outcome;
            }
            if outage {
                break; // the broker cannot take messages: everything left is released
            }
        }
        outcomes
    }
}
