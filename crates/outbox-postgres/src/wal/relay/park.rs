//! Parking: what the stream cannot publish now leaves the stream, so that nothing
//! else waits for it.
//!
//! A message whose destination refuses it (a full queue or stream), whose publish
//! failed transiently and is to be retried after a backoff, or whose `visible_at` is
//! still ahead (a delayed message) is *parked*: its row is set to `Processing` with
//! `lease_until` at the time it may be tried again and no claim token, in the same
//! statements that record the rest of the batch. The slot's position then moves past
//! it like past a published message: the table, not the WAL, holds it from now on.
//! Later messages of its ordering key (the `order_key` column: the partition key, else
//! the aggregate) are parked behind it, so a key never overtakes itself; messages of
//! other keys and destinations go on.
//!
//! A key's first parked row is its *head* and carries `parked_until` (migration 12):
//! when it is due by the database's clock, or `infinity` while a circuit holds it back
//! (`parked_for` names the circuit). Rows behind a head carry neither: they go with it.
//! So the *sweeper* ([`WalRelay::sweep`]), which runs beside the stream in the same
//! session (only the relay that reads the slot sweeps), walks only due heads, in the
//! order they came due (an index), never the rows waiting behind a head that is not
//! due, and publishes each due key's rows in `seq` order, never while the stream holds
//! an earlier message of that key. When a head leaves (published or dead), the same
//! transaction flags its key's next parked row. A row parked behind a head that left
//! meanwhile flags itself: the statement that parks it waits for the sweeper's
//! transaction on the head (`FOR SHARE`) and looks again.
//!
//! A destination that refused gets a circuit like the polling relay's: its heads wait
//! (`parked_for`) for a trial (one message alone, after 500 ms, doubling up to the
//! probe cap), found by its own lookup; confirmed, the circuit closes and its heads
//! are released (due now), refused, the delay doubles. At most [`MAX_CIRCUITS`]
//! circuits are kept in memory (the table holds the rest, found again in turn), and
//! refused trials are limited to [`TRIALS_PER_SECOND`]. A parked row is an ordinary
//! expired lease for every other tool: `outbox stats` counts it as processing, and the
//! polling relay would reclaim it.
//!
//! The stream decides whether a key waits from the table (one indexed lookup per
//! batch, with the batch's visibility check, while anything may be parked) and the
//! rows it parked itself that no lookup has seen yet: no map grows with the number of
//! parked keys.
//!
//! Crash loops: each claim of the sweeper counts in `unfinished_alone`; a claim that
//! finds a row counted already (its last publish ended with the relay) publishes one
//! row at a time, and a row claimed more than the crash-loop limit times without an
//! outcome goes `Dead`.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use outboxkit_core::{EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::WalRelay;
use super::record::Outcomes;

/// Most open circuits a session keeps in memory. Beyond them, the table holds the
/// circuits (`parked_for`): they are tried in turn as room frees up, and a refused
/// trial gives its room to the next one while others wait.
pub(super) const MAX_CIRCUITS: usize = 1_000;
/// Refused trials per second, over every circuit: a confirmed trial gives its turn
/// back and one more (up to a batch), so trials speed up while destinations take
/// messages again.
pub(super) const TRIALS_PER_SECOND: f64 = 10.0;

/// The ordering key as the `order_key` column encodes it (migration 0003):
/// `p:<partition key>`, else `a:<length of aggregate type in characters>:<aggregate
/// type>:<aggregate id>`.
pub(super) fn order_key(m: &OutboxMessage) -> String {
    match &m.partition_key {
        Some(p) => format!("p:{p}"),
        None => format!(
            "a:{}:{}:{}",
            m.aggregate_type.chars().count(),
            m.aggregate_type,
            m.aggregate_id
        ),
    }
}

/// A message the stream or the sweeper leaves in the table for later.
#[derive(Debug, Clone)]
pub(super) struct ParkedRow {
    pub(super) id: Uuid,
    /// Its ordering key.
    pub(super) key: String,
    /// Not before this long from now (and never before its `visible_at`).
    pub(super) delay: Duration,
    /// Whether the attempt counts (a transient failure), or not (a refusal, a delay).
    pub(super) charge: bool,
    pub(super) error: Option<String>,
    /// The circuit that holds it back: as a head it waits for that circuit's trial
    /// rather than for a time.
    pub(super) held_for: Option<String>,
}

impl ParkedRow {
    /// Parked behind its key's earlier parked row (or, as a head, due at once).
    pub(super) fn behind(id: Uuid, key: &str) -> Self {
        Self {
            id,
            key: key.to_owned(),
            delay: Duration::ZERO,
            charge: false,
            error: None,
            held_for: None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Open {
    delay: Duration,
    next_trial: Instant,
}

/// Whether a message of a destination may be published now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    Go,
    /// Held back: its circuit is open. The circuit's trial is due in this long.
    Hold(Duration),
    /// The circuit is open and its trial is due (the sweeper's).
    Trial,
}

#[derive(Debug)]
struct State {
    /// Keys of rows the stream parked whose recording has not ended, and how many.
    /// Bounded by the rows the stream has in flight.
    unrecorded: HashMap<String, usize>,
    /// Keys of rows the stream parked and recorded since the last key lookup began
    /// (that lookup may not have seen them). Bounded likewise.
    recorded: HashSet<String>,
    /// Whether the table may hold parked rows: the stream then looks its batches'
    /// keys up. Unknown (true) at a session's start.
    table_parked: bool,
    /// Rows the stream decided to park, ever (see [`Parked::no_heads`]).
    parks: u64,
    /// Keys of the messages the stream is publishing. Bounded by the batches in flight.
    in_stream: HashMap<String, usize>,
    /// Keys the sweeper left alone because the stream holds them: their leaving wakes
    /// it. A subset of `in_stream`'s.
    waited_on: HashSet<String>,
    /// Open circuits, at most [`MAX_CIRCUITS`].
    circuits: HashMap<String, Open>,
    /// Whether the table may hold heads of circuits not in `circuits`.
    unmapped: bool,
    /// Closed circuits whose heads are being released, at most [`MAX_CIRCUITS`].
    releasing: Vec<String>,
    /// The last circuit brought in from the table (the next ones come after it).
    adopted: String,
    /// Trials allowed now (see [`TRIALS_PER_SECOND`]), and when last refilled.
    trial_tokens: f64,
    refilled: Instant,
    /// When the sweeper wakes by itself; `None` while it works.
    sweeper_wakes: Option<Instant>,
}

/// What the stream and the sweeper of one session share.
#[derive(Debug)]
pub(super) struct Parked {
    state: Mutex<State>,
    wake: Notify,
    initial: Duration,
    max: Duration,
    /// Most trials in a burst (a batch).
    trial_burst: f64,
}

impl Parked {
    /// `max`: the longest delay between a circuit's trials; `batch_size`: the most
    /// trials in a burst.
    pub(super) fn new(max: Duration, batch_size: usize) -> Self {
        #[allow(clippy::cast_precision_loss)] // reason: a batch size, far below 2^52
        let trial_burst = (batch_size as f64).max(TRIALS_PER_SECOND);
        Self {
            state: Mutex::new(State {
                unrecorded: HashMap::new(),
                recorded: HashSet::new(),
                table_parked: true,
                parks: 0,
                in_stream: HashMap::new(),
                waited_on: HashSet::new(),
                circuits: HashMap::new(),
                unmapped: true,
                releasing: Vec::new(),
                adopted: String::new(),
                trial_tokens: TRIALS_PER_SECOND,
                refilled: Instant::now(),
                sweeper_wakes: None,
            }),
            wake: Notify::new(),
            initial: Duration::from_millis(500),
            max,
            trial_burst,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a batch's keys must be looked up in the table before it is published
    /// (something may be parked); the lookup then begins, and covers every park
    /// recorded so far.
    pub(super) fn begin_lookup(&self) -> bool {
        let mut s = self.lock();
        let needed = s.table_parked || !s.unrecorded.is_empty() || !s.recorded.is_empty();
        s.recorded.clear();
        needed
    }

    /// Whether parked rows of `key` wait, by the batch's lookup (`waiting`: the keys
    /// the table has heads of) and what the stream parked since: then its next message
    /// is parked behind them.
    pub(super) fn key_waits(&self, key: &str, waiting: &HashSet<String>) -> bool {
        if waiting.contains(key) {
            return true;
        }
        let s = self.lock();
        s.unrecorded.contains_key(key) || s.recorded.contains(key)
    }

    /// Counts a row of `key` that the stream parks (recorded later).
    pub(super) fn park_key(&self, key: &str) {
        let mut s = self.lock();
        *s.unrecorded.entry(key.to_owned()).or_default() += 1;
        s.table_parked = true;
        s.parks += 1;
    }

    /// The stream's parked rows of `keys` are recorded.
    pub(super) fn recorded<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut s = self.lock();
        for k in keys {
            if let Some(c) = s.unrecorded.get_mut(k) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    s.unrecorded.remove(k);
                }
            }
            s.recorded.insert(k.to_owned());
        }
    }

    /// The stream's parks so far (see [`no_heads`](Self::no_heads)).
    pub(super) fn parks(&self) -> u64 {
        self.lock().parks
    }

    /// The sweeper found no head in the table, looking after `parks` parks of the
    /// stream: unless the stream parked more since, nothing is parked and batches need
    /// no lookup.
    pub(super) fn no_heads(&self, parks: u64) {
        let mut s = self.lock();
        if s.parks == parks && s.unrecorded.is_empty() && s.recorded.is_empty() {
            s.table_parked = false;
        }
    }

    /// A head is due in `d`: wakes the sweeper if it would sleep longer.
    pub(super) fn due_in(&self, d: Duration) {
        let wakes = self.lock().sweeper_wakes;
        if wakes.is_none_or(|w| Instant::now() + d < w) {
            self.wake.notify_one();
        }
    }

    /// Registers keys of messages the stream publishes: the sweeper leaves those keys
    /// alone until [`leave_stream`](Self::leave_stream).
    pub(super) fn enter_stream<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut s = self.lock();
        for k in keys {
            *s.in_stream.entry(k.to_owned()).or_default() += 1;
        }
    }

    /// Unregisters keys of the stream's messages that were recorded; wakes the
    /// sweeper if it waits for one of them.
    pub(super) fn leave_stream<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut s = self.lock();
        let mut wake = false;
        for k in keys {
            if let Some(c) = s.in_stream.get_mut(k) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    s.in_stream.remove(k);
                    wake |= s.waited_on.remove(k);
                }
            }
        }
        drop(s);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Unregisters every key of the stream (its batch is over, however it ended).
    pub(super) fn clear_stream(&self) {
        let mut s = self.lock();
        s.in_stream.clear();
        let wake = !s.waited_on.is_empty();
        s.waited_on.clear();
        drop(s);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Which of `keys` the stream holds; the sweeper is woken when they leave.
    pub(super) fn held_by_stream<'a>(
        &self,
        keys: impl Iterator<Item = &'a str>,
    ) -> HashSet<String> {
        let mut s = self.lock();
        let held: HashSet<String> = keys
            .filter(|k| s.in_stream.contains_key(*k))
            .map(str::to_owned)
            .collect();
        s.waited_on.extend(held.iter().cloned());
        held
    }

    /// Whether any circuit is open (in memory).
    pub(super) fn any_open(&self) -> bool {
        !self.lock().circuits.is_empty()
    }

    /// Whether a message of circuit `circuit` may be published now.
    pub(super) fn admit(&self, circuit: &str) -> Admit {
        match self.lock().circuits.get(circuit) {
            None => Admit::Go,
            Some(open) => {
                let now = Instant::now();
                if open.next_trial <= now {
                    Admit::Trial
                } else {
                    Admit::Hold(open.next_trial - now)
                }
            }
        }
    }

    /// `m` (of ordering `key`) was refused by its destination (`outcome`): its
    /// `circuit` opens or its delay doubles (see [`refused`](Self::refused)), and `m`
    /// is to be parked for the circuit's trial, uncharged.
    pub(super) fn refusal(
        &self,
        m: &OutboxMessage,
        circuit: &str,
        key: &str,
        outcome: &PublishOutcome,
    ) -> ParkedRow {
        let delay = self.refused(circuit);
        outboxkit_core::metrics::deferred(&m.event_type);
        ParkedRow {
            id: m.id,
            key: key.to_owned(),
            delay,
            charge: false,
            error: Some(outcome_text(outcome)),
            held_for: Some(circuit.to_owned()),
        }
    }

    /// `circuit` refused a message: it opens, or its delay doubles. Returns how long
    /// its messages are held back. With [`MAX_CIRCUITS`] open already, a new one is
    /// left to the table (its heads' `parked_for`) and found later.
    pub(super) fn refused(&self, circuit: &str) -> Duration {
        let mut s = self.lock();
        let delay = match s.circuits.get(circuit) {
            Some(open) => (open.delay * 2).min(self.max),
            None => {
                if s.circuits.len() >= MAX_CIRCUITS {
                    s.unmapped = true;
                    return self.initial;
                }
                warn!(
                    circuit,
                    "a destination refuses messages: its messages are parked, the others go on"
                );
                self.initial
            }
        };
        s.circuits.insert(
            circuit.to_owned(),
            Open {
                delay,
                next_trial: Instant::now() + delay,
            },
        );
        // Closed and refusing again: its heads stay held.
        s.releasing.retain(|c| c != circuit);
        outboxkit_core::metrics::destinations_open(s.circuits.len());
        drop(s);
        self.due_in(delay);
        delay
    }

    /// `circuit`'s trial was confirmed: it closes, and its heads are released.
    pub(super) fn took(&self, circuit: &str) {
        let mut s = self.lock();
        if s.circuits.remove(circuit).is_some() {
            info!(circuit, "the destination takes messages again");
            outboxkit_core::metrics::destinations_open(s.circuits.len());
        }
        if s.releasing.len() < MAX_CIRCUITS && !s.releasing.iter().any(|c| c == circuit) {
            s.releasing.push(circuit.to_owned());
        } else {
            // Its heads stay held: found in the table and tried again later.
            s.unmapped = true;
        }
    }

    /// A refused trial of `circuit`: its delay doubled (by [`refused`](Self::refused)).
    /// While other circuits wait in the table for room, it leaves memory (its heads
    /// stay held in the table) and the next one comes in.
    pub(super) fn rotate(&self, circuit: &str) {
        let mut s = self.lock();
        if s.unmapped && s.circuits.len() >= MAX_CIRCUITS {
            s.circuits.remove(circuit);
            outboxkit_core::metrics::destinations_open(s.circuits.len());
        }
    }

    /// Refills the trials' turns (see [`TRIALS_PER_SECOND`]) and returns how many are
    /// left.
    fn trial_turns(&self, s: &mut State) -> f64 {
        let now = Instant::now();
        let refill = now.duration_since(s.refilled).as_secs_f64() * TRIALS_PER_SECOND;
        s.trial_tokens = (s.trial_tokens + refill).min(self.trial_burst);
        s.refilled = now;
        s.trial_tokens
    }

    /// Takes a trial's turn, if one is left.
    pub(super) fn take_trial(&self) -> bool {
        let mut s = self.lock();
        if self.trial_turns(&mut s) >= 1.0 {
            s.trial_tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// A confirmed trial: its turn back, and one more.
    pub(super) fn trial_confirmed(&self) {
        let mut s = self.lock();
        s.trial_tokens = (s.trial_tokens + 2.0).min(self.trial_burst);
    }

    /// The open circuits whose trial is due, longest due first, as many as trials may
    /// go now; and how long until the next trial may go (a circuit's, or the next
    /// turn while more are due).
    pub(super) fn due_trials(&self) -> (Vec<String>, Option<Duration>) {
        let mut s = self.lock();
        let now = Instant::now();
        let mut due: Vec<(Instant, &String)> = Vec::new();
        let mut next: Option<Duration> = None;
        for (c, open) in &s.circuits {
            if open.next_trial <= now {
                due.push((open.next_trial, c));
            } else {
                let d = open.next_trial - now;
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        due.sort_unstable();
        let mut due: Vec<String> = due.into_iter().map(|(_, c)| c.clone()).collect();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        // reason: turns are 0..=a batch
        let turns = self.trial_turns(&mut s).floor() as usize;
        if due.len() > turns {
            due.truncate(turns);
            let turn = Duration::from_secs_f64(1.0 / TRIALS_PER_SECOND);
            next = Some(next.map_or(turn, |n| n.min(turn)));
        }
        (due, next)
    }

    /// A circuit whose trial found nothing held: it is forgotten.
    pub(super) fn forget(&self, circuit: &str) {
        let mut s = self.lock();
        if s.circuits.remove(circuit).is_some() {
            debug!(circuit, "an open circuit holds nothing: forgotten");
            outboxkit_core::metrics::destinations_open(s.circuits.len());
        }
        // Parks of the stream for it may be on their way to the table.
        s.unmapped = true;
    }

    /// A trial of `circuit` goes now: the next one not before its delay.
    pub(super) fn trying(&self, circuit: &str) {
        if let Some(open) = self.lock().circuits.get_mut(circuit) {
            open.next_trial = Instant::now() + open.delay;
        }
    }

    /// The sweeper works (a head parked meanwhile wakes it again at once).
    pub(super) fn sweeper_works(&self) {
        self.lock().sweeper_wakes = None;
    }

    /// The sweeper sleeps for `wait` unless woken.
    pub(super) async fn sweeper_sleeps(&self, wait: Duration) {
        self.lock().sweeper_wakes = Some(Instant::now() + wait);
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = self.wake.notified() => {}
        }
    }

    /// How many keys the stream holds.
    pub(super) fn in_stream(&self) -> usize {
        self.lock().in_stream.len()
    }

    /// The closed circuits whose heads are being released.
    pub(super) fn releasing(&self) -> Vec<String> {
        self.lock().releasing.clone()
    }

    /// Every head of `circuits` is released.
    pub(super) fn released(&self, circuits: &[String]) {
        self.lock().releasing.retain(|c| !circuits.contains(c));
    }

    /// When circuits may wait in the table beyond those in memory and there is room:
    /// the room, the circuits known (in memory or being released), and the name after
    /// which to look.
    pub(super) fn adoption(&self) -> Option<(usize, HashSet<String>, String)> {
        let s = self.lock();
        if !s.unmapped || s.circuits.len() >= MAX_CIRCUITS {
            return None;
        }
        let known = s.circuits.keys().chain(&s.releasing).cloned().collect();
        Some((MAX_CIRCUITS - s.circuits.len(), known, s.adopted.clone()))
    }

    /// Circuits `found` in the table (`parked_for`) come into memory, their trial due;
    /// the next look starts after `last` (`None`: from the first again). `all`: the
    /// look went over every circuit of the table.
    pub(super) fn adopted(&self, found: Vec<String>, last: Option<String>, all: bool) {
        let mut s = self.lock();
        let now = Instant::now();
        for c in found {
            if s.circuits.len() >= MAX_CIRCUITS {
                break;
            }
            s.circuits.entry(c).or_insert(Open {
                delay: self.initial,
                next_trial: now,
            });
        }
        outboxkit_core::metrics::destinations_open(s.circuits.len());
        s.adopted = last.unwrap_or_default();
        if all && s.circuits.len() < MAX_CIRCUITS {
            s.unmapped = false;
        }
    }
}
impl<P: EventPublisher> WalRelay<P> {
    /// A transient failure of `m` (of ordering `key`): parked for a retry after its
    /// event type's backoff (charged), or dead when its attempts are exhausted (pushed
    /// to `out.dead`).
    pub(super) fn retry_or_dead(
        &self,
        m: &OutboxMessage,
        key: &str,
        error: &PublishError,
        out: &mut Outcomes,
    ) -> Option<ParkedRow> {
        outboxkit_core::metrics::publish_failed(error.kind(), &m.event_type);
        let attempts = u32::try_from(m.attempts).unwrap_or(0) + 1;
        let policy = self.config.retry.for_event_type(&m.event_type);
        if policy.should_retry(attempts) {
            outboxkit_core::metrics::retried(&m.event_type);
            debug!(id = %m.id, attempts, error = %error, "publish failed, will retry");
            Some(ParkedRow {
                delay: policy.delay(attempts),
                charge: true,
                error: Some(error.to_string()),
                ..ParkedRow::behind(m.id, key)
            })
        } else {
            outboxkit_core::metrics::dead(&m.event_type);
            warn!(id = %m.id, event_type = %m.event_type, attempts, error = %error, "attempts exhausted, message is dead");
            out.dead.push((
                m.id,
                format!(
                    "attempts exhausted ({attempts}/{}): {error}",
                    policy.max_attempts()
                ),
            ));
            None
        }
    }
}

/// A verdict about `m` itself (unroutable, oversized, invalid): dead at once.
pub(super) fn dead_for_good(m: &OutboxMessage, e: &PublishError, out: &mut Outcomes) {
    outboxkit_core::metrics::publish_failed(e.kind(), &m.event_type);
    outboxkit_core::metrics::dead(&m.event_type);
    warn!(id = %m.id, event_type = %m.event_type, error = %e, "permanent publish failure, message is dead");
    out.dead.push((m.id, e.to_string()));
}

/// The error text of a transient outcome.
pub(super) fn outcome_text(o: &PublishOutcome) -> String {
    match o {
        PublishOutcome::Transient(e) | PublishOutcome::Permanent(e) => e.to_string(),
        other => format!("{other:?}"),
    }
}
