//! Publishing in the configured order: unordered, one guarded call (`publish`); per key,
//! waves (the first message of every key, then the second, ...), and under
//! [`OnDead::Block`] the messages behind a poison row of their key held back.
//!
//! Like `publish`, every function here returns one `Option<PublishOutcome>` per message,
//! in the messages' order (`None`: not attempted, released without charge).

use std::collections::{HashMap, HashSet};

use tokio::time::Instant;
use tracing::warn;

use super::Dispatcher;
use crate::message::OutboxMessage;
use crate::ordering::{OnDead, OrderKey, Ordering};
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::{OutboxStore, PoisonRow};

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
