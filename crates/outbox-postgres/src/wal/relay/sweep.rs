//! The sweeper of parked rows (see `park`): each round it releases the heads of
//! circuits that closed, brings circuits waiting in the table into memory, walks the
//! heads that are due (the `parked_due` index, at most a batch of them) and each due
//! circuit's first head (the `parked_for` index), and publishes what may go: each due
//! key's parked rows in `seq` order, one trial per circuit. What it publishes is
//! claimed first (`claim_token`, a lease, `unfinished_alone`) and recorded in one
//! transaction that also flags each key's next parked row.
//!
//! It sleeps until the next head is due (asked of the database, as a duration), the
//! next trial, a key it waits on leaving the stream, or the stream parking a head due
//! sooner; at most [`IDLE`].
//!
//! Its statements are planned afresh at each run (`persistent(false)`), not from a
//! plan cached while the table held few parked rows: such a generic plan hashes every
//! head on each run once they are many (measured with the stream's lookup: 575 ms a
//! lookup at 300,000 heads), until an `ANALYZE` invalidates it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use outboxkit_core::{ErrorKind, EventPublisher, MessageStatus, OutboxMessage, PublishOutcome};
use sqlx::{AssertSqlSafe, Row as _};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

use super::WalRelay;
use super::park::{Admit, Parked, ParkedRow, dead_for_good, order_key};
use super::record::{Outcomes, Whose};
use crate::error::db;
use crate::sql::{COLUMNS, quoted_schema};
use crate::wal::WalError;

/// Most heads of a closed circuit released per statement (one statement per round).
const RELEASE_CHUNK: i64 = 10_000;
/// The longest the sweeper sleeps with nothing due: a due head, a trial, a key leaving
/// the stream or a head parked sooner wake it.
const IDLE: Duration = Duration::from_secs(60);

/// A parked row as the sweeper sees it.
struct Candidate {
    id: Uuid,
    key: String,
    circuit: String,
    /// Due (by the database's clock) and not claimed by a live lease.
    due: bool,
    /// Not claimed by a live lease (a trial needs no more).
    free: bool,
    /// Until it is due (`None`: held by a circuit).
    wait: Option<Duration>,
    suspect: bool,
}

impl Candidate {
    /// The columns [`read`](Self::read) reads, of `m`.
    const COLUMNS: &str = "m.id, m.order_key, m.routing_key, m.event_type, \
         COALESCE(m.parked_until, m.lease_until, now()) <= now() \
             AND (m.claim_token IS NULL OR m.lease_until <= now()), \
         m.claim_token IS NULL OR m.lease_until <= now(), \
         CASE WHEN m.parked_until IS NULL OR m.parked_until < 'infinity' THEN \
             GREATEST(EXTRACT(EPOCH FROM COALESCE(m.parked_until, m.lease_until, now()) - now()), \
                      EXTRACT(EPOCH FROM CASE WHEN m.claim_token IS NOT NULL THEN m.lease_until END - now()), \
                      0)::float8 END, \
         m.unfinished_alone > 0";

    /// The candidate in `r`'s columns from `at` on, of `circuit` (`None`: the one
    /// `relay` names for its routing key).
    fn read<P: EventPublisher>(
        relay: &WalRelay<P>,
        r: &sqlx::postgres::PgRow,
        at: usize,
        circuit: Option<&str>,
    ) -> Result<Self, WalError> {
        let routing_key: Option<String> = r.try_get(at + 2).map_err(db("wal parked rows"))?;
        let event_type: String = r.try_get(at + 3).map_err(db("wal parked rows"))?;
        let wait: Option<f64> = r.try_get(at + 6).map_err(db("wal parked rows"))?;
        Ok(Self {
            id: r.try_get(at).map_err(db("wal parked rows"))?,
            key: r.try_get(at + 1).map_err(db("wal parked rows"))?,
            circuit: match circuit {
                Some(c) => c.to_owned(),
                None => relay
                    .circuit(routing_key.as_deref(), &event_type)
                    .into_owned(),
            },
            due: r.try_get(at + 4).map_err(db("wal parked rows"))?,
            free: r.try_get(at + 5).map_err(db("wal parked rows"))?,
            wait: wait.map(|w| Duration::from_secs_f64(w.clamp(0.0, 86_400.0))),
            suspect: r.try_get(at + 7).map_err(db("wal parked rows"))?,
        })
    }
}

/// What one round looks at: the due keys' parked rows (grouped by key, keys in the
/// order their heads came due, rows in `seq` order), and each due trial's circuit with
/// what it holds.
struct Candidates {
    rows: Vec<Candidate>,
    trials: Vec<(String, Trial)>,
}

/// What a circuit whose trial is due holds.
enum Trial {
    /// Its first head that is its key's first parked row: the index in `rows`.
    Head(usize),
    /// Heads, each behind an earlier parked row of its key (which goes first).
    Behind,
    /// Nothing.
    Nothing,
}

/// What one round does: the rows it claims (`(index, whether a trial)`), the heads
/// that a circuit holds (to mark so), and how long until the next is due.
#[derive(Default)]
struct Choice {
    chosen: Vec<(usize, bool)>,
    held: Vec<usize>,
    next: Option<Duration>,
}

impl Choice {
    fn sooner(&mut self, d: Option<Duration>) {
        if let Some(d) = d {
            self.next = Some(self.next.map_or(d, |n| n.min(d)));
        }
    }
}

/// What one sweep did.
enum Swept {
    /// Published something (or made something dead, or released): look again now.
    Again,
    /// Nothing to do before this long (or a wake-up).
    Wait(Duration),
}

impl<P: EventPublisher> WalRelay<P> {
    /// Publishes parked rows as they come due, until `stop`. Failures of its own
    /// statements are logged and retried: the stream's statements meet the same
    /// database and end the session if it is gone.
    pub(super) async fn sweep(&self, parked: &Parked, stop: &CancellationToken) {
        let mut outage = Duration::from_millis(500);
        let mut failing = Duration::from_millis(500);
        loop {
            parked.sweeper_works();
            let wait = if self.counters.circuit_open.load(Ordering::Relaxed) {
                // The stream is probing a broker outage: nothing can be published.
                Duration::from_millis(500)
            } else {
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
                        failing = outboxkit_core::retry::outage_backoff(d, self.config.probe_cap);
                        d
                    }
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = parked.sweeper_sleeps(wait) => {}
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
        let parks = parked.parks();
        let released = self.release(&schema, parked).await?;
        if self.adopt(&schema, parked).await? || released {
            return Ok(Swept::Again);
        }
        let candidates = self.candidates(&schema, parked).await?;
        let mut choice = self.choose(parked, &candidates);
        if !choice.held.is_empty() {
            self.hold_heads(&schema, &candidates.rows, &choice.held)
                .await?;
        }
        if choice.chosen.is_empty() {
            if !choice.held.is_empty() {
                return Ok(Swept::Again);
            }
            let (next_due, any) = self.next_due(&schema).await?;
            if !any {
                parked.no_heads(parks);
            }
            choice.sooner(next_due);
            return Ok(Swept::Wait(
                choice
                    .next
                    .unwrap_or(IDLE)
                    .clamp(Duration::from_millis(5), IDLE),
            ));
        }
        let rows = &candidates.rows;
        let trial_of: HashMap<Uuid, &str> = choice
            .chosen
            .iter()
            .filter(|c| c.1)
            .map(|c| (rows[c.0].id, rows[c.0].circuit.as_str()))
            .collect();
        let ids: Vec<Uuid> = choice.chosen.iter().map(|c| rows[c.0].id).collect();
        let token = Uuid::new_v4();
        let claimed = self.claim_parked(&schema, &ids, token).await?;
        if claimed.is_empty() {
            return Ok(Swept::Again);
        }
        let mut out = Outcomes::default();
        let mut messages = Vec::with_capacity(claimed.len());
        for (id, key, counted, message) in claimed {
            // Whatever becomes of it, its key's first parked row is a head after.
            out.promote.push(key);
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
                    outboxkit_core::metrics::dead_poison();
                    out.dead.push((id, format!("undecodable row: {reason}")));
                }
            }
        }
        let (confirmed, refused) = self
            .publish_claimed(&messages, &trial_of, parked, outage, &mut out)
            .await;
        if !self
            .record(&out, Whose::Claimed(token), parked, stop)
            .await?
        {
            return Ok(Swept::Again);
        }
        for c in confirmed {
            parked.took(c);
            parked.trial_confirmed();
        }
        for c in refused {
            parked.rotate(c);
        }
        if !out.sent.is_empty() {
            debug!(sent = out.sent.len(), "published parked rows");
        }
        Ok(Swept::Again)
    }

    /// Publishes claimed `messages` and judges their outcomes into `out`: the
    /// circuits whose trial (`trial_of`) was confirmed, and those whose trial was
    /// refused.
    async fn publish_claimed<'a>(
        &self,
        messages: &[OutboxMessage],
        trial_of: &HashMap<Uuid, &'a str>,
        parked: &Parked,
        outage: &mut Duration,
        out: &mut Outcomes,
    ) -> (Vec<&'a str>, Vec<&'a str>) {
        let (mut confirmed, mut refused) = (Vec::new(), Vec::new());
        if messages.is_empty() {
            return (confirmed, refused);
        }
        let keys: Vec<String> = messages.iter().map(order_key).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let outcomes = self.publish_keyed(messages, &key_refs).await;
        let mut stopped: HashSet<&str> = HashSet::new();
        let mut broker_out = false;
        for ((m, &key), outcome) in messages.iter().zip(&key_refs).zip(outcomes) {
            let trial = trial_of.get(&m.id).copied();
            if broker_out || stopped.contains(key) {
                out.parked.push(ParkedRow::behind(m.id, key));
                continue;
            }
            match outcome {
                Some(PublishOutcome::Published) => {
                    confirmed.extend(trial);
                    out.sent.push(m.id);
                }
                Some(PublishOutcome::Permanent(e)) => dead_for_good(m, &e, out),
                Some(o) if o.is_refused_by_destination() => {
                    stopped.insert(key);
                    let circuit = match trial {
                        Some(c) => std::borrow::Cow::Borrowed(c),
                        None => self.circuit(m.routing_key.as_deref(), &m.event_type),
                    };
                    out.parked.push(parked.refusal(m, &circuit, key, &o));
                    refused.extend(trial);
                }
                Some(PublishOutcome::Transient(e)) if e.kind() != ErrorKind::Unavailable => {
                    stopped.insert(key);
                    if let Some(p) = self.retry_or_dead(m, key, &e, out) {
                        out.parked.push(p);
                    }
                }
                other => {
                    // The broker as a whole: park the rest uncharged, try again later
                    // (the stream meets the same outage and probes it). A trial stays
                    // its circuit's.
                    debug!(outcome = ?other, "the broker cannot take parked rows now");
                    broker_out = true;
                    out.parked.push(ParkedRow {
                        delay: *outage,
                        held_for: trial.map(str::to_owned),
                        ..ParkedRow::behind(m.id, key)
                    });
                }
            }
        }
        if broker_out {
            *outage = outboxkit_core::retry::outage_backoff(*outage, self.config.probe_cap);
        } else {
            *outage = Duration::from_millis(500);
        }
        outboxkit_core::metrics::commit_to_publish(
            messages
                .iter()
                .map(|m| (&m.created_at, out.sent.contains(&m.id))),
        );
        (confirmed, refused)
    }

    /// Releases the heads of closed circuits (at most [`RELEASE_CHUNK`] a round): due
    /// now. Whether any was released.
    async fn release(&self, schema: &str, parked: &Parked) -> Result<bool, WalError> {
        let releasing = parked.releasing();
        if releasing.is_empty() {
            return Ok(false);
        }
        let sql = format!(
            "UPDATE {schema}.outbox_messages AS m \
             SET parked_for = NULL, parked_until = now(), lease_until = now() \
             WHERE m.id IN (SELECT id FROM {schema}.outbox_messages \
                            WHERE parked_for = ANY($1) AND phase = 0 LIMIT $2) \
               AND m.status = 9 AND (m.claim_token IS NULL OR m.lease_until <= now())"
        );
        let n = sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
            .bind(&releasing)
            .bind(RELEASE_CHUNK)
            .execute(self.outbox.pool())
            .await
            .map_err(db("wal release parked"))?
            .rows_affected();
        if n < RELEASE_CHUNK.unsigned_abs() {
            parked.released(&releasing);
        }
        Ok(n > 0)
    }

    /// With room for circuits in memory while circuits of the table's heads may not
    /// be there, brings the next ones in (by name after the last one brought in, round
    /// the table; one index probe each), their trials due. Whether any came in.
    async fn adopt(&self, schema: &str, parked: &Parked) -> Result<bool, WalError> {
        let Some((room, known, after)) = parked.adoption() else {
            return Ok(false);
        };
        let sql = format!(
            "WITH RECURSIVE c(v) AS ( \
                 (SELECT parked_for FROM {schema}.outbox_messages \
                   WHERE phase = 0 AND parked_for > $1 ORDER BY parked_for LIMIT 1) \
                 UNION ALL \
                 SELECT (SELECT parked_for FROM {schema}.outbox_messages \
                          WHERE phase = 0 AND parked_for > c.v ORDER BY parked_for LIMIT 1) \
                   FROM c WHERE c.v IS NOT NULL) \
             SELECT v FROM c WHERE v IS NOT NULL LIMIT $2"
        );
        let most = room + known.len();
        let found: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql))
            .persistent(false)
            .bind(&after)
            .bind(i64::try_from(most).unwrap_or(i64::MAX))
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal held circuits"))?;
        // Fewer than asked: the end of the table's circuits.
        let end = found.len() < most;
        let last = found.last().cloned();
        let new: Vec<String> = found
            .into_iter()
            .filter(|c| !known.contains(c))
            .take(room)
            .collect();
        let any = !new.is_empty();
        if any {
            debug!(
                circuits = new.len(),
                "open circuits found in the table's parked rows"
            );
        }
        parked.adopted(new, if end { None } else { last }, after.is_empty() && end);
        Ok(any)
    }

    /// What this round looks at (see [`Candidates`]): the due heads in the order they
    /// came due (a batch of them, beside the keys the stream holds), each one's key's
    /// parked rows in `seq` order from its first (a share of the batch each); and for
    /// each open circuit whose trial is due, its first head.
    async fn candidates(&self, schema: &str, parked: &Parked) -> Result<Candidates, WalError> {
        let heads = i64::try_from(self.config.batch_size + parked.in_stream()).unwrap_or(i64::MAX);
        let batch = i64::try_from(self.config.batch_size).unwrap_or(i64::MAX);
        let cols = Candidate::COLUMNS;
        let sql = format!(
            "WITH d AS ( \
                 SELECT order_key, parked_until, seq FROM {schema}.outbox_messages \
                  WHERE phase = 0 AND parked_until <= now() AND status = 9 \
                  ORDER BY parked_until, seq LIMIT $1), \
             h AS (SELECT order_key, min(parked_until) AS due, min(seq) AS seq \
                     FROM d GROUP BY order_key) \
             SELECT {cols} FROM h, LATERAL ( \
                 SELECT * FROM {schema}.outbox_messages AS m \
                  WHERE m.order_key = h.order_key AND m.phase = 0 AND m.status = 9 \
                  ORDER BY m.seq \
                  LIMIT (SELECT GREATEST(1, $2 / count(*)) FROM h)) AS m \
             ORDER BY h.due, h.seq, m.seq"
        );
        let found = sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
            .bind(heads)
            .bind(batch)
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal parked rows"))?;
        let mut rows = found
            .iter()
            .map(|r| Candidate::read(self, r, 0, None))
            .collect::<Result<Vec<_>, _>>()?;
        let (due, _) = parked.due_trials();
        let mut trials = Vec::with_capacity(due.len());
        if !due.is_empty() {
            // A circuit's first head that is its key's first parked row (an earlier
            // one of the key goes first).
            let sql = format!(
                "SELECT c, EXISTS (SELECT 1 FROM {schema}.outbox_messages \
                                    WHERE parked_for = c AND phase = 0), {cols} \
                   FROM unnest($1::text[]) AS c LEFT JOIN LATERAL ( \
                     SELECT * FROM {schema}.outbox_messages AS m \
                      WHERE m.parked_for = c AND m.phase = 0 AND m.status = 9 \
                        AND NOT EXISTS (SELECT 1 FROM {schema}.outbox_messages AS o \
                                         WHERE o.order_key = m.order_key AND o.phase = 0 \
                                           AND o.status = 9 AND o.seq < m.seq) \
                      ORDER BY m.seq LIMIT 1) AS m ON true"
            );
            let found = sqlx::query(AssertSqlSafe(sql))
                .persistent(false)
                .bind(&due)
                .fetch_all(self.outbox.pool())
                .await
                .map_err(db("wal trials"))?;
            for r in &found {
                let c: String = r.try_get(0).map_err(db("wal trials"))?;
                let held: bool = r.try_get(1).map_err(db("wal trials"))?;
                let id: Option<Uuid> = r.try_get(2).map_err(db("wal trials"))?;
                let trial = match id {
                    Some(_) => {
                        // A trial is its circuit's, whatever its routing key is
                        // named now.
                        rows.push(Candidate::read(self, r, 2, Some(&c))?);
                        Trial::Head(rows.len() - 1)
                    }
                    None if held => Trial::Behind,
                    None => Trial::Nothing,
                };
                trials.push((c, trial));
            }
        }
        Ok(Candidates { rows, trials })
    }

    /// Which candidates to claim now, which heads their circuits hold, and the wait
    /// until the next is due: each due key's rows in `seq` order up to its first row
    /// that is not due, whose circuit is open (its first row is then marked held), or
    /// while the stream holds an earlier message of the key; then one trial per due
    /// circuit, as far as trials are allowed (see `park::TRIALS_PER_SECOND`). When a
    /// candidate was claimed before without an outcome (a relay died publishing), one
    /// row alone.
    fn choose(&self, parked: &Parked, c: &Candidates) -> Choice {
        let rows = &c.rows;
        let in_stream = parked.held_by_stream(rows.iter().map(|r| r.key.as_str()));
        let mut choice = Choice::default();
        let mut stopped: HashSet<&str> = HashSet::new();
        let mut seen: HashSet<&str> = HashSet::new();
        let trial_rows: HashSet<usize> = c
            .trials
            .iter()
            .filter_map(|t| match t.1 {
                Trial::Head(i) => Some(i),
                _ => None,
            })
            .collect();
        for (i, r) in rows.iter().enumerate() {
            if trial_rows.contains(&i) || choice.chosen.len() >= self.config.batch_size {
                break;
            }
            let first = seen.insert(&r.key);
            if stopped.contains(r.key.as_str()) {
                continue;
            }
            if in_stream.contains(&r.key) || !r.due {
                stopped.insert(&r.key);
                if !in_stream.contains(&r.key) {
                    choice.sooner(r.wait);
                }
                continue;
            }
            match parked.admit(&r.circuit) {
                Admit::Go => choice.chosen.push((i, false)),
                Admit::Hold(_) | Admit::Trial => {
                    stopped.insert(&r.key);
                    if first {
                        choice.held.push(i);
                    }
                }
            }
        }
        for (circuit, trial) in &c.trials {
            let i = match *trial {
                Trial::Head(i) => i,
                // When the earlier rows have gone.
                Trial::Behind => {
                    choice.sooner(Some(Duration::from_secs(1)));
                    continue;
                }
                Trial::Nothing => {
                    if !choice.held.iter().any(|&h| rows[h].circuit == *circuit) {
                        parked.forget(circuit);
                    }
                    continue;
                }
            };
            let r = &rows[i];
            if choice.chosen.len() >= self.config.batch_size {
                break;
            }
            let taken = choice.chosen.iter().any(|&(j, _)| rows[j].key == r.key);
            if !r.free || taken || in_stream.contains(&r.key) {
                choice.sooner(r.wait.or(Some(Duration::from_millis(100))));
                continue;
            }
            if !parked.take_trial() {
                choice.sooner(Some(Duration::from_millis(100)));
                break;
            }
            parked.trying(circuit);
            choice.chosen.push((i, true));
        }
        let (_, next_trial) = parked.due_trials();
        choice.sooner(next_trial);
        if choice.chosen.iter().any(|(i, _)| rows[*i].suspect) {
            choice.chosen.truncate(1);
        }
        choice
    }

    /// Marks heads `held` (of `rows`) as held by their circuits: out of the walk of
    /// due heads until the circuit's trial is confirmed.
    async fn hold_heads(
        &self,
        schema: &str,
        rows: &[Candidate],
        held: &[usize],
    ) -> Result<(), WalError> {
        let ids: Vec<Uuid> = held.iter().map(|&i| rows[i].id).collect();
        let circuits: Vec<&str> = held.iter().map(|&i| rows[i].circuit.as_str()).collect();
        let sql = format!(
            "UPDATE {schema}.outbox_messages AS m \
             SET parked_until = 'infinity', parked_for = d.c, claim_token = NULL \
             FROM unnest($1::uuid[], $2::text[]) AS d(id, c) \
             WHERE m.id = d.id AND m.status = 9 \
               AND (m.claim_token IS NULL OR m.lease_until <= now())"
        );
        sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
            .bind(ids)
            .bind(circuits)
            .execute(self.outbox.pool())
            .await
            .map_err(db("wal hold parked"))?;
        Ok(())
    }

    /// How long until the next head is due (`None`: none waits for a time), and
    /// whether the table has any head at all.
    async fn next_due(&self, schema: &str) -> Result<(Option<Duration>, bool), WalError> {
        let sql = format!(
            "SELECT EXTRACT(EPOCH FROM (SELECT parked_until FROM {schema}.outbox_messages \
                    WHERE phase = 0 AND parked_until > now() AND parked_until < 'infinity' \
                    ORDER BY parked_until LIMIT 1) - now())::float8, \
                    EXISTS (SELECT 1 FROM {schema}.outbox_messages \
                             WHERE phase = 0 AND parked_until IS NOT NULL)"
        );
        let (next, any): (Option<f64>, bool) = sqlx::query_as(AssertSqlSafe(sql))
            .persistent(false)
            .fetch_one(self.outbox.pool())
            .await
            .map_err(db("wal next due"))?;
        Ok((
            next.map(|s| Duration::from_secs_f64(s.clamp(0.0, 86_400.0))),
            any,
        ))
    }

    /// Claims parked rows `ids` that no live lease holds, counting the claim in
    /// `unfinished_alone`: (id, ordering key, count, the message or why it does not
    /// decode), in `seq` order. A head's `parked_until` becomes the lease's end.
    async fn claim_parked(
        &self,
        schema: &str,
        ids: &[Uuid],
        token: Uuid,
    ) -> Result<Vec<(Uuid, String, i64, Result<OutboxMessage, String>)>, WalError> {
        let sql = format!(
            "UPDATE {schema}.outbox_messages AS m \
             SET claim_token = $2, lease_until = now() + make_interval(secs => $3), \
                 parked_until = CASE WHEN m.parked_until IS NOT NULL \
                     THEN now() + make_interval(secs => $3) END, \
                 unfinished_alone = m.unfinished_alone + 1 \
             WHERE m.id = ANY($1) AND m.status = 9 \
               AND (m.claim_token IS NULL OR m.lease_until <= now()) \
             RETURNING {COLUMNS}, m.order_key, m.unfinished_alone::bigint AS counted"
        );
        let rows = sqlx::query(AssertSqlSafe(sql))
            .persistent(false)
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
            let key: String = r.try_get("order_key").map_err(db("wal claim parked"))?;
            let counted: i64 = r.try_get("counted").map_err(db("wal claim parked"))?;
            let message = crate::store::decode_for_publish(r)
                .map(|mut m| {
                    // It is published as what it is: a pending message.
                    m.status = MessageStatus::New;
                    m
                })
                .map_err(|e| e.to_string());
            out.push((seq, id, key, counted, message));
        }
        out.sort_unstable_by_key(|r| r.0);
        Ok(out
            .into_iter()
            .map(|(_, id, key, n, m)| (id, key, n, m))
            .collect())
    }
}
