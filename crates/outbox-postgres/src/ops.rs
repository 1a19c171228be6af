//! Operator queries behind the `outbox` binary: the [`OutboxAdmin`] impl of [`PgOutbox`]:
//!
//! - [`OutboxAdmin::stats_by_group`]: counts by status and queue lag per event type and
//!   tenant;
//! - [`OutboxAdmin::reconcile`]: per day, tenant, event type and consumer, messages written
//!   to the outbox vs recorded as processed in that consumer's inbox;
//! - [`OutboxAdmin::archive_sent`] / [`OutboxAdmin::archive_inbox_records`]: retention that
//!   moves rows into the archive tables of migration 4 instead of deleting them (plain
//!   deletion is [`OutboxStore::purge_sent`](outboxkit_core::OutboxStore::purge_sent) and
//!   [`InboxStore::purge`]);
//! - [`OutboxAdmin::inbox_dead_letters`] / [`OutboxAdmin::replay_inbox_dead_letters`]: the
//!   consumer side's dead letters (idempotent-consumer failures and durable-inbox
//!   `Dead` rows) and their replay.
//!
//! The inbox queries read the inbox tables of the **same schema** as the outbox (the
//! layout of the examples: producer and consumer share a database). These are admin
//! queries: the breakdowns scan the table; run them against a replica when it is huge.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outboxkit_core::inbox::DurableInbox;
use outboxkit_core::{
    InboxStore, MessageFilter, MessageStatus, OnDead, OutboxAdmin, OutboxError, OutboxStats,
};
use sqlx::{AssertSqlSafe, Row};

use crate::error::db;
use crate::sql::{PENDING_LAG_SECS, like_escape, quoted_schema};
use crate::store::PgOutbox;

use outboxkit_core::admin::{
    GroupStats, InboxDeadFilter, InboxDeadKind, InboxDeadLetter, InboxReplayMode,
    InboxReplayReport, MessageCount, MessageCursor, MessagePage, MessageState, MessageSummary,
    PENDING_STATS_BOUND, ReconcileRow, RelayHeartbeat, RelaySeen, SentPerMinute, VacuumPressure,
};

/// Columns of the outbox archive (migration 4).
const ARCHIVE_COLUMNS: &str = "id, seq, aggregate_type, aggregate_id, aggregate_version, \
    event_type, payload, headers, tenant_id, routing_key, partition_key, occurred_at, \
    created_at, attempts, last_error, sent_at";

/// Filter over `inbox_failures f` (`$1` ids, `$2` from, `$3` to, `$4` consumer,
/// `$5` event type, `$6` error text escaped by [`like_escape`]).
const FAILURE_FILTER: &str = "f.dead_at IS NOT NULL
    AND ($1::uuid[] IS NULL OR f.message_id = ANY($1))
    AND ($2::timestamptz IS NULL OR f.dead_at >= $2)
    AND ($3::timestamptz IS NULL OR f.dead_at < $3)
    AND ($4::text IS NULL OR f.consumer = $4)
    AND ($5::text IS NULL OR f.event_type = $5)
    AND ($6::text IS NULL OR f.last_error ILIKE '%' || $6 || '%' ESCAPE E'\\\\')";

/// Filter over `inbox_messages d`, same parameters as [`FAILURE_FILTER`].
const DURABLE_FILTER: &str = "d.phase = 3
    AND ($1::uuid[] IS NULL OR d.id = ANY($1))
    AND ($2::timestamptz IS NULL OR d.received_at >= $2)
    AND ($3::timestamptz IS NULL OR d.received_at < $3)
    AND ($4::text IS NULL OR starts_with(coalesce(d.last_error, ''), $4 || ': '))
    AND ($5::text IS NULL OR d.event_type = $5)
    AND ($6::text IS NULL OR d.last_error ILIKE '%' || $6 || '%' ESCAPE E'\\\\')";

/// The optional filter of the message listings, after the state's predicate (`$1` ids,
/// `$2` from, `$3` to, `$4` tenant, `$5` aggregate type, `$6` aggregate id, `$7` event
/// type, `$8` error text escaped by [`like_escape`]): the dead-letter filter of
/// `sql.rs` for any state.
const LIST_FILTER: &str = "($1::uuid[] IS NULL OR m.id = ANY($1))
    AND ($2::timestamptz IS NULL OR m.created_at >= $2)
    AND ($3::timestamptz IS NULL OR m.created_at < $3)
    AND ($4::text IS NULL OR m.tenant_id = $4)
    AND ($5::text IS NULL OR m.aggregate_type = $5)
    AND ($6::text IS NULL OR m.aggregate_id = $6)
    AND ($7::text IS NULL OR m.event_type = $7)
    AND ($8::text IS NULL OR m.last_error ILIKE '%' || $8 || '%' ESCAPE E'\\\\')";

/// Columns of a [`MessageSummary`].
const SUMMARY_COLUMNS: &str = "m.id, m.seq, m.status, m.event_type, m.aggregate_type, \
    m.aggregate_id, m.tenant_id, m.created_at, m.visible_at, m.sent_at, m.attempts, m.last_error";

/// The state's partial-index predicate, order column and direction (`>` ascending,
/// `<` descending).
fn state_order(state: MessageState) -> (&'static str, &'static str, &'static str) {
    match state {
        MessageState::Pending => ("m.phase = 0", "m.visible_at", ">"),
        MessageState::Dead => ("m.phase = 3", "m.created_at", "<"),
        MessageState::Sent => ("m.phase = 1", "m.sent_at", "<"),
    }
}

/// One page of a listing (`$1`-`$8` the filter, `$9` the limit; with a cursor, its
/// time and seq next (`$10`, `$11`); when `scanned`, the scan bound after those).
/// The texts differ by cursor rather than `$10 IS NULL OR ...`: the row comparison
/// must be an index condition in every plan, a generic one included, so that a late
/// page does not scan the pages before it. A `scanned` (filtered) page applies the
/// filter to a window of the first rows in the index's order (`LIMIT` in a subquery,
/// below which the planner cannot push the filter): whatever the planner estimates for
/// a filter, it walks the index and examines at most the scan bound.
fn list_messages_sql(
    schema: &str,
    state: MessageState,
    with_cursor: bool,
    scanned: bool,
) -> String {
    let s = quoted_schema(schema);
    let (phase, at, cmp) = state_order(state);
    let dir = if cmp == ">" { "" } else { " DESC" };
    let cursor = if with_cursor {
        format!(" AND ({at}, m.seq) {cmp} ($10, $11)")
    } else {
        String::new()
    };
    if !scanned {
        return format!(
            "SELECT {SUMMARY_COLUMNS} FROM {s}.outbox_messages m
              WHERE {phase} AND {LIST_FILTER}{cursor}
              ORDER BY {at}{dir}, m.seq{dir} LIMIT $9"
        );
    }
    let scan = if with_cursor { "$12" } else { "$10" };
    format!(
        "SELECT {SUMMARY_COLUMNS} FROM (
             SELECT m.* FROM {s}.outbox_messages m WHERE {phase}{cursor}
              ORDER BY {at}{dir}, m.seq{dir} LIMIT {scan}) m
          WHERE {LIST_FILTER}
          ORDER BY {at}{dir}, m.seq{dir} LIMIT $9"
    )
}

/// The horizon of a filtered listing: the order key of the row `OFFSET` rows after the
/// cursor (`$1` time and `$2` seq with a cursor, then the offset; else `$1` the
/// offset), on the state's index; no row when the state ends before.
fn horizon_sql(schema: &str, state: MessageState, with_cursor: bool) -> String {
    let s = quoted_schema(schema);
    let (phase, at, cmp) = state_order(state);
    let dir = if cmp == ">" { "" } else { " DESC" };
    let (cursor, offset) = if with_cursor {
        (format!(" AND ({at}, m.seq) {cmp} ($1, $2)"), "$3")
    } else {
        (String::new(), "$1")
    };
    format!(
        "SELECT {at}, m.seq FROM {s}.outbox_messages m WHERE {phase}{cursor}
          ORDER BY {at}{dir}, m.seq{dir} OFFSET {offset} LIMIT 1"
    )
}

/// The bounded count (`$1`-`$8` the filter, `$9` the bound): unfiltered, the rows of
/// the state up to the bound (no filter column is read); filtered, the matching rows
/// among the first `$9` (the scan bound) of the state in its order, and how many were
/// examined.
fn count_messages_sql(schema: &str, state: MessageState, filtered: bool) -> String {
    let s = quoted_schema(schema);
    let (phase, at, cmp) = state_order(state);
    if !filtered {
        return format!(
            "SELECT count(*), count(*) FROM (SELECT 1 FROM {s}.outbox_messages m
              WHERE {phase} AND {LIST_FILTER} LIMIT $9) c"
        );
    }
    let dir = if cmp == ">" { "" } else { " DESC" };
    format!(
        "SELECT count(*) FILTER (WHERE {LIST_FILTER}), count(*) FROM (
             SELECT m.id, m.created_at, m.tenant_id, m.aggregate_type, m.aggregate_id,
                    m.event_type, m.last_error
               FROM {s}.outbox_messages m WHERE {phase}
              ORDER BY {at}{dir}, m.seq{dir} LIMIT $9) m"
    )
}

fn bind_message_filter<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    f: &'q MessageFilter,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(if f.ids.is_empty() { None } else { Some(&f.ids) })
        .bind(f.from)
        .bind(f.to)
        .bind(f.tenant_id.as_deref())
        .bind(f.aggregate_type.as_deref())
        .bind(f.aggregate_id.as_deref())
        .bind(f.event_type.as_deref())
        .bind(f.error_contains.as_deref().map(like_escape))
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn bind_inbox_filter<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    f: &'q InboxDeadFilter,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(if f.ids.is_empty() { None } else { Some(&f.ids) })
        .bind(f.from)
        .bind(f.to)
        .bind(f.consumer.as_deref())
        .bind(f.event_type.as_deref())
        .bind(f.error_contains.as_deref().map(like_escape))
}

#[async_trait::async_trait]
impl OutboxAdmin for PgOutbox {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn schema(&self) -> &str {
        PgOutbox::schema(self)
    }

    async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        PgOutbox::migrate(self).await
    }

    /// Counts by status and the oldest pending age, per `(event_type, tenant_id)`,
    /// ordered by event type then tenant. Scans the table.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn stats_by_group(&self) -> Result<Vec<GroupStats>, OutboxError> {
        let s = quoted_schema(self.schema());
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT event_type, tenant_id,
                    count(*) FILTER (WHERE status = 0), count(*) FILTER (WHERE status = 9),
                    count(*) FILTER (WHERE status = 1), count(*) FILTER (WHERE status = 3),
                    {PENDING_LAG_SECS}
               FROM {s}.outbox_messages
              GROUP BY event_type, tenant_id
              ORDER BY event_type, tenant_id NULLS FIRST"
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

    /// The relay's periodic gauges: like
    /// [`OutboxStore::stats`](outboxkit_core::OutboxStore::stats) but **bounded**, so that
    /// it costs the same at a backlog of a million rows as at an empty table (under
    /// 50 ms, measured by `cargo xtask bench -- --backlog 1000000`):
    ///
    /// - `new` and `processing` count the first [`PENDING_STATS_BOUND`] pending rows
    ///   in claim order (the pending index); when `new + processing` equals the bound,
    ///   at least that many are pending;
    /// - `dead` counts at most [`PENDING_STATS_BOUND`] rows (the dead index);
    /// - `oldest_pending_age` is the queue lag among those same rows: the age of the
    ///   oldest one counted from when it became due (`visible_at`, or its first failure
    ///   when earlier: see [`OutboxStats::oldest_pending_age`]), database clock; exact
    ///   when fewer than the bound are pending, else the lag of the backlog's head (a
    ///   message in a retry backoff behind the first [`PENDING_STATS_BOUND`] is not
    ///   seen);
    /// - `sent` is not counted (left 0).
    ///
    /// `outbox stats` ([`OutboxStore::stats`](outboxkit_core::OutboxStore::stats) and
    /// [`stats_by_group`](Self::stats_by_group)) stays exact.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn pending_stats(&self) -> Result<OutboxStats, OutboxError> {
        let s = quoted_schema(self.schema());
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE p.status = 0),
                    count(*) FILTER (WHERE p.status = 9),
                    (SELECT count(*) FROM (SELECT 1 FROM {s}.outbox_messages
                                            WHERE phase = 3 LIMIT $1) d),
                    {PENDING_LAG_SECS}
               FROM (SELECT status, visible_at, first_failed_at FROM {s}.outbox_messages
                      WHERE phase = 0 ORDER BY visible_at, seq LIMIT $1) p"
        )))
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

    /// How long the oldest claimable message (`New` and visible) has been waiting,
    /// by the database clock; `None` when nothing is claimable. A relay that keeps up
    /// keeps this below its poll interval plus one batch. Uses the claim index.
    ///
    /// The WAL relay's parked rows count too: a key's head that has been due (its
    /// `parked_until`) this long without being published by the sweeper (the
    /// `parked_due` index; heads held by a circuit wait for its trial and are not
    /// due, rows behind a head go with it).
    ///
    /// With `ordered = Some(on_dead)` (per-key mode) a message is claimable only when
    /// no earlier message of its key is in flight, in a retry backoff or (under
    /// [`OnDead::Block`]) `Dead`: those keys are blocked by design and reported by
    /// [`blocked_keys`](outboxkit_core::OutboxStore::blocked_keys), not as a stuck relay.
    /// Only the 1,000 oldest visible messages are examined, so the cost stays flat
    /// under a large backlog (if all of them wait behind blocked keys the answer is
    /// `None`).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn oldest_claimable_wait(
        &self,
        ordered: Option<OnDead>,
    ) -> Result<Option<Duration>, OutboxError> {
        let s = quoted_schema(self.schema());
        let parked = format!(
            "(SELECT parked_until FROM {s}.outbox_messages
               WHERE phase = 0 AND parked_until <= now() AND status = 9
               ORDER BY parked_until LIMIT 1)"
        );
        let sql = match ordered {
            None => format!(
                "SELECT extract(epoch FROM now() - LEAST(min(visible_at), {parked}))::float8
                   FROM {s}.outbox_messages WHERE phase = 0 AND status = 0 AND visible_at <= now()"
            ),
            Some(on_dead) => {
                // A message waits behind an earlier one of its key that is in flight or
                // in a retry backoff, or (under Block) Dead: one probe of each per-key
                // index.
                let dead_blocks = if on_dead == OnDead::Block {
                    format!(
                        "OR EXISTS (SELECT 1 FROM {s}.outbox_messages d
                                     WHERE d.order_key = m.order_key AND d.phase = 3 AND d.seq < m.seq)"
                    )
                } else {
                    String::new()
                };
                format!(
                    "SELECT extract(epoch FROM now() - LEAST(min(m.visible_at), {parked}))::float8
                       FROM (SELECT order_key, seq, visible_at FROM {s}.outbox_messages
                              WHERE phase = 0 AND status = 0 AND visible_at <= now()
                              ORDER BY visible_at, seq LIMIT 1000) m
                      WHERE NOT (EXISTS (
                            SELECT 1 FROM {s}.outbox_messages b
                             WHERE b.order_key = m.order_key AND b.phase = 0 AND b.seq < m.seq
                               AND (b.status = 9 OR b.visible_at > now())) {dead_blocks})"
                )
            }
        };
        let secs: Option<f64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(self.pool())
            .await
            .map_err(db("oldest_claimable_wait"))?;
        Ok(secs.map(|s| Duration::from_secs_f64(s.max(0.0))))
    }

    /// Reconciles the outbox with the inbox records of the same schema for messages
    /// created in `[from, to)`: one row per UTC day, tenant, event type and consumer.
    ///
    /// A consumer is expected for an event type when it has an inbox record or a
    /// consumer dead letter for at least one message of that event type in the window,
    /// or when it is named in `consumers` (which also restricts the output to those
    /// consumers when not empty). Purged rows are not counted: reconcile windows
    /// inside the retention of both the outbox and the inbox.
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
        let s = quoted_schema(self.schema());
        let rows = sqlx::query(AssertSqlSafe(format!(
            "WITH w AS (
                 SELECT id, (created_at AT TIME ZONE 'UTC')::date AS day, tenant_id, event_type
                   FROM {s}.outbox_messages WHERE created_at >= $1 AND created_at < $2
             ), written AS (
                 SELECT day, tenant_id, event_type, count(*) AS n FROM w GROUP BY 1, 2, 3
             ), seen AS (
                 SELECT w.event_type, r.consumer FROM w JOIN {s}.inbox_records r ON r.message_id = w.id
                 UNION
                 SELECT w.event_type, f.consumer FROM w JOIN {s}.inbox_failures f ON f.message_id = w.id
                 UNION
                 SELECT e.event_type, c.consumer
                   FROM (SELECT DISTINCT event_type FROM w) e CROSS JOIN unnest($3::text[]) AS c(consumer)
             ), expected AS (
                 SELECT DISTINCT event_type, consumer FROM seen
                  WHERE cardinality($3::text[]) = 0 OR consumer = ANY($3)
             ), processed AS (
                 SELECT w.day, w.tenant_id, w.event_type, r.consumer, count(*) AS n
                   FROM w JOIN {s}.inbox_records r ON r.message_id = w.id GROUP BY 1, 2, 3, 4
             ), dead AS (
                 SELECT w.day, w.tenant_id, w.event_type, f.consumer, count(*) AS n
                   FROM w JOIN {s}.inbox_failures f ON f.message_id = w.id AND f.dead_at IS NOT NULL
                  GROUP BY 1, 2, 3, 4
             )
             SELECT wr.day, wr.tenant_id, wr.event_type, x.consumer, wr.n,
                    coalesce(p.n, 0), coalesce(d.n, 0)
               FROM written wr
               JOIN expected x ON x.event_type = wr.event_type
               LEFT JOIN processed p ON p.day = wr.day AND p.tenant_id IS NOT DISTINCT FROM wr.tenant_id
                                    AND p.event_type = wr.event_type AND p.consumer = x.consumer
               LEFT JOIN dead d ON d.day = wr.day AND d.tenant_id IS NOT DISTINCT FROM wr.tenant_id
                               AND d.event_type = wr.event_type AND d.consumer = x.consumer
              ORDER BY wr.day, wr.tenant_id NULLS FIRST, wr.event_type, x.consumer"
        )))
        .bind(from)
        .bind(to)
        .bind(consumers)
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
    /// into `outbox_messages_archive` (one statement: delete and insert commit
    /// together); returns how many moved. Call until it returns less than
    /// `batch_size`. Rows locked by others are skipped, so the relay is never blocked.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 4 not applied).
    async fn archive_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        let s = quoted_schema(self.schema());
        let moved: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "WITH moved AS (
                 DELETE FROM {s}.outbox_messages WHERE id IN (
                     SELECT id FROM {s}.outbox_messages
                      WHERE phase = 1 AND sent_at <= now() - make_interval(secs => $1)
                      ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 RETURNING {ARCHIVE_COLUMNS}
             ), kept AS (
                 INSERT INTO {s}.outbox_messages_archive ({ARCHIVE_COLUMNS})
                 SELECT {ARCHIVE_COLUMNS} FROM moved ON CONFLICT (id) DO NOTHING
             )
             SELECT count(*) FROM moved"
        )))
        .bind(older_than.as_secs_f64())
        .bind(limit(batch_size))
        .fetch_one(self.pool())
        .await
        .map_err(db("archive_sent"))?;
        Ok(count(moved))
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
    /// `inbox_records_archive`; returns how many moved. The dedup caveat of
    /// [`InboxStore::purge`](outboxkit_core::InboxStore::purge) applies: an archived
    /// record no longer absorbs duplicates.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 4 not applied).
    async fn archive_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        let s = quoted_schema(self.schema());
        let moved: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "WITH moved AS (
                 DELETE FROM {s}.inbox_records WHERE (message_id, consumer) IN (
                     SELECT message_id, consumer FROM {s}.inbox_records
                      WHERE processed_at <= now() - make_interval(secs => $1)
                      ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 RETURNING message_id, consumer, processed_at
             ), kept AS (
                 INSERT INTO {s}.inbox_records_archive (message_id, consumer, processed_at)
                 SELECT message_id, consumer, processed_at FROM moved
                 ON CONFLICT (message_id, consumer) DO NOTHING
             )
             SELECT count(*) FROM moved"
        )))
        .bind(older_than.as_secs_f64())
        .bind(limit(batch_size))
        .fetch_one(self.pool())
        .await
        .map_err(db("archive_inbox_records"))?;
        Ok(count(moved))
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
        let s = quoted_schema(self.schema());
        let rows = bind_inbox_filter(
            sqlx::query(AssertSqlSafe(format!(
                "(SELECT 0 AS kind, f.message_id, f.consumer, f.event_type, f.last_error,
                         f.attempts, f.dead_at AS at
                    FROM {s}.inbox_failures f WHERE {FAILURE_FILTER}
                   ORDER BY f.dead_at LIMIT $7)
                 UNION ALL
                 (SELECT 1, d.id, NULL, d.event_type, d.last_error, d.attempts, d.received_at
                    FROM {s}.inbox_messages d WHERE {DURABLE_FILTER}
                   ORDER BY d.received_at LIMIT $7)
                 ORDER BY 1, 7 LIMIT $7"
            ))),
            filter,
        )
        .bind(limit(limit_rows))
        .fetch_all(self.pool())
        .await
        .map_err(db("inbox_dead_letters"))?;
        rows.iter()
            .map(|r| {
                Ok(InboxDeadLetter {
                    kind: if r.try_get::<i32, _>(0)? == 0 {
                        InboxDeadKind::Consumer
                    } else {
                        InboxDeadKind::Durable
                    },
                    message_id: r.try_get(1)?,
                    consumer: r.try_get(2)?,
                    event_type: r.try_get(3)?,
                    last_error: r.try_get(4)?,
                    attempts: r.try_get(5)?,
                    at: r.try_get(6)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db("inbox_dead_letters"))
    }

    /// Makes consumer-side dead letters matching `filter` processable again, in one
    /// transaction. With [`InboxReplayMode::DryRun`] only counts them.
    ///
    /// - **Durable inbox** `Dead` rows go back to `New`, visible now, attempts 0. Their
    ///   handlers' inbox records stay, so only the handlers that had not succeeded run.
    /// - **Idempotent-consumer** dead letters: the broker acked the message long ago,
    ///   so it has to be delivered again. The message's outbox row (same id, same
    ///   schema) is set back to `New`, visible now, attempts 0 (from `Sent` or `Dead`;
    ///   left alone when already pending), and the failure row is deleted, so the
    ///   consumer no longer skips it and counts failures afresh. The relay republishes
    ///   it to every subscriber; consumers that had handled it hold an inbox record and
    ///   ignore it. When the outbox row is gone (purged, or the message was produced in
    ///   another database) the dead letter is counted as `failed` and kept, unless
    ///   the mode is [`InboxReplayMode::ClearOnly`]: then only the failure rows are deleted, and the operator
    ///   arranges the redelivery.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure (nothing changes then).
    async fn replay_inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        mode: InboxReplayMode,
    ) -> Result<InboxReplayReport, OutboxError> {
        let dry_run = mode == InboxReplayMode::DryRun;
        let clear_only = mode == InboxReplayMode::ClearOnly;
        let started = Instant::now();
        let s = quoted_schema(self.schema());
        let mut tx = self.pool().begin().await.map_err(db("inbox_replay"))?;
        let (matched, replayed) = if dry_run {
            let row = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "SELECT (SELECT count(*) FROM {s}.inbox_failures f WHERE {FAILURE_FILTER})
                          + (SELECT count(*) FROM {s}.inbox_messages d WHERE {DURABLE_FILTER})"
                ))),
                filter,
            )
            .fetch_one(&mut *tx)
            .await
            .map_err(db("inbox_replay"))?;
            (row.try_get::<i64, _>(0).map_err(db("inbox_replay"))?, 0)
        } else {
            let row = bind_inbox_filter(
                sqlx::query(AssertSqlSafe(format!(
                    "WITH target AS (
                         SELECT f.message_id, f.consumer FROM {s}.inbox_failures f
                          WHERE {FAILURE_FILTER} FOR UPDATE
                     ), source AS (
                         SELECT m.id, m.status FROM {s}.outbox_messages m
                          WHERE m.id IN (SELECT message_id FROM target) FOR UPDATE
                     ), requeued AS (
                         UPDATE {s}.outbox_messages m
                            SET status = 0, attempts = 0, visible_at = now(), lease_until = NULL,
                                claim_token = NULL, sent_at = NULL, unfinished_claims = 0,
                                unfinished_alone = 0
                          WHERE m.id IN (SELECT id FROM source WHERE status IN (1, 3)) AND NOT $7
                         RETURNING m.id
                     ), cleared AS (
                         DELETE FROM {s}.inbox_failures f USING target t
                          WHERE f.message_id = t.message_id AND f.consumer = t.consumer
                            AND ($7 OR t.message_id IN (SELECT id FROM source))
                         RETURNING f.message_id
                     ), durable AS (
                         UPDATE {s}.inbox_messages d
                            SET status = 0, attempts = 0, visible_at = now(), lease_until = NULL,
                                claim_token = NULL
                          WHERE {DURABLE_FILTER}
                         RETURNING d.id
                     )
                     SELECT (SELECT count(*) FROM target) + (SELECT count(*) FROM durable),
                            (SELECT count(*) FROM cleared) + (SELECT count(*) FROM durable),
                            (SELECT count(*) FROM requeued)"
                ))),
                filter,
            )
            .bind(clear_only)
            .fetch_one(&mut *tx)
            .await
            .map_err(db("inbox_replay"))?;
            let matched: i64 = row.try_get(0).map_err(db("inbox_replay"))?;
            let replayed: i64 = row.try_get(1).map_err(db("inbox_replay"))?;
            let requeued: i64 = row.try_get(2).map_err(db("inbox_replay"))?;
            tracing::info!(
                matched,
                replayed,
                requeued,
                clear_only,
                "consumer dead letters replayed"
            );
            (matched, replayed)
        };
        tx.commit().await.map_err(db("inbox_replay"))?;
        let (matched, replayed) = (count(matched), count(replayed));
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

    /// One page of `state` in its order (see [`MessageState`]), keyset-paged along the
    /// state's partial index: `outbox_messages_pending (visible_at, seq)`,
    /// `outbox_messages_dead (created_at)` and `outbox_messages_sent (sent_at)`. A
    /// filtered page applies its filter to a window of `scan` rows of that index; a short
    /// page then finds where the window ended, its `next`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn list_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        after: Option<MessageCursor>,
        limit_rows: usize,
        scan: u64,
    ) -> Result<MessagePage, OutboxError> {
        const OP: &str = "list_messages";
        let scanned = *filter != MessageFilter::new();
        let scan = i64::try_from(scan.max(1)).unwrap_or(i64::MAX);
        let sql = list_messages_sql(self.schema(), state, after.is_some(), scanned);
        let mut query = bind_message_filter(sqlx::query(AssertSqlSafe(sql)), filter)
            .bind(limit(limit_rows.saturating_add(1)));
        if let Some(c) = after {
            query = query.bind(c.at).bind(c.seq);
        }
        if scanned {
            query = query.bind(scan);
        }
        let rows = query.fetch_all(self.pool()).await.map_err(db(OP))?;
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
            // A short page: continue after the last row examined (the window's last),
            // if the window was full.
            let sql = horizon_sql(self.schema(), state, after.is_some());
            let mut query = sqlx::query_as::<_, (DateTime<Utc>, i64)>(AssertSqlSafe(sql));
            if let Some(c) = after {
                query = query.bind(c.at).bind(c.seq);
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

    /// Counts at most `bound` rows of `state` matching `filter`: unfiltered, a `LIMIT`
    /// in a subquery over the state's partial index; filtered, among the first `scan`
    /// rows of that index.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn count_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        bound: u64,
        scan: u64,
    ) -> Result<MessageCount, OutboxError> {
        let filtered = *filter != MessageFilter::new();
        let stop = if filtered { scan } else { bound };
        let (matching, examined): (i64, i64) = bind_message_filter(
            sqlx::query(AssertSqlSafe(count_messages_sql(
                self.schema(),
                state,
                filtered,
            ))),
            filter,
        )
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

    /// Sent rows per minute over the last `minutes` minutes, through the sent index.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn sent_per_minute(&self, minutes: u32) -> Result<SentPerMinute, OutboxError> {
        const OP: &str = "sent_per_minute";
        let s = quoted_schema(self.schema());
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT n.now, a.ago, a.sent
               FROM (SELECT now() AS now) n
               LEFT JOIN LATERAL (
                    SELECT floor(extract(epoch FROM n.now - m.sent_at) / 60)::int8 AS ago,
                           count(*) AS sent
                      FROM {s}.outbox_messages m
                     WHERE m.phase = 1 AND m.sent_at > n.now - make_interval(mins => $1)
                     GROUP BY 1) a ON true"
        )))
        .bind(i32::try_from(minutes).unwrap_or(i32::MAX))
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

    /// Upserts the relay's row of `outbox_relays` (migration 10) and deletes those not
    /// heard of for a day, in one statement.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 10 not applied).
    /// `pg_stat_user_tables` for the outbox table; the oldest of this database's
    /// sessions with a snapshot or a transaction id in `pg_stat_activity` (this one
    /// excepted) and of its prepared transactions.
    async fn vacuum_pressure(&self) -> Result<Option<VacuumPressure>, OutboxError> {
        let row = sqlx::query(
            "SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0),
                    greatest(s.last_vacuum, s.last_autovacuum), h.age, h.holder
               FROM (SELECT 1) one
               LEFT JOIN pg_stat_user_tables s
                      ON s.schemaname = $1 AND s.relname = 'outbox_messages'
               LEFT JOIN LATERAL (
                    SELECT extract(epoch FROM clock_timestamp() - a.xact_start)::float8 AS age,
                           format('pid %s (%s), %s', a.pid,
                                  coalesce(nullif(a.application_name, ''), a.usename::text, '?'),
                                  coalesce(a.state, '?')) AS holder
                      FROM pg_stat_activity a
                     WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                       AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
                       AND a.xact_start IS NOT NULL
                    UNION ALL
                    SELECT extract(epoch FROM clock_timestamp() - p.prepared)::float8,
                           format('prepared transaction %L', p.gid)
                      FROM pg_prepared_xacts p
                     WHERE p.database = current_database()
                     ORDER BY 1 DESC LIMIT 1) h ON true",
        )
        .bind(self.schema())
        .fetch_one(self.pool())
        .await
        .map_err(db("vacuum_pressure"))?;
        let get = |e| db("vacuum_pressure")(e);
        let age: Option<f64> = row.try_get(3).map_err(get)?;
        let mut pressure = VacuumPressure::default();
        pressure.dead_rows = count(row.try_get(0).map_err(get)?);
        pressure.live_rows = count(row.try_get(1).map_err(get)?);
        pressure.last_vacuum = row.try_get(2).map_err(get)?;
        pressure.oldest_transaction_age = age.map(|a| Duration::from_secs_f64(a.max(0.0)));
        pressure.oldest_transaction = row.try_get(4).map_err(get)?;
        Ok(Some(pressure))
    }

    async fn record_heartbeat(&self, beat: &RelayHeartbeat) -> Result<(), OutboxError> {
        let s = quoted_schema(self.schema());
        sqlx::query(AssertSqlSafe(format!(
            "WITH gone AS (
                 DELETE FROM {s}.outbox_relays
                  WHERE last_seen_at < now() - interval '1 day' AND relay_id <> $1
             )
             INSERT INTO {s}.outbox_relays AS r
                    (relay_id, host, pid, version, circuit_open, healthy, published, detail)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (relay_id) DO UPDATE
                SET last_seen_at = now(), circuit_open = EXCLUDED.circuit_open,
                    healthy = EXCLUDED.healthy, published = EXCLUDED.published,
                    detail = EXCLUDED.detail"
        )))
        .bind(beat.relay_id)
        .bind(&beat.host)
        .bind(i64::from(beat.pid))
        .bind(&beat.version)
        .bind(beat.circuit_open)
        .bind(beat.healthy)
        .bind(i64::try_from(beat.published).unwrap_or(i64::MAX))
        .bind(beat.detail.chars().take(1000).collect::<String>())
        .execute(self.pool())
        .await
        .map_err(db("record_heartbeat"))?;
        Ok(())
    }

    /// The relays of `outbox_relays` heard of within `within`, most recent first.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 10 not applied).
    async fn relays_seen(
        &self,
        within: Duration,
        limit_rows: usize,
    ) -> Result<Vec<RelaySeen>, OutboxError> {
        const OP: &str = "relays_seen";
        let s = quoted_schema(self.schema());
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT relay_id, host, pid, version, started_at, last_seen_at,
                    extract(epoch FROM now() - last_seen_at)::float8, circuit_open, healthy,
                    published, detail
               FROM {s}.outbox_relays
              WHERE last_seen_at >= now() - make_interval(secs => $1)
              ORDER BY last_seen_at DESC, relay_id LIMIT $2"
        )))
        .bind(within.as_secs_f64())
        .bind(limit(limit_rows))
        .fetch_all(self.pool())
        .await
        .map_err(db(OP))?;
        rows.iter()
            .map(|r| {
                let silent: f64 = r.try_get(6)?;
                Ok(RelaySeen {
                    relay_id: r.try_get(0)?,
                    host: r.try_get(1)?,
                    pid: r.try_get(2)?,
                    version: r.try_get(3)?,
                    started_at: r.try_get(4)?,
                    last_seen_at: r.try_get(5)?,
                    silent_for: Duration::from_secs_f64(silent.max(0.0)),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn squash(sql: &str) -> String {
        sql.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn listings_page_by_key_along_each_state_index() {
        let pending = squash(&list_messages_sql(
            "outbox",
            MessageState::Pending,
            true,
            false,
        ));
        assert!(pending.contains("WHERE m.phase = 0 AND ($1::uuid[] IS NULL"));
        assert!(pending.contains(
            "AND (m.visible_at, m.seq) > ($10, $11) ORDER BY m.visible_at, m.seq LIMIT $9"
        ));
        // Filtered: the filter over a window of the index, the scan bound its LIMIT.
        let scanned = squash(&list_messages_sql(
            "outbox",
            MessageState::Pending,
            true,
            true,
        ));
        assert!(scanned.contains(
            "FROM ( SELECT m.* FROM \"outbox\".outbox_messages m WHERE m.phase = 0 AND (m.visible_at, m.seq) > ($10, $11) ORDER BY m.visible_at, m.seq LIMIT $12) m WHERE ($1::uuid[] IS NULL"
        ));
        assert!(scanned.ends_with("ORDER BY m.visible_at, m.seq LIMIT $9"));
        let first = squash(&list_messages_sql(
            "outbox",
            MessageState::Dead,
            false,
            true,
        ));
        assert!(
            first.contains("WHERE m.phase = 3 ORDER BY m.created_at DESC, m.seq DESC LIMIT $10) m")
        );
        let dead = squash(&list_messages_sql(
            "outbox",
            MessageState::Dead,
            true,
            false,
        ));
        assert!(dead.contains(
            "AND (m.created_at, m.seq) < ($10, $11) ORDER BY m.created_at DESC, m.seq DESC LIMIT $9"
        ));
        let sent = squash(&list_messages_sql(
            "outbox",
            MessageState::Sent,
            false,
            false,
        ));
        assert!(sent.contains("WHERE m.phase = 1 AND"));
        assert!(sent.ends_with("ORDER BY m.sent_at DESC, m.seq DESC LIMIT $9"));
        assert!(!sent.contains("$10"), "no cursor on the first page");
        let horizon = squash(&horizon_sql("outbox", MessageState::Pending, true));
        assert!(horizon.contains(
            "WHERE m.phase = 0 AND (m.visible_at, m.seq) > ($1, $2) ORDER BY m.visible_at, m.seq OFFSET $3 LIMIT 1"
        ));
        let horizon = squash(&horizon_sql("outbox", MessageState::Sent, false));
        assert!(horizon.ends_with("ORDER BY m.sent_at DESC, m.seq DESC OFFSET $1 LIMIT 1"));
        let count = squash(&count_messages_sql("outbox", MessageState::Dead, false));
        assert!(count.starts_with(
            "SELECT count(*), count(*) FROM (SELECT 1 FROM \"outbox\".outbox_messages m WHERE m.phase = 3 AND"
        ));
        assert!(count.ends_with("LIMIT $9) c"));
        let scanned = squash(&count_messages_sql("outbox", MessageState::Pending, true));
        assert!(scanned.starts_with("SELECT count(*) FILTER (WHERE ($1::uuid[] IS NULL"));
        assert!(scanned.ends_with("WHERE m.phase = 0 ORDER BY m.visible_at, m.seq LIMIT $9) m"));
    }
}
