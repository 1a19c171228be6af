//! [`MySqlOutbox`]: enqueue inside the caller's transaction, and the [`OutboxStore`] the
//! dispatcher uses.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outboxkit_core::{
    BlockedKey, ClaimedBatch, CompleteReport, Completion, CompletionOutcome, Headers,
    MessageFilter, MessageStatus, NewMessage, OnDead, OutboxError, OutboxMessage, OutboxProducer,
    OutboxStats, OutboxStore, Poison, PoisonRow, ReplayReport, SentRetention, sanitize_error,
};
use serde_json::value::RawValue;
use sqlx::mysql::{MySqlArguments, MySqlRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, MySqlPool, Row};
use tracing::Instrument as _;
use uuid::Uuid;

use crate::config::MySqlConfig;
use crate::error::db;
use crate::inbox::MySqlInbox;
use crate::sql::{BEGIN_READ_COMMITTED, COLUMNS, Queries, like_escape, micros, placeholders, sql};

/// Rows per `INSERT` of `MySqlOutbox`'s [`enqueue_batch`](OutboxProducer::enqueue_batch): 12 parameters a row keeps a
/// statement far below MySQL's 65,535 placeholders and its payload below a default
/// `max_allowed_packet` (64 MiB) for payloads of tens of kilobytes.
const ENQUEUE_CHUNK: usize = 500;

/// The MySQL / MariaDB outbox: a pool plus the SQL rendered for one database. Cheap to
/// clone.
///
/// Writes go through [`OutboxProducer`] ([`enqueue`](OutboxProducer::enqueue) /
/// [`enqueue_batch`](OutboxProducer::enqueue_batch)) on the caller's own transaction
/// ([`begin`](Self::begin), or any `&mut MySqlConnection` of theirs), so the events
/// commit or roll back with the business rows. The relay side is the [`OutboxStore`]
/// impl (no push wake-up: the dispatcher polls).
#[derive(Debug, Clone)]
pub struct MySqlOutbox {
    pool: MySqlPool,
    schema: Arc<str>,
    q: Arc<Queries>,
    /// Where the last ordered claim stopped walking keys (shared by clones).
    key_cursor: Arc<std::sync::Mutex<Vec<u8>>>,
    /// Claims and completions run again as deadlock victims (shared by clones).
    deadlocks: Arc<std::sync::atomic::AtomicU64>,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
    max_payload_bytes: usize,
}

impl MySqlOutbox {
    /// An outbox over `pool` with the settings of `config`: its database (run
    /// [`migrate`](Self::migrate) first), [sent retention](MySqlConfig::with_sent_retention),
    /// [crash-loop limit](MySqlConfig::with_crash_loop_limit) and
    /// [payload limit](MySqlConfig::with_max_payload_bytes); its URL and pool settings
    /// are not used (the pool is yours, and its connections must run with
    /// `time_zone = '+00:00'`, as [`parse_url`](crate::parse_url) sets).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid schema name.
    pub fn new(pool: MySqlPool, config: &MySqlConfig) -> Result<Self, OutboxError> {
        let schema = config.schema();
        crate::config::validate_schema(schema)?;
        Ok(Self {
            pool,
            schema: schema.into(),
            q: Arc::new(Queries::new(schema)),
            key_cursor: Arc::default(),
            deadlocks: Arc::default(),
            sent_retention: config.sent_retention(),
            crash_loop_limit: config.crash_loop_limit(),
            max_payload_bytes: config.max_payload_bytes(),
        })
    }

    /// Opens a pool with `config`'s URL and pool settings and takes its other settings,
    /// as [`new`](Self::new). The pool connects eagerly, so a wrong URL or a down server
    /// fails here, and skips sqlx's ping before each acquire (`test_before_acquire(false)`:
    /// a round trip per transaction saved; a connection broken meanwhile fails its next
    /// statement, which the relay retries and the inbox defers). The tables are not
    /// touched: [`migrate`](Self::migrate) creates or upgrades them.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for a missing or malformed URL or schema, or
    /// [`OutboxError::Database`] when the server cannot be reached.
    pub async fn connect(config: &MySqlConfig) -> Result<Self, OutboxError> {
        let pool = config.connect().await?;
        Self::new(pool, config)
    }

    /// Begins a transaction on the pool (the server's default isolation, `REPEATABLE
    /// READ` unless configured otherwise): write the business rows and
    /// [`enqueue`](OutboxProducer::enqueue) the events on it (`&mut tx`), then commit.
    ///
    /// # Errors
    /// [`OutboxError::Database`] when no connection can be had or `BEGIN` fails.
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, MySql>, OutboxError> {
        self.pool.begin().await.map_err(db("begin"))
    }

    /// The inbox in this outbox's database and pool: the one way to have a [`MySqlInbox`]
    /// ([`migrate`](Self::migrate) creates its tables with the outbox's). A consumer
    /// whose inbox lives in another database connects a store to that database
    /// (`MySqlOutbox::connect(&inbox_config)?.inbox()`); its URL, pool and database
    /// settings are the inbox's.
    pub fn inbox(&self) -> MySqlInbox {
        MySqlInbox::with_queries(self.pool.clone(), &self.schema)
    }

    /// The payload limit of enqueue, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Claims without an outcome after which a row is a suspected crash loop (see
    /// [`Poison::CrashLoop`]).
    pub fn crash_loop_limit(&self) -> u32 {
        self.crash_loop_limit
    }

    /// What completions do with sent messages.
    pub fn sent_retention(&self) -> SentRetention {
        self.sent_retention
    }

    /// Creates the database if needed (`utf8mb4`) and applies pending migrations to it;
    /// returns the versions applied.
    ///
    /// Every table of the database is created: the outbox's and the inbox's
    /// ([`inbox`](Self::inbox)). Each migration runs once, in its own transaction, under a
    /// lock on the database name, so several processes may migrate at start-up.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid database name or when the database
    /// already has a newer version than this crate knows ([`LATEST_VERSION`](crate::LATEST_VERSION));
    /// [`OutboxError::Database`] when a statement fails (the migration is not recorded
    /// and runs again next time) or the migration lock is not had within 60 s.
    pub async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        crate::migrate::migrate(&self.pool, &self.schema).await
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The database name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// A transaction under `READ COMMITTED` (see [`BEGIN_READ_COMMITTED`]).
    async fn begin_read_committed(
        &self,
        operation: &'static str,
    ) -> Result<sqlx::Transaction<'static, MySql>, OutboxError> {
        self.pool
            .begin_with(BEGIN_READ_COMMITTED)
            .await
            .map_err(db(operation))
    }

    /// Claims the rows `ids` (locked by the caller's transaction) under `token`:
    /// Processing, a lease of `lease` from the database clock, one more attempt and one
    /// more claim without an outcome (one more alone for a `suspect`, claimed alone),
    /// and reads them back.
    async fn claim_rows(
        &self,
        tx: &mut MySqlConnection,
        ids: &[Uuid],
        lease: Duration,
        token: Uuid,
        suspect: bool,
        operation: &'static str,
    ) -> Result<Vec<MySqlRow>, OutboxError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let list = placeholders(ids.len());
        // Assignments run left to right in MySQL: status last.
        let mut update = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET lease_until = NOW(6) + INTERVAL ? MICROSECOND, claim_token = ?,
                    attempts = attempts + 1, unfinished_claims = unfinished_claims + 1,
                    unfinished_alone = unfinished_alone + ?, status = 9
              WHERE id IN ({list})",
            self.q.table
        )))
        .bind(micros(lease))
        .bind(token)
        .bind(i32::from(suspect));
        for id in ids {
            update = update.bind(*id);
        }
        update.execute(&mut *tx).await.map_err(db(operation))?;
        let mut read = sqlx::query(AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM {} m WHERE m.id IN ({list})",
            self.q.table
        )));
        for id in ids {
            read = read.bind(*id);
        }
        read.fetch_all(&mut *tx).await.map_err(db(operation))
    }

    /// Moves the suspect `id` (locked by the caller's transaction) to Dead as a crash
    /// loop and reads it back.
    async fn kill_crash_loop(
        &self,
        tx: &mut MySqlConnection,
        id: Uuid,
        operation: &'static str,
    ) -> Result<Vec<MySqlRow>, OutboxError> {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET
                    last_error = CONCAT('suspected crash loop: claimed alone ', unfinished_alone,
                        ' times without an outcome (', unfinished_claims,
                        ' claims without an outcome in all; each relay holding it stopped, crashed or lost its lease before recording one); replay it once the cause is fixed'),
                    first_failed_at = COALESCE(first_failed_at, NOW(6)),
                    lease_until = NULL, claim_token = NULL, status = 3
              WHERE id = ?",
            self.q.table
        )))
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(db(operation))?;
        sqlx::query(AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM {} m WHERE m.id = ?",
            self.q.table
        )))
        .bind(id)
        .fetch_all(&mut *tx)
        .await
        .map_err(db(operation))
    }

    fn crash_loop_limit_i32(&self) -> i32 {
        i32::try_from(self.crash_loop_limit).unwrap_or(i32::MAX)
    }

    /// The ordered claim's work inside its transaction (see
    /// [`OutboxStore::claim_ordered`]): returns the rows claimed (or killed).
    async fn claim_ordered_in(
        &self,
        tx: &mut MySqlConnection,
        batch_size: usize,
        lease: Duration,
        token: Uuid,
        on_dead: OnDead,
        cursor: &[u8],
    ) -> Result<Vec<MySqlRow>, OutboxError> {
        const OP: &str = "claim_ordered";
        let t = &self.q.table;
        let want = limit(batch_size.max(1));
        // 1. Keys with pending rows, from after the cursor, wrapping around to it
        //    (a walk of the key index), with each key's head (first pending row).
        let keys_sql = |cmp: &str| {
            format!(
                "SELECT k.order_key,
                        (SELECT x.id FROM {t} x WHERE x.phase = 0 AND x.order_key = k.order_key
                          ORDER BY x.seq LIMIT 1) AS head
                   FROM (SELECT DISTINCT p.order_key FROM {t} p
                          WHERE p.phase = 0 AND p.order_key {cmp} ?
                          ORDER BY p.order_key LIMIT ?) k
                  ORDER BY k.order_key"
            )
        };
        // A few keys more than the batch: some are held or blocked.
        let walk = want.saturating_mul(4).max(16);
        let mut heads: Vec<(Vec<u8>, Uuid)> = sqlx::query_as(AssertSqlSafe(keys_sql(">")))
            .bind(cursor)
            .bind(walk)
            .fetch_all(&mut *tx)
            .await
            .map_err(db(OP))?;
        if heads.len() < usize::try_from(walk).unwrap_or(usize::MAX) {
            let wrapped: Vec<(Vec<u8>, Uuid)> = sqlx::query_as(AssertSqlSafe(keys_sql("<=")))
                .bind(cursor)
                .bind(walk)
                .fetch_all(&mut *tx)
                .await
                .map_err(db(OP))?;
            heads.extend(wrapped);
        }
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        // 2. The heads that are claimable at their latest version (a locking read under
        //    READ COMMITTED) and, under Block, not preceded by a Dead row of their key,
        //    locked; a head another claimer holds is skipped: the head lock is the
        //    key's mutex.
        let block = on_dead == OnDead::Block;
        let mut lock_heads =
            sqlx::query_as::<_, (Uuid, Vec<u8>, i64, i16, i32)>(AssertSqlSafe(format!(
                "SELECT h.id, h.order_key, h.seq, h.status, h.unfinished_alone FROM {t} h
                  WHERE h.id IN ({})
                    AND h.phase = 0
                    AND ((h.status = 0 AND h.visible_at <= NOW(6))
                         OR (h.status = 9 AND h.lease_until < NOW(6)))
                    AND NOT (? AND EXISTS (SELECT 1 FROM {t} d
                             WHERE d.phase = 3 AND d.order_key = h.order_key AND d.seq < h.seq))
                  ORDER BY h.seq
                  FOR UPDATE SKIP LOCKED",
                placeholders(heads.len())
            )));
        for (_, id) in &heads {
            lock_heads = lock_heads.bind(*id);
        }
        let mut locked = lock_heads
            .bind(block)
            .fetch_all(&mut *tx)
            .await
            .map_err(db(OP))?;
        if locked.is_empty() {
            return Ok(Vec::new());
        }
        // A suspect head is claimed alone (the oldest one).
        if let Some(&(id, _, _, _, alone)) = locked.iter().find(|h| h.3 == 9) {
            if alone >= self.crash_loop_limit_i32() {
                return self.kill_crash_loop(tx, id, OP).await;
            }
            return self.claim_rows(tx, &[id], lease, token, true, OP).await;
        }
        // Keys in walk order (after the cursor first), at most the batch size.
        let position: std::collections::HashMap<&[u8], usize> = heads
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.as_slice(), i))
            .collect();
        locked.sort_by_key(|h| position.get(h.1.as_slice()).copied().unwrap_or(usize::MAX));
        locked.truncate(batch_size.max(1));
        // 3. Each key's run: up to batch/keys pending rows from its head, locked and
        //    read at their latest version; a run stops at a row that is not New and
        //    visible, and (under Block) at the key's next Dead row.
        let per_key = (batch_size / locked.len()).max(1);
        let per_key_i = limit(per_key);
        let mut run_sql = String::new();
        for i in 0..locked.len() {
            if i > 0 {
                run_sql.push_str(" UNION ALL ");
            }
            // The key's pending rows from its head, and its first Dead row after the
            // head: two short walks of the per-key index (phase, order_key, seq).
            run_sql.push_str(&format!(
                "(SELECT r.id, r.order_key, r.seq, r.phase,
                         r.status = 0 AND r.visible_at <= NOW(6) AS free
                    FROM {t} r
                   WHERE r.phase = 0 AND r.order_key = ? AND r.seq >= ?
                   ORDER BY r.seq LIMIT ?)
                 UNION ALL
                 (SELECT r.id, r.order_key, r.seq, r.phase, 0 AS free
                    FROM {t} r
                   WHERE r.phase = 3 AND r.order_key = ? AND r.seq > ?
                   ORDER BY r.seq LIMIT 1)"
            ));
        }
        let mut runs = sqlx::query_as::<_, (Uuid, Vec<u8>, i64, i16, i64)>(AssertSqlSafe(run_sql));
        for (_, key, seq, _, _) in &locked {
            runs = runs
                .bind(key.clone())
                .bind(*seq)
                .bind(per_key_i)
                .bind(key.clone())
                .bind(*seq);
        }
        let mut run_rows = runs.fetch_all(&mut *tx).await.map_err(db(OP))?;
        run_rows.sort_by_key(|r| r.2);
        let heads_held: HashSet<Uuid> = locked.iter().map(|h| h.0).collect();
        let mut taken: Vec<Uuid> = Vec::new();
        let mut per: std::collections::HashMap<Vec<u8>, (usize, bool)> =
            std::collections::HashMap::new();
        let mut candidates = Vec::new();
        for (id, key, _, phase, free) in &run_rows {
            let entry = per.entry(key.clone()).or_insert((0, true));
            if !entry.1 || entry.0 >= per_key {
                continue;
            }
            if *phase == 3 {
                if block {
                    entry.1 = false;
                }
                continue;
            }
            if heads_held.contains(id) || *free != 0 {
                entry.0 += 1;
                candidates.push(*id);
            } else {
                entry.1 = false;
            }
        }
        // Lock the runs' rows (their heads are ours already) and keep each key's
        // prefix still New and visible at its latest version.
        let others: Vec<Uuid> = candidates
            .iter()
            .copied()
            .filter(|id| !heads_held.contains(id))
            .collect();
        let mut still_free: HashSet<Uuid> = HashSet::new();
        if !others.is_empty() {
            let mut lock_runs = sqlx::query_as::<_, (Uuid,)>(AssertSqlSafe(format!(
                "SELECT r.id FROM {t} r WHERE r.id IN ({}) AND r.status = 0 AND r.visible_at <= NOW(6)
                  FOR UPDATE",
                placeholders(others.len())
            )));
            for id in &others {
                lock_runs = lock_runs.bind(*id);
            }
            still_free.extend(
                lock_runs
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db(OP))?
                    .into_iter()
                    .map(|(id,)| id),
            );
        }
        let mut stopped: HashSet<Vec<u8>> = HashSet::new();
        for (id, key, _, phase, _) in &run_rows {
            if *phase == 3 || !candidates.contains(id) || stopped.contains(key) {
                continue;
            }
            if heads_held.contains(id) || still_free.contains(id) {
                taken.push(*id);
            } else {
                stopped.insert(key.clone());
            }
        }
        taken.truncate(batch_size.max(1));
        self.claim_rows(tx, &taken, lease, token, false, OP).await
    }
}

/// The `outbox.enqueue` span: the message count, and for a single message its id,
/// event type, tenant, aggregate and version (never the payload).
fn enqueue_span(messages: &[NewMessage]) -> tracing::Span {
    match messages {
        [m] => tracing::debug_span!(
            "outbox.enqueue",
            messages = 1,
            message.id = %m.id,
            event_type = %m.event_type,
            tenant = m.tenant_id.as_deref().unwrap_or(""),
            aggregate_type = %m.aggregate_type,
            aggregate_id = %m.aggregate_id,
            aggregate_version = m.aggregate_version,
        ),
        _ => tracing::debug_span!("outbox.enqueue", messages = messages.len()),
    }
}

/// The rows of a claim under `token`: a row the claim moved to `Dead` (status 3) is a
/// [`Poison::CrashLoop`], a row that does not decode a [`Poison::Undecodable`], the rest
/// messages in `seq` order.
fn decode_claim(rows: &[MySqlRow], token: Uuid) -> Result<ClaimedBatch, OutboxError> {
    let mut messages = Vec::with_capacity(rows.len());
    let mut poison = Vec::new();
    for row in rows {
        let status: i16 = row.try_get("status").map_err(db("claim"))?;
        if status == MessageStatus::Dead.code() {
            let alone: i32 = row.try_get("unfinished_alone").map_err(db("claim"))?;
            poison.push(poison_row(
                row,
                Poison::CrashLoop {
                    claims_alone: u32::try_from(alone).unwrap_or(0),
                },
            )?);
            continue;
        }
        match decode_row(row, HeaderDecoding::Strict) {
            Ok(message) => messages.push(message),
            Err(e) => {
                let reason = match e {
                    OutboxError::Decode { reason, .. } => reason,
                    other => other.to_string(),
                };
                poison.push(poison_row(
                    row,
                    Poison::Undecodable {
                        claim_token: token,
                        reason,
                    },
                )?);
            }
        }
    }
    messages.sort_unstable_by_key(|m| m.seq);
    Ok(ClaimedBatch::new(messages, poison))
}

/// A poison row from the plain text columns every row can give.
fn poison_row(row: &MySqlRow, poison: Poison) -> Result<PoisonRow, OutboxError> {
    Ok(PoisonRow {
        id: row.try_get("id").map_err(db("claim"))?,
        seq: row.try_get("seq").map_err(db("claim"))?,
        aggregate_type: row.try_get("aggregate_type").map_err(db("claim"))?,
        aggregate_id: row.try_get("aggregate_id").map_err(db("claim"))?,
        partition_key: row.try_get("partition_key").map_err(db("claim"))?,
        poison,
    })
}

/// How strictly [`decode_row`] reads `headers`.
#[derive(Clone, Copy)]
enum HeaderDecoding {
    /// An object of strings or a decode error: for publishing.
    Strict,
    /// Whatever is there, made into strings: for showing rows (`get`, dead letters).
    Lossy,
}

fn decode_row(row: &MySqlRow, headers: HeaderDecoding) -> Result<OutboxMessage, OutboxError> {
    let id: Uuid = row.try_get("id").map_err(db("decode"))?;
    let decode_err = |reason: String| OutboxError::Decode {
        id: id.to_string(),
        reason,
    };
    let payload: String = row.try_get("payload").map_err(db("decode"))?;
    let payload =
        RawValue::from_string(payload).map_err(|e| decode_err(format!("payload: {e}")))?;
    let raw: String = row.try_get("headers").map_err(db("decode"))?;
    let raw: serde_json::Value =
        serde_json::from_str(&raw).map_err(|e| decode_err(format!("headers: {e}")))?;
    let headers: Headers = match headers {
        HeaderDecoding::Strict => outboxkit_core::headers_from_json(raw).map_err(decode_err)?,
        HeaderDecoding::Lossy => outboxkit_core::headers_from_json_lossy(raw),
    };
    let status: i16 = row.try_get("status").map_err(db("decode"))?;
    Ok(OutboxMessage {
        id,
        seq: row.try_get("seq").map_err(db("decode"))?,
        aggregate_type: row.try_get("aggregate_type").map_err(db("decode"))?,
        aggregate_id: row.try_get("aggregate_id").map_err(db("decode"))?,
        aggregate_version: row.try_get("aggregate_version").map_err(db("decode"))?,
        event_type: row.try_get("event_type").map_err(db("decode"))?,
        payload,
        headers,
        tenant_id: row.try_get("tenant_id").map_err(db("decode"))?,
        routing_key: row.try_get("routing_key").map_err(db("decode"))?,
        partition_key: row.try_get("partition_key").map_err(db("decode"))?,
        occurred_at: row.try_get("occurred_at").map_err(db("decode"))?,
        created_at: row.try_get("created_at").map_err(db("decode"))?,
        visible_at: row.try_get("visible_at").map_err(db("decode"))?,
        attempts: row.try_get("attempts").map_err(db("decode"))?,
        status: MessageStatus::from_code(status)?,
        last_error: row.try_get("last_error").map_err(db("decode"))?,
        claim_token: row.try_get("claim_token").map_err(db("decode"))?,
        lease_until: row
            .try_get::<Option<DateTime<Utc>>, _>("lease_until")
            .map_err(db("decode"))?,
        sent_at: row.try_get("sent_at").map_err(db("decode"))?,
    })
}

pub(crate) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

pub(crate) fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Binds a [`MessageFilter`] to the [`FILTER`](crate::sql::FILTER) predicate (each
/// value twice).
pub(crate) fn bind_filter<'q>(
    query: Query<'q, MySql, MySqlArguments>,
    f: &'q MessageFilter,
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
    query
        .bind(ids.clone())
        .bind(ids)
        .bind(f.from)
        .bind(f.from)
        .bind(f.to)
        .bind(f.to)
        .bind(f.tenant_id.as_deref())
        .bind(f.tenant_id.as_deref())
        .bind(f.aggregate_type.as_deref())
        .bind(f.aggregate_type.as_deref())
        .bind(f.aggregate_id.as_deref())
        .bind(f.aggregate_id.as_deref())
        .bind(f.event_type.as_deref())
        .bind(f.event_type.as_deref())
        .bind(error.clone())
        .bind(error)
}

/// Enqueueing on the caller's transaction: `&mut tx` of a
/// `sqlx::Transaction<'_, MySql>` ([`MySqlOutbox::begin`] or your pool's), or any
/// `&mut MySqlConnection` inside a transaction. The rows are visible to the relay when
/// it commits.
#[async_trait]
impl OutboxProducer for MySqlOutbox {
    type Connection = MySqlConnection;

    /// Writes `messages` on `conn` with multi-row `INSERT`s of up to 500 rows each,
    /// preserving their order in `seq` (InnoDB hands a statement's rows rising
    /// auto-increment values in row order, under every `innodb_autoinc_lock_mode`).
    /// Returns their ids.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] ([`InvalidMessage::PayloadTooLarge`](outboxkit_core::InvalidMessage::PayloadTooLarge))
    /// when any payload is longer than [`max_payload_bytes`](MySqlOutbox::max_payload_bytes):
    /// no message of the batch is written and the transaction is untouched.
    /// [`OutboxError::Database`] when an insert fails: roll the transaction back (an
    /// earlier chunk of the batch may be written in it).
    async fn enqueue_batch(
        &self,
        conn: &mut MySqlConnection,
        messages: &[NewMessage],
    ) -> Result<Vec<Uuid>, OutboxError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        for m in messages {
            m.check_payload_size(self.max_payload_bytes)?;
        }
        let mut headers = Vec::with_capacity(messages.len());
        for m in messages {
            headers.push(
                serde_json::to_string(&m.headers).map_err(|e| OutboxError::Decode {
                    id: m.id.to_string(),
                    reason: e.to_string(),
                })?,
            );
        }
        let span = enqueue_span(messages);
        for (chunk, chunk_headers) in messages
            .chunks(ENQUEUE_CHUNK)
            .zip(headers.chunks(ENQUEUE_CHUNK))
        {
            let rows = vec![
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, COALESCE(?, NOW(6)), NOW(6) + INTERVAL ? MICROSECOND)";
                chunk.len()
            ]
            .join(", ");
            let text = format!(
                "INSERT INTO {} (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                     payload, headers, tenant_id, routing_key, partition_key, occurred_at, visible_at)
                 VALUES {rows}",
                self.q.table
            );
            let mut query = sqlx::query(AssertSqlSafe(text));
            for (m, h) in chunk.iter().zip(chunk_headers) {
                query = query
                    .bind(m.id)
                    .bind(m.aggregate_type.as_str())
                    .bind(m.aggregate_id.as_str())
                    .bind(m.aggregate_version)
                    .bind(m.event_type.as_str())
                    .bind(m.payload.get())
                    .bind(h.as_str())
                    .bind(m.tenant_id.as_deref())
                    .bind(m.routing_key.as_deref())
                    .bind(m.partition_key.as_deref())
                    .bind(m.occurred_at)
                    .bind(m.deliver_after.map_or(0, micros));
            }
            query
                .execute(&mut *conn)
                .instrument(span.clone())
                .await
                .map_err(db("enqueue"))?;
        }
        Ok(messages.iter().map(|m| m.id).collect())
    }
}

#[async_trait]
impl OutboxStore for MySqlOutbox {
    /// See `claim_once`, retried on a deadlock (see
    /// [`MySqlOutbox::deadlock_retries`]).
    async fn claim(&self, batch_size: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError> {
        self.retry_deadlocks(|| self.claim_once(batch_size, lease))
            .await
    }

    async fn claim_ordered(
        &self,
        batch_size: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        self.retry_deadlocks(|| self.claim_ordered_once(batch_size, lease, on_dead))
            .await
    }

    async fn blocked_keys(&self, limit_rows: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        let rows = sqlx::query(sql(&self.q.blocked_keys))
            .bind(limit(limit_rows))
            .fetch_all(&self.pool)
            .await
            .map_err(db("blocked_keys"))?;
        rows.iter()
            .map(|row| {
                let status: i16 = row.try_get("status").map_err(db("blocked_keys"))?;
                let waiting: i64 = row.try_get("waiting").map_err(db("blocked_keys"))?;
                let key: Vec<u8> = row.try_get("order_key").map_err(db("blocked_keys"))?;
                Ok(BlockedKey::new(
                    String::from_utf8_lossy(&key).into_owned(),
                    row.try_get("id").map_err(db("blocked_keys"))?,
                    row.try_get("seq").map_err(db("blocked_keys"))?,
                    MessageStatus::from_code(status)?,
                    row.try_get("attempts").map_err(db("blocked_keys"))?,
                    row.try_get("last_error").map_err(db("blocked_keys"))?,
                    row.try_get("first_failed_at").map_err(db("blocked_keys"))?,
                    row.try_get("retry_at").map_err(db("blocked_keys"))?,
                    count(waiting),
                ))
            })
            .collect()
    }

    /// See `complete_statements`: each statement run again on a deadlock (a deadlock
    /// victim's statement changed nothing, and its fences still hold).
    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        self.complete_statements(completions).await
    }

    /// One `READ COMMITTED` transaction: each destination's trial row locked (`FOR
    /// UPDATE SKIP LOCKED`), made visible and no longer held, claimed as `claim` claims,
    /// read back; retried on a deadlock.
    async fn claim_held(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        if destinations.is_empty() {
            return Ok(ClaimedBatch::default());
        }
        self.retry_deadlocks(|| self.claim_held_once(destinations, lease, order))
            .await
    }

    async fn release_held(&self, destination: &str, limit_rows: usize) -> Result<u64, OutboxError> {
        let done = self
            .retry_deadlocks(|| async {
                sqlx::query(sql(&self.q.release_held))
                    .bind(destination)
                    .bind(limit(limit_rows))
                    .execute(&self.pool)
                    .await
                    .map_err(db("release_held"))
            })
            .await?;
        Ok(done.rows_affected())
    }

    async fn held_destinations(
        &self,
        after: &str,
        limit_rows: usize,
    ) -> Result<Vec<String>, OutboxError> {
        sqlx::query_scalar(sql(&self.q.held_destinations))
            .bind(after)
            .bind(limit(limit_rows))
            .fetch_all(&self.pool)
            .await
            .map_err(db("held_destinations"))
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        let row = sqlx::query(sql(&self.q.get))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db("get"))?;
        row.as_ref()
            .map(|r| decode_row(r, HeaderDecoding::Lossy))
            .transpose()
    }

    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        let row = sqlx::query(sql(&self.q.stats))
            .fetch_one(&self.pool)
            .await
            .map_err(db("stats"))?;
        let get = |i: usize| row.try_get::<i64, _>(i).map(count).map_err(db("stats"));
        let age: Option<f64> = row.try_get(4).map_err(db("stats"))?;
        let mut stats = OutboxStats::default();
        stats.new = get(0)?;
        stats.processing = get(1)?;
        stats.sent = get(2)?;
        stats.dead = get(3)?;
        stats.oldest_pending_age = age.map(|s| Duration::from_secs_f64(s.max(0.0)));
        Ok(stats)
    }

    async fn dead_letters(
        &self,
        filter: &MessageFilter,
        limit_rows: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        let rows = bind_filter(sqlx::query(sql(&self.q.dead_letters)), filter)
            .bind(limit(limit_rows))
            .fetch_all(&self.pool)
            .await
            .map_err(db("dead_letters"))?;
        rows.iter()
            .map(|r| decode_row(r, HeaderDecoding::Lossy))
            .collect()
    }

    async fn replay(
        &self,
        filter: &MessageFilter,
        dry_run: bool,
    ) -> Result<ReplayReport, OutboxError> {
        let started = Instant::now();
        let matched: i64 = bind_filter(sqlx::query(sql(&self.q.replay_count)), filter)
            .fetch_one(&self.pool)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(db("replay"))?;
        let replayed = if dry_run {
            0
        } else {
            bind_filter(sqlx::query(sql(&self.q.replay)), filter)
                .execute(&self.pool)
                .await
                .map_err(db("replay"))?
                .rows_affected()
        };
        let matched = count(matched);
        Ok(ReplayReport {
            matched,
            replayed,
            failed: if dry_run {
                0
            } else {
                matched.saturating_sub(replayed)
            },
            elapsed: started.elapsed(),
        })
    }

    async fn purge_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        Ok(sqlx::query(sql(&self.q.purge_sent))
            .bind(micros(older_than))
            .bind(limit(batch_size))
            .execute(&self.pool)
            .await
            .map_err(db("purge_sent"))?
            .rows_affected())
    }
}

/// How many times a claim or completion that InnoDB chose as a deadlock victim is run
/// again before its error is returned.
const DEADLOCK_ATTEMPTS: u32 = 5;

impl MySqlOutbox {
    /// How many claims and completions of this store (and its clones) were deadlock
    /// victims and ran again. InnoDB can make a claim and a completion deadlock: a
    /// claim's `SKIP LOCKED` walk locks a row's entry in the pending index and then
    /// waits for the row itself, which a completion holds while it moves the row's
    /// index entry (see `docs/mysql.md`). The victim's transaction is rolled back whole,
    /// so running it again loses and duplicates nothing.
    pub fn deadlock_retries(&self) -> u64 {
        self.deadlocks.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs `op` again (up to [`DEADLOCK_ATTEMPTS`] times in all) while it fails as a
    /// deadlock victim, counting each retry.
    async fn retry_deadlocks<T, F, Fut>(&self, mut op: F) -> Result<T, OutboxError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, OutboxError>>,
    {
        let mut attempt = 1;
        loop {
            match op().await {
                Err(e) if attempt < DEADLOCK_ATTEMPTS && crate::error::is_deadlock(&e) => {
                    attempt += 1;
                    self.deadlocks
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::debug!(attempt, "deadlock victim, running again");
                }
                other => return other,
            }
        }
    }
    /// One `READ COMMITTED` transaction: the candidates locked with `FOR UPDATE SKIP
    /// LOCKED`, the crash-loop guard decided on their latest versions, one `UPDATE` by
    /// primary key, the rows read back, `COMMIT` (5 round trips).
    async fn claim_once(
        &self,
        batch_size: usize,
        lease: Duration,
    ) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let mut tx = self.begin_read_committed("claim").await?;
        let candidates: Vec<(Uuid, i16, i32)> = sqlx::query_as(sql(&self.q.claim_candidates))
            .bind(limit(batch_size.max(1)))
            .fetch_all(&mut *tx)
            .await
            .map_err(db("claim"))?;
        let rows = match candidates.first() {
            None => Vec::new(),
            // The crash-loop guard: a suspect first in claim order is taken alone (or
            // killed once claimed alone the limit's times); otherwise no suspect is.
            Some(&(id, 9, alone)) if alone >= self.crash_loop_limit_i32() => {
                self.kill_crash_loop(&mut tx, id, "claim").await?
            }
            Some(&(id, 9, _)) => {
                self.claim_rows(&mut tx, &[id], lease, token, true, "claim")
                    .await?
            }
            Some(_) => {
                let ids: Vec<Uuid> = candidates
                    .iter()
                    .filter(|c| c.1 == 0)
                    .map(|c| c.0)
                    .collect();
                self.claim_rows(&mut tx, &ids, lease, token, false, "claim")
                    .await?
            }
        };
        tx.commit().await.map_err(db("claim"))?;
        decode_claim(&rows, token)
    }

    async fn claim_held_once(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let mut tx = self.begin_read_committed("claim_held").await?;
        let mut ids = Vec::with_capacity(destinations.len());
        for dest in destinations {
            let id: Option<Uuid> = sqlx::query_scalar(sql(&self.q.held_trial))
                .bind(dest)
                .bind(i32::from(order.is_some()))
                .bind(i32::from(order == Some(OnDead::Block)))
                .fetch_optional(&mut *tx)
                .await
                .map_err(db("claim_held"))?;
            ids.extend(id);
        }
        if ids.is_empty() {
            tx.commit().await.map_err(db("claim_held"))?;
            return Ok(ClaimedBatch::default());
        }
        let mut unhold = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET visible_at = NOW(6), held_for = NULL WHERE id IN ({})",
            self.q.table,
            placeholders(ids.len())
        )));
        for id in &ids {
            unhold = unhold.bind(*id);
        }
        unhold.execute(&mut *tx).await.map_err(db("claim_held"))?;
        let rows = self
            .claim_rows(&mut tx, &ids, lease, token, false, "claim_held")
            .await?;
        tx.commit().await.map_err(db("claim_held"))?;
        decode_claim(&rows, token)
    }

    async fn claim_ordered_once(
        &self,
        batch_size: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let cursor = self
            .key_cursor
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default();
        let mut tx = self.begin_read_committed("claim_ordered").await?;
        let rows = self
            .claim_ordered_in(&mut tx, batch_size, lease, token, on_dead, &cursor)
            .await?;
        tx.commit().await.map_err(db("claim_ordered"))?;
        // Keys were visited after the cursor, then from the start up to it: the last
        // one visited is the greatest key at or below the cursor if the walk wrapped,
        // else the greatest key. The next claim starts after it.
        let mut after: Option<Vec<u8>> = None;
        let mut wrapped: Option<Vec<u8>> = None;
        for row in &rows {
            let key: Vec<u8> = row.try_get("order_key").map_err(db("claim_ordered"))?;
            let slot = if key.as_slice() > cursor.as_slice() {
                &mut after
            } else {
                &mut wrapped
            };
            if slot.as_ref().is_none_or(|k| key > *k) {
                *slot = Some(key);
            }
        }
        if let Some(last) = wrapped.or(after)
            && let Ok(mut c) = self.key_cursor.lock()
        {
            *c = last;
        }
        decode_claim(&rows, token)
    }

    /// One `UPDATE … JOIN JSON_TABLE(…)` for the whole batch (under
    /// [`SentRetention::Delete`], one `DELETE` by primary key of the Sent rows it
    /// marked after it). Only when fewer rows matched than completions were given does
    /// a query find out which were fenced.
    ///
    /// Each statement commits on its own and is run again alone when InnoDB makes it a
    /// deadlock victim, with the same mark (`nonce`): run again from the `UPDATE` after
    /// a later statement failed, the completion would match none of its rows (their
    /// claim tokens are gone), report every message fenced and never delete its Sent
    /// rows. The `DELETE` is retention, not the record: when it fails otherwise (a
    /// lock-wait timeout), the outcomes stand, the rows stay `Sent` for `outbox purge`,
    /// and a warning says so (an error would make the caller complete again, and be
    /// told every message was fenced).
    async fn complete_statements(
        &self,
        completions: &[Completion],
    ) -> Result<CompleteReport, OutboxError> {
        if completions.is_empty() {
            return Ok(CompleteReport::default());
        }
        let mut rows = Vec::with_capacity(completions.len());
        for c in completions {
            let (status, delay, error, release) = match &c.outcome {
                CompletionOutcome::Sent => (MessageStatus::Sent, 0, None, false),
                CompletionOutcome::Retry { delay, error } => (
                    MessageStatus::New,
                    micros(*delay),
                    Some(error.as_str()),
                    false,
                ),
                CompletionOutcome::Dead { error } => {
                    (MessageStatus::Dead, 0, Some(error.as_str()), false)
                }
                CompletionOutcome::Release => (MessageStatus::New, 0, None, true),
                CompletionOutcome::Hold { error, .. } => {
                    (MessageStatus::New, 0, Some(error.as_str()), true)
                }
            };
            let mut row = serde_json::Map::new();
            row.insert("i".into(), c.id.simple().to_string().into());
            row.insert("t".into(), c.claim_token.simple().to_string().into());
            row.insert("s".into(), status.code().into());
            row.insert("d".into(), delay.into());
            if let Some(e) = error {
                row.insert("e".into(), sanitize_error(e).into_owned().into());
            }
            row.insert("r".into(), i32::from(release).into());
            if let CompletionOutcome::Hold { destination, .. } = &c.outcome {
                row.insert("h".into(), destination.as_str().into());
            }
            rows.push(serde_json::Value::Object(row));
        }
        let json = serde_json::Value::Array(rows).to_string();
        // This call's mark on the rows it changes: how a completion that matched fewer
        // rows than it carried finds out which ones were applied.
        let nonce = Uuid::new_v4();
        let applied = self
            .retry_deadlocks(|| async {
                sqlx::query(sql(&self.q.complete))
                    .bind(&json)
                    .bind(nonce)
                    .execute(&self.pool)
                    .await
                    .map_err(db("complete"))
            })
            .await?
            .rows_affected();
        let n = completions.len();
        let (applied_ids, fenced): (Vec<Uuid>, Vec<Uuid>) = if applied >= n as u64 {
            (completions.iter().map(|c| c.id).collect(), Vec::new())
        } else {
            let read_sql = format!(
                "SELECT id FROM {} WHERE completed_token = ? AND id IN ({})",
                self.q.table,
                placeholders(n)
            );
            let done: HashSet<Uuid> = self
                .retry_deadlocks(|| async {
                    let mut read =
                        sqlx::query_scalar::<_, Uuid>(AssertSqlSafe(read_sql.as_str())).bind(nonce);
                    for c in completions {
                        read = read.bind(c.id);
                    }
                    read.fetch_all(&self.pool).await.map_err(db("complete"))
                })
                .await?
                .into_iter()
                .collect();
            completions
                .iter()
                .map(|c| c.id)
                .partition(|id| done.contains(id))
        };
        if self.sent_retention == SentRetention::Delete {
            // The Sent rows this call marked go: a second statement (a crash before it
            // leaves them Sent, for the retention to purge).
            let applied_set: HashSet<Uuid> = applied_ids.iter().copied().collect();
            let sent: Vec<Uuid> = completions
                .iter()
                .filter(|c| {
                    matches!(c.outcome, CompletionOutcome::Sent) && applied_set.contains(&c.id)
                })
                .map(|c| c.id)
                .collect();
            if !sent.is_empty() {
                let delete_sql = format!(
                    "DELETE FROM {} WHERE completed_token = ? AND status = 1 AND id IN ({})",
                    self.q.table,
                    placeholders(sent.len())
                );
                let deleted = self
                    .retry_deadlocks(|| async {
                        let mut delete =
                            sqlx::query(AssertSqlSafe(delete_sql.as_str())).bind(nonce);
                        for id in &sent {
                            delete = delete.bind(*id);
                        }
                        delete.execute(&self.pool).await.map_err(db("complete"))
                    })
                    .await;
                if let Err(e) = deleted {
                    tracing::warn!(error = %e, messages = sent.len(), "completion recorded, but its Sent rows could not be deleted: they stay Sent until `outbox purge`");
                }
            }
        }
        Ok(CompleteReport {
            applied: applied_ids.len() as u64,
            fenced,
        })
    }
}
