//! One circuit per destination: a full queue or stream holds back only the messages
//! for it, while every other destination keeps flowing.
//!
//! A message's destination is what its publisher names for its routing key
//! ([`EventPublisher::destination`](crate::EventPublisher::destination)): by default
//! the routing key itself (`routing_key`, else `event_type`; the AMQP routing key on
//! the exchange, the NATS subject under the prefix); the JetStream stream that refused
//! it (NATS); the queue an operator's routing-key pattern names (RabbitMQ). The broker's
//! answer that it will not take a message for a reason of its own (AMQP `basic.nack`: a
//! queue at `x-max-length` with `reject-publish`; a JetStream error about the stream's
//! state: full with `discard: new`, no leader, store failed;
//! [`PublishError::Rejected`](crate::PublishError::Rejected)) opens that destination's
//! circuit. A broker-wide fault (no connection, no confirm in time, a memory alarm, a
//! frozen server) opens the dispatcher's own circuit instead (see `circuit`).
//!
//! While a destination's circuit is open its messages are not published: they are
//! handed back uncharged and **held** ([`CompletionOutcome::Hold`]): out of every
//! claim's path, in the table, named by their destination, costing nothing while they
//! wait. When the circuit's trial is due (500 ms, 1 s, ... up to the probe cap, 30 s by
//! default), the dispatcher's trial task claims one held row of it
//! ([`OutboxStore::claim_held`]) and publishes it alone: confirmed, the circuit closes
//! and its held rows are released in chunks of [`RELEASE_CHUNK`]
//! ([`OutboxStore::release_held`]); refused again, the delay doubles.
//!
//! Bounds, as the PostgreSQL WAL relay's (`park.rs`): at most [`MAX_CIRCUITS`] circuits
//! are kept in memory; the table holds the rest (the held rows name them) and they are
//! brought in, in turn, as room frees up ([`OutboxStore::held_destinations`], also how a
//! relay that restarts finds the circuits of its predecessor). A circuit whose trial
//! finds nothing held is forgotten. Refused trials are limited to
//! [`TRIALS_PER_SECOND`] over all circuits (a confirmed trial gives its turn back and
//! one more, so trials speed up while destinations take messages again).
//!
//! [`CompletionOutcome::Hold`]: crate::CompletionOutcome::Hold
//! [`OutboxStore::claim_held`]: crate::OutboxStore::claim_held
//! [`OutboxStore::release_held`]: crate::OutboxStore::release_held
//! [`OutboxStore::held_destinations`]: crate::OutboxStore::held_destinations

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, warn};

use std::borrow::Cow;

/// Most open destination circuits a dispatcher keeps in memory. Beyond them the table
/// holds the circuits (each held row names its destination): they are tried in turn
/// as room frees up, and a refused trial gives its room to the next one while others
/// wait.
pub const MAX_CIRCUITS: usize = 1_000;

/// Refused trials per second, over every destination circuit of a dispatcher.
pub const TRIALS_PER_SECOND: f64 = 10.0;

/// Held rows released per statement once a destination's trial is confirmed.
pub const RELEASE_CHUNK: usize = 1_000;

/// What to do with a message of a destination now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// The destination takes messages: publish.
    Go,
    /// Its circuit is open: hold it until the destination's trial succeeds.
    Hold,
}

#[derive(Debug, Clone, Copy)]
struct Open {
    /// The current backoff.
    delay: Duration,
    /// When the next trial may go.
    next_trial: Instant,
}

#[derive(Debug)]
struct State {
    /// Open circuits, at most [`MAX_CIRCUITS`].
    open: HashMap<String, Open>,
    /// Whether the table may hold destinations not in `open` (at a start: unknown).
    unmapped: bool,
    /// The last destination brought in from the table (the next ones come after it).
    adopted: String,
    /// When the table was last looked over to the end.
    scanned: Option<Instant>,
    /// Closed circuits whose held rows are being released, at most [`MAX_CIRCUITS`].
    releasing: Vec<String>,
    /// Trials allowed now (see [`TRIALS_PER_SECOND`]), and when last refilled.
    tokens: f64,
    refilled: Instant,
}

/// The destination circuits of a dispatcher.
#[derive(Debug)]
pub(super) struct Destinations {
    state: Mutex<State>,
    initial: Duration,
    max: Duration,
    /// Most trials in a burst.
    burst: f64,
    /// Wakes the trial task (a circuit opened, a trial confirmed).
    wake: Notify,
}

impl Destinations {
    /// `initial`, `max`: the first and the longest delay between a circuit's trials;
    /// `batch_size`: the most trials in a burst.
    pub(super) fn new(initial: Duration, max: Duration, batch_size: usize) -> Self {
        #[allow(clippy::cast_precision_loss)] // reason: a batch size, far below 2^52
        let burst = (batch_size as f64).max(TRIALS_PER_SECOND);
        Self {
            state: Mutex::new(State {
                open: HashMap::new(),
                unmapped: true,
                adopted: String::new(),
                scanned: None,
                releasing: Vec::new(),
                tokens: TRIALS_PER_SECOND,
                refilled: Instant::now(),
            }),
            initial,
            max,
            burst,
            wake: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether any destination's circuit is open (in memory).
    pub(super) fn any_open(&self) -> bool {
        !self.lock().open.is_empty()
    }

    /// How many circuits are open in memory.
    pub(super) fn open_count(&self) -> usize {
        self.lock().open.len()
    }

    /// Decides, in order, what to do with each message of `destinations` now: held
    /// when its destination's circuit is open.
    pub(super) fn admit(&self, destinations: &[Cow<'_, str>]) -> Vec<Admit> {
        let s = self.lock();
        if s.open.is_empty() {
            return vec![Admit::Go; destinations.len()];
        }
        destinations
            .iter()
            .map(|dest| {
                if s.open.contains_key(dest.as_ref()) {
                    Admit::Hold
                } else {
                    Admit::Go
                }
            })
            .collect()
    }

    /// `dest` refused a message: opens its circuit, or (open already, e.g. a trial
    /// refused) doubles its delay, up to the cap. Returns the delay to its next trial
    /// and whether the circuit opened just now. With [`MAX_CIRCUITS`] open already, a
    /// new one is left to the table (its held rows) and found later.
    pub(super) fn refused(&self, dest: &str) -> (Duration, bool) {
        let mut s = self.lock();
        let now = Instant::now();
        s.releasing.retain(|c| c != dest);
        if let Some(state) = s.open.get_mut(dest) {
            state.delay = state.delay.saturating_mul(2).min(self.max);
            state.next_trial = now + state.delay;
            return (state.delay, false);
        }
        if s.open.len() >= MAX_CIRCUITS {
            s.unmapped = true;
            return (self.initial, false);
        }
        s.open.insert(
            dest.to_owned(),
            Open {
                delay: self.initial,
                next_trial: now + self.initial,
            },
        );
        crate::metrics::destinations_open(s.open.len());
        drop(s);
        self.wake.notify_one();
        (self.initial, true)
    }

    /// A refused trial of `dest` (its delay doubled by [`refused`](Self::refused)):
    /// while other circuits wait in the table for room, it leaves memory (its rows stay
    /// held) and the next one comes in.
    pub(super) fn rotate(&self, dest: &str) {
        let mut s = self.lock();
        if s.unmapped && s.open.len() >= MAX_CIRCUITS {
            s.open.remove(dest);
            crate::metrics::destinations_open(s.open.len());
        }
    }

    /// `dest` took a message: closes its circuit, and (when `trial`, or when it was
    /// open) queues its held rows for release. Returns whether it was open.
    pub(super) fn accepted(&self, dest: &str, trial: bool) -> bool {
        let mut s = self.lock();
        let closed = s.open.remove(dest).is_some();
        if closed {
            crate::metrics::destinations_open(s.open.len());
        }
        if (closed || trial) && !s.releasing.iter().any(|c| c == dest) {
            if s.releasing.len() < MAX_CIRCUITS {
                s.releasing.push(dest.to_owned());
            } else {
                // Its rows stay held: found in the table and tried again later.
                s.unmapped = true;
            }
        }
        drop(s);
        if closed || trial {
            self.wake.notify_one();
        }
        closed
    }

    /// Refills the trials' turns and returns how many are left.
    fn turns(&self, s: &mut State) -> f64 {
        let now = Instant::now();
        let refill = now.duration_since(s.refilled).as_secs_f64() * TRIALS_PER_SECOND;
        s.tokens = (s.tokens + refill).min(self.burst);
        s.refilled = now;
        s.tokens
    }

    /// A confirmed trial: its turn back, and one more.
    pub(super) fn trial_confirmed(&self) {
        let mut s = self.lock();
        s.tokens = (s.tokens + 2.0).min(self.burst);
    }

    /// The open circuits whose trial is due, longest due first, as many as trials may
    /// go now (each takes a turn and its next trial is one delay away); and how long
    /// until the next trial may go (a circuit's, or the next turn while more are due).
    pub(super) fn due_trials(&self) -> (Vec<String>, Option<Duration>) {
        let mut s = self.lock();
        let now = Instant::now();
        let mut due: Vec<(Instant, String)> = Vec::new();
        let mut next: Option<Duration> = None;
        for (c, open) in &s.open {
            if open.next_trial <= now {
                due.push((open.next_trial, c.clone()));
            } else {
                let d = open.next_trial - now;
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        due.sort_unstable();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        // reason: turns are 0..=a batch
        let turns = self.turns(&mut s).floor() as usize;
        if due.len() > turns {
            due.truncate(turns);
            let turn = Duration::from_secs_f64(1.0 / TRIALS_PER_SECOND);
            next = Some(next.map_or(turn, |n| n.min(turn)));
        }
        #[allow(clippy::cast_precision_loss)] // reason: at most a batch
        {
            s.tokens -= due.len() as f64;
        }
        let due: Vec<String> = due.into_iter().map(|(_, c)| c).collect();
        for c in &due {
            if let Some(open) = s.open.get_mut(c) {
                open.next_trial = now + open.delay;
            }
        }
        (due, next)
    }

    /// A circuit whose trial found nothing held (or nothing it may try now, in per-key
    /// order): it is forgotten. Rows held for it meanwhile are found in the table.
    pub(super) fn forget(&self, dest: &str) {
        let mut s = self.lock();
        if s.open.remove(dest).is_some() {
            debug!(
                destination = dest,
                "an open destination circuit holds nothing: forgotten"
            );
            crate::metrics::destinations_open(s.open.len());
        }
    }

    /// The closed circuits whose held rows are being released.
    pub(super) fn releasing(&self) -> Vec<String> {
        self.lock().releasing.clone()
    }

    /// Every held row of `dest` is released. The table is looked over again soon: rows
    /// held for it while the release ran (a batch in flight) are found there.
    pub(super) fn released(&self, dest: &str) {
        let mut s = self.lock();
        s.releasing.retain(|c| c != dest);
        s.unmapped = true;
    }

    /// When destinations may wait in the table beyond those in memory (or the last full
    /// look is older than `rescan`) and there is room: the room, the destinations known
    /// (in memory or being released), and the name after which to look.
    pub(super) fn adoption(&self, rescan: Duration) -> Option<(usize, HashSet<String>, String)> {
        let mut s = self.lock();
        if s.scanned.is_none_or(|at| at.elapsed() >= rescan) {
            s.unmapped = true;
        }
        if !s.unmapped || s.open.len() >= MAX_CIRCUITS {
            return None;
        }
        let known = s.open.keys().chain(&s.releasing).cloned().collect();
        Some((MAX_CIRCUITS - s.open.len(), known, s.adopted.clone()))
    }

    /// Destinations `found` in the table come into memory, their trial due; the next
    /// look starts after `last` (`None`: from the first again). `all`: the look went
    /// over every destination of the table.
    pub(super) fn adopted(&self, found: Vec<String>, last: Option<String>, all: bool) {
        let mut s = self.lock();
        let now = Instant::now();
        let before = s.open.len();
        for c in found {
            if s.open.len() >= MAX_CIRCUITS {
                break;
            }
            s.open.entry(c).or_insert(Open {
                delay: self.initial,
                next_trial: now,
            });
        }
        if s.open.len() > before {
            warn!(
                circuits = s.open.len() - before,
                "destinations hold messages (held by this relay or another before): their trials are due"
            );
        }
        crate::metrics::destinations_open(s.open.len());
        s.adopted = last.unwrap_or_default();
        if all {
            s.scanned = Some(now);
            if s.open.len() < MAX_CIRCUITS {
                s.unmapped = false;
            }
        }
    }

    /// Resolves when a circuit opened or a trial was confirmed since the last call.
    pub(super) async fn woken(&self) {
        self.wake.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(routing_key: &str) -> Cow<'_, str> {
        Cow::Borrowed(routing_key)
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_destination_is_held_and_tried_after_its_delay() {
        let d = Destinations::new(Duration::from_millis(500), Duration::from_secs(2), 10);
        let (full, other) = (msg("Full"), msg("Other"));
        assert_eq!(
            d.admit(&[full.clone(), other.clone()]),
            [Admit::Go, Admit::Go]
        );
        assert_eq!(d.refused("Full"), (Duration::from_millis(500), true));
        assert!(d.any_open());
        assert_eq!(
            d.admit(&[full.clone(), other.clone()]),
            [Admit::Hold, Admit::Go],
            "only the refused destination is held"
        );
        assert!(d.due_trials().0.is_empty(), "not due yet");
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(d.due_trials().0, ["Full"], "its trial is due");
        assert!(d.due_trials().0.is_empty(), "one trial per delay");
        assert_eq!(
            d.refused("Full"),
            (Duration::from_secs(1), false),
            "a refused trial doubles the delay"
        );
        assert_eq!(d.refused("Full"), (Duration::from_secs(2), false));
        assert_eq!(d.refused("Full"), (Duration::from_secs(2), false), "capped");
        assert!(d.accepted("Full", true), "a confirmed trial closes it");
        assert_eq!(d.releasing(), ["Full"], "and releases its held rows");
        assert!(!d.any_open());
        d.released("Full");
        assert!(d.releasing().is_empty());
        assert_eq!(
            d.refused("Full"),
            (Duration::from_millis(500), true),
            "reset"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn circuits_are_bounded_and_trials_rate_limited() {
        let d = Destinations::new(Duration::from_millis(500), Duration::from_secs(30), 10);
        let _ = d.adoption(Duration::from_secs(30));
        d.adopted(Vec::new(), None, true);
        for i in 0..MAX_CIRCUITS + 5 {
            d.refused(&format!("k{i}"));
        }
        assert_eq!(d.open_count(), MAX_CIRCUITS, "bounded");
        assert!(
            d.adoption(Duration::from_secs(30)).is_none(),
            "no room: the rest waits in the table"
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        let (due, next) = d.due_trials();
        assert_eq!(due.len(), 10, "a burst of trials at most");
        assert_eq!(next, Some(Duration::from_millis(100)), "the next turn");
        assert!(d.due_trials().0.is_empty(), "no turn left");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(d.due_trials().0.len(), 10, "ten a second");
        // A refused trial leaves memory while others wait in the table.
        let first = due[0].clone();
        d.refused(&first);
        d.rotate(&first);
        assert_eq!(d.open_count(), MAX_CIRCUITS - 1);
        let (room, known, _) = d.adoption(Duration::from_secs(30)).expect("room");
        assert_eq!(room, 1);
        assert!(!known.contains(&first));
        d.forget("k1");
        assert_eq!(d.open_count(), MAX_CIRCUITS - 2, "forgotten");
    }
}
