//! One circuit per destination: a full queue or stream holds back only the messages
//! for it, while every other destination keeps flowing.
//!
//! A message's destination is its routing key (`routing_key`, else `event_type`): the
//! AMQP routing key on the exchange, the NATS subject under the prefix. The broker's
//! answer that it will not take a message for a reason of its own (AMQP `basic.nack`: a
//! queue at `x-max-length` with `reject-publish`; a JetStream error about the stream's
//! state: full with `discard: new`, no leader, store failed;
//! [`PublishError::Rejected`](crate::PublishError::Rejected)) opens that destination's
//! circuit. A broker-wide fault (no connection, no confirm in time, a memory alarm, a
//! frozen server) opens the dispatcher's own circuit instead (see `circuit`).
//!
//! While a destination's circuit is open its messages are not published: they are
//! handed back uncharged and held back until its next trial
//! ([`CompletionOutcome::Defer`](crate::CompletionOutcome::Defer)). When the trial is
//! due, one message of that destination is published alone; confirmed, the circuit
//! closes; refused again, the delay doubles (500 ms, 1 s, ... up to the probe cap,
//! 30 s by default).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::message::OutboxMessage;

/// The destination key of `msg`: its
/// [`effective_routing_key`](OutboxMessage::effective_routing_key).
pub(super) fn destination(msg: &OutboxMessage) -> &str {
    msg.effective_routing_key()
}

/// What to do with a message of a destination now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// The destination takes messages: publish.
    Go,
    /// Its circuit is open and a trial is due: publish this one message alone.
    Trial,
    /// Its circuit is open: hold it back for this long.
    Hold(Duration),
}

#[derive(Debug, Clone, Copy)]
struct Open {
    /// The current backoff.
    delay: Duration,
    /// When the next trial may go.
    next_trial: Instant,
}

/// The open destination circuits of a dispatcher.
#[derive(Debug)]
pub(super) struct Destinations {
    open: Mutex<HashMap<String, Open>>,
    initial: Duration,
    max: Duration,
}

impl Destinations {
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            open: Mutex::default(),
            initial,
            max,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Open>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether any destination's circuit is open.
    pub(super) fn any_open(&self) -> bool {
        !self.lock().is_empty()
    }

    /// Decides, in order, what to do with each of `messages` now: at most one trial per
    /// open destination whose trial is due (its next trial is then one delay away),
    /// the others of an open destination held back until its next trial.
    pub(super) fn admit(&self, messages: &[OutboxMessage]) -> Vec<Admit> {
        let mut open = self.lock();
        if open.is_empty() {
            return vec![Admit::Go; messages.len()];
        }
        let now = Instant::now();
        messages
            .iter()
            .map(|msg| match open.get_mut(destination(msg)) {
                None => Admit::Go,
                Some(state) if state.next_trial <= now => {
                    state.next_trial = now + state.delay;
                    Admit::Trial
                }
                Some(state) => Admit::Hold(state.next_trial - now),
            })
            .collect()
    }

    /// `dest` refused a message: opens its circuit, or (open already, e.g. a trial
    /// refused) doubles its delay, up to the cap. Returns how long to hold its messages
    /// back, and whether the circuit opened just now.
    pub(super) fn refused(&self, dest: &str) -> (Duration, bool) {
        let mut open = self.lock();
        let now = Instant::now();
        match open.get_mut(dest) {
            Some(state) => {
                state.delay = state.delay.saturating_mul(2).min(self.max);
                state.next_trial = now + state.delay;
                (state.delay, false)
            }
            None => {
                open.insert(
                    dest.to_owned(),
                    Open {
                        delay: self.initial,
                        next_trial: now + self.initial,
                    },
                );
                crate::metrics::destinations_open(open.len());
                (self.initial, true)
            }
        }
    }

    /// `dest` took a message: closes its circuit. Returns whether it was open.
    pub(super) fn accepted(&self, dest: &str) -> bool {
        let mut open = self.lock();
        let closed = open.remove(dest).is_some();
        if closed {
            crate::metrics::destinations_open(open.len());
        }
        closed
    }

    /// How long messages of `dest` are held back now (zero when its circuit is closed).
    pub(super) fn hold_for(&self, dest: &str) -> Duration {
        let now = Instant::now();
        self.lock().get(dest).map_or(Duration::ZERO, |s| {
            s.next_trial.saturating_duration_since(now)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{NewMessage, OutboxMessage};

    fn msg(event_type: &str) -> OutboxMessage {
        let m = NewMessage::builder("t", "1", event_type)
            .payload_json("{}")
            .build()
            .expect("valid");
        OutboxMessage::claimed_from(m, chrono::Utc::now())
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_destination_is_held_back_and_tried_one_message_at_a_time() {
        let d = Destinations::new(Duration::from_millis(500), Duration::from_secs(2));
        let (full, other) = (msg("Full"), msg("Other"));
        assert_eq!(
            d.admit(&[full.clone(), other.clone()]),
            [Admit::Go, Admit::Go]
        );
        assert_eq!(d.refused("Full"), (Duration::from_millis(500), true));
        assert!(d.any_open());
        assert_eq!(
            d.admit(&[full.clone(), other.clone()]),
            [Admit::Hold(Duration::from_millis(500)), Admit::Go],
            "only the refused destination is held back"
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(
            d.admit(&[full.clone(), full.clone(), other.clone()]),
            [
                Admit::Trial,
                Admit::Hold(Duration::from_millis(500)),
                Admit::Go
            ],
            "one trial when due, the rest held"
        );
        assert_eq!(
            d.refused("Full"),
            (Duration::from_secs(1), false),
            "a refused trial doubles the delay"
        );
        assert_eq!(d.refused("Full"), (Duration::from_secs(2), false));
        assert_eq!(d.refused("Full"), (Duration::from_secs(2), false), "capped");
        assert!(d.accepted("Full"), "a confirmed trial closes it");
        assert!(!d.any_open());
        assert_eq!(d.hold_for("Full"), Duration::ZERO);
        assert_eq!(
            d.refused("Full"),
            (Duration::from_millis(500), true),
            "reset"
        );
    }
}
