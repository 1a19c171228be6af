//! Operator queries behind the `outbox` binary on SQL Server: the
//! [`OutboxAdmin`] impl of [`MssqlOutbox`], holding the T-SQL (the PostgreSQL backend's `ops.rs` is the reference;
//! each method here is its translation):
//!
//! - [`OutboxAdmin::stats_by_group`], [`OutboxAdmin::pending_stats`],
//!   [`OutboxAdmin::oldest_claimable_wait`]: counts and queue lag;
//! - [`OutboxAdmin::reconcile`]: per day, tenant, event type and consumer, messages
//!   written to the outbox vs recorded as processed in that consumer's inbox;
//! - [`OutboxAdmin::archive_sent`] / [`OutboxAdmin::archive_inbox_records`]: retention
//!   that moves rows into the archive tables of migration 5;
//! - [`OutboxAdmin::inbox_dead_letters`] / [`OutboxAdmin::replay_inbox_dead_letters`]:
//!   the consumer side's dead letters and their replay.
//!
//! The inbox queries read the inbox tables of the **same schema** as the outbox. Text
//! comparisons (groups, consumer and event-type filters) follow the columns' collation,
//! the database default (usually case-insensitive), as every other query of this
//! backend does. The SQL is rendered per call (a few `format!`s; these are operator
//! queries and periodic gauges, not the claim path). Requires SQL Server 2016 or later
//! (`OPENJSON`, `DATEDIFF_BIG`), like the rest of the crate.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use outboxkit_core::inbox::DurableInbox;
use outboxkit_core::{
    InboxStore, MessageFilter, MessageStatus, OnDead, OutboxAdmin, OutboxError, OutboxStats,
};
use tiberius::{Row, ToSql};
use uuid::Uuid;

use crate::error::db;
use crate::sql::{like_escape, millis, minus_ms, pending_lag_ms, quoted_schema};
use crate::store::{FilterParams, MssqlOutbox};

use outboxkit_core::admin::{
    GroupStats, InboxDeadFilter, InboxDeadKind, InboxDeadLetter, InboxReplayMode,
    InboxReplayReport, MessageCount, MessageCursor, MessagePage, MessageState, MessageSummary,
    PENDING_STATS_BOUND, ReconcileRow, RelayHeartbeat, RelaySeen, SentPerMinute,
};

/// The most rows one bulk statement touches (archive moves, completions, purges,
/// replays: the crate's one bound, `sql::ROWS_PER_STATEMENT`). A `batch_size` above it
/// is moved in several statements of at most this many rows inside one transaction:
/// each statement then takes at most about 4,000 row and key locks (a row of
/// `outbox_messages` has a key in up to four indexes), below the 5,000 locks on one
/// table at which SQL Server escalates a statement's locks to a table lock, which would
/// block the relay.
pub const MAX_ROWS_PER_STATEMENT: usize = crate::sql::ROWS_PER_STATEMENT as usize;

/// How many of the oldest visible messages [`MssqlOutbox::oldest_claimable_wait`]
/// examines in per-key mode.
const ORDERED_WAIT_SCAN: i64 = 1_000;

/// Columns of the outbox archive (migration 5), as PostgreSQL's migration 4 has them.
const ARCHIVE_COLUMNS: &[&str] = &[
    "id",
    "seq",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "event_type",
    "payload",
    "headers",
    "tenant_id",
    "routing_key",
    "partition_key",
    "occurred_at",
    "created_at",
    "attempts",
    "last_error",
    "sent_at",
];

/// Columns of the inbox-record archive (migration 5).
const INBOX_ARCHIVE_COLUMNS: &[&str] = &["message_id", "consumer", "processed_at"];

/// The message-id filter: `@P1` is NULL or a JSON array of uuid strings.
fn ids_match(column: &str) -> String {
    format!(
        "(@P1 IS NULL OR {column} IN (SELECT CAST(j.value AS uniqueidentifier) FROM OPENJSON(@P1) AS j))"
    )
}

/// Filter over `inbox_failures f` (`@P1` ids as a JSON array, `@P2` from, `@P3` to,
/// `@P4` consumer, `@P5` event type, `@P6` error text escaped by [`like_escape`]; `@P7`
/// is only used by [`durable_filter`]). `UPPER` on both sides makes the error match
/// case-insensitive whatever the collation.
fn failure_filter() -> String {
    format!(
        "f.dead_at IS NOT NULL
    AND {}
    AND (@P2 IS NULL OR f.dead_at >= @P2)
    AND (@P3 IS NULL OR f.dead_at < @P3)
    AND (@P4 IS NULL OR f.consumer = @P4)
    AND (@P5 IS NULL OR f.event_type = @P5)
    AND (@P6 IS NULL OR UPPER(f.last_error) LIKE N'%' + UPPER(@P6) + N'%' ESCAPE N'\\')",
        ids_match("f.message_id")
    )
}

/// Filter over `inbox_messages d`, same parameters as [`failure_filter`] plus `@P7`:
/// the consumer as a `LIKE` prefix pattern (`<escaped consumer>: %`; the processor
/// names the failing handler that way in `last_error`). A `LIKE` prefix, not `LEFT(...)
/// = ...`: `=` ignores trailing spaces, and the prefix ends with one.
fn durable_filter() -> String {
    format!(
        "d.status = 3
    AND {}
    AND (@P2 IS NULL OR d.received_at >= @P2)
    AND (@P3 IS NULL OR d.received_at < @P3)
    AND (@P7 IS NULL OR d.last_error LIKE @P7 ESCAPE N'\\')
    AND (@P5 IS NULL OR d.event_type = @P5)
    AND (@P6 IS NULL OR UPPER(d.last_error) LIKE N'%' + UPPER(@P6) + N'%' ESCAPE N'\\')",
        ids_match("d.id")
    )
}

/// Counts by status and the oldest pending age in ms per `(event_type, tenant_id)`;
/// NULL tenants sort first (SQL Server's ascending order). No parameters.
fn stats_by_group_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    format!(
        "SELECT event_type, tenant_id,
        COUNT_BIG(CASE WHEN status = 0 THEN 1 END) AS new_rows,
        COUNT_BIG(CASE WHEN status = 9 THEN 1 END) AS processing_rows,
        COUNT_BIG(CASE WHEN status = 1 THEN 1 END) AS sent_rows,
        COUNT_BIG(CASE WHEN status = 3 THEN 1 END) AS dead_rows,
        {lag} AS oldest_pending_ms
   FROM {s}.outbox_messages
  GROUP BY event_type, tenant_id
  ORDER BY event_type, tenant_id",
        lag = pending_lag_ms("SYSUTCDATETIME()")
    )
}

/// The bounded gauges (`@P1` the bound): the first `@P1` pending rows in claim order
/// (New through the `claim_new` index, Processing through `claim_expired`, merged by
/// `(visible_at, seq)`), at most `@P1` Dead rows (the `dead` index). `READPAST`: a
/// gauge never waits on a lock; rows being claimed or inserted by an uncommitted
/// transaction at that instant are not counted.
fn pending_stats_sql(schema: &str) -> String {
    let t = format!("{}.outbox_messages", quoted_schema(schema));
    format!(
        "DECLARE @now datetime2(7) = SYSUTCDATETIME();
DECLARE @dead bigint = (SELECT COUNT_BIG(*) FROM (
    SELECT TOP (@P1) d.seq FROM {t} AS d WITH (READPAST) WHERE d.status = 3) AS d);
SELECT COUNT_BIG(CASE WHEN p.status = 0 THEN 1 END) AS new_rows,
       COUNT_BIG(CASE WHEN p.status = 9 THEN 1 END) AS processing_rows,
       @dead AS dead_rows,
       {lag} AS oldest_pending_ms
  FROM (SELECT TOP (@P1) x.status, x.visible_at, x.first_failed_at FROM (
            SELECT n.status, n.first_failed_at, n.visible_at, n.seq FROM (
                SELECT TOP (@P1) c.status, c.first_failed_at, c.visible_at, c.seq
                  FROM {t} AS c WITH (READPAST)
                 WHERE c.status = 0
                 ORDER BY c.visible_at, c.seq) AS n
            UNION ALL
            SELECT g.status, g.first_failed_at, g.visible_at, g.seq FROM (
                SELECT TOP (@P1) c.status, c.first_failed_at, c.visible_at, c.seq
                  FROM {t} AS c WITH (READPAST)
                 WHERE c.status = 9
                 ORDER BY c.visible_at, c.seq) AS g
        ) AS x
        ORDER BY x.visible_at, x.seq) AS p",
        lag = pending_lag_ms("@now")
    )
}

/// The wait in ms of the oldest claimable message (NULL when none); no parameters.
/// `ordered`: per-key mode under that dead-letter policy. Candidates are read
/// `READPAST` (an uncommitted enqueue is not claimable yet, a row being claimed is
/// taken); the per-key probes `NOLOCK` on the per-key indexes, as the ordered claim's
/// walk does (never waits; a row in flight can only make a key look blocked).
fn oldest_claimable_wait_sql(schema: &str, ordered: Option<OnDead>) -> String {
    let t = format!("{}.outbox_messages", quoted_schema(schema));
    let Some(on_dead) = ordered else {
        return format!(
            "DECLARE @now datetime2(7) = SYSUTCDATETIME();
SELECT DATEDIFF_BIG(millisecond, MIN(m.visible_at), @now) AS wait_ms
  FROM {t} AS m WITH (READPAST)
 WHERE m.status = 0 AND m.visible_at <= @now"
        );
    };
    let dead_blocks = if on_dead == OnDead::Block {
        format!(
            "
    OR EXISTS (SELECT 1 FROM {t} AS d WITH (NOLOCK)
                WHERE d.order_hash = m.order_hash AND d.status = 3 AND d.seq < m.seq)"
        )
    } else {
        String::new()
    };
    format!(
        "DECLARE @now datetime2(7) = SYSUTCDATETIME();
SELECT DATEDIFF_BIG(millisecond, MIN(m.visible_at), @now) AS wait_ms
  FROM (SELECT TOP ({ORDERED_WAIT_SCAN}) c.order_hash, c.seq, c.visible_at
          FROM {t} AS c WITH (READPAST)
         WHERE c.status = 0 AND c.visible_at <= @now
         ORDER BY c.visible_at, c.seq) AS m
 WHERE NOT (EXISTS (SELECT 1 FROM {t} AS b WITH (NOLOCK)
                     WHERE b.order_hash = m.order_hash AND b.status IN (0, 9) AND b.seq < m.seq
                       AND (b.status = 9 OR b.visible_at > @now)){dead_blocks})"
    )
}

/// Reconciliation (`@P1` from, `@P2` to, `@P3` the consumers as a JSON array of
/// strings, `[]` for none). The window is materialised once in a table variable (a CTE
/// would be evaluated at each of its five uses). The named consumers carry an explicit
/// `COLLATE DATABASE_DEFAULT` so comparing them with the inbox tables' consumer column
/// can never raise a collation conflict. Tenants join NULL-safely by hand (`IS NOT
/// DISTINCT FROM` is SQL Server 2022 only).
fn reconcile_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    format!(
        "SET NOCOUNT ON;
DECLARE @w TABLE (id uniqueidentifier PRIMARY KEY, day date NOT NULL,
                  tenant_id nvarchar(255) NULL, event_type nvarchar(255) NOT NULL);
INSERT INTO @w (id, day, tenant_id, event_type)
SELECT m.id, CAST(m.created_at AS date), m.tenant_id, m.event_type
  FROM {s}.outbox_messages AS m
 WHERE m.created_at >= @P1 AND m.created_at < @P2;
WITH named AS (
    SELECT DISTINCT j.consumer COLLATE DATABASE_DEFAULT AS consumer
      FROM OPENJSON(@P3) WITH (consumer nvarchar(255) '$') AS j
     WHERE j.consumer IS NOT NULL
), written AS (
    SELECT w.day, w.tenant_id, w.event_type, COUNT_BIG(*) AS n
      FROM @w AS w GROUP BY w.day, w.tenant_id, w.event_type
), seen AS (
    SELECT w.event_type, r.consumer FROM @w AS w
      JOIN {s}.inbox_records AS r ON r.message_id = w.id
    UNION
    SELECT w.event_type, f.consumer FROM @w AS w
      JOIN {s}.inbox_failures AS f ON f.message_id = w.id
    UNION
    SELECT e.event_type, c.consumer
      FROM (SELECT DISTINCT event_type FROM @w) AS e CROSS JOIN named AS c
), expected AS (
    SELECT DISTINCT x.event_type, x.consumer FROM seen AS x
     WHERE NOT EXISTS (SELECT 1 FROM named) OR x.consumer IN (SELECT consumer FROM named)
), processed AS (
    SELECT w.day, w.tenant_id, w.event_type, r.consumer, COUNT_BIG(*) AS n
      FROM @w AS w JOIN {s}.inbox_records AS r ON r.message_id = w.id
     GROUP BY w.day, w.tenant_id, w.event_type, r.consumer
), dead AS (
    SELECT w.day, w.tenant_id, w.event_type, f.consumer, COUNT_BIG(*) AS n
      FROM @w AS w JOIN {s}.inbox_failures AS f
        ON f.message_id = w.id AND f.dead_at IS NOT NULL
     GROUP BY w.day, w.tenant_id, w.event_type, f.consumer
)
SELECT wr.day, wr.tenant_id, wr.event_type, x.consumer, wr.n AS written,
       COALESCE(p.n, 0) AS processed, COALESCE(d.n, 0) AS dead
  FROM written AS wr
  JOIN expected AS x ON x.event_type = wr.event_type
  LEFT JOIN processed AS p
    ON p.day = wr.day
   AND (p.tenant_id = wr.tenant_id OR (p.tenant_id IS NULL AND wr.tenant_id IS NULL))
   AND p.event_type = wr.event_type AND p.consumer = x.consumer
  LEFT JOIN dead AS d
    ON d.day = wr.day
   AND (d.tenant_id = wr.tenant_id OR (d.tenant_id IS NULL AND wr.tenant_id IS NULL))
   AND d.event_type = wr.event_type AND d.consumer = x.consumer
 ORDER BY wr.day, wr.tenant_id, wr.event_type, x.consumer;"
    )
}

/// One archive move: up to `@P2` rows of `live` matching `due` (`m` the row, `@cutoff`
/// now minus `@P1` ms), oldest `order` first, skipping rows others hold (`READPAST`),
/// deleted with their `columns` `OUTPUT` into `archive` (delete and insert are one
/// statement). At most [`MAX_ROWS_PER_STATEMENT`] rows per statement, repeated inside
/// one transaction until `@P2` rows moved or a statement found fewer than it asked for.
/// Ends with `SELECT @moved AS affected`.
fn archive_move_sql(live: &str, archive: &str, columns: &[&str], due: &str, order: &str) -> String {
    let cutoff = minus_ms("SYSUTCDATETIME()", "@P1");
    let picked = columns
        .iter()
        .map(|c| format!("m.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    let deleted = columns
        .iter()
        .map(|c| format!("deleted.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    let into = columns.join(", ");
    format!(
        "SET XACT_ABORT ON;
SET NOCOUNT ON;
DECLARE @left bigint = @P2, @chunk bigint, @n bigint, @moved bigint = 0;
DECLARE @cutoff datetime2(7) = {cutoff};
BEGIN TRANSACTION;
WHILE @left > 0
BEGIN
    SET @chunk = CASE WHEN @left > {MAX_ROWS_PER_STATEMENT} THEN {MAX_ROWS_PER_STATEMENT} ELSE @left END;
    WITH d AS (
        SELECT TOP (@chunk) {picked}
          FROM {live} AS m WITH (ROWLOCK, READPAST)
         WHERE {due}
         ORDER BY {order})
    DELETE FROM d
    OUTPUT {deleted}
      INTO {archive} ({into});
    SET @n = @@ROWCOUNT;
    SET @moved = @moved + @n;
    SET @left = @left - @n;
    IF @n < @chunk BREAK;
END;
COMMIT TRANSACTION;
SELECT @moved AS affected;"
    )
}

/// `archive_sent`: Sent rows whose `sent_at` is at least `@P1` ms old (the `sent`
/// index), `@P2` rows at most.
fn archive_sent_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    archive_move_sql(
        &format!("{s}.outbox_messages"),
        &format!("{s}.outbox_messages_archive"),
        ARCHIVE_COLUMNS,
        "m.status = 1 AND m.sent_at <= @cutoff",
        "m.sent_at",
    )
}

/// `archive_inbox_records`: inbox records at least `@P1` ms old (the `processed_at`
/// index), `@P2` rows at most.
fn archive_inbox_records_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    archive_move_sql(
        &format!("{s}.inbox_records"),
        &format!("{s}.inbox_records_archive"),
        INBOX_ARCHIVE_COLUMNS,
        "m.processed_at <= @cutoff",
        "m.processed_at",
    )
}

/// Consumer dead letters then durable `Dead` rows, each oldest first, `@P8` in all
/// (filter parameters `@P1`-`@P7` as in [`failure_filter`] and [`durable_filter`]).
/// `kind` 0 is a consumer dead letter, 1 a durable row.
fn inbox_dead_letters_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    let (ff, df) = (failure_filter(), durable_filter());
    format!(
        "SELECT TOP (@P8) x.kind, x.message_id, x.consumer, x.event_type, x.last_error,
       x.attempts, x.at
  FROM (
    SELECT a.kind, a.message_id, a.consumer, a.event_type, a.last_error, a.attempts, a.at
      FROM (SELECT TOP (@P8) 0 AS kind, f.message_id, f.consumer, f.event_type,
                   f.last_error, f.attempts, f.dead_at AS at
              FROM {s}.inbox_failures AS f
             WHERE {ff}
             ORDER BY f.dead_at) AS a
    UNION ALL
    SELECT b.kind, b.message_id, b.consumer, b.event_type, b.last_error, b.attempts, b.at
      FROM (SELECT TOP (@P8) 1 AS kind, d.id AS message_id,
                   CAST(NULL AS nvarchar(255)) AS consumer, d.event_type, d.last_error,
                   d.attempts, d.received_at AS at
              FROM {s}.inbox_messages AS d
             WHERE {df}
             ORDER BY d.received_at) AS b
  ) AS x
 ORDER BY x.kind, x.at
OPTION (RECOMPILE)"
    )
}

/// The dry run of the inbox replay: matching dead letters of both kinds (`@P1`-`@P7`).
fn inbox_replay_count_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    let (ff, df) = (failure_filter(), durable_filter());
    format!(
        "SELECT (SELECT COUNT_BIG(*) FROM {s}.inbox_failures AS f WHERE {ff})
     + (SELECT COUNT_BIG(*) FROM {s}.inbox_messages AS d WHERE {df}) AS matched
OPTION (RECOMPILE)"
    )
}

/// The inbox replay, one transaction (`@P1`-`@P7` the filter, `@P8` clear-only as a
/// bit):
///
/// 1. the matching consumer dead letters are read and update-locked (`@target`: their
///    message id and the consumer's bytes, so the delete below finds exactly these rows
///    without comparing text across collations);
/// 2. their outbox rows (same id) are update-locked (`@source`);
/// 3. unless clear-only, those rows that are `Sent` or `Dead` go back to `New`, visible
///    now, attempts and crash-loop count 0 (rows already pending are left alone);
/// 4. the dead letters are deleted: all of them when clear-only, else those whose
///    outbox row exists (the others are kept and reported as failed);
/// 5. the matching durable `Dead` rows go back to `New`, visible now, attempts 0.
///
/// Returns one row: `matched` (dead letters of both kinds), `replayed` (deleted plus
/// durable rows made New), `requeued` (outbox rows made New).
fn inbox_replay_sql(schema: &str) -> String {
    let s = quoted_schema(schema);
    let t = format!("{s}.outbox_messages");
    let (ff, df) = (failure_filter(), durable_filter());
    format!(
        "SET XACT_ABORT ON;
SET NOCOUNT ON;
DECLARE @now datetime2(7) = SYSUTCDATETIME();
DECLARE @target TABLE (message_id uniqueidentifier NOT NULL, consumer_bytes varbinary(510) NOT NULL);
DECLARE @source TABLE (id uniqueidentifier PRIMARY KEY, status smallint NOT NULL);
DECLARE @matched bigint, @requeued bigint = 0, @cleared bigint, @durable bigint;
BEGIN TRANSACTION;
INSERT INTO @target (message_id, consumer_bytes)
SELECT f.message_id, CAST(f.consumer AS varbinary(510))
  FROM {s}.inbox_failures AS f WITH (UPDLOCK, ROWLOCK)
 WHERE {ff}
OPTION (RECOMPILE);
SET @matched = @@ROWCOUNT;
INSERT INTO @source (id, status)
SELECT m.id, m.status
  FROM {t} AS m WITH (UPDLOCK, ROWLOCK)
 WHERE m.id IN (SELECT x.message_id FROM @target AS x);
IF @P8 = 0
BEGIN
    UPDATE m
       SET m.status = 0, m.attempts = 0, m.visible_at = @now, m.lease_until = NULL,
           m.claim_token = NULL, m.sent_at = NULL, m.unfinished_claims = 0,
           m.unfinished_alone = 0
      FROM {t} AS m
      JOIN @source AS src ON src.id = m.id
     WHERE src.status IN (1, 3) AND m.status IN (1, 3);
    SET @requeued = @@ROWCOUNT;
END;
DELETE f
  FROM {s}.inbox_failures AS f
  JOIN @target AS x
    ON x.message_id = f.message_id AND x.consumer_bytes = CAST(f.consumer AS varbinary(510))
 WHERE @P8 = 1 OR EXISTS (SELECT 1 FROM @source AS src WHERE src.id = x.message_id);
SET @cleared = @@ROWCOUNT;
UPDATE d
   SET d.status = 0, d.attempts = 0, d.visible_at = @now, d.lease_until = NULL,
       d.claim_token = NULL
  FROM {s}.inbox_messages AS d
 WHERE {df}
OPTION (RECOMPILE);
SET @durable = @@ROWCOUNT;
COMMIT TRANSACTION;
SELECT @matched + @durable AS matched, @cleared + @durable AS replayed, @requeued AS requeued;"
    )
}

/// The optional filter of the message listings over `m` (`@P1` ids as a JSON array,
/// `@P2` from, `@P3` to, `@P4` tenant, `@P5` aggregate type, `@P6` aggregate id, `@P7`
/// event type, `@P8` error text escaped by [`like_escape`]): the dead-letter filter of
/// `sql.rs` without its status, bound by the store's `FilterParams`.
const LIST_FILTER: &str =
    "(@P1 IS NULL OR m.id IN (SELECT CAST(j.value AS uniqueidentifier) FROM OPENJSON(@P1) AS j))
    AND (@P2 IS NULL OR m.created_at >= @P2)
    AND (@P3 IS NULL OR m.created_at < @P3)
    AND (@P4 IS NULL OR m.tenant_id = @P4)
    AND (@P5 IS NULL OR m.aggregate_type = @P5)
    AND (@P6 IS NULL OR m.aggregate_id = @P6)
    AND (@P7 IS NULL OR m.event_type = @P7)
    AND (@P8 IS NULL OR UPPER(m.last_error) LIKE N'%' + UPPER(@P8) + N'%' ESCAPE N'\\')";

/// Columns of a [`MessageSummary`] (the listing's branches select them from `c`).
const SUMMARY_COLUMNS: &[&str] = &[
    "id",
    "seq",
    "status",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "tenant_id",
    "created_at",
    "visible_at",
    "sent_at",
    "attempts",
    "last_error",
];

/// `alias.column, ...` of [`SUMMARY_COLUMNS`].
fn summary_columns(alias: &str) -> String {
    SUMMARY_COLUMNS
        .iter()
        .map(|c| format!("{alias}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The key bounds of a listing branch over `m`: after the cursor (`@P{c}` time,
/// `@P{c+1}` seq), up to the horizon inclusive (`@P{h}`, `@P{h+1}`), in the direction
/// `cmp` (`>` ascending, `<` descending). T-SQL has no row comparison, so
/// `(at, seq) > (t, s)` is spelled `at > t OR (at = t AND seq > s)`.
fn key_bounds(at: &str, cmp: &str, cursor: Option<usize>, horizon: Option<usize>) -> String {
    let mut out = String::new();
    if let Some(c) = cursor {
        out.push_str(&format!(
            " AND (m.{at} {cmp} @P{c} OR (m.{at} = @P{c} AND m.seq {cmp} @P{}))",
            c + 1
        ));
    }
    if let Some(h) = horizon {
        let (strict, upto) = if cmp == ">" { ("<", "<=") } else { (">", ">=") };
        out.push_str(&format!(
            " AND (m.{at} {strict} @P{h} OR (m.{at} = @P{h} AND m.seq {upto} @P{}))",
            h + 1
        ));
    }
    out
}

/// The state's status predicates (one per filtered index), order column and
/// direction.
fn state_order(state: MessageState) -> (&'static [&'static str], &'static str, &'static str) {
    match state {
        MessageState::Pending => (&["m.status = 0", "m.status = 9"], "visible_at", ">"),
        MessageState::Dead => (&["m.status = 3"], "created_at", "<"),
        MessageState::Sent => (&["m.status = 1"], "sent_at", "<"),
    }
}

/// `cols` of the first `top` rows of `state` in its order that pass `pred` (after the
/// `bounds`), as a derived table's body: each status through its filtered index, two
/// branches (New, Processing) merged for Pending as `pending_stats` does. `READPAST`:
/// never waits on a lock (rows being claimed or enqueued at that instant are passed).
fn window(t: &str, state: MessageState, cols: &str, pred: &str, bounds: &str, top: &str) -> String {
    let (statuses, at, cmp) = state_order(state);
    let dir = if cmp == ">" { "" } else { " DESC" };
    let branch = |status: &str| {
        format!(
            "SELECT TOP ({top}) {cols} FROM {t} AS m WITH (READPAST)
          WHERE {status}{pred}{bounds}
          ORDER BY m.{at}{dir}, m.seq{dir}"
        )
    };
    let all_cols: Vec<&str> = cols
        .split(", ")
        .map(|c| c.trim_start_matches("m."))
        .collect();
    let x_cols = all_cols
        .iter()
        .map(|c| format!("x.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    let merged = statuses
        .iter()
        .enumerate()
        .map(|(i, status)| format!("SELECT b{i}.* FROM ({}) AS b{i}", branch(status)))
        .collect::<Vec<_>>()
        .join("\n    UNION ALL\n    ");
    format!(
        "SELECT TOP ({top}) {x_cols} FROM (
    {merged}
) AS x
 ORDER BY x.{at}{dir}, x.seq{dir}"
    )
}

/// One page of a listing (`@P1`-`@P8` the filter, `@P9` the limit; with a cursor its
/// time and seq at `@P10`, `@P11`; with a horizon its time and seq next). The state's
/// order comes from the outer `ORDER BY`. `OPTION (RECOMPILE)`: catch-all filters.
fn list_messages_sql(
    schema: &str,
    state: MessageState,
    with_cursor: bool,
    with_horizon: bool,
) -> String {
    let t = format!("{}.outbox_messages", quoted_schema(schema));
    let (_, at, cmp) = state_order(state);
    let cursor = with_cursor.then_some(10);
    let horizon = with_horizon.then_some(if with_cursor { 12 } else { 10 });
    let bounds = key_bounds(at, cmp, cursor, horizon);
    format!(
        "{}
OPTION (RECOMPILE)",
        window(
            &t,
            state,
            &summary_columns("m"),
            &format!(" AND {LIST_FILTER}"),
            &bounds,
            "@P9"
        )
    )
}

/// The horizon of a filtered listing: the order key (`at`, `seq`) of the `@P{k+1}`-th
/// row (an offset, the scan bound less one) after the cursor (`@P1`, `@P2` when
/// `with_cursor`), with `@P{k}` the scan bound as the branches' `TOP`; no row when the
/// state ends before.
fn horizon_sql(schema: &str, state: MessageState, with_cursor: bool) -> String {
    let t = format!("{}.outbox_messages", quoted_schema(schema));
    let (_, at, cmp) = state_order(state);
    let dir = if cmp == ">" { "" } else { " DESC" };
    let bounds = key_bounds(at, cmp, with_cursor.then_some(1), None);
    let k = if with_cursor { 3 } else { 1 };
    format!(
        "SELECT w.{at} AS at, w.seq FROM (
{}
) AS w
 ORDER BY w.{at}{dir}, w.seq{dir}
OFFSET @P{} ROWS FETCH NEXT 1 ROWS ONLY",
        window(
            &t,
            state,
            &format!("m.{at}, m.seq"),
            "",
            &bounds,
            &format!("@P{k}")
        ),
        k + 1
    )
}

/// The bounded count (`@P1`-`@P8` the filter, `@P9` the bound or the scan):
/// unfiltered, the rows of the state up to the bound; filtered, the matching rows among
/// the first `@P9` of the state in its order, and how many were examined (the window
/// is read twice: T-SQL cannot aggregate over a subquery, which the id filter is).
fn count_messages_sql(schema: &str, state: MessageState, filtered: bool) -> String {
    let t = format!("{}.outbox_messages", quoted_schema(schema));
    let (_, at, _) = state_order(state);
    if !filtered {
        return format!(
            "SELECT COUNT_BIG(*) AS n, COUNT_BIG(*) AS examined FROM (
{}
) AS c
OPTION (RECOMPILE)",
            window(
                &t,
                state,
                &format!("m.seq, m.{at}"),
                &format!(" AND {LIST_FILTER}"),
                "",
                "@P9"
            )
        );
    }
    // The filter's columns, the order key once (created_at is both for Dead).
    let mut cols = vec!["m.id".to_owned(), "m.seq".to_owned(), format!("m.{at}")];
    for c in [
        "created_at",
        "tenant_id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "last_error",
    ] {
        if c != at {
            cols.push(format!("m.{c}"));
        }
    }
    format!(
        "WITH w AS (
{}
)
SELECT (SELECT COUNT_BIG(*) FROM w AS m WHERE {LIST_FILTER}) AS n,
       (SELECT COUNT_BIG(*) FROM w) AS examined
OPTION (RECOMPILE)",
        window(&t, state, &cols.join(", "), "", "", "@P9")
    )
}

/// Sent rows per whole minute of age over the last `@P1` minutes (`sent` index), with
/// the server clock: one row per minute that has any, or one row with NULLs.
fn sent_per_minute_sql(schema: &str) -> String {
    let t = format!("{}.outbox_messages", quoted_schema(schema));
    format!(
        "DECLARE @now datetime2(7) = SYSUTCDATETIME();
SELECT @now AS now, a.ago, a.sent
  FROM (SELECT 1 AS one) AS o
  LEFT JOIN (
    SELECT DATEDIFF_BIG(millisecond, m.sent_at, @now) / 60000 AS ago, COUNT_BIG(*) AS sent
      FROM {t} AS m WITH (READPAST)
     WHERE m.status = 1 AND m.sent_at > DATEADD(minute, -@P1, @now)
     GROUP BY DATEDIFF_BIG(millisecond, m.sent_at, @now) / 60000
  ) AS a ON 1 = 1"
    )
}

/// The relay's heartbeat (`@P1` relay id, `@P2` host, `@P3` pid, `@P4` version, `@P5`
/// circuit open, `@P6` healthy, `@P7` published, `@P8` detail): deletes the rows of
/// relays not heard of for a day, updates the relay's row, inserts it when there was
/// none (one process writes one row: no concurrent insert of the same id).
fn record_heartbeat_sql(schema: &str) -> String {
    let t = format!("{}.outbox_relays", quoted_schema(schema));
    format!(
        "SET NOCOUNT ON;
DECLARE @now datetime2(7) = SYSUTCDATETIME();
DELETE FROM {t} WHERE last_seen_at < DATEADD(day, -1, @now) AND relay_id <> @P1;
UPDATE {t}
   SET last_seen_at = @now, circuit_open = @P5, healthy = @P6, published = @P7, detail = @P8
 WHERE relay_id = @P1;
IF @@ROWCOUNT = 0
    INSERT INTO {t} (relay_id, host, pid, version, started_at, last_seen_at, circuit_open,
                     healthy, published, detail)
    VALUES (@P1, @P2, @P3, @P4, @now, @now, @P5, @P6, @P7, @P8);"
    )
}

/// The relays heard of within `@P1` ms, most recent first, `@P2` at most.
fn relays_seen_sql(schema: &str) -> String {
    let t = format!("{}.outbox_relays", quoted_schema(schema));
    let since = minus_ms("@now", "@P1");
    format!(
        "DECLARE @now datetime2(7) = SYSUTCDATETIME();
SELECT TOP (@P2) relay_id, host, pid, version, started_at, last_seen_at,
       DATEDIFF_BIG(millisecond, last_seen_at, @now) AS silent_ms, circuit_open, healthy,
       published, detail
  FROM {t}
 WHERE last_seen_at >= {since}
 ORDER BY last_seen_at DESC, relay_id"
    )
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Milliseconds from the server (possibly negative after a clock step) as a duration.
fn ms_duration(ms: i64) -> Duration {
    Duration::from_millis(count(ms))
}

/// The parameters of [`failure_filter`] and [`durable_filter`], owned.
struct InboxFilterParams {
    ids: Option<String>,
    from: Option<NaiveDateTime>,
    to: Option<NaiveDateTime>,
    consumer: Option<String>,
    event_type: Option<String>,
    error: Option<String>,
    consumer_prefix: Option<String>,
}

impl InboxFilterParams {
    fn new(f: &InboxDeadFilter) -> Result<Self, OutboxError> {
        Ok(Self {
            ids: ids_json(&f.ids)?,
            from: f.from.map(|t| t.naive_utc()),
            to: f.to.map(|t| t.naive_utc()),
            consumer: f.consumer.clone(),
            event_type: f.event_type.clone(),
            error: f.error_contains.as_deref().map(like_escape),
            consumer_prefix: f.consumer.as_deref().map(consumer_prefix_pattern),
        })
    }

    fn params(&self) -> [&dyn ToSql; 7] {
        [
            &self.ids,
            &self.from,
            &self.to,
            &self.consumer,
            &self.event_type,
            &self.error,
            &self.consumer_prefix,
        ]
    }
}

/// `None` for no ids (no filter), else the ids as a JSON array of strings.
fn ids_json(ids: &[Uuid]) -> Result<Option<String>, OutboxError> {
    if ids.is_empty() {
        return Ok(None);
    }
    serde_json::to_string(ids)
        .map(Some)
        .map_err(|e| OutboxError::Decode {
            id: "filter".into(),
            reason: e.to_string(),
        })
}

/// The `LIKE` pattern of a durable row failed by `consumer`: its `last_error` starts
/// with `"<consumer>: "` (escaped with [`like_escape`], so the name matches literally).
fn consumer_prefix_pattern(consumer: &str) -> String {
    format!("{}: %", like_escape(consumer))
}

/// A bigint column that may be NULL (an aggregate over no rows), as a count.
fn count_at(row: &Row, i: usize, operation: &'static str) -> Result<u64, OutboxError> {
    Ok(row
        .try_get::<i64, _>(i)
        .map_err(db(operation))?
        .map_or(0, count))
}

/// A required column by index.
fn need<'a, T: tiberius::FromSql<'a>>(
    row: &'a Row,
    i: usize,
    operation: &'static str,
) -> Result<T, OutboxError> {
    row.try_get::<T, _>(i)
        .map_err(db(operation))?
        .ok_or_else(|| OutboxError::Decode {
            id: operation.to_owned(),
            reason: format!("column {i} is NULL"),
        })
}

#[async_trait]
impl OutboxAdmin for MssqlOutbox {
    fn backend(&self) -> &'static str {
        "sqlserver"
    }

    fn schema(&self) -> &str {
        MssqlOutbox::schema(self)
    }

    async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        MssqlOutbox::migrate(self).await
    }

    /// Counts by status and the oldest pending age, per `(event_type, tenant_id)`,
    /// ordered by event type then tenant (no tenant first). Scans the table, with
    /// ordinary read-committed locking (like [`stats`](outboxkit_core::OutboxStore::stats)),
    /// so it is exact; groups follow the columns' collation (see the module docs).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn stats_by_group(&self) -> Result<Vec<GroupStats>, OutboxError> {
        const OP: &str = "stats_by_group";
        let rows = self
            .pool()
            .rows(OP, &stats_by_group_sql(self.schema()), &[])
            .await?;
        rows.iter()
            .map(|r| {
                Ok(GroupStats {
                    event_type: need::<&str>(r, 0, OP)?.to_owned(),
                    tenant_id: r.try_get::<&str, _>(1).map_err(db(OP))?.map(str::to_owned),
                    new: count_at(r, 2, OP)?,
                    processing: count_at(r, 3, OP)?,
                    sent: count_at(r, 4, OP)?,
                    dead: count_at(r, 5, OP)?,
                    oldest_pending_age_secs: r
                        .try_get::<i64, _>(6)
                        .map_err(db(OP))?
                        .map(|ms| ms.max(0) as f64 / 1000.0),
                })
            })
            .collect()
    }

    /// The relay's periodic gauges, **bounded** by [`PENDING_STATS_BOUND`] (see
    /// [`OutboxAdmin::pending_stats`]): `new` and `processing` among the first
    /// [`PENDING_STATS_BOUND`] pending rows in claim order, `dead` counted up to the
    /// bound, `oldest_pending_age` the queue lag among those rows, counted from when
    /// each became due (see [`OutboxStats::oldest_pending_age`]; server clock,
    /// millisecond resolution), `sent` left 0. Reads `WITH (READPAST)`, so the gauges
    /// never wait on a lock: rows locked at that instant (being claimed, or inserted by
    /// a transaction not yet committed) are not counted.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn pending_stats(&self) -> Result<OutboxStats, OutboxError> {
        const OP: &str = "pending_stats";
        let rows = self
            .pool()
            .rows(
                OP,
                &pending_stats_sql(self.schema()),
                &[&PENDING_STATS_BOUND],
            )
            .await?;
        let row = rows.last().ok_or_else(|| OutboxError::Decode {
            id: OP.into(),
            reason: "no row".into(),
        })?;
        let mut stats = OutboxStats::default();
        stats.new = count_at(row, 0, OP)?;
        stats.processing = count_at(row, 1, OP)?;
        stats.dead = count_at(row, 2, OP)?;
        stats.oldest_pending_age = row.try_get::<i64, _>(3).map_err(db(OP))?.map(ms_duration);
        Ok(stats)
    }

    /// How long the oldest claimable message (`New` and visible) has been waiting, by
    /// the server clock (millisecond resolution); `None` when nothing is claimable.
    /// With `ordered = Some(on_dead)` a message is claimable only when no earlier
    /// message of its key (`order_hash`) is Processing or waiting out a retry backoff,
    /// or, under [`OnDead::Block`], Dead. Only the 1,000 oldest visible messages are
    /// examined (if all wait behind blocked keys the answer is `None`). Never waits on
    /// a lock: candidates are read `READPAST`, the per-key probes `NOLOCK`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn oldest_claimable_wait(
        &self,
        ordered: Option<OnDead>,
    ) -> Result<Option<Duration>, OutboxError> {
        const OP: &str = "oldest_claimable_wait";
        let rows = self
            .pool()
            .rows(OP, &oldest_claimable_wait_sql(self.schema(), ordered), &[])
            .await?;
        Ok(rows
            .last()
            .map(|r| r.try_get::<i64, _>(0))
            .transpose()
            .map_err(db(OP))?
            .flatten()
            .map(ms_duration))
    }

    /// Reconciles the outbox with the inbox records of the same schema for messages
    /// created in `[from, to)` (instants compared as UTC `datetime2`): one row per UTC
    /// day, tenant, event type and consumer (see [`OutboxAdmin::reconcile`]). Purged
    /// and archived rows are not counted.
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
        const OP: &str = "reconcile";
        if to <= from {
            return Err(OutboxError::Config(format!(
                "reconcile window is empty: {from} is not before {to}"
            )));
        }
        let named = serde_json::to_string(consumers).map_err(|e| OutboxError::Decode {
            id: OP.into(),
            reason: e.to_string(),
        })?;
        let (from, to) = (from.naive_utc(), to.naive_utc());
        let rows = self
            .pool()
            .rows(OP, &reconcile_sql(self.schema()), &[&from, &to, &named])
            .await?;
        rows.iter()
            .map(|r| {
                let written: i64 = need(r, 4, OP)?;
                let processed: i64 = need(r, 5, OP)?;
                Ok(ReconcileRow {
                    day: need::<NaiveDate>(r, 0, OP)?,
                    tenant_id: r.try_get::<&str, _>(1).map_err(db(OP))?.map(str::to_owned),
                    event_type: need::<&str>(r, 2, OP)?.to_owned(),
                    consumer: need::<&str>(r, 3, OP)?.to_owned(),
                    written: count(written),
                    processed: count(processed),
                    dead: count(need(r, 6, OP)?),
                    missing: written - processed,
                })
            })
            .collect()
    }

    /// Moves up to `batch_size` `Sent` rows whose `sent_at` is older than `older_than`
    /// (milliseconds, server clock) into `outbox_messages_archive`, oldest first;
    /// returns how many moved. Call until it returns less than `batch_size`.
    ///
    /// Each statement is `DELETE ... OUTPUT deleted.* INTO` the archive (delete and
    /// insert are one statement) over rows read `WITH (ROWLOCK, READPAST)`, so rows
    /// others hold are skipped and the relay is never blocked, and moves at most
    /// [`MAX_ROWS_PER_STATEMENT`] rows (below lock escalation); a larger `batch_size`
    /// runs several such statements in one transaction, so a call moves all its rows
    /// or none. A row whose id is already archived is dropped from the live table
    /// without a second archive row (`IGNORE_DUP_KEY`).
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 5 not applied); nothing moved then.
    async fn archive_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.pool()
            .affected(
                "archive_sent",
                &archive_sent_sql(self.schema()),
                &[&millis(older_than), &limit(batch_size)],
            )
            .await
    }

    /// [`InboxStore::purge`] of an [`MssqlInbox`](crate::MssqlInbox) on this pool and schema.
    async fn purge_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.inbox().purge(older_than, batch_size).await
    }

    /// [`DurableInbox::purge_processed`] of an [`MssqlInbox`](crate::MssqlInbox) on this pool and schema.
    async fn purge_inbox_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.inbox().purge_processed(older_than, batch_size).await
    }

    /// Moves up to `batch_size` inbox records older than `older_than` (by
    /// `processed_at`, milliseconds, server clock) into `inbox_records_archive`, oldest
    /// first; returns how many moved. Statements and locking as in
    /// [`archive_sent`](Self::archive_sent). An archived record no longer absorbs
    /// duplicates of its message.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 5 not applied); nothing moved then.
    async fn archive_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.pool()
            .affected(
                "archive_inbox_records",
                &archive_inbox_records_sql(self.schema()),
                &[&millis(older_than), &limit(batch_size)],
            )
            .await
    }

    /// Consumer-side dead letters matching `filter`: idempotent-consumer dead letters
    /// then durable-inbox `Dead` rows, each oldest first, at most `limit_rows` in all.
    /// The error filter matches literally (`%`, `_`, `[` and `\` escaped) and
    /// case-insensitively (`UPPER` on both sides).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        limit_rows: usize,
    ) -> Result<Vec<InboxDeadLetter>, OutboxError> {
        const OP: &str = "inbox_dead_letters";
        let f = InboxFilterParams::new(filter)?;
        let n = limit(limit_rows);
        let mut params: Vec<&dyn ToSql> = f.params().to_vec();
        params.push(&n);
        let rows = self
            .pool()
            .rows(OP, &inbox_dead_letters_sql(self.schema()), &params)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(InboxDeadLetter {
                    kind: if need::<i32>(r, 0, OP)? == 0 {
                        InboxDeadKind::Consumer
                    } else {
                        InboxDeadKind::Durable
                    },
                    message_id: need(r, 1, OP)?,
                    consumer: r.try_get::<&str, _>(2).map_err(db(OP))?.map(str::to_owned),
                    event_type: need::<&str>(r, 3, OP)?.to_owned(),
                    last_error: r.try_get::<&str, _>(4).map_err(db(OP))?.map(str::to_owned),
                    attempts: need(r, 5, OP)?,
                    at: need::<NaiveDateTime>(r, 6, OP)?.and_utc(),
                })
            })
            .collect()
    }

    /// Makes consumer-side dead letters matching `filter` processable again, in one
    /// transaction (one T-SQL batch under `XACT_ABORT`); with [`InboxReplayMode::DryRun`] only counts
    /// them. Same semantics as the PostgreSQL backend (see
    /// [`OutboxAdmin::replay_inbox_dead_letters`]): durable `Dead` rows go back to
    /// `New`; an idempotent-consumer dead letter sets its outbox row (same id) back to
    /// `New` from `Sent` or `Dead` and is deleted, or, when that row is gone, is kept
    /// and counted as failed unless the mode is [`InboxReplayMode::ClearOnly`] (then only the dead letters are
    /// deleted). The dead letters and their outbox rows are update-locked from the
    /// first read to the commit.
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
        const OP: &str = "inbox_replay";
        let started = Instant::now();
        let f = InboxFilterParams::new(filter)?;
        if dry_run {
            let rows = self
                .pool()
                .rows(OP, &inbox_replay_count_sql(self.schema()), &f.params())
                .await?;
            let matched = rows
                .last()
                .map(|r| count_at(r, 0, OP))
                .transpose()?
                .unwrap_or(0);
            return Ok(InboxReplayReport {
                matched,
                replayed: 0,
                failed: 0,
                elapsed_secs: started.elapsed().as_secs_f64(),
            });
        }
        let mut params: Vec<&dyn ToSql> = f.params().to_vec();
        params.push(&clear_only);
        let rows = self
            .pool()
            .rows(OP, &inbox_replay_sql(self.schema()), &params)
            .await?;
        let row = rows.last().ok_or_else(|| OutboxError::Decode {
            id: OP.into(),
            reason: "no row".into(),
        })?;
        let (matched, replayed, requeued) = (
            count_at(row, 0, OP)?,
            count_at(row, 1, OP)?,
            count_at(row, 2, OP)?,
        );
        tracing::info!(
            matched,
            replayed,
            requeued,
            clear_only,
            "consumer dead letters replayed"
        );
        Ok(InboxReplayReport {
            matched,
            replayed,
            failed: matched.saturating_sub(replayed),
            elapsed_secs: started.elapsed().as_secs_f64(),
        })
    }

    /// One page of `state` in its order (see [`MessageState`]), keyset-paged along the
    /// state's filtered indexes, read `READPAST` (see `list_messages_sql`); a filtered
    /// page first finds its horizon, `scan` rows on, on the same indexes.
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
        let cursor = after.map(|c| (c.at.naive_utc(), c.seq));
        let horizon = if *filter == MessageFilter::new() {
            None
        } else {
            let top = i64::try_from(scan.max(1)).unwrap_or(i64::MAX);
            let offset = top - 1;
            let mut params: Vec<&dyn ToSql> = Vec::new();
            if let Some((at, seq)) = &cursor {
                params.push(at);
                params.push(seq);
            }
            params.push(&top);
            params.push(&offset);
            let sql = horizon_sql(self.schema(), state, cursor.is_some());
            let rows = self.pool().rows(OP, &sql, &params).await?;
            rows.last()
                .map(|r| -> Result<_, OutboxError> {
                    Ok((need::<NaiveDateTime>(r, 0, OP)?, need::<i64>(r, 1, OP)?))
                })
                .transpose()?
        };
        let f = FilterParams::new(filter)?;
        let n = limit(limit_rows.saturating_add(1));
        let mut params: Vec<&dyn ToSql> = f.params().to_vec();
        params.push(&n);
        for (at, seq) in [&cursor, &horizon].into_iter().flatten() {
            params.push(at);
            params.push(seq);
        }
        let sql = list_messages_sql(self.schema(), state, cursor.is_some(), horizon.is_some());
        let rows = self.pool().rows(OP, &sql, &params).await?;
        let mut rows = rows
            .iter()
            .map(|r| {
                let text = |i: usize| -> Result<Option<String>, OutboxError> {
                    Ok(r.try_get::<&str, _>(i).map_err(db(OP))?.map(str::to_owned))
                };
                let time = |i: usize| -> Result<Option<DateTime<Utc>>, OutboxError> {
                    Ok(r.try_get::<NaiveDateTime, _>(i)
                        .map_err(db(OP))?
                        .map(|t| t.and_utc()))
                };
                Ok(MessageSummary {
                    id: need(r, 0, OP)?,
                    seq: need(r, 1, OP)?,
                    status: MessageStatus::from_code(need(r, 2, OP)?)?,
                    event_type: need::<&str>(r, 3, OP)?.to_owned(),
                    aggregate_type: need::<&str>(r, 4, OP)?.to_owned(),
                    aggregate_id: need::<&str>(r, 5, OP)?.to_owned(),
                    tenant_id: text(6)?,
                    created_at: need::<NaiveDateTime>(r, 7, OP)?.and_utc(),
                    visible_at: need::<NaiveDateTime>(r, 8, OP)?.and_utc(),
                    sent_at: time(9)?,
                    attempts: need(r, 10, OP)?,
                    last_error: text(11)?,
                })
            })
            .collect::<Result<Vec<_>, OutboxError>>()?;
        let next = if rows.len() > limit_rows {
            rows.truncate(limit_rows);
            rows.last().map(|m| m.cursor(state))
        } else {
            horizon.map(|(at, seq)| MessageCursor {
                at: at.and_utc(),
                seq,
            })
        };
        Ok(MessagePage { rows, next })
    }

    /// Counts at most `bound` rows of `state` matching `filter` (`TOP` in a derived
    /// table); filtered, among the first `scan` rows of the state. Read `READPAST`.
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
        const OP: &str = "count_messages";
        let filtered = *filter != MessageFilter::new();
        let stop = if filtered { scan } else { bound };
        let f = FilterParams::new(filter)?;
        let top = i64::try_from(stop).unwrap_or(i64::MAX);
        let mut params: Vec<&dyn ToSql> = f.params().to_vec();
        params.push(&top);
        let rows = self
            .pool()
            .rows(
                OP,
                &count_messages_sql(self.schema(), state, filtered),
                &params,
            )
            .await?;
        let (matching, examined) = match rows.last() {
            Some(r) => (count_at(r, 0, OP)?, count_at(r, 1, OP)?),
            None => (0, 0),
        };
        Ok(MessageCount {
            matching: matching.min(bound),
            exact: matching < bound && examined < stop,
        })
    }

    /// Sent rows per minute over the last `minutes` minutes (server clock, the `sent`
    /// index).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn sent_per_minute(&self, minutes: u32) -> Result<SentPerMinute, OutboxError> {
        const OP: &str = "sent_per_minute";
        let window = i32::try_from(minutes).unwrap_or(i32::MAX);
        let rows = self
            .pool()
            .rows(OP, &sent_per_minute_sql(self.schema()), &[&window])
            .await?;
        let mut until = None;
        let mut ages = Vec::with_capacity(rows.len());
        for r in &rows {
            until = Some(need::<NaiveDateTime>(r, 0, OP)?.and_utc());
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

    /// Records the relay's heartbeat in `outbox_relays` (migration 7), deleting the
    /// rows of relays not heard of for a day.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 7 not applied).
    async fn record_heartbeat(&self, beat: &RelayHeartbeat) -> Result<(), OutboxError> {
        let pid = i64::from(beat.pid);
        let published = i64::try_from(beat.published).unwrap_or(i64::MAX);
        let detail: String = beat.detail.chars().take(1000).collect();
        self.pool()
            .rows(
                "record_heartbeat",
                &record_heartbeat_sql(self.schema()),
                &[
                    &beat.relay_id,
                    &beat.host.as_str(),
                    &pid,
                    &beat.version.as_str(),
                    &beat.circuit_open,
                    &beat.healthy,
                    &published,
                    &detail.as_str(),
                ],
            )
            .await?;
        Ok(())
    }

    /// The relays of `outbox_relays` heard of within `within`, most recent first.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (e.g. migration 7 not applied).
    async fn relays_seen(
        &self,
        within: Duration,
        limit_rows: usize,
    ) -> Result<Vec<RelaySeen>, OutboxError> {
        const OP: &str = "relays_seen";
        let rows = self
            .pool()
            .rows(
                OP,
                &relays_seen_sql(self.schema()),
                &[&millis(within), &limit(limit_rows)],
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(RelaySeen {
                    relay_id: need(r, 0, OP)?,
                    host: need::<&str>(r, 1, OP)?.to_owned(),
                    pid: need(r, 2, OP)?,
                    version: need::<&str>(r, 3, OP)?.to_owned(),
                    started_at: need::<NaiveDateTime>(r, 4, OP)?.and_utc(),
                    last_seen_at: need::<NaiveDateTime>(r, 5, OP)?.and_utc(),
                    silent_for: ms_duration(need(r, 6, OP)?),
                    circuit_open: need(r, 7, OP)?,
                    healthy: need(r, 8, OP)?,
                    published: count(need(r, 9, OP)?),
                    detail: need::<&str>(r, 10, OP)?.to_owned(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sql::without_literals;

    /// Every statement of this module, rendered for `schema`.
    fn all(schema: &str) -> Vec<(&'static str, String)> {
        vec![
            ("stats_by_group", stats_by_group_sql(schema)),
            ("pending_stats", pending_stats_sql(schema)),
            ("oldest_wait", oldest_claimable_wait_sql(schema, None)),
            (
                "oldest_wait_block",
                oldest_claimable_wait_sql(schema, Some(OnDead::Block)),
            ),
            (
                "oldest_wait_skip",
                oldest_claimable_wait_sql(schema, Some(OnDead::Skip)),
            ),
            ("reconcile", reconcile_sql(schema)),
            ("archive_sent", archive_sent_sql(schema)),
            ("archive_inbox_records", archive_inbox_records_sql(schema)),
            ("inbox_dead_letters", inbox_dead_letters_sql(schema)),
            ("inbox_replay_count", inbox_replay_count_sql(schema)),
            ("inbox_replay", inbox_replay_sql(schema)),
            (
                "list_pending",
                list_messages_sql(schema, MessageState::Pending, false, false),
            ),
            (
                "list_pending_after_to_horizon",
                list_messages_sql(schema, MessageState::Pending, true, true),
            ),
            (
                "list_pending_to_horizon",
                list_messages_sql(schema, MessageState::Pending, false, true),
            ),
            (
                "list_dead_after",
                list_messages_sql(schema, MessageState::Dead, true, false),
            ),
            (
                "list_sent",
                list_messages_sql(schema, MessageState::Sent, false, false),
            ),
            (
                "horizon_pending_after",
                horizon_sql(schema, MessageState::Pending, true),
            ),
            (
                "horizon_dead",
                horizon_sql(schema, MessageState::Dead, false),
            ),
            (
                "count_pending",
                count_messages_sql(schema, MessageState::Pending, false),
            ),
            (
                "count_pending_scanned",
                count_messages_sql(schema, MessageState::Pending, true),
            ),
            (
                "count_dead_scanned",
                count_messages_sql(schema, MessageState::Dead, true),
            ),
            ("sent_per_minute", sent_per_minute_sql(schema)),
            ("record_heartbeat", record_heartbeat_sql(schema)),
            ("relays_seen", relays_seen_sql(schema)),
        ]
    }

    /// Whitespace collapsed to single spaces.
    fn squash(sql: &str) -> String {
        sql.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// The `@Pn` parameters a statement uses, sorted.
    fn params(sql: &str) -> Vec<u32> {
        let mut found: Vec<u32> = sql
            .match_indices("@P")
            .filter_map(|(at, _)| {
                let digits: String = sql[at + 2..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                digits.parse().ok()
            })
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    }

    #[test]
    #[ignore = "prints the rendered SQL for review"]
    fn dump_sql() {
        for (name, sql) in all("outbox") {
            println!("-- ===== {name}\n{sql}\nGO\n");
        }
    }

    #[test]
    fn every_table_is_schema_quoted_and_every_value_a_parameter() {
        for schema in ["outbox", "user", "select"] {
            for (name, sql) in all(schema) {
                let bare = without_literals(&sql);
                for table in [
                    "outbox_messages",
                    "outbox_messages_archive",
                    "inbox_records",
                    "inbox_records_archive",
                    "inbox_failures",
                    "inbox_messages",
                ] {
                    let mut rest = bare.as_str();
                    while let Some(at) = rest.find(table) {
                        let before = &rest[..at];
                        let after = rest[at + table.len()..].chars().next();
                        // A whole table name (not a prefix of a longer one, nor an
                        // index or alias name) is preceded by the quoted schema.
                        if after.is_none_or(|c| !c.is_ascii_alphanumeric() && c != '_')
                            && !before.ends_with('_')
                        {
                            assert!(
                                before.ends_with(&format!("[{schema}].")),
                                "{name}: {table} without [{schema}]."
                            );
                        }
                        rest = &rest[at + table.len()..];
                    }
                }
                assert!(!bare.contains(&format!(" {schema}.")), "{name}");
            }
        }
    }

    #[test]
    fn parameters_are_numbered_as_bound() {
        let expected: &[(&str, &[u32])] = &[
            ("stats_by_group", &[]),
            ("pending_stats", &[1]),
            ("oldest_wait", &[]),
            ("oldest_wait_block", &[]),
            ("oldest_wait_skip", &[]),
            ("reconcile", &[1, 2, 3]),
            ("archive_sent", &[1, 2]),
            ("archive_inbox_records", &[1, 2]),
            ("inbox_dead_letters", &[1, 2, 3, 4, 5, 6, 7, 8]),
            ("inbox_replay_count", &[1, 2, 3, 4, 5, 6, 7]),
            ("inbox_replay", &[1, 2, 3, 4, 5, 6, 7, 8]),
            ("list_pending", &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            (
                "list_pending_after_to_horizon",
                &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
            ),
            (
                "list_pending_to_horizon",
                &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
            ),
            ("list_dead_after", &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
            ("list_sent", &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            ("horizon_pending_after", &[1, 2, 3, 4]),
            ("horizon_dead", &[1, 2]),
            ("count_pending", &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            ("count_pending_scanned", &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            ("count_dead_scanned", &[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            ("sent_per_minute", &[1]),
            ("record_heartbeat", &[1, 2, 3, 4, 5, 6, 7, 8]),
            ("relays_seen", &[1, 2]),
        ];
        let sqls = all("outbox");
        for (name, want) in expected {
            let sql = &sqls.iter().find(|(n, _)| n == name).expect("rendered").1;
            assert_eq!(params(sql), *want, "{name}");
        }
        assert_eq!(sqls.len(), expected.len());
        // The filter binds seven values in this order; the eighth is the limit or the
        // clear-only flag.
        let f = InboxFilterParams::new(&InboxDeadFilter::new()).expect("params");
        assert_eq!(f.params().len(), 7);
    }

    #[test]
    fn every_time_comes_from_the_server_clock() {
        for (name, sql) in all("outbox") {
            for local in [
                "GETDATE(",
                "GETUTCDATE(",
                "SYSDATETIME(",
                "CURRENT_TIMESTAMP",
            ] {
                assert!(!sql.contains(local), "{name} uses {local}");
            }
            let uses_now = sql.contains("@now") || sql.contains("@cutoff");
            assert!(
                !uses_now || sql.contains("SYSUTCDATETIME()"),
                "{name}: @now/@cutoff derive from SYSUTCDATETIME()"
            );
        }
    }

    #[test]
    fn stats_by_group_counts_each_status_and_sorts_null_tenants_first() {
        let sql = squash(&stats_by_group_sql("outbox"));
        for status in [0, 9, 1, 3] {
            assert!(sql.contains(&format!(
                "COUNT_BIG(CASE WHEN status = {status} THEN 1 END)"
            )));
        }
        // The lag counts from when a message became due (`sql::DUE_AT`), not from
        // `created_at`.
        assert!(
            sql.contains(&squash(&crate::sql::pending_lag_ms("SYSUTCDATETIME()"))),
            "{sql}"
        );
        // Ascending order puts NULLs first in T-SQL (PostgreSQL needs NULLS FIRST).
        assert!(sql.ends_with("GROUP BY event_type, tenant_id ORDER BY event_type, tenant_id"));
        assert!(sql.contains("FROM [outbox].outbox_messages GROUP BY"));
    }

    #[test]
    fn pending_stats_is_bounded_and_never_waits() {
        let sql = squash(&pending_stats_sql("outbox"));
        // Three TOP (@P1) over pending rows (outer merge, New branch, Processing
        // branch) and one over Dead rows.
        assert_eq!(sql.matches("TOP (@P1)").count(), 4, "{sql}");
        assert_eq!(sql.matches("WITH (READPAST)").count(), 3);
        assert!(sql.contains("WHERE c.status = 0 ORDER BY c.visible_at, c.seq) AS n"));
        assert!(sql.contains("WHERE c.status = 9 ORDER BY c.visible_at, c.seq) AS g"));
        assert!(sql.contains("ORDER BY x.visible_at, x.seq) AS p"));
        assert!(sql.contains("WHERE d.status = 3) AS d);"));
        assert!(
            sql.contains(&squash(&crate::sql::pending_lag_ms("@now"))),
            "{sql}"
        );
        // Each ordered branch of the UNION sits in a derived table (bare is a syntax
        // error in T-SQL).
        assert!(sql.contains("UNION ALL SELECT g.status"));
    }

    #[test]
    fn oldest_claimable_wait_matches_the_postgresql_definition() {
        let plain = squash(&oldest_claimable_wait_sql("outbox", None));
        assert!(plain.contains(
            "FROM [outbox].outbox_messages AS m WITH (READPAST) WHERE m.status = 0 AND m.visible_at <= @now"
        ));
        assert!(!plain.contains("order_hash"));
        let block = squash(&oldest_claimable_wait_sql("outbox", Some(OnDead::Block)));
        let skip = squash(&oldest_claimable_wait_sql("outbox", Some(OnDead::Skip)));
        for sql in [&block, &skip] {
            assert!(sql.contains("SELECT TOP (1000) c.order_hash, c.seq, c.visible_at"));
            assert!(sql.contains("ORDER BY c.visible_at, c.seq) AS m"));
            // An earlier message of the key in flight or in a retry backoff blocks.
            assert!(sql.contains(
                "WHERE b.order_hash = m.order_hash AND b.status IN (0, 9) AND b.seq < m.seq AND (b.status = 9 OR b.visible_at > @now))"
            ));
        }
        assert!(block.contains(
            "OR EXISTS (SELECT 1 FROM [outbox].outbox_messages AS d WITH (NOLOCK) WHERE d.order_hash = m.order_hash AND d.status = 3 AND d.seq < m.seq))"
        ));
        assert!(
            !skip.contains("d.status = 3"),
            "Skip: Dead rows do not block"
        );
    }

    #[test]
    fn reconcile_materialises_the_window_and_joins_tenants_null_safely() {
        let sql = squash(&reconcile_sql("outbox"));
        assert!(sql.contains("WHERE m.created_at >= @P1 AND m.created_at < @P2;"));
        assert!(sql.contains("CAST(m.created_at AS date)"), "the UTC day");
        assert!(sql.contains("FROM OPENJSON(@P3) WITH (consumer nvarchar(255) '$') AS j"));
        assert!(sql.contains("j.consumer COLLATE DATABASE_DEFAULT AS consumer"));
        assert!(sql.contains("WHERE NOT EXISTS (SELECT 1 FROM named) OR x.consumer IN"));
        for side in ["p", "d"] {
            assert!(sql.contains(&format!(
                "({side}.tenant_id = wr.tenant_id OR ({side}.tenant_id IS NULL AND wr.tenant_id IS NULL))"
            )));
        }
        assert!(
            !sql.contains("IS NOT DISTINCT FROM"),
            "SQL Server 2022 only"
        );
        assert!(sql.contains("ON f.message_id = w.id AND f.dead_at IS NOT NULL"));
        assert!(sql.ends_with("ORDER BY wr.day, wr.tenant_id, wr.event_type, x.consumer;"));
        // The CTE follows a statement that ends with `;`, as T-SQL requires.
        assert!(sql.contains("m.created_at < @P2; WITH named AS ("));
    }

    #[test]
    fn archive_moves_are_one_statement_per_chunk_capped_below_lock_escalation() {
        let sent = squash(&archive_sent_sql("outbox"));
        let cols = ARCHIVE_COLUMNS.join(", ");
        let deleted = ARCHIVE_COLUMNS
            .iter()
            .map(|c| format!("deleted.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        assert!(sent.contains(&format!(
            "DELETE FROM d OUTPUT {deleted} INTO [outbox].outbox_messages_archive ({cols});"
        )));
        assert!(sent.contains(
            "FROM [outbox].outbox_messages AS m WITH (ROWLOCK, READPAST) WHERE m.status = 1 AND m.sent_at <= @cutoff ORDER BY m.sent_at)"
        ));
        assert!(sent.contains(&format!(
            "DECLARE @cutoff datetime2(7) = {};",
            minus_ms("SYSUTCDATETIME()", "@P1")
        )));
        let inbox = squash(&archive_inbox_records_sql("outbox"));
        assert!(inbox.contains(
            "DELETE FROM d OUTPUT deleted.message_id, deleted.consumer, deleted.processed_at INTO [outbox].inbox_records_archive (message_id, consumer, processed_at);"
        ));
        assert!(inbox.contains("WHERE m.processed_at <= @cutoff ORDER BY m.processed_at)"));
        for sql in [&sent, &inbox] {
            // The cap: no statement moves more than 1,000 rows; a larger batch loops
            // inside one transaction until it is done or a chunk comes back short.
            assert!(sql.contains("SET @chunk = CASE WHEN @left > 1000 THEN 1000 ELSE @left END;"));
            assert!(sql.contains("SELECT TOP (@chunk) "));
            assert!(!sql.contains("TOP (@P2)"), "the batch size is never a TOP");
            assert!(sql.contains("SET @n = @@ROWCOUNT; SET @moved = @moved + @n;"));
            assert!(sql.contains("IF @n < @chunk BREAK;"));
            let (begin, commit) = (
                sql.find("BEGIN TRANSACTION;"),
                sql.find("COMMIT TRANSACTION;"),
            );
            assert!(begin.is_some() && begin < sql.find("WHILE") && sql.find("END;") < commit);
            assert!(sql.starts_with("SET XACT_ABORT ON;"));
            assert!(
                sql.ends_with("SELECT @moved AS affected;"),
                "read by MssqlPool::affected"
            );
        }
        assert_eq!(MAX_ROWS_PER_STATEMENT, 1_000);
    }

    #[test]
    fn archive_columns_exist_in_both_tables() {
        let squashed = |sql: &str| sql.split_whitespace().collect::<Vec<_>>().join(" ");
        let live = squashed(
            &crate::migrate::MIGRATIONS
                .iter()
                .map(|m| m.2)
                .collect::<Vec<_>>()
                .join("\n"),
        );
        let archive = squashed(include_str!("../migrations/0005_archive.sql"));
        for c in ARCHIVE_COLUMNS.iter().chain(INBOX_ARCHIVE_COLUMNS) {
            assert!(live.contains(&format!(" {c} ")), "{c} in the live tables");
            assert!(archive.contains(&format!(" {c} ")), "{c} in the archive");
        }
    }

    #[test]
    fn inbox_filters_escape_like_and_match_case_insensitively() {
        let ff = squash(&failure_filter());
        let df = squash(&durable_filter());
        for (f, alias, id, at) in [
            (&ff, "f", "f.message_id", "f.dead_at"),
            (&df, "d", "d.id", "d.received_at"),
        ] {
            assert!(f.contains(&format!(
                "(@P1 IS NULL OR {id} IN (SELECT CAST(j.value AS uniqueidentifier) FROM OPENJSON(@P1) AS j))"
            )));
            assert!(f.contains(&format!("(@P2 IS NULL OR {at} >= @P2)")));
            assert!(f.contains(&format!("(@P3 IS NULL OR {at} < @P3)")));
            assert!(f.contains(&format!("(@P5 IS NULL OR {alias}.event_type = @P5)")));
            assert!(f.contains(&format!(
                "(@P6 IS NULL OR UPPER({alias}.last_error) LIKE N'%' + UPPER(@P6) + N'%' ESCAPE N'\\')"
            )));
        }
        assert!(ff.starts_with("f.dead_at IS NOT NULL"));
        assert!(ff.contains("(@P4 IS NULL OR f.consumer = @P4)"));
        assert!(!ff.contains("@P7"));
        assert!(df.starts_with("d.status = 3"));
        assert!(df.contains("(@P7 IS NULL OR d.last_error LIKE @P7 ESCAPE N'\\')"));
        assert!(!df.contains("@P4"));

        // The escape: `%`, `_`, `[` (a T-SQL LIKE class) and `\` itself match literally.
        let mut filter = InboxDeadFilter::new();
        filter.error_contains = Some("100%_[a]\\x".into());
        filter.consumer = Some("proj_[1]".into());
        filter.ids = vec![Uuid::nil()];
        let p = InboxFilterParams::new(&filter).expect("params");
        assert_eq!(p.error.as_deref(), Some("100\\%\\_\\[a]\\\\x"));
        assert_eq!(
            p.consumer.as_deref(),
            Some("proj_[1]"),
            "equality: not escaped"
        );
        assert_eq!(p.consumer_prefix.as_deref(), Some("proj\\_\\[1]: %"));
        assert_eq!(
            p.ids.as_deref(),
            Some("[\"00000000-0000-0000-0000-000000000000\"]")
        );
        let none = InboxFilterParams::new(&InboxDeadFilter::new()).expect("params");
        assert!(none.ids.is_none() && none.error.is_none() && none.consumer_prefix.is_none());
    }

    #[test]
    fn inbox_dead_letters_list_consumer_then_durable_each_oldest_first() {
        let sql = squash(&inbox_dead_letters_sql("outbox"));
        assert!(sql.starts_with("SELECT TOP (@P8) x.kind"));
        assert!(sql.contains("FROM (SELECT TOP (@P8) 0 AS kind, f.message_id"));
        assert!(sql.contains("FROM [outbox].inbox_failures AS f WHERE f.dead_at IS NOT NULL"));
        assert!(sql.contains("ORDER BY f.dead_at) AS a UNION ALL SELECT b.kind"));
        assert!(sql.contains("CAST(NULL AS nvarchar(255)) AS consumer"));
        assert!(sql.contains("FROM [outbox].inbox_messages AS d WHERE d.status = 3"));
        assert!(sql.contains("ORDER BY d.received_at) AS b ) AS x ORDER BY x.kind, x.at"));
        assert!(sql.ends_with("OPTION (RECOMPILE)"), "catch-all filters");
    }

    #[test]
    fn inbox_replay_is_one_transaction_with_the_postgresql_semantics() {
        let sql = squash(&inbox_replay_sql("outbox"));
        let at = |needle: &str| {
            sql.find(needle)
                .unwrap_or_else(|| panic!("missing {needle}:\n{sql}"))
        };
        let begin = at("BEGIN TRANSACTION;");
        let target = at("INSERT INTO @target (message_id, consumer_bytes)");
        let source = at("INSERT INTO @source (id, status)");
        let requeue = at("IF @P8 = 0 BEGIN UPDATE m");
        let clear = at("DELETE f FROM [outbox].inbox_failures AS f");
        let durable = at("UPDATE d SET d.status = 0");
        let commit = at("COMMIT TRANSACTION;");
        assert!(sql.starts_with("SET XACT_ABORT ON;"));
        assert!(begin < target && target < source && source < requeue);
        assert!(requeue < clear && clear < durable && durable < commit);
        // Dead letters and their outbox rows are update-locked from the first read.
        assert!(sql.contains(
            "FROM [outbox].inbox_failures AS f WITH (UPDLOCK, ROWLOCK) WHERE f.dead_at IS NOT NULL"
        ));
        assert!(sql.contains("FROM [outbox].outbox_messages AS m WITH (UPDLOCK, ROWLOCK) WHERE m.id IN (SELECT x.message_id FROM @target AS x);"));
        // Only Sent or Dead outbox rows go back to New, with a fresh claim history.
        assert!(sql.contains(
            "SET m.status = 0, m.attempts = 0, m.visible_at = @now, m.lease_until = NULL, m.claim_token = NULL, m.sent_at = NULL, m.unfinished_claims = 0, m.unfinished_alone = 0"
        ));
        assert!(sql.contains("WHERE src.status IN (1, 3) AND m.status IN (1, 3);"));
        // A dead letter whose outbox row is gone is kept unless clear-only.
        assert!(sql.contains(
            "ON x.message_id = f.message_id AND x.consumer_bytes = CAST(f.consumer AS varbinary(510)) WHERE @P8 = 1 OR EXISTS (SELECT 1 FROM @source AS src WHERE src.id = x.message_id);"
        ));
        assert!(sql.contains(
            "SET d.status = 0, d.attempts = 0, d.visible_at = @now, d.lease_until = NULL, d.claim_token = NULL FROM [outbox].inbox_messages AS d WHERE d.status = 3"
        ));
        assert!(sql.ends_with(
            "SELECT @matched + @durable AS matched, @cleared + @durable AS replayed, @requeued AS requeued;"
        ));
        let count = squash(&inbox_replay_count_sql("outbox"));
        assert!(
            !count.contains("UPDATE") && !count.contains("DELETE"),
            "dry run"
        );
        assert!(count.contains(
            "+ (SELECT COUNT_BIG(*) FROM [outbox].inbox_messages AS d WHERE d.status = 3"
        ));
    }

    #[test]
    fn server_counts_and_ages_convert_safely() {
        assert_eq!(count(-3), 0);
        assert_eq!(
            ms_duration(-5),
            Duration::ZERO,
            "a clock step back is no age"
        );
        assert_eq!(ms_duration(1500), Duration::from_millis(1500));
        assert_eq!(limit(usize::MAX), i64::MAX);
    }

    #[test]
    fn listings_page_by_key_through_each_filtered_index() {
        let pending = squash(&list_messages_sql(
            "outbox",
            MessageState::Pending,
            true,
            true,
        ));
        // Two branches, each over its own filtered index, merged in claim order.
        assert!(pending.starts_with("SELECT TOP (@P9) x.id, x.seq, x.status"));
        assert!(pending.contains("WHERE m.status = 0 AND (@P1 IS NULL"));
        assert!(pending.contains("WHERE m.status = 9 AND (@P1 IS NULL"));
        assert_eq!(
            pending
                .matches("AND (m.visible_at > @P10 OR (m.visible_at = @P10 AND m.seq > @P11)) AND (m.visible_at < @P12 OR (m.visible_at = @P12 AND m.seq <= @P13)) ORDER BY m.visible_at, m.seq")
                .count(),
            2,
            "{pending}"
        );
        assert!(pending.contains(") AS b0 UNION ALL SELECT b1.* FROM ("));
        assert!(pending.ends_with(") AS x ORDER BY x.visible_at, x.seq OPTION (RECOMPILE)"));
        let to_horizon = squash(&list_messages_sql(
            "outbox",
            MessageState::Pending,
            false,
            true,
        ));
        assert!(to_horizon.contains(
            "AND (m.visible_at < @P10 OR (m.visible_at = @P10 AND m.seq <= @P11)) ORDER BY"
        ));
        let dead = squash(&list_messages_sql(
            "outbox",
            MessageState::Dead,
            true,
            false,
        ));
        assert!(dead.contains("WHERE m.status = 3 AND"));
        assert!(!dead.contains("UNION ALL"), "one filtered index");
        assert!(dead.contains(
            "AND (m.created_at < @P10 OR (m.created_at = @P10 AND m.seq < @P11)) ORDER BY m.created_at DESC, m.seq DESC) AS b0"
        ));
        assert!(dead.ends_with("ORDER BY x.created_at DESC, x.seq DESC OPTION (RECOMPILE)"));
        let sent = squash(&list_messages_sql(
            "outbox",
            MessageState::Sent,
            false,
            false,
        ));
        assert!(sent.contains("WHERE m.status = 1 AND"));
        assert!(sent.contains("ORDER BY m.sent_at DESC, m.seq DESC) AS b0"));
        assert!(!sent.contains("@P10"), "no cursor on the first page");
        for sql in [&pending, &dead, &sent] {
            assert!(sql.contains("FROM [outbox].outbox_messages AS m WITH (READPAST)"));
            assert!(sql.contains(
                "(@P8 IS NULL OR UPPER(m.last_error) LIKE N'%' + UPPER(@P8) + N'%' ESCAPE N'\\')"
            ));
            // Each branch selects the summary columns by name, so UNION ALL lines up.
            assert!(sql.contains(&summary_columns("m")));
            assert!(sql.contains(&summary_columns("x")));
        }
        // The horizon: the scan bound's row on the same indexes, keys only.
        let horizon = squash(&horizon_sql("outbox", MessageState::Pending, true));
        assert!(horizon.starts_with(
            "SELECT w.visible_at AS at, w.seq FROM ( SELECT TOP (@P3) x.visible_at, x.seq"
        ));
        assert!(horizon.contains(
            "SELECT TOP (@P3) m.visible_at, m.seq FROM [outbox].outbox_messages AS m WITH (READPAST) WHERE m.status = 0 AND (m.visible_at > @P1 OR (m.visible_at = @P1 AND m.seq > @P2))"
        ));
        assert!(
            horizon
                .ends_with("ORDER BY w.visible_at, w.seq OFFSET @P4 ROWS FETCH NEXT 1 ROWS ONLY")
        );
        let horizon = squash(&horizon_sql("outbox", MessageState::Dead, false));
        assert!(horizon.contains("SELECT TOP (@P1) m.created_at, m.seq"));
        assert!(horizon.ends_with("OFFSET @P2 ROWS FETCH NEXT 1 ROWS ONLY"));
        // Counts: bounded by TOP; filtered ones over the first @P9 rows, read twice.
        let count = squash(&count_messages_sql("outbox", MessageState::Pending, false));
        assert!(count.starts_with("SELECT COUNT_BIG(*) AS n, COUNT_BIG(*) AS examined FROM ( SELECT TOP (@P9) x.seq, x.visible_at"));
        assert!(count.contains("WHERE m.status = 0 AND (@P1 IS NULL"));
        let scanned = squash(&count_messages_sql("outbox", MessageState::Dead, true));
        assert!(scanned.starts_with(
            "WITH w AS ( SELECT TOP (@P9) x.id, x.seq, x.created_at, x.tenant_id, x.aggregate_type, x.aggregate_id, x.event_type, x.last_error FROM ("
        ));
        assert!(scanned.contains("WHERE m.status = 3 ORDER BY m.created_at DESC, m.seq DESC"));
        assert!(
            scanned
                .contains("SELECT (SELECT COUNT_BIG(*) FROM w AS m WHERE (@P1 IS NULL OR m.id IN")
        );
        assert!(scanned.ends_with("(SELECT COUNT_BIG(*) FROM w) AS examined OPTION (RECOMPILE)"));
        let sent = squash(&sent_per_minute_sql("outbox"));
        assert!(sent.starts_with("DECLARE @now datetime2(7) = SYSUTCDATETIME();"));
        assert!(sent.contains("WHERE m.status = 1 AND m.sent_at > DATEADD(minute, -@P1, @now)"));
        assert!(sent.contains("GROUP BY DATEDIFF_BIG(millisecond, m.sent_at, @now) / 60000"));
        assert!(
            sent.contains("LEFT JOIN ("),
            "one row even when nothing was sent"
        );
    }

    #[test]
    fn heartbeats_upsert_one_row_per_relay_and_age_out_after_a_day() {
        let beat = squash(&record_heartbeat_sql("outbox"));
        assert!(beat.contains(
            "DELETE FROM [outbox].outbox_relays WHERE last_seen_at < DATEADD(day, -1, @now) AND relay_id <> @P1;"
        ));
        assert!(beat.contains(
            "UPDATE [outbox].outbox_relays SET last_seen_at = @now, circuit_open = @P5, healthy = @P6, published = @P7, detail = @P8 WHERE relay_id = @P1; IF @@ROWCOUNT = 0 INSERT INTO [outbox].outbox_relays"
        ));
        assert!(beat.ends_with("VALUES (@P1, @P2, @P3, @P4, @now, @now, @P5, @P6, @P7, @P8);"));
        let seen = squash(&relays_seen_sql("outbox"));
        assert!(seen.contains("SELECT TOP (@P2) relay_id, host, pid, version"));
        assert!(seen.contains(&format!(
            "WHERE last_seen_at >= {}",
            minus_ms("@now", "@P1")
        )));
        assert!(seen.ends_with("ORDER BY last_seen_at DESC, relay_id"));
    }
}
