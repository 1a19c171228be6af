//! What the relay writes to the outbox table: outcomes (`Sent` or deleted, `Dead`),
//! the rows a new session skips, the crash-loop guard's count.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outboxkit_core::{EventPublisher, OutboxMessage, SentRetention, sanitize_error};
use pgwire_replication::Lsn;
use sqlx::{AssertSqlSafe, PgConnection, Row as _};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

use super::WalRelay;
use super::config::Counters;
use super::park::{Parked, ParkedRow};
use crate::PgOutbox;
use crate::error::db;
use crate::sql::quoted_schema;
use crate::wal::WalError;

/// How long [`Recorder::record`] retries an unavailable database while holding the
/// replication session.
const RECORD_HOLD: Duration = Duration::from_secs(3);
/// The shortest wait for a connection of [`Recorder::record`]'s last attempt.
const MIN_ACQUIRE: Duration = Duration::from_millis(500);
/// How long [`WalRelay::wait_visible`] checks again every millisecond before it backs
/// off (doubling the pause up to 100 ms): longer than a descheduled backend's time
/// slice, short enough that a commit waiting for a synchronous standby costs at most
/// 20 more queries.
const VISIBLE_SOON: Duration = Duration::from_millis(20);

impl<P: EventPublisher> WalRelay<P> {
    /// Counts one more start whose first pending message is `id`; returns the count
    /// (0 when the row is no longer pending).
    pub(super) async fn bump_alone(&self, id: Uuid) -> Result<i64, WalError> {
        let sql = format!(
            "UPDATE {}.outbox_messages SET unfinished_alone = unfinished_alone + 1 \
             WHERE id = $1 AND status = 0 RETURNING unfinished_alone::bigint",
            quoted_schema(self.outbox.schema())
        );
        let n: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.outbox.pool())
            .await
            .map_err(db("wal crash-loop guard"))?;
        Ok(n.unwrap_or(0))
    }

    pub(super) async fn reset_alone(&self, id: Uuid) -> Result<(), WalError> {
        let sql = format!(
            "UPDATE {}.outbox_messages SET unfinished_alone = 0 \
             WHERE id = $1 AND status = 0 AND unfinished_alone <> 0",
            quoted_schema(self.outbox.schema())
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(id)
            .execute(self.outbox.pool())
            .await
            .map_err(db("wal crash-loop guard"))?;
        Ok(())
    }

    /// Waits until every transaction `xids` (32-bit, as `pgoutput` gives them) is
    /// visible in a new snapshot (`pg_visible_in_snapshot`, the epoch taken from the
    /// snapshot's `xmax`): normally at once; while a commit waits for a synchronous
    /// standby, as long as it waits. Then says what the batch's messages (of ordering
    /// `keys`) are to be judged by ([`Checked`]): the database's time, and, while
    /// anything may be parked (`parked`), which keys have parked rows (one probe of an
    /// index of heads per key). `None`: shutdown came first.
    ///
    /// A commit the walsender decoded can also be invisible for a moment: the
    /// producer's backend flushed its commit record (which wakes the walsender) and
    /// has not yet left the process array, typically because it was descheduled in
    /// between on a busy machine (measured here at 500 messages/s: about 1 % of the
    /// batches, visible at the second check, 2-3 ms later). That lasts a scheduler's
    /// time slice, so the check is repeated every millisecond for [`VISIBLE_SOON`]
    /// before the pause doubles (a pause doubling from the start would make a 5 ms
    /// wait cost 7). Waits of more than one check, or of 5 ms or more, are logged at
    /// debug level.
    pub(super) async fn wait_visible(
        &self,
        xids: &[u32],
        keys: &[String],
        parked: &Parked,
        shutdown: &CancellationToken,
    ) -> Result<Option<Checked>, WalError> {
        let xids: Vec<i64> = xids.iter().map(|&x| i64::from(x)).collect();
        // Every park recorded before this point is in the table for the lookup.
        let keys: Option<Vec<&str>> = parked.begin_lookup().then(|| {
            let distinct: HashSet<&str> = keys.iter().map(String::as_str).collect();
            distinct.into_iter().collect()
        });
        let sql = format!(
            "SELECT (SELECT count(*) FROM (SELECT pg_current_snapshot() AS s) AS q, unnest($1::bigint[]) AS x \
                      WHERE NOT pg_visible_in_snapshot(((( \
                          ((pg_snapshot_xmax(q.s)::text::bigint) >> 32) \
                          - CASE WHEN x > ((pg_snapshot_xmax(q.s)::text::bigint) & 4294967295) THEN 1 ELSE 0 END \
                      ) << 32) | x)::text::xid8, q.s)), \
                    now(), \
                    ARRAY(SELECT k FROM unnest($2::text[]) AS k \
                           WHERE EXISTS (SELECT 1 FROM {}.outbox_messages \
                                          WHERE order_key = k AND phase = 0 AND parked_until IS NOT NULL))",
            quoted_schema(self.outbox.schema())
        );
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(1);
        let mut logged = false;
        let mut checks = 0_u32;
        loop {
            // With keys, planned afresh (see `sweep`): a cached generic plan hashed
            // every head of the table on each lookup.
            let row = sqlx::query(AssertSqlSafe(sql.as_str()))
                .persistent(keys.is_none())
                .bind(&xids)
                .bind(&keys)
                .fetch_one(self.outbox.pool())
                .await
                .map_err(db("wal visibility"))?;
            let invisible: i64 = row.try_get(0).map_err(db("wal visibility"))?;
            checks += 1;
            if invisible == 0 {
                if checks > 1 || started.elapsed() >= Duration::from_millis(5) {
                    debug!(
                        checks,
                        waited_us = started.elapsed().as_micros(),
                        "committed transactions became visible"
                    );
                }
                let waiting: Vec<String> = row.try_get(2).map_err(db("wal visibility"))?;
                return Ok(Some(Checked {
                    now: row.try_get(1).map_err(db("wal visibility"))?,
                    waiting: waiting.into_iter().collect(),
                }));
            }
            if !logged && started.elapsed() >= Duration::from_secs(1) {
                logged = true;
                warn!(
                    transactions = invisible,
                    "committed transactions are not visible to other sessions yet (a commit waiting for a synchronous standby?): their messages wait"
                );
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(None),
                () = tokio::time::sleep(pause) => {}
            }
            if started.elapsed() >= VISIBLE_SOON {
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    }

    /// The ids of `messages` whose rows are still `New` in the table.
    pub(super) async fn still_pending(
        &self,
        messages: &[OutboxMessage],
    ) -> Result<std::collections::HashSet<Uuid>, WalError> {
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
        let sql = format!(
            "SELECT id FROM {}.outbox_messages WHERE id = ANY($1) AND status = 0",
            quoted_schema(self.outbox.schema())
        );
        let pending: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(ids)
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal pending"))?;
        Ok(pending.into_iter().collect())
    }

    /// What records outcomes, for a task of its own.
    pub(super) fn recorder(&self) -> Recorder {
        Recorder {
            outbox: self.outbox.clone(),
            counters: Arc::clone(&self.counters),
        }
    }

    /// [`Recorder::record`] by this relay.
    pub(super) async fn record(
        &self,
        out: &Outcomes,
        whose: Whose,
        parked: &Parked,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        self.recorder().record(out, whose, parked, shutdown).await
    }
}

/// Records outcomes in the outbox table and counts them.
#[derive(Debug, Clone)]
pub(super) struct Recorder {
    outbox: PgOutbox,
    counters: Arc<Counters>,
}

impl Recorder {
    /// Records published messages (`Sent`, or deleted), dead and parked ones,
    /// retrying a database that is unavailable for up to [`RECORD_HOLD`]; then the
    /// error ends the replication session (the next one replays from the confirmed
    /// position and skips what was recorded). `Ok(false)`: shutdown came first. Then
    /// `parked` learns that the stream's parks are recorded, and the sweeper is woken
    /// for a head due sooner than it would wake.
    ///
    /// Why not retry for as long as it takes: a PostgreSQL shutting down (`pg_ctl stop
    /// -m fast`, a restart) refuses new connections and then waits for every walsender
    /// to see its client confirm the last WAL it sent. A relay that held its replication
    /// session open while waiting to record would never confirm, and the server would
    /// never finish stopping (found by `cargo xtask chaos -- --source wal`).
    pub(super) async fn record(
        &self,
        out: &Outcomes,
        whose: Whose,
        parked: &Parked,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        if out.is_empty() {
            return Ok(true);
        }
        let schema = quoted_schema(self.outbox.schema());
        let mut backoff = Duration::from_millis(200);
        let started = tokio::time::Instant::now();
        loop {
            // The wait for a connection is bounded by what is left of the hold: the
            // pool's own acquire timeout (10 s) kept a retry waiting for a server
            // shutting down, whose stop waited for this session (found by
            // `cargo xtask chaos -- --source wal`: a restart took 14 s).
            let left = RECORD_HOLD
                .saturating_sub(started.elapsed())
                .max(MIN_ACQUIRE);
            match self.record_once(&schema, out, whose, left).await {
                Ok(due) => {
                    if matches!(whose, Whose::Pending) {
                        parked.recorded(out.parked.iter().map(|p| p.key.as_str()));
                    }
                    if let Some(d) = due {
                        parked.due_in(d);
                    }
                    break;
                }
                Err(e) if e.is_retryable() && started.elapsed() >= RECORD_HOLD => {
                    warn!(error = %e, "cannot record outcomes; ending the replication session (a server shutting down waits for it)");
                    return Err(e);
                }
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, "cannot record outcomes; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(false),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff =
                        outboxkit_core::retry::outage_backoff(backoff, Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
        self.counters
            .published
            .fetch_add(out.sent.len() as u64, Ordering::Relaxed);
        self.counters
            .dead
            .fetch_add(out.dead.len() as u64, Ordering::Relaxed);
        outboxkit_core::metrics::completed(out.sent.len(), 0, 0);
        Ok(true)
    }

    /// One attempt of [`record`](Self::record): how soon a head it parked (or
    /// flagged) is due, if any is.
    async fn record_once(
        &self,
        schema: &str,
        out: &Outcomes,
        whose: Whose,
        acquire: Duration,
    ) -> Result<Option<Duration>, WalError> {
        let mut conn = tokio::time::timeout(acquire, self.outbox.pool().acquire())
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
            .map_err(db("wal record"))?;
        match whose {
            // Separate statements on one connection, no transaction: the position is
            // confirmed only after all of them, and a replay skips rows one of them
            // changed already.
            Whose::Pending => self.statements(&mut conn, schema, out, whose).await,
            // The sweeper's: its keys' next parked rows are flagged in the same
            // transaction as the rows that leave, or a relay dying in between would
            // leave them behind no head.
            Whose::Claimed(_) => {
                let mut tx = sqlx::Connection::begin(&mut *conn)
                    .await
                    .map_err(db("wal record"))?;
                let due = self.statements(&mut tx, schema, out, whose).await?;
                tx.commit().await.map_err(db("wal record"))?;
                Ok(due)
            }
        }
    }

    async fn statements(
        &self,
        conn: &mut PgConnection,
        schema: &str,
        out: &Outcomes,
        whose: Whose,
    ) -> Result<Option<Duration>, WalError> {
        let token = match whose {
            Whose::Pending => None,
            Whose::Claimed(t) => Some(t),
        };
        if !out.sent.is_empty() {
            let sql = match self.outbox.sent_retention() {
                SentRetention::Delete => {
                    format!(
                        "DELETE FROM {schema}.outbox_messages AS m WHERE m.id = ANY($1) AND {}",
                        whose.filter(2)
                    )
                }
                _ => format!(
                    "UPDATE {schema}.outbox_messages AS m \
                     SET status = 1, sent_at = now(), attempts = m.attempts + 1, \
                         claim_token = NULL, lease_until = NULL, unfinished_alone = 0, \
                         parked_until = NULL, parked_for = NULL \
                     WHERE m.id = ANY($1) AND {}",
                    whose.filter(2)
                ),
            };
            bind_token(sqlx::query(AssertSqlSafe(sql)).bind(&out.sent), token)
                .execute(&mut *conn)
                .await
                .map_err(db("wal record sent"))?;
        }
        if !out.dead.is_empty() {
            // Error texts through `sanitize_error` (a NUL byte escaped, a long text cut):
            // PostgreSQL refuses a NUL in text, and a refused outcome would stop the relay
            // at the same message after every restart.
            let (ids, errors): (Vec<Uuid>, Vec<String>) = out
                .dead
                .iter()
                .map(|(id, e)| (*id, sanitize_error(e).into_owned()))
                .unzip();
            let sql = format!(
                "UPDATE {schema}.outbox_messages AS m \
                 SET status = 3, last_error = d.error, attempts = m.attempts + 1, \
                     claim_token = NULL, lease_until = NULL, unfinished_alone = 0, \
                     parked_until = NULL, parked_for = NULL \
                 FROM unnest($1::uuid[], $2::text[]) AS d(id, error) \
                 WHERE m.id = d.id AND {}",
                whose.filter(3)
            );
            bind_token(
                sqlx::query(AssertSqlSafe(sql)).bind(ids).bind(errors),
                token,
            )
            .execute(&mut *conn)
            .await
            .map_err(db("wal record dead"))?;
        }
        let mut due: Vec<Option<f64>> = Vec::new();
        if !out.parked.is_empty() {
            let ids: Vec<Uuid> = out.parked.iter().map(|p| p.id).collect();
            let delays: Vec<f64> = out.parked.iter().map(|p| p.delay.as_secs_f64()).collect();
            let charges: Vec<i32> = out.parked.iter().map(|p| i32::from(p.charge)).collect();
            let errors: Vec<Option<String>> = out
                .parked
                .iter()
                .map(|p| p.error.as_deref().map(|e| sanitize_error(e).into_owned()))
                .collect();
            let held: Vec<Option<&str>> =
                out.parked.iter().map(|p| p.held_for.as_deref()).collect();
            // Parked: Processing, due at `lease_until`, no claim (see `park`). A row
            // with no earlier parked row of its key (in the table or in this
            // statement) is its key's head: `parked_until` when it is due ('infinity'
            // while a circuit holds it). `FOR SHARE`: a head the sweeper is taking out
            // in a transaction of its own is waited for and looked at again, so that
            // a row parked behind it meanwhile becomes the head itself.
            let sql = format!(
                "WITH d AS (SELECT * FROM unnest($1::uuid[], $2::float8[], $3::int[], $4::text[], $5::text[]) \
                              AS d(id, delay, charge, error, held_for)), \
                 h AS (SELECT d.*, NOT EXISTS ( \
                           SELECT 1 FROM {schema}.outbox_messages AS o \
                            WHERE o.order_key = r.order_key AND o.phase = 0 AND o.seq < r.seq \
                              AND (o.status = 9 OR o.id IN (SELECT id FROM d)) \
                              FOR SHARE OF o) AS head \
                         FROM d JOIN {schema}.outbox_messages AS r ON r.id = d.id) \
                 UPDATE {schema}.outbox_messages AS m \
                 SET status = 9, claim_token = NULL, unfinished_alone = 0, \
                     lease_until = GREATEST(m.visible_at, now() + make_interval(secs => h.delay)), \
                     attempts = m.attempts + h.charge, \
                     last_error = COALESCE(h.error, m.last_error), \
                     first_failed_at = CASE WHEN h.charge > 0 \
                         THEN COALESCE(m.first_failed_at, now()) ELSE m.first_failed_at END, \
                     parked_for = CASE WHEN h.head THEN h.held_for END, \
                     parked_until = CASE WHEN NOT h.head THEN NULL \
                         WHEN h.held_for IS NOT NULL THEN 'infinity' \
                         ELSE GREATEST(m.visible_at, now() + make_interval(secs => h.delay)) END \
                 FROM h WHERE m.id = h.id AND {} \
                 RETURNING CASE WHEN m.parked_until < 'infinity' \
                     THEN EXTRACT(EPOCH FROM m.parked_until - now())::float8 END",
                whose.filter(6)
            );
            let rows = bind_token(
                sqlx::query(AssertSqlSafe(sql))
                    .persistent(false)
                    .bind(ids)
                    .bind(delays)
                    .bind(charges)
                    .bind(errors)
                    .bind(held),
                token,
            )
            .fetch_all(&mut *conn)
            .await
            .map_err(db("wal record parked"))?;
            due = rows
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()
                .map_err(db("wal record parked"))?;
        }
        if !out.promote.is_empty() {
            // Each key's first parked row left is its head (rows parked behind a row
            // that left have none).
            let sql = format!(
                "UPDATE {schema}.outbox_messages AS m \
                 SET parked_until = GREATEST(m.lease_until, now()) \
                 FROM (SELECT (SELECT o.id FROM {schema}.outbox_messages AS o \
                                WHERE o.order_key = k AND o.phase = 0 AND o.status = 9 \
                                ORDER BY o.seq LIMIT 1) AS id \
                         FROM unnest($1::text[]) AS k) AS f \
                 WHERE m.id = f.id AND m.parked_until IS NULL \
                 RETURNING EXTRACT(EPOCH FROM m.parked_until - now())::float8"
            );
            let flagged: Vec<Option<f64>> = sqlx::query_scalar(AssertSqlSafe(sql))
                .persistent(false)
                .bind(&out.promote)
                .fetch_all(&mut *conn)
                .await
                .map_err(db("wal record heads"))?;
            due.extend(flagged);
        }
        Ok(due
            .into_iter()
            .flatten()
            .reduce(f64::min)
            .map(|s| Duration::from_secs_f64(s.clamp(0.0, 86_400.0))))
    }
}

/// Outcomes of a publish, recorded by one call of [`Recorder::record`].
#[derive(Debug, Default)]
pub(super) struct Outcomes {
    pub(super) sent: Vec<Uuid>,
    pub(super) dead: Vec<(Uuid, String)>,
    pub(super) parked: Vec<ParkedRow>,
    /// Ordering keys whose first parked row is to be their head (the sweeper's: a
    /// head of theirs left or was parked again).
    pub(super) promote: Vec<String>,
}

impl Outcomes {
    pub(super) fn is_empty(&self) -> bool {
        self.sent.is_empty()
            && self.dead.is_empty()
            && self.parked.is_empty()
            && self.promote.is_empty()
    }
}

/// What the database said of a batch just before it is published (see
/// [`WalRelay::wait_visible`]).
#[derive(Debug)]
pub(super) struct Checked {
    /// The database's `now()`: a message is due when its `visible_at` is not after
    /// it. Read a few milliseconds before the publish, so a message is never published
    /// before its `visible_at` by the database's clock; one that comes due in between
    /// is parked and published by the sweeper.
    pub(super) now: DateTime<Utc>,
    /// The batch's ordering keys that have parked rows in the table.
    pub(super) waiting: HashSet<String>,
}

/// Whose rows a [`WalRelay::record`] changes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Whose {
    /// The stream's: rows still `New`.
    Pending,
    /// The sweeper's: `Processing` rows claimed with this token.
    Claimed(Uuid),
}

impl Whose {
    /// The predicate on `m` of a recording statement, the token (if any) being its
    /// parameter `$token`: the stream's rows are `New`; the sweeper's are the
    /// `Processing` rows of its claim.
    fn filter(self, token: usize) -> String {
        match self {
            Self::Pending => "m.status = 0".to_owned(),
            Self::Claimed(_) => format!("m.status = 9 AND m.claim_token = ${token}"),
        }
    }
}

fn bind_token<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    token: Option<Uuid>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    match token {
        Some(t) => q.bind(t),
        None => q,
    }
}

/// The stream's outcomes being recorded by a task of their own while the next
/// batches are read and published: the table is written once per recording, and that
/// write need not hold up the next publish.
///
/// At most one recording is in flight. Outcomes started while it is (the batches in
/// flight coming back, see `pipeline`) are queued and merged, and recorded together
/// once it has ended ([`advance`](Self::advance), [`settle`](Self::settle)): a
/// recording costs PostgreSQL a commit (a WAL flush), and batches landing faster than
/// that no longer wait for each other's. Every other record of the stream waits for
/// both first ([`settle`](Self::settle)), so outcomes reach the table in stream order
/// (the sweeper sees a key's parked rows in order). The replication position is
/// confirmed only once the recording holding it has ended (see `session`). Dropped
/// (the session ends with an error), the task is aborted: what it did not record is
/// read again by the next session, as after a crash.
#[derive(Debug, Default)]
pub(super) struct Recording {
    task: Option<JoinHandle<Result<bool, WalError>>>,
    /// Everything received up to here is handled once the task has ended.
    upto: Option<Lsn>,
    /// A position whose recording ended, to confirm.
    settled: Option<Lsn>,
    /// Outcomes waiting for the task in flight.
    next: Option<Queued>,
}

/// Outcomes queued behind the recording in flight.
#[derive(Debug)]
struct Queued {
    recorder: Recorder,
    out: Outcomes,
    keys: Vec<String>,
    parked: Arc<Parked>,
    shutdown: CancellationToken,
    upto: Option<Lsn>,
}

impl Recording {
    /// Whether a recording is in flight.
    pub(super) fn busy(&self) -> bool {
        self.task.is_some()
    }

    /// Whether a recording in flight has ended and waits to be settled.
    pub(super) fn ended(&self) -> bool {
        self.task
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished)
    }

    /// Records `out` (the stream's, rows still `New`) in a task, then unregisters its
    /// messages' `keys` from the stream; queued behind the recording in flight, if
    /// any.
    pub(super) fn start(
        &mut self,
        recorder: Recorder,
        out: Outcomes,
        keys: Vec<String>,
        parked: Arc<Parked>,
        shutdown: CancellationToken,
    ) {
        let queued = Queued {
            recorder,
            out,
            keys,
            parked,
            shutdown,
            upto: None,
        };
        if self.task.is_none() {
            self.spawn(queued);
            return;
        }
        match &mut self.next {
            Some(q) => {
                q.out.sent.extend(queued.out.sent);
                q.out.dead.extend(queued.out.dead);
                q.out.parked.extend(queued.out.parked);
                q.out.promote.extend(queued.out.promote);
                q.keys.extend(queued.keys);
            }
            None => self.next = Some(queued),
        }
    }

    fn spawn(&mut self, q: Queued) {
        debug_assert!(self.task.is_none(), "one recording at a time");
        self.upto = q.upto;
        self.task = Some(tokio::spawn(async move {
            let recorded = q
                .recorder
                .record(&q.out, Whose::Pending, &q.parked, &q.shutdown)
                .await?;
            if recorded {
                q.parked.leave_stream(q.keys.iter().map(String::as_str));
            }
            Ok(recorded)
        }));
    }

    /// Once the outcomes last started are recorded, everything received up to `lsn` is
    /// handled.
    pub(super) fn holds(&mut self, lsn: Option<Lsn>) {
        if lsn.is_none() {
            return;
        }
        match &mut self.next {
            Some(q) => q.upto = lsn,
            None => self.upto = lsn,
        }
    }

    /// Everything received up to `lsn` is handled once the recordings in flight and
    /// queued (if any) have ended, or now.
    pub(super) fn after(&mut self, lsn: Option<Lsn>) {
        if self.busy() {
            self.holds(lsn);
        } else if lsn.is_some() {
            self.settled = lsn;
        }
    }

    /// Takes the outcome of the task in flight, which has ended, and starts the
    /// outcomes queued behind it. `Some`: the recording did not complete (shutdown came
    /// first, or an error), and the queued outcomes are dropped.
    fn ended_with(
        &mut self,
        ended: Result<Result<bool, WalError>, tokio::task::JoinError>,
    ) -> Option<Result<bool, WalError>> {
        self.task = None;
        match ended {
            Ok(Ok(true)) => {
                self.settled = self.upto.take().or(self.settled);
                if let Some(q) = self.next.take() {
                    self.spawn(q);
                }
                None
            }
            Ok(other) => {
                self.next = None;
                Some(other)
            }
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => {
                self.next = None;
                Some(Ok(false))
            }
        }
    }

    /// Settles the recording in flight if it has ended and starts the outcomes queued
    /// behind it; never waits for one still running. `Ok(false)` and errors: as
    /// [`settle`](Self::settle).
    pub(super) async fn advance(&mut self) -> Result<bool, WalError> {
        if !self.ended() {
            return Ok(true);
        }
        let Some(task) = self.task.as_mut() else {
            return Ok(true);
        };
        // It has ended: this returns at once.
        let ended = task.await;
        match self.ended_with(ended) {
            None => Ok(true),
            Some(other) => other,
        }
    }

    /// Waits for the recording in flight and the outcomes queued behind it (if any) to
    /// be recorded. Cancel-safe (a task is kept until it ended). `Ok(false)`: shutdown
    /// came first and the outcomes may not all be recorded; an error of the task ends
    /// the session.
    pub(super) async fn settle(&mut self) -> Result<bool, WalError> {
        while let Some(task) = self.task.as_mut() {
            let ended = task.await;
            if let Some(other) = self.ended_with(ended) {
                return other;
            }
        }
        Ok(true)
    }

    /// The position of the recordings that ended since the last call, to confirm.
    pub(super) fn take_settled(&mut self) -> Option<Lsn> {
        self.settled.take()
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
