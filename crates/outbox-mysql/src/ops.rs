//! Operator queries behind the `outbox` binary: the [`OutboxAdmin`] impl of
//! [`MySqlOutbox`] (the same capabilities as the PostgreSQL and SQL Server backends):
//!
//! - [`OutboxAdmin::stats_by_group`], [`OutboxAdmin::pending_stats`] (bounded, for the
//!   relay's gauges), [`OutboxAdmin::oldest_claimable_wait`];
//! - [`OutboxAdmin::reconcile`]: outbox rows vs each consumer's inbox records;
//! - retention: [`OutboxAdmin::archive_sent`], [`OutboxAdmin::archive_inbox_records`]
//!   (moves into the archive tables of migration 1) and the purges;
//! - the consumer side's dead letters and their replay;
//! - the dashboard: [`OutboxAdmin::list_messages`] (keyset pages along the state's
//!   index), [`OutboxAdmin::count_messages`] (bounded), [`OutboxAdmin::sent_per_minute`],
//!   relay heartbeats in `outbox_relays` (migration 3).
//!
//! The inbox queries read the inbox tables of the **same database** as the outbox.
//! These are admin queries: the breakdowns scan the table.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outboxkit_core::inbox::DurableInbox;
use outboxkit_core::{
    InboxStore, MessageFilter, MessageStatus, OnDead, OutboxAdmin, OutboxError, OutboxStats,
};
use sqlx::mysql::MySqlArguments;
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, MySql, Row};
use uuid::Uuid;

use crate::error::db;
use crate::sql::{
    BEGIN_READ_COMMITTED, FILTER, PENDING_LAG_SECS, like_escape, micros, placeholders,
    quoted_schema,
};
use crate::store::{MySqlOutbox, bind_filter, count, limit};

use outboxkit_core::admin::{
    GroupStats, InboxDeadFilter, InboxDeadKind, InboxDeadLetter, InboxReplayMode,
    InboxReplayReport, MessageCount, MessageCursor, MessagePage, MessageState, MessageSummary,
    PENDING_STATS_BOUND, ReconcileRow, RelayHeartbeat, RelaySeen, SentPerMinute,
};

/// Columns of the outbox archive (migration 1).
const ARCHIVE_COLUMNS: &str = "id, seq, aggregate_type, aggregate_id, aggregate_version, \
    event_type, payload, headers, tenant_id, routing_key, partition_key, occurred_at, \
    created_at, attempts, last_error, sent_at";

/// Filter over `inbox_failures f` (bound by [`bind_inbox_filter`]: ids as a JSON array
/// of hex strings, from, to, consumer, event type, error text; each twice).
const FAILURE_FILTER: &str = "f.dead_at IS NOT NULL
    AND (? IS NULL OR JSON_CONTAINS(?, JSON_QUOTE(LOWER(HEX(f.message_id)))))
    AND (? IS NULL OR f.dead_at >= ?)
    AND (? IS NULL OR f.dead_at < ?)
    AND (? IS NULL OR f.consumer = ?)
    AND (? IS NULL OR f.event_type = ?)
    AND (? IS NULL OR LOWER(f.last_error) LIKE CONCAT('%', LOWER(?), '%') ESCAPE '!')";

/// Filter over `inbox_messages d`, same parameters as [`FAILURE_FILTER`].
const DURABLE_FILTER: &str = "d.phase = 3
    AND (? IS NULL OR JSON_CONTAINS(?, JSON_QUOTE(LOWER(HEX(d.id)))))
    AND (? IS NULL OR d.received_at >= ?)
    AND (? IS NULL OR d.received_at < ?)
    AND (? IS NULL OR LEFT(COALESCE(d.last_error, ''), CHAR_LENGTH(?) + 2) = CONCAT(?, ': '))
    AND (? IS NULL OR d.event_type = ?)
    AND (? IS NULL OR LOWER(d.last_error) LIKE CONCAT('%', LOWER(?), '%') ESCAPE '!')";

/// Columns of a [`MessageSummary`].
const SUMMARY_COLUMNS: &str = "m.id, m.seq, m.status, m.event_type, m.aggregate_type, \
    m.aggregate_id, m.tenant_id, m.created_at, m.visible_at, m.sent_at, m.attempts, m.last_error";

fn bind_inbox_filter<'q>(
    query: Query<'q, MySql, MySqlArguments>,
    f: &'q InboxDeadFilter,
    durable: bool,
) -> Query<'q, MySql, MySqlArguments> {
    let ids = (!f.ids.is_empty()).then(|| {
        serde_json::Value::from(
            f.ids
                .iter()
                .map(|id| serde_json::Value::from(id.simple().to_string()))
                .collect::<Vec<_>>(),
        )
        .to_string()
    });
    let error = f.error_contains.as_deref().map(like_escape);
    let mut query = query
        .bind(ids.clone())
        .bind(ids)
        .bind(f.from)
        .bind(f.from)
        .bind(f.to)
        .bind(f.to)
        .bind(f.consumer.as_deref())
        .bind(f.consumer.as_deref());
    if durable {
        query = query.bind(f.consumer.as_deref());
    }
    query
        .bind(f.event_type.as_deref())
        .bind(f.event_type.as_deref())
        .bind(error.clone())
        .bind(error)
}

/// The state's phase predicate, order column and direction (`>` ascending, `<`
/// descending): each is the prefix of an index `(phase, column, seq)`.
fn state_order(state: MessageState) -> (&'static str, &'static str, &'static str) {
    match state {
        MessageState::Pending => ("m.phase = 0", "m.visible_at", ">"),
        MessageState::Dead => ("m.phase = 3", "m.created_at", "<"),
        MessageState::Sent => ("m.phase = 1", "m.sent_at", "<"),
    }
}

/// The keyset condition after a cursor (`at`, `seq`: three parameters, `at` twice).
fn after_cursor(at: &str, cmp: &str) -> String {
    format!(" AND ({at} {cmp} ? OR ({at} = ? AND m.seq {cmp} ?))")
}

fn bind_cursor<'q>(
    query: Query<'q, MySql, MySqlArguments>,
    c: MessageCursor,
) -> Query<'q, MySql, MySqlArguments> {
    query.bind(c.at).bind(c.at).bind(c.seq)
}

impl MySqlOutbox {
    /// `` `schema` ``.
    fn s(&self) -> String {
        quoted_schema(self.schema())
    }

    /// The outbox rows of `ids` go to the archive and leave the table, in the caller's
    /// transaction.
    async fn move_to_archive(
        &self,
        tx: &mut sqlx::MySqlConnection,
        ids: &[Uuid],
    ) -> Result<u64, OutboxError> {
        let s = self.s();
        let list = placeholders(ids.len());
        let mut copy = sqlx::query(AssertSqlSafe(format!(
            "INSERT IGNORE INTO {s}.outbox_messages_archive ({ARCHIVE_COLUMNS})
             SELECT {ARCHIVE_COLUMNS} FROM {s}.outbox_messages WHERE id IN ({list})"
        )));
        for id in ids {
            copy = copy.bind(*id);
        }
        copy.execute(&mut *tx).await.map_err(db("archive_sent"))?;
        let mut delete = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {s}.outbox_messages WHERE id IN ({list})"
        )));
        for id in ids {
            delete = delete.bind(*id);
        }
        Ok(delete
            .execute(&mut *tx)
            .await
            .map_err(db("archive_sent"))?
            .rows_affected())
    }
}

#[async_trait::async_trait]
impl OutboxAdmin for MySqlOutbox {
    fn backend(&self) -> &'static str {
        "mysql"
    }

    fn schema(&self) -> &str {
        MySqlOutbox::schema(self)
    }

    async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        MySqlOutbox::migrate(self).await
    }

    /// Counts by status and the oldest pending age, per `(event_type, tenant_id)`,
    /// ordered by event type then tenant (no tenant first). Scans the table.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn stats_by_group(&self) -> Result<Vec<GroupStats>, OutboxError> {
        let s = self.s();
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_type, tenant_id,
                    COUNT(CASE WHEN status = 0 THEN 1 END), COUNT(CASE WHEN status = 9 THEN 1 END),
                    COUNT(CASE WHEN status = 1 THEN 1 END), COUNT(CASE WHEN status = 3 THEN 1 END),
                    {PENDING_LAG_SECS}
               FROM {s}.outbox_messages
              GROUP BY event_type, tenant_id
              ORDER BY event_type, tenant_id"
        )))
        .fetch_all(self.pool())
        .await
        .map_err(db("stats_by_group"))?;
        rows.iter()
            .map(|r| {
                let n = |i: usize| r.try_get::<i64, _>(i).map(count);
                Ok(GroupStats {
                    event_type: r.try_get(0)?,
                    tenant_id: r.try_get(1)?,
                    new: n(2)?,
                    processing: n(3)?,
                    sent: n(4)?,
                    dead: n(5)?,
                    oldest_pending_age_secs: r.try_get::<Option<f64>, _>(6)?.map(|a| a.max(0.0)),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db("stats_by_group"))
    }

    /// The relay's periodic gauges, **bounded** as on PostgreSQL: `new` and
    /// `processing` count the first [`PENDING_STATS_BOUND`] pending rows in claim order
    /// (the pending index), `dead` at most that many rows, `oldest_pending_age` is the
    /// queue lag among those pending rows, counted from when each became due (see
    /// [`OutboxStats::oldest_pending_age`]); `sent` is not counted (0).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn pending_stats(&self) -> Result<OutboxStats, OutboxError> {
        let s = self.s();
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT COUNT(CASE WHEN p.status = 0 THEN 1 END),
                    COUNT(CASE WHEN p.status = 9 THEN 1 END),
                    (SELECT COUNT(*) FROM (SELECT 1 FROM {s}.outbox_messages
                                            WHERE phase = 3 LIMIT ?) d),
                    {PENDING_LAG_SECS}
               FROM (SELECT status, visible_at, first_failed_at FROM {s}.outbox_messages
                      WHERE phase = 0 ORDER BY phase, visible_at, seq LIMIT ?) p"
        )))
        .bind(PENDING_STATS_BOUND)
        .bind(PENDING_STATS_BOUND)
        .fetch_one(self.pool())
        .await
        .map_err(db("pending_stats"))?;
        let n = |i: usize| {
            row.try_get::<i64, _>(i)
                .map(count)
                .map_err(db("pending_stats"))
        };
        let age: Option<f64> = row.try_get(3).map_err(db("pending_stats"))?;
        let mut stats = OutboxStats::default();
        stats.new = n(0)?;
        stats.processing = n(1)?;
        stats.dead = n(2)?;
        stats.oldest_pending_age = age.map(|a| Duration::from_secs_f64(a.max(0.0)));
        Ok(stats)
    }

    /// How long the oldest claimable message (`New` and visible) has been waiting, by
    /// the database clock; `None` when nothing is claimable. With `ordered` (per-key
    /// mode) a message waiting behind an earlier one of its key (in flight, in a retry
    /// backoff or, under [`OnDead::Block`], `Dead`) is not claimable; only the 1,000
    /// oldest visible messages are examined.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn oldest_claimable_wait(
        &self,
        ordered: Option<OnDead>,
    ) -> Result<Option<Duration>, OutboxError> {
        let s = self.s();
        let sql = match ordered {
            None => format!(
                "SELECT TIMESTAMPDIFF(MICROSECOND, MIN(visible_at), NOW(6)) / 1e6
                   FROM {s}.outbox_messages WHERE phase = 0 AND status = 0 AND visible_at <= NOW(6)"
            ),
            Some(on_dead) => {
                let dead_blocks = if on_dead == OnDead::Block {
                    format!(
                        "OR EXISTS (SELECT 1 FROM {s}.outbox_messages d
                                     WHERE d.phase = 3 AND d.order_key = m.order_key AND d.seq < m.seq)"
                    )
                } else {
                    String::new()
                };
                format!(
                    "SELECT TIMESTAMPDIFF(MICROSECOND, MIN(m.visible_at), NOW(6)) / 1e6
                       FROM (SELECT order_key, seq, visible_at FROM {s}.outbox_messages
                              WHERE phase = 0 AND status = 0 AND visible_at <= NOW(6)
                              ORDER BY phase, visible_at, seq LIMIT 1000) m
                      WHERE NOT (EXISTS (
                            SELECT 1 FROM {s}.outbox_messages b
                             WHERE b.phase = 0 AND b.order_key = m.order_key AND b.seq < m.seq
                               AND (b.status = 9 OR b.visible_at > NOW(6))) {dead_blocks})"
                )
            }
        };
        let secs: Option<f64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(self.pool())
            .await
            .map_err(db("oldest_claimable_wait"))?;
        Ok(secs.map(|s| Duration::from_secs_f64(s.max(0.0))))
    }

    /// Reconciles the outbox with the inbox records of the same database for messages
    /// created in `[from, to)`: one row per UTC day, tenant, event type and consumer
    /// (the contract of [`OutboxAdmin::reconcile`]).
    ///
    /// # Errors
    /// [`OutboxError::Config`] when `to <= from`, [`OutboxError::Database`] on database
    /// failure.
    async fn reconcile(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        consumers: &[String],
    ) -> Result<Vec<ReconcileRow>, OutboxError> {
        if to <= from {
            return Err(OutboxError::Config(format!(
                "reconcile window is empty: {from} is not before {to}"
            )));
        }
        let s = self.s();
        let named = serde_json::to_string(consumers).unwrap_or_else(|_| "[]".into());
        let rows = sqlx::query(AssertSqlSafe(format!(
            "WITH w AS (
                 SELECT id, DATE(created_at) AS day, tenant_id, event_type
                   FROM {s}.outbox_messages WHERE created_at >= ? AND created_at < ?
             ), named AS (
                 SELECT c.consumer FROM JSON_TABLE(?, '$[*]' COLUMNS (
                     consumer VARCHAR(255) CHARACTER SET utf8mb4 PATH '$')) c
             ), written AS (
                 SELECT day, tenant_id, event_type, COUNT(*) AS n FROM w
                  GROUP BY day, tenant_id, event_type
             ), seen AS (
                 SELECT w.event_type, r.consumer FROM w JOIN {s}.inbox_records r ON r.message_id = w.id
                 UNION
                 SELECT w.event_type, f.consumer FROM w JOIN {s}.inbox_failures f ON f.message_id = w.id
                 UNION
                 SELECT e.event_type, CONVERT(n.consumer USING utf8mb4) COLLATE utf8mb4_bin
                   FROM (SELECT DISTINCT event_type FROM w) e CROSS JOIN named n
             ), expected AS (
                 SELECT DISTINCT event_type, consumer FROM seen
                  WHERE (SELECT COUNT(*) FROM named) = 0
                     OR consumer IN (SELECT CONVERT(consumer USING utf8mb4) COLLATE utf8mb4_bin FROM named)
             ), processed AS (
                 SELECT w.day, w.tenant_id, w.event_type, r.consumer, COUNT(*) AS n
                   FROM w JOIN {s}.inbox_records r ON r.message_id = w.id
                  GROUP BY w.day, w.tenant_id, w.event_type, r.consumer
             ), dead AS (
                 SELECT w.day, w.tenant_id, w.event_type, f.consumer, COUNT(*) AS n
                   FROM w JOIN {s}.inbox_failures f ON f.message_id = w.id AND f.dead_at IS NOT NULL
                  GROUP BY w.day, w.tenant_id, w.event_type, f.consumer
             )
             SELECT wr.day, wr.tenant_id, wr.event_type, x.consumer, wr.n,
                    COALESCE(p.n, 0), COALESCE(d.n, 0)
               FROM written wr
               JOIN expected x ON x.event_type = wr.event_type
               LEFT JOIN processed p ON p.day = wr.day AND p.tenant_id <=> wr.tenant_id
                                    AND p.event_type = wr.event_type AND p.consumer = x.consumer
               LEFT JOIN dead d ON d.day = wr.day AND d.tenant_id <=> wr.tenant_id
                               AND d.event_type = wr.event_type AND d.consumer = x.consumer
              ORDER BY wr.day, wr.tenant_id, wr.event_type, x.consumer"
        )))
        .bind(from)
        .bind(to)
        .bind(named)
        .fetch_all(self.pool())
        .await
        .map_err(db("reconcile"))?;
        rows.iter()
            .map(|r| {
                let written: i64 = r.try_get(4)?;
                let processed: i64 = r.try_get(5)?;
                Ok(ReconcileRow {
                    day: r.try_get(0)?,
                    tenant_id: r.try_get(1)?,
                    event_type: r.try_get(2)?,
                    consumer: r.try_get(3)?,
                    written: count(written),
                    processed: count(processed),
                    dead: count(r.try_get(6)?),
                    missing: written - processed,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db("reconcile"))
    }

    /// Moves up to `batch_size` `Sent` rows whose `sent_at` is older than `older_than`
    /// into `outbox_messages_archive` (one `READ COMMITTED` transaction: rows locked
    /// with `SKIP LOCKED`, copied, deleted); returns how many moved. Call until it
    /// returns less than `batch_size`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn archive_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        let s = self.s();
        let mut tx = self
            .pool()
            .begin_with(BEGIN_READ_COMMITTED)
            .await
            .map_err(db("archive_sent"))?;
        let ids: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {s}.outbox_messages
              WHERE phase = 1 AND sent_at <= NOW(6) - INTERVAL ? MICROSECOND
              ORDER BY phase, sent_at, seq LIMIT ? FOR UPDATE SKIP LOCKED"
        )))
        .bind(micros(older_than))
        .bind(limit(batch_size))
        .fetch_all(&mut *tx)
        .await
        .map_err(db("archive_sent"))?;
        let moved = if ids.is_empty() {
            0
        } else {
            self.move_to_archive(&mut tx, &ids).await?
        };
        tx.commit().await.map_err(db("archive_sent"))?;
        Ok(moved)
    }

    async fn purge_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.inbox().purge(older_than, batch_size).await
    }

    async fn purge_inbox_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.inbox().purge_processed(older_than, batch_size).await
    }

    /// Moves up to `batch_size` inbox records older than `older_than` into
    /// `inbox_records_archive`; returns how many moved. An archived record no longer
    /// absorbs duplicates (as with [`InboxStore::purge`]).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn archive_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        const OP: &str = "archive_inbox_records";
        let s = self.s();
        let mut tx = self
            .pool()
            .begin_with(BEGIN_READ_COMMITTED)
            .await
            .map_err(db(OP))?;
        let pairs: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT message_id, consumer FROM {s}.inbox_records
              WHERE processed_at <= NOW(6) - INTERVAL ? MICROSECOND
              ORDER BY processed_at LIMIT ? FOR UPDATE SKIP LOCKED"
        )))
        .bind(micros(older_than))
        .bind(limit(batch_size))
        .fetch_all(&mut *tx)
        .await
        .map_err(db(OP))?;
        let mut moved = 0;
        if !pairs.is_empty() {
            let list = vec!["(?, ?)"; pairs.len()].join(", ");
            let mut copy = sqlx::query(AssertSqlSafe(format!(
                "INSERT IGNORE INTO {s}.inbox_records_archive (message_id, consumer, processed_at)
                 SELECT message_id, consumer, processed_at FROM {s}.inbox_records
                  WHERE (message_id, consumer) IN ({list})"
            )));
            for (id, consumer) in &pairs {
                copy = copy.bind(*id).bind(consumer.as_str());
            }
            copy.execute(&mut *tx).await.map_err(db(OP))?;
            let mut delete = sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {s}.inbox_records WHERE (message_id, consumer) IN ({list})"
            )));
            for (id, consumer) in &pairs {
                delete = delete.bind(*id).bind(consumer.as_str());
            }
            moved = delete
                .execute(&mut *tx)
                .await
                .map_err(db(OP))?
                .rows_affected();
        }
        tx.commit().await.map_err(db(OP))?;
        Ok(moved)
    }

    /// Consumer-side dead letters matching `filter`: idempotent-consumer dead letters
    /// then durable-inbox `Dead` rows, each oldest first, at most `limit_rows` in all.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        limit_rows: usize,
    ) -> Result<Vec<InboxDeadLetter>, OutboxError> {
        const OP: &str = "inbox_dead_letters";
        let s = self.s();
        let consumer_rows = bind_inbox_filter(
            sqlx::query(AssertSqlSafe(format!(
                "SELECT f.message_id, f.consumer, f.event_type, f.last_error, f.attempts, f.dead_at
                   FROM {s}.inbox_failures f WHERE {FAILURE_FILTER}
                  ORDER BY f.dead_at LIMIT ?"
            ))),
            filter,
            false,
        )
        .bind(limit(limit_rows))
        .fetch_all(self.pool())
        .await
        .map_err(db(OP))?;
        let mut out = consumer_rows
            .iter()
            .map(|r| {
                Ok(InboxDeadLetter {
                    kind: InboxDeadKind::Consumer,
                    message_id: r.try_get(0)?,
                    consumer: r.try_get(1)?,
                    event_type: r.try_get(2)?,
                    last_error: r.try_get(3)?,
                    attempts: r.try_get(4)?,
                    at: r.try_get(5)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(db(OP))?;
        let left = limit_rows.saturating_sub(out.len());
        if left > 0 {
            let durable_rows = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT d.id, d.event_type, d.last_error, d.attempts, d.received_at
                       FROM {s}.inbox_messages d WHERE {DURABLE_FILTER}
                      ORDER BY d.received_at LIMIT ?"
                ))),
                filter,
                true,
            )
            .bind(limit(left))
            .fetch_all(self.pool())
            .await
            .map_err(db(OP))?;
            for r in &durable_rows {
                out.push(
                    (|| {
                        Ok::<_, sqlx::Error>(InboxDeadLetter {
                            kind: InboxDeadKind::Durable,
                            message_id: r.try_get(0)?,
                            consumer: None,
                            event_type: r.try_get(1)?,
                            last_error: r.try_get(2)?,
                            attempts: r.try_get(3)?,
                            at: r.try_get(4)?,
                        })
                    })()
                    .map_err(db(OP))?,
                );
            }
        }
        Ok(out)
    }

    /// Replays consumer-side dead letters in one transaction: the matching
    /// `inbox_failures` rows are locked and cleared (with
    /// [`InboxReplayMode::Republish`], only those whose message is still in this
    /// outbox, which is requeued as `New`), and the matching durable-inbox `Dead` rows
    /// go back to `New`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure (nothing is changed then).
    async fn replay_inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        mode: InboxReplayMode,
    ) -> Result<InboxReplayReport, OutboxError> {
        const OP: &str = "inbox_replay";
        let dry_run = mode == InboxReplayMode::DryRun;
        let clear_only = mode == InboxReplayMode::ClearOnly;
        let started = Instant::now();
        let s = self.s();
        let mut tx = self.pool().begin().await.map_err(db(OP))?;
        let (matched, replayed) = if dry_run {
            let failures: i64 = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {s}.inbox_failures f WHERE {FAILURE_FILTER}"
                ))),
                filter,
                false,
            )
            .fetch_one(&mut *tx)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(db(OP))?;
            let durable: i64 = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT COUNT(*) FROM {s}.inbox_messages d WHERE {DURABLE_FILTER}"
                ))),
                filter,
                true,
            )
            .fetch_one(&mut *tx)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(db(OP))?;
            (count(failures) + count(durable), 0)
        } else {
            let target: Vec<(Uuid, String)> = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT f.message_id, f.consumer FROM {s}.inbox_failures f
                      WHERE {FAILURE_FILTER} ORDER BY f.message_id, f.consumer FOR UPDATE"
                ))),
                filter,
                false,
            )
            .fetch_all(&mut *tx)
            .await
            .and_then(|rows| {
                rows.iter()
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                    .collect()
            })
            .map_err(db(OP))?;
            let ids: Vec<Uuid> = target
                .iter()
                .map(|(id, _)| *id)
                .collect::<HashSet<_>>()
                .into_iter()
                .collect();
            let mut source: Vec<(Uuid, i16)> = Vec::new();
            if !ids.is_empty() {
                let mut q = sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT id, status FROM {s}.outbox_messages WHERE id IN ({}) FOR UPDATE",
                    placeholders(ids.len())
                )));
                for id in &ids {
                    q = q.bind(*id);
                }
                source = q.fetch_all(&mut *tx).await.map_err(db(OP))?;
            }
            let requeue: Vec<Uuid> = source
                .iter()
                .filter(|(_, status)| {
                    *status == MessageStatus::Sent.code() || *status == MessageStatus::Dead.code()
                })
                .map(|(id, _)| *id)
                .collect();
            let mut requeued = 0;
            if !clear_only && !requeue.is_empty() {
                let mut q = sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {s}.outbox_messages
                        SET attempts = 0, visible_at = NOW(6), lease_until = NULL,
                            claim_token = NULL, sent_at = NULL, unfinished_claims = 0,
                            unfinished_alone = 0, status = 0
                      WHERE id IN ({})",
                    placeholders(requeue.len())
                )));
                for id in &requeue {
                    q = q.bind(*id);
                }
                requeued = q.execute(&mut *tx).await.map_err(db(OP))?.rows_affected();
            }
            let in_outbox: HashSet<Uuid> = source.iter().map(|(id, _)| *id).collect();
            let clear: Vec<&(Uuid, String)> = target
                .iter()
                .filter(|(id, _)| clear_only || in_outbox.contains(id))
                .collect();
            let mut cleared = 0;
            if !clear.is_empty() {
                let mut q = sqlx::query(AssertSqlSafe(format!(
                    "DELETE FROM {s}.inbox_failures WHERE (message_id, consumer) IN ({})",
                    vec!["(?, ?)"; clear.len()].join(", ")
                )));
                for (id, consumer) in &clear {
                    q = q.bind(*id).bind(consumer.as_str());
                }
                cleared = q.execute(&mut *tx).await.map_err(db(OP))?.rows_affected();
            }
            let durable = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {s}.inbox_messages d
                        SET attempts = 0, visible_at = NOW(6), lease_until = NULL,
                            claim_token = NULL, status = 0
                      WHERE {DURABLE_FILTER}"
                ))),
                filter,
                true,
            )
            .execute(&mut *tx)
            .await
            .map_err(db(OP))?
            .rows_affected();
            let matched = target.len() as u64 + durable;
            let replayed = cleared + durable;
            tracing::info!(
                matched,
                replayed,
                requeued,
                clear_only,
                "consumer dead letters replayed"
            );
            (matched, replayed)
        };
        tx.commit().await.map_err(db(OP))?;
        Ok(InboxReplayReport {
            matched,
            replayed,
            failed: if dry_run {
                0
            } else {
                matched.saturating_sub(replayed)
            },
            elapsed_secs: started.elapsed().as_secs_f64(),
        })
    }

    /// One keyset page of `state` along its index `(phase, time, seq)`. A filtered
    /// page examines at most `scan` rows after the cursor (the filter is applied to
    /// that window), and when the window ends before the page is full its `next`
    /// cursor is the window's end.
    async fn list_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        after: Option<MessageCursor>,
        limit_rows: usize,
        scan: u64,
    ) -> Result<MessagePage, OutboxError> {
        const OP: &str = "list_messages";
        let s = self.s();
        let scanned = *filter != MessageFilter::new();
        let scan = i64::try_from(scan.max(1)).unwrap_or(i64::MAX);
        let (phase, at, cmp) = state_order(state);
        let dir = if cmp == ">" { "" } else { " DESC" };
        let cursor = if after.is_some() {
            after_cursor(at, cmp)
        } else {
            String::new()
        };
        let order = format!("ORDER BY {at}{dir}, m.seq{dir}");
        let rows = if scanned {
            let mut query = sqlx::query(AssertSqlSafe(format!(
                "SELECT {SUMMARY_COLUMNS} FROM (
                     SELECT m.* FROM {s}.outbox_messages m WHERE {phase}{cursor}
                      {order} LIMIT ?) m
                  WHERE {FILTER}
                  {order} LIMIT ?"
            )));
            if let Some(c) = after {
                query = bind_cursor(query, c);
            }
            bind_filter(query.bind(scan), filter)
                .bind(limit(limit_rows.saturating_add(1)))
                .fetch_all(self.pool())
                .await
        } else {
            let mut query = bind_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT {SUMMARY_COLUMNS} FROM {s}.outbox_messages m
                      WHERE {phase} AND {FILTER}{cursor}
                      {order} LIMIT ?"
                ))),
                filter,
            );
            if let Some(c) = after {
                query = bind_cursor(query, c);
            }
            query
                .bind(limit(limit_rows.saturating_add(1)))
                .fetch_all(self.pool())
                .await
        }
        .map_err(db(OP))?;
        let mut rows = rows
            .iter()
            .map(|r| {
                let status: i16 = r.try_get(2).map_err(db(OP))?;
                Ok(MessageSummary {
                    id: r.try_get(0).map_err(db(OP))?,
                    seq: r.try_get(1).map_err(db(OP))?,
                    status: MessageStatus::from_code(status)?,
                    event_type: r.try_get(3).map_err(db(OP))?,
                    aggregate_type: r.try_get(4).map_err(db(OP))?,
                    aggregate_id: r.try_get(5).map_err(db(OP))?,
                    tenant_id: r.try_get(6).map_err(db(OP))?,
                    created_at: r.try_get(7).map_err(db(OP))?,
                    visible_at: r.try_get(8).map_err(db(OP))?,
                    sent_at: r.try_get(9).map_err(db(OP))?,
                    attempts: r.try_get(10).map_err(db(OP))?,
                    last_error: r.try_get(11).map_err(db(OP))?,
                })
            })
            .collect::<Result<Vec<_>, OutboxError>>()?;
        let next = if rows.len() > limit_rows {
            rows.truncate(limit_rows);
            rows.last().map(|m| m.cursor(state))
        } else if scanned {
            // The horizon: the order key of the window's last row, if the state goes on
            // that far.
            let mut query = sqlx::query_as::<_, (DateTime<Utc>, i64)>(AssertSqlSafe(format!(
                "SELECT {at}, m.seq FROM {s}.outbox_messages m WHERE {phase}{cursor}
                  {order} LIMIT 1 OFFSET ?"
            )));
            if let Some(c) = after {
                query = query.bind(c.at).bind(c.at).bind(c.seq);
            }
            query
                .bind(scan - 1)
                .fetch_optional(self.pool())
                .await
                .map_err(db(OP))?
                .map(|(at, seq)| MessageCursor { at, seq })
        } else {
            None
        };
        Ok(MessagePage { rows, next })
    }

    /// Bounded counts: unfiltered, the rows of the state up to `bound`; filtered, the
    /// matching rows among the first `scan` of the state in its order.
    async fn count_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        bound: u64,
        scan: u64,
    ) -> Result<MessageCount, OutboxError> {
        let s = self.s();
        let filtered = *filter != MessageFilter::new();
        let stop = if filtered { scan } else { bound };
        let (phase, at, cmp) = state_order(state);
        let dir = if cmp == ">" { "" } else { " DESC" };
        let sql = if filtered {
            format!(
                "SELECT COUNT(CASE WHEN {FILTER} THEN 1 END), COUNT(*) FROM (
                     SELECT m.id, m.created_at, m.tenant_id, m.aggregate_type, m.aggregate_id,
                            m.event_type, m.last_error
                       FROM {s}.outbox_messages m WHERE {phase}
                      ORDER BY {at}{dir}, m.seq{dir} LIMIT ?) m"
            )
        } else {
            format!(
                "SELECT COUNT(*), COUNT(*) FROM (SELECT 1 FROM {s}.outbox_messages m
                  WHERE {phase} LIMIT ?) c"
            )
        };
        let mut query = sqlx::query(AssertSqlSafe(sql));
        if filtered {
            query = bind_filter(query, filter);
        }
        let (matching, examined): (i64, i64) = query
            .bind(i64::try_from(stop).unwrap_or(i64::MAX))
            .fetch_one(self.pool())
            .await
            .and_then(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .map_err(db("count_messages"))?;
        let (matching, examined) = (count(matching), count(examined));
        Ok(MessageCount {
            matching: matching.min(bound),
            exact: matching < bound && examined < stop,
        })
    }

    async fn sent_per_minute(&self, minutes: u32) -> Result<SentPerMinute, OutboxError> {
        const OP: &str = "sent_per_minute";
        let s = self.s();
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT n.now, a.ago, a.sent
               FROM (SELECT NOW(6) AS now) n
               LEFT JOIN (
                    SELECT TIMESTAMPDIFF(MICROSECOND, m.sent_at, NOW(6)) DIV 60000000 AS ago,
                           COUNT(*) AS sent
                      FROM {s}.outbox_messages m
                     WHERE m.phase = 1 AND m.sent_at > NOW(6) - INTERVAL ? MINUTE
                     GROUP BY ago) a ON TRUE"
        )))
        .bind(i64::from(minutes))
        .fetch_all(self.pool())
        .await
        .map_err(db(OP))?;
        let mut until = None;
        let mut ages = Vec::with_capacity(rows.len());
        for r in &rows {
            until = Some(r.try_get::<DateTime<Utc>, _>(0).map_err(db(OP))?);
            let ago: Option<i64> = r.try_get(1).map_err(db(OP))?;
            let sent: Option<i64> = r.try_get(2).map_err(db(OP))?;
            if let (Some(ago), Some(sent)) = (ago, sent) {
                ages.push((ago, count(sent)));
            }
        }
        Ok(SentPerMinute::from_ages(
            until.unwrap_or_else(Utc::now),
            minutes as usize,
            &ages,
        ))
    }

    /// Two statements: relays not heard of for a day are deleted, then this relay's
    /// row is inserted or updated (`ON DUPLICATE KEY UPDATE`).
    async fn record_heartbeat(&self, beat: &RelayHeartbeat) -> Result<(), OutboxError> {
        let s = self.s();
        sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {s}.outbox_relays
              WHERE last_seen_at < NOW(6) - INTERVAL 1 DAY AND relay_id <> ?"
        )))
        .bind(beat.relay_id)
        .execute(self.pool())
        .await
        .map_err(db("record_heartbeat"))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.outbox_relays
                    (relay_id, host, pid, version, circuit_open, healthy, published, detail)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)
             ON DUPLICATE KEY UPDATE
                    last_seen_at = NOW(6), circuit_open = VALUES(circuit_open),
                    healthy = VALUES(healthy), published = VALUES(published),
                    detail = VALUES(detail)"
        )))
        .bind(beat.relay_id)
        .bind(beat.host.chars().take(255).collect::<String>())
        .bind(i64::from(beat.pid))
        .bind(beat.version.chars().take(255).collect::<String>())
        .bind(beat.circuit_open)
        .bind(beat.healthy)
        .bind(i64::try_from(beat.published).unwrap_or(i64::MAX))
        .bind(beat.detail.chars().take(1000).collect::<String>())
        .execute(self.pool())
        .await
        .map_err(db("record_heartbeat"))?;
        Ok(())
    }

    async fn relays_seen(
        &self,
        within: Duration,
        limit_rows: usize,
    ) -> Result<Vec<RelaySeen>, OutboxError> {
        const OP: &str = "relays_seen";
        let s = self.s();
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT relay_id, host, pid, version, started_at, last_seen_at,
                    TIMESTAMPDIFF(MICROSECOND, last_seen_at, NOW(6)) / 1e6, circuit_open, healthy,
                    published, detail
               FROM {s}.outbox_relays
              WHERE last_seen_at >= NOW(6) - INTERVAL ? MICROSECOND
              ORDER BY last_seen_at DESC, relay_id LIMIT ?"
        )))
        .bind(micros(within))
        .bind(limit(limit_rows))
        .fetch_all(self.pool())
        .await
        .map_err(db(OP))?;
        rows.iter()
            .map(|r| {
                let silent: Option<f64> = r.try_get(6)?;
                Ok(RelaySeen {
                    relay_id: r.try_get(0)?,
                    host: r.try_get(1)?,
                    pid: r.try_get(2)?,
                    version: r.try_get(3)?,
                    started_at: r.try_get(4)?,
                    last_seen_at: r.try_get(5)?,
                    silent_for: Duration::from_secs_f64(silent.unwrap_or(0.0).max(0.0)),
                    circuit_open: r.try_get(7)?,
                    healthy: r.try_get(8)?,
                    published: count(r.try_get(9)?),
                    detail: r.try_get(10)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db(OP))
    }
}
