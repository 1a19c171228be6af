//! Parking: what the stream cannot publish now leaves the stream, so that nothing
//! else waits for it.
//!
//! A message whose destination refuses it (a full queue or stream), whose publish
//! failed transiently and is to be retried after a backoff, or whose `visible_at` is
//! still ahead (a delayed message) is *parked*: its row is set to `Processing` with
//! `lease_until` at the time it may be tried again and no claim token, in the same
//! statement that records the rest of the batch. The slot's position then moves past
//! it like past a published message: the table, not the WAL, holds it from now on.
//! Later messages of its ordering key (the `order_key` column: the partition key, else
//! the aggregate) are parked behind it, so a key never overtakes itself; messages of
//! other keys and destinations go on.
//!
//! The *sweeper* ([`WalRelay::sweep`]) runs beside the stream in the same session
//! (only the relay that reads the slot sweeps) and publishes parked rows once they are
//! due, each key's rows in `seq` order and never while the stream holds an earlier
//! message of that key. A destination that refused is held back as the polling
//! relay's destination circuits do: its parked rows wait for a trial (one message
//! alone, after 500 ms, doubling up to the probe cap); confirmed, the destination
//! takes messages again, refused, the delay doubles. A parked row is an ordinary
//! expired lease for every other tool: `outbox stats` counts it as processing, and the
//! polling relay would reclaim it.
//!
//! Crash loops: each claim of the sweeper counts in `unfinished_alone`; a claim that
//! finds a row counted already (its last publish ended with the relay) publishes one
//! row at a time, and a row claimed more than the crash-loop limit times without an
//! outcome goes `Dead`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use outbox_core::{
    ErrorKind, EventPublisher, MessageStatus, OutboxMessage, PublishError, PublishOutcome,
};
use sqlx::{AssertSqlSafe, Row as _};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use super::WalRelay;
use super::record::{Outcomes, Whose};
use crate::error::db;
use crate::sql::{COLUMNS, quoted_schema};
use crate::wal::WalError;

/// Most parked rows one sweep looks at.
const CANDIDATES: i64 = 10_000;
/// How long the sweeper sleeps when nothing is parked (the stream wakes it sooner).
const IDLE: Duration = Duration::from_secs(5);

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
    /// Not before this long from now (and never before its `visible_at`).
    pub(super) delay: Duration,
    /// Whether the attempt counts (a transient failure), or not (a refusal, a delay).
    pub(super) charge: bool,
    pub(super) error: Option<String>,
}

impl ParkedRow {
    pub(super) fn behind(id: Uuid) -> Self {
        Self {
            id,
            delay: Duration::ZERO,
            charge: false,
            error: None,
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
    /// Held back: its circuit is open. The sweeper's first message for it after this
    /// long is the trial.
    Hold(Duration),
    /// The circuit is open and a trial is due (the sweeper's).
    Trial,
}

#[derive(Debug, Default)]
struct State {
    /// Parked rows per ordering key.
    keys: HashMap<String, usize>,
    /// Keys of the batch the stream is publishing.
    in_stream: HashMap<String, usize>,
    /// Destinations that refused.
    destinations: HashMap<String, Open>,
}

/// What the stream and the sweeper of one session share.
#[derive(Debug)]
pub(super) struct Parked {
    state: Mutex<State>,
    pub(super) wake: Notify,
    initial: Duration,
    max: Duration,
}

impl Parked {
    pub(super) fn new(keys: HashMap<String, usize>, max: Duration) -> Self {
        Self {
            state: Mutex::new(State {
                keys,
                ..State::default()
            }),
            wake: Notify::new(),
            initial: Duration::from_millis(500),
            max,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether parked rows of `key` wait: then its next message is parked behind them.
    pub(super) fn key_waits(&self, key: &str) -> bool {
        self.lock().keys.get(key).is_some_and(|n| *n > 0)
    }

    /// Counts a row of `key` parked.
    pub(super) fn park_key(&self, key: &str) {
        *self.lock().keys.entry(key.to_owned()).or_default() += 1;
    }

    /// Uncounts parked rows of `key` that were published or went dead.
    fn unpark_key(&self, key: &str, n: usize) {
        let mut s = self.lock();
        if let Some(c) = s.keys.get_mut(key) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                s.keys.remove(key);
            }
        }
    }

    pub(super) fn parked_keys(&self) -> usize {
        self.lock().keys.len()
    }

    /// Registers keys of messages the stream publishes: the sweeper leaves those keys
    /// alone until [`leave_stream`](Self::leave_stream).
    pub(super) fn enter_stream<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut s = self.lock();
        for k in keys {
            *s.in_stream.entry(k.to_owned()).or_default() += 1;
        }
    }

    /// Unregisters keys of the stream's messages that were recorded, and wakes the
    /// sweeper.
    pub(super) fn leave_stream<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut s = self.lock();
        for k in keys {
            if let Some(c) = s.in_stream.get_mut(k) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    s.in_stream.remove(k);
                }
            }
        }
        drop(s);
        self.wake.notify_one();
    }

    /// Unregisters every key of the stream (its batch is over, however it ended).
    pub(super) fn clear_stream(&self) {
        self.lock().in_stream.clear();
    }

    /// Whether a message for `destination` may be published now.
    pub(super) fn admit(&self, destination: &str) -> Admit {
        match self.lock().destinations.get(destination) {
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

    /// `m`'s destination `destination` refused it (`outcome`): the destination's
    /// circuit opens or its delay doubles (see [`refused`](Self::refused)), and `m` is
    /// to be parked for that long, uncharged.
    pub(super) fn refusal(
        &self,
        m: &OutboxMessage,
        destination: &str,
        outcome: &PublishOutcome,
    ) -> ParkedRow {
        let delay = self.refused(destination);
        outbox_core::metrics::deferred(&m.event_type);
        ParkedRow {
            id: m.id,
            delay,
            charge: false,
            error: Some(outcome_text(outcome)),
        }
    }

    /// `destination` refused a message: its circuit opens, or its delay doubles.
    /// Returns how long its messages are held back.
    pub(super) fn refused(&self, destination: &str) -> Duration {
        let mut s = self.lock();
        let delay = match s.destinations.get(destination) {
            Some(open) => (open.delay * 2).min(self.max),
            None => {
                warn!(
                    destination,
                    "a destination refuses messages: its messages are parked, the others go on"
                );
                self.initial
            }
        };
        s.destinations.insert(
            destination.to_owned(),
            Open {
                delay,
                next_trial: Instant::now() + delay,
            },
        );
        outbox_core::metrics::destinations_open(s.destinations.len());
        delay
    }

    /// `destination` took a message: its circuit closes.
    fn took(&self, destination: &str) {
        let mut s = self.lock();
        if s.destinations.remove(destination).is_some() {
            info!(destination, "the destination takes messages again");
            outbox_core::metrics::destinations_open(s.destinations.len());
        }
    }
}

/// A parked row as the sweeper first sees it.
struct Candidate {
    id: Uuid,
    key: String,
    destination: String,
    due: bool,
    wait: Duration,
    suspect: bool,
}

/// What one sweep did.
enum Swept {
    /// Published something (or made something dead): look again now.
    Again,
    /// Nothing to publish before this long (or a wake-up).
    Wait(Duration),
}

impl<P: EventPublisher> WalRelay<P> {
    /// The parked rows per ordering key, as the table has them at a session's start.
    pub(super) async fn parked_keys(&self) -> Result<HashMap<String, usize>, WalError> {
        let sql = format!(
            "SELECT order_key, count(*) FROM {}.outbox_messages WHERE status = 9 GROUP BY order_key",
            quoted_schema(self.outbox.schema())
        );
        let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(sql))
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal parked keys"))?;
        Ok(rows
            .into_iter()
            .map(|(k, n)| (k, usize::try_from(n).unwrap_or(0)))
            .collect())
    }

    /// Publishes parked rows as they come due, until `stop`. Failures of its own
    /// statements are logged and retried: the stream's statements meet the same
    /// database and end the session if it is gone.
    pub(super) async fn sweep(&self, parked: &Parked, stop: &CancellationToken) {
        let mut outage = Duration::from_millis(500);
        let mut failing = Duration::from_millis(500);
        let mut looked = Instant::now();
        loop {
            let wait = if self.counters.circuit_open.load(Ordering::Relaxed) {
                // The stream is probing a broker outage: nothing can be published.
                Duration::from_millis(500)
            } else if parked.parked_keys() == 0 && looked.elapsed() < IDLE {
                // Nothing parked by this session or counted at its start: no query on
                // every wake-up (the stream's rounds), only every `IDLE` to be sure.
                IDLE.saturating_sub(looked.elapsed())
            } else {
                looked = Instant::now();
                match self.sweep_once(parked, &mut outage, stop).await {
                    Ok(Swept::Again) => {
                        failing = Duration::from_millis(500);
                        if stop.is_cancelled() {
                            return;
                        }
                        continue;
                    }
                    Ok(Swept::Wait(d)) => {
                        failing = Duration::from_millis(500);
                        d
                    }
                    Err(e) => {
                        warn!(error = %e, "the sweeper of parked rows failed; retrying");
                        let d = failing;
                        failing = outbox_core::retry::outage_backoff(d, self.config.probe_cap);
                        d
                    }
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
                () = parked.wake.notified() => {}
            }
        }
    }

    async fn sweep_once(
        &self,
        parked: &Parked,
        outage: &mut Duration,
        stop: &CancellationToken,
    ) -> Result<Swept, WalError> {
        let schema = quoted_schema(self.outbox.schema());
        let sql = format!(
            "SELECT id, order_key, COALESCE(routing_key, event_type), \
                    COALESCE(lease_until <= now(), true), \
                    GREATEST(EXTRACT(EPOCH FROM (lease_until - now())), 0)::float8, \
                    unfinished_alone > 0 \
             FROM {schema}.outbox_messages WHERE status = 9 ORDER BY seq LIMIT $1"
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(CANDIDATES)
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal parked rows"))?;
        if rows.is_empty() {
            return Ok(Swept::Wait(IDLE));
        }
        let mut candidates = Vec::with_capacity(rows.len());
        for r in &rows {
            let wait: Option<f64> = r.try_get(4).map_err(db("wal parked rows"))?;
            candidates.push(Candidate {
                id: r.try_get(0).map_err(db("wal parked rows"))?,
                key: r.try_get(1).map_err(db("wal parked rows"))?,
                destination: r.try_get(2).map_err(db("wal parked rows"))?,
                due: r.try_get(3).map_err(db("wal parked rows"))?,
                wait: Duration::from_secs_f64(wait.unwrap_or(0.0).clamp(0.0, 3600.0)),
                suspect: r.try_get(5).map_err(db("wal parked rows"))?,
            });
        }
        let (chosen, next) = self.choose(parked, &candidates);
        if chosen.is_empty() {
            return Ok(Swept::Wait(
                next.unwrap_or(IDLE).clamp(Duration::from_millis(20), IDLE),
            ));
        }
        let trials: HashSet<&str> = chosen
            .iter()
            .filter(|c| c.1)
            .map(|c| candidates[c.0].destination.as_str())
            .collect();
        let ids: Vec<Uuid> = chosen.iter().map(|c| candidates[c.0].id).collect();
        let token = Uuid::new_v4();
        let claimed = self.claim_parked(&schema, &ids, token).await?;
        if claimed.is_empty() {
            return Ok(Swept::Again);
        }
        let mut out = Outcomes::default();
        let mut messages = Vec::with_capacity(claimed.len());
        for (id, counted, message) in claimed {
            if counted > i64::from(self.config.crash_loop_limit) {
                warn!(%id, claims = counted - 1, "suspected crash loop: the relay ended every time it published this parked row; it is dead");
                let error = format!(
                    "suspected crash loop: claimed {} times without an outcome (the relay ended each time)",
                    counted - 1
                );
                out.dead.push((id, error));
                continue;
            }
            match message {
                Ok(m) => messages.push(m),
                Err(reason) => {
                    warn!(%id, %reason, "poison row: it cannot be decoded, it is dead");
                    outbox_core::metrics::dead_poison();
                    out.dead.push((id, format!("undecodable row: {reason}")));
                }
            }
        }
        let keys: HashMap<Uuid, String> = messages.iter().map(|m| (m.id, order_key(m))).collect();
        if !messages.is_empty() {
            let key_refs: Vec<&str> = messages.iter().map(|m| keys[&m.id].as_str()).collect();
            let outcomes = self.publish_keyed(&messages, &key_refs).await;
            let mut stopped: HashSet<&str> = HashSet::new();
            let mut broker_out = false;
            for (m, outcome) in messages.iter().zip(outcomes) {
                let key = keys[&m.id].as_str();
                let dest = m.effective_routing_key();
                if broker_out || stopped.contains(key) {
                    out.parked.push(ParkedRow::behind(m.id));
                    continue;
                }
                match outcome {
                    Some(PublishOutcome::Published) => {
                        if trials.contains(dest) {
                            parked.took(dest);
                        }
                        out.sent.push(m.id);
                    }
                    Some(PublishOutcome::Permanent(e)) => dead_for_good(m, &e, &mut out),
                    Some(o) if o.is_refused_by_destination() => {
                        stopped.insert(key);
                        out.parked.push(parked.refusal(m, dest, &o));
                    }
                    Some(PublishOutcome::Transient(e)) if e.kind() != ErrorKind::Unavailable => {
                        stopped.insert(key);
                        if let Some(p) = self.retry_or_dead(m, &e, &mut out) {
                            out.parked.push(p);
                        }
                    }
                    other => {
                        // The broker as a whole: park the rest uncharged, try again
                        // later (the stream meets the same outage and probes it).
                        debug!(outcome = ?other, "the broker cannot take parked rows now");
                        broker_out = true;
                        out.parked.push(ParkedRow {
                            id: m.id,
                            delay: *outage,
                            charge: false,
                            error: None,
                        });
                    }
                }
            }
            if broker_out {
                *outage = outbox_core::retry::outage_backoff(*outage, self.config.probe_cap);
            } else {
                *outage = Duration::from_millis(500);
            }
            outbox_core::metrics::commit_to_publish(
                messages
                    .iter()
                    .map(|m| (&m.created_at, out.sent.contains(&m.id))),
            );
        }
        if !self.record(&out, Whose::Claimed(token), stop).await? {
            return Ok(Swept::Again);
        }
        // Published or dead: no longer parked. (A claimed row whose message did not
        // decode has no key here; the session's next start counts afresh.)
        for id in out.sent.iter().chain(out.dead.iter().map(|d| &d.0)) {
            if let Some(k) = keys.get(id) {
                parked.unpark_key(k, 1);
            }
        }
        if !out.sent.is_empty() {
            debug!(sent = out.sent.len(), "published parked rows");
        }
        Ok(Swept::Again)
    }

    /// Which candidates to claim now (index, whether it is a destination's trial), and
    /// the wait until the next one is due. Each key's rows in `seq` order up to its
    /// first row that is not due, held back by its destination, or behind a message
    /// the stream holds; one trial per held destination. When a candidate was claimed
    /// before without an outcome (a relay died publishing), one row alone.
    fn choose(
        &self,
        parked: &Parked,
        candidates: &[Candidate],
    ) -> (Vec<(usize, bool)>, Option<Duration>) {
        let in_stream: HashSet<String> = parked.lock().in_stream.keys().cloned().collect();
        let mut stopped: HashSet<&str> = HashSet::new();
        let mut trial_taken: HashSet<&str> = HashSet::new();
        let mut chosen = Vec::new();
        let mut next: Option<Duration> = None;
        let sooner = |d: Duration, next: &mut Option<Duration>| {
            *next = Some(next.map_or(d, |n| n.min(d)));
        };
        for (i, c) in candidates.iter().enumerate() {
            if stopped.contains(c.key.as_str()) {
                continue;
            }
            if in_stream.contains(&c.key) {
                stopped.insert(&c.key);
                sooner(Duration::from_millis(50), &mut next);
                continue;
            }
            if !c.due {
                stopped.insert(&c.key);
                sooner(c.wait, &mut next);
                continue;
            }
            match parked.admit(&c.destination) {
                Admit::Go => chosen.push((i, false)),
                Admit::Trial if trial_taken.insert(&c.destination) => {
                    chosen.push((i, true));
                    stopped.insert(&c.key);
                }
                Admit::Trial => {
                    stopped.insert(&c.key);
                }
                Admit::Hold(d) => {
                    stopped.insert(&c.key);
                    sooner(d, &mut next);
                }
            }
            if chosen.len() >= self.config.batch_size {
                break;
            }
        }
        if chosen.iter().any(|(i, _)| candidates[*i].suspect) {
            chosen.truncate(1);
        }
        (chosen, next)
    }

    /// Claims parked rows `ids` that are still parked and due, counting the claim in
    /// `unfinished_alone`: (id, count, the message or why it does not decode), in `seq`
    /// order.
    async fn claim_parked(
        &self,
        schema: &str,
        ids: &[Uuid],
        token: Uuid,
    ) -> Result<Vec<(Uuid, i64, Result<OutboxMessage, String>)>, WalError> {
        let sql = format!(
            "UPDATE {schema}.outbox_messages AS m \
             SET claim_token = $2, lease_until = now() + make_interval(secs => $3), \
                 unfinished_alone = m.unfinished_alone + 1 \
             WHERE m.id = ANY($1) AND m.status = 9 AND (m.lease_until IS NULL OR m.lease_until <= now()) \
             RETURNING {COLUMNS}, m.unfinished_alone::bigint AS counted"
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(ids)
            .bind(token)
            .bind(self.config.lease.as_secs_f64())
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal claim parked"))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let id: Uuid = r.try_get("id").map_err(db("wal claim parked"))?;
            let seq: i64 = r.try_get("seq").map_err(db("wal claim parked"))?;
            let counted: i64 = r.try_get("counted").map_err(db("wal claim parked"))?;
            let message = crate::store::decode_for_publish(r)
                .map(|mut m| {
                    // It is published as what it is: a pending message.
                    m.status = MessageStatus::New;
                    m
                })
                .map_err(|e| e.to_string());
            out.push((seq, id, counted, message));
        }
        out.sort_unstable_by_key(|r| r.0);
        Ok(out.into_iter().map(|(_, id, n, m)| (id, n, m)).collect())
    }

    /// A transient failure of `m`: parked for a retry after its event type's backoff
    /// (charged), or dead when its attempts are exhausted (pushed to `out.dead`).
    pub(super) fn retry_or_dead(
        &self,
        m: &OutboxMessage,
        error: &PublishError,
        out: &mut Outcomes,
    ) -> Option<ParkedRow> {
        outbox_core::metrics::publish_failed(error.kind(), &m.event_type);
        let attempts = u32::try_from(m.attempts).unwrap_or(0) + 1;
        let policy = self.config.retry.for_event_type(&m.event_type);
        if policy.should_retry(attempts) {
            outbox_core::metrics::retried(&m.event_type);
            debug!(id = %m.id, attempts, error = %error, "publish failed, will retry");
            Some(ParkedRow {
                id: m.id,
                delay: policy.delay(attempts),
                charge: true,
                error: Some(error.to_string()),
            })
        } else {
            outbox_core::metrics::dead(&m.event_type);
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
    outbox_core::metrics::publish_failed(e.kind(), &m.event_type);
    outbox_core::metrics::dead(&m.event_type);
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
