//! [`MySqlInbox`]: the consumer's dedup records, claimed inside the consumer's
//! transaction.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outboxkit_core::inbox::{
    ConsumerDeadLetter, ConsumerDeadLetters, DurableInbox, FailureCount, InboxClaim,
    InboxCompletion, InboxOutcome, StoredMessage, VersionTracking,
};
use outboxkit_core::wire::{IncomingMessage, TraceParent};
use outboxkit_core::{CompleteReport, ErrorKind, Headers, InboxStore, OutboxError};
use sqlx::mysql::{MySqlDatabaseError, MySqlRow, MySqlTransactionManager};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Executor as _, MySql, MySqlConnection, MySqlPool, Row, SqlStr};
use sqlx_core::transaction::TransactionManager as _;
use uuid::Uuid;

use crate::error::db;
use crate::sql::{BEGIN_READ_COMMITTED, Queries, micros, placeholders, quoted_schema, sql};
use crate::store::limit;

/// Longest consumer name, in characters (the `VARCHAR(255)` of the inbox tables).
const MAX_CONSUMER_CHARS: usize = 255;

/// `ER_DUP_ENTRY`: a duplicate key.
const DUPLICATE_KEY: u16 = 1062;

/// `ER_SP_DOES_NOT_EXIST`: no savepoint of that name in the current transaction.
const NO_SUCH_SAVEPOINT: u16 = 1305;

/// Begins an inbox transaction, in one round trip: autocommit off for the session, so
/// that no statement sent after a rollback (a deadlock victim's, or one the handler sent
/// itself) commits on its own (each opens a transaction that ends only with `COMMIT` or
/// `ROLLBACK`), and a savepoint, the mark of this transaction: any rollback of the
/// whole transaction discards it, on MySQL and MariaDB alike.
const BEGIN_INBOX: &str = "SET autocommit = 0; START TRANSACTION; SAVEPOINT outbox_inbox_begun";

/// Commits only the transaction [`BEGIN_INBOX`] began, in one round trip: `RELEASE
/// SAVEPOINT` fails ([`NO_SUCH_SAVEPOINT`]) once that transaction was rolled back, and
/// the statements after it then do not run; else `COMMIT`, and autocommit back on.
const COMMIT_INBOX: &str = "RELEASE SAVEPOINT outbox_inbox_begun; COMMIT; SET autocommit = 1";

/// Rolls back whatever is open (the inbox's transaction, or one the statements sent
/// after its rollback opened) and turns autocommit back on.
const ROLLBACK_INBOX: &str = "ROLLBACK; SET autocommit = 1";

/// Inbox records in `{schema}.inbox_records` (created by the same migrations as the
/// outbox). Cheap to clone.
///
/// [`try_claim`](InboxStore::try_claim) runs `INSERT IGNORE` on the caller's
/// transaction: the record commits with the handler's effects or not at all. A
/// concurrent claim of the same `(message_id, consumer)` waits on the first
/// transaction's uncommitted primary-key record and then finds the duplicate (0 rows),
/// or inserts when the first rolled back, so at most one of them returns `true` and
/// commits.
///
/// Batch claims, versions and durable-inbox batches go pair by pair in sorted order
/// (the traits' defaults): MySQL has no arrays to bind and `INSERT IGNORE` does not say
/// which rows of a multi-row insert were new.
#[derive(Debug, Clone)]
pub struct MySqlInbox {
    pool: MySqlPool,
    q: Arc<Queries>,
    /// `` `schema` `` (tables are `{s}.inbox_…`).
    s: Arc<str>,
}

impl MySqlInbox {
    /// `schema` validated already.
    pub(crate) fn with_queries(pool: MySqlPool, schema: &str) -> Self {
        Self {
            pool,
            q: Arc::new(Queries::new(schema)),
            s: quoted_schema(schema).into(),
        }
    }

    /// The pool (handy for beginning the consumer's transaction).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Whether `(message_id, consumer)` is a consumer dead letter, asked on `executor`
    /// (the pool, or a transaction's connection).
    async fn dead_letter_on<'e>(
        &self,
        executor: impl sqlx::MySqlExecutor<'e>,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<bool, OutboxError> {
        let s = &self.s;
        let dead: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {s}.inbox_failures
                             WHERE message_id = ? AND consumer = ? AND dead_at IS NOT NULL)"
        )))
        .bind(message_id)
        .bind(consumer)
        .fetch_one(executor)
        .await
        .map_err(db("inbox_is_dead"))?;
        Ok(dead != 0)
    }
}

/// A consumer name the tables can hold: not empty, at most 255 characters.
fn check_consumer(consumer: &str) -> Result<(), OutboxError> {
    if consumer.is_empty() {
        return Err(OutboxError::Config(
            "consumer name must not be empty".into(),
        ));
    }
    if consumer.chars().count() > MAX_CONSUMER_CHARS {
        return Err(OutboxError::Config(format!(
            "consumer name is longer than {MAX_CONSUMER_CHARS} characters"
        )));
    }
    Ok(())
}

fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(d) => d
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// A transaction of [`MySqlInbox`]: a pooled connection with a transaction open and
/// autocommit off. Dereferences to [`MySqlConnection`], so a handler's statements run
/// inside it (and a handler's nested `begin` is a savepoint, as in a
/// `sqlx::Transaction`).
///
/// Begun by [`InboxStore::begin`] (`SET autocommit = 0; START TRANSACTION; SAVEPOINT
/// …`, one round trip) and ended by [`InboxStore::commit`] (`RELEASE SAVEPOINT …;
/// COMMIT; SET autocommit = 1`, one round trip) or [`InboxStore::rollback`]. With
/// autocommit off, a statement sent after the transaction was rolled back (InnoDB's
/// deadlock victim, or a `ROLLBACK` the handler sent) does not commit on its own but
/// opens a transaction that the commit rolls back, and the savepoint, which the rollback
/// discarded, tells the commit that the transaction it would commit is not the one
/// begun: [`OutboxError::TransactionAborted`]. Dropped without commit or rollback, its
/// connection is closed instead of going back to the pool (the server rolls back): no
/// later borrower of the pool gets a session with autocommit off.
#[derive(Debug)]
pub struct MySqlInboxTransaction {
    conn: PoolConnection<MySql>,
    /// Not yet ended by a commit or rollback that went through.
    open: bool,
}

impl MySqlInboxTransaction {
    async fn begin(pool: &MySqlPool) -> Result<Self, OutboxError> {
        let conn = pool.acquire().await.map_err(db("inbox_begin"))?;
        // Dropped on an error below: the connection is closed.
        let mut tx = Self { conn, open: true };
        MySqlTransactionManager::begin(&mut tx.conn, Some(SqlStr::from_static(BEGIN_INBOX)))
            .await
            .map_err(db("inbox_begin"))?;
        Ok(tx)
    }

    /// Runs `statements` (which end the transaction and turn autocommit back on); when
    /// they went through, the connection may go back to the pool.
    async fn end(&mut self, statements: &'static str) -> Result<(), sqlx::Error> {
        self.conn.execute(statements).await?;
        // sqlx counts the transaction open until told otherwise (the count is what
        // makes a nested `begin` a savepoint). `start_rollback` is its way to close
        // the count without a round trip: the `ROLLBACK` it queues goes out with the
        // connection's next use (the pool's check when it is returned) and finds no
        // transaction open.
        MySqlTransactionManager::start_rollback(&mut self.conn);
        self.open = false;
        Ok(())
    }
}

impl Drop for MySqlInboxTransaction {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}

impl std::ops::Deref for MySqlInboxTransaction {
    type Target = MySqlConnection;
    fn deref(&self) -> &MySqlConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for MySqlInboxTransaction {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        &mut self.conn
    }
}

#[async_trait]
impl InboxStore for MySqlInbox {
    type Connection = MySqlConnection;
    type Transaction = MySqlInboxTransaction;

    async fn begin(&self) -> Result<MySqlInboxTransaction, OutboxError> {
        MySqlInboxTransaction::begin(&self.pool).await
    }

    /// Commits only the transaction [`begin`](Self::begin) began, in one round trip
    /// (see [`MySqlInboxTransaction`]). InnoDB rolls a deadlock victim's whole
    /// transaction back (and a lock wait timeout's under `innodb_rollback_on_timeout`),
    /// and a handler may send `ROLLBACK` itself: when such a rollback's error was caught
    /// and ignored, this is [`OutboxError::TransactionAborted`], and whatever was sent
    /// after the rollback (the handler's statements, the version recorded) is rolled
    /// back too: none of it committed on its own, autocommit being off.
    async fn commit(&self, mut tx: MySqlInboxTransaction) -> Result<(), OutboxError> {
        match tx.end(COMMIT_INBOX).await {
            Ok(()) => Ok(()),
            Err(e) if error_number(&e) == Some(NO_SUCH_SAVEPOINT) => {
                // Should this fail too, the connection is closed (still open), and the
                // server rolls back: nothing was committed either way.
                let _ = tx.end(ROLLBACK_INBOX).await;
                Err(OutboxError::TransactionAborted {
                    operation: "inbox_commit",
                })
            }
            Err(e) => Err(db("inbox_commit")(e)),
        }
    }

    async fn rollback(&self, mut tx: MySqlInboxTransaction) -> Result<(), OutboxError> {
        tx.end(ROLLBACK_INBOX).await.map_err(db("inbox_rollback"))
    }

    async fn try_claim(
        &self,
        conn: &mut MySqlConnection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<bool, OutboxError> {
        check_consumer(consumer)?;
        let inserted = sqlx::query(sql(&self.q.inbox_claim))
            .bind(message_id)
            .bind(consumer)
            .execute(&mut *conn)
            .await
            .map_err(db("inbox_claim"))?
            .rows_affected();
        Ok(inserted == 1)
    }

    /// A `sqlx::Error`'s kind, by its MySQL error number and SQLSTATE (the crate's
    /// error classification).
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        error
            .downcast_ref::<sqlx::Error>()
            .map(crate::error::classify)
    }

    async fn purge(&self, older_than: Duration, batch_size: usize) -> Result<u64, OutboxError> {
        Ok(sqlx::query(sql(&self.q.inbox_purge))
            .bind(micros(older_than))
            .bind(limit(batch_size))
            .execute(&self.pool)
            .await
            .map_err(db("inbox_purge"))?
            .rows_affected())
    }
}

#[async_trait]
impl VersionTracking for MySqlInbox {
    /// Creates the aggregate's version row if missing and locks it (`INSERT … ON
    /// DUPLICATE KEY UPDATE`, a no-op update that takes the row lock), then reads it:
    /// two messages of one aggregate for one consumer are handled one after the other.
    async fn applied_version(
        &self,
        conn: &mut MySqlConnection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Option<i64>, OutboxError> {
        let s = &self.s;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.inbox_versions (consumer, aggregate_type, aggregate_id)
             VALUES (?, ?, ?) ON DUPLICATE KEY UPDATE version = version"
        )))
        .bind(consumer)
        .bind(aggregate_type.as_bytes())
        .bind(aggregate_id.as_bytes())
        .execute(&mut *conn)
        .await
        .map_err(db("inbox_version"))?;
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT version FROM {s}.inbox_versions
              WHERE consumer = ? AND aggregate_type = ? AND aggregate_id = ? FOR UPDATE"
        )))
        .bind(consumer)
        .bind(aggregate_type.as_bytes())
        .bind(aggregate_id.as_bytes())
        .fetch_one(&mut *conn)
        .await
        .map_err(db("inbox_version"))
    }

    async fn record_version(
        &self,
        conn: &mut MySqlConnection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<(), OutboxError> {
        let s = &self.s;
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.inbox_versions
                SET version = GREATEST(COALESCE(version, ?), ?), updated_at = NOW(6)
              WHERE consumer = ? AND aggregate_type = ? AND aggregate_id = ?"
        )))
        .bind(version)
        .bind(version)
        .bind(consumer)
        .bind(aggregate_type.as_bytes())
        .bind(aggregate_id.as_bytes())
        .execute(&mut *conn)
        .await
        .map_err(db("inbox_version"))?;
        Ok(())
    }
}

#[async_trait]
impl ConsumerDeadLetters for MySqlInbox {
    /// The dead-letter check, then the claim, both on `conn` (two statements: MySQL's
    /// `INSERT IGNORE` cannot be made conditional on another table in one). Not the
    /// trait's default, which asks [`is_dead`](Self::is_dead) on a connection of the
    /// pool while `conn`'s transaction holds one: with as many deliveries in flight as
    /// the pool has connections, every one of them waits for a second connection until
    /// the acquire timeout, and nothing progresses (seen in the chaos harness).
    async fn claim_unless_dead(
        &self,
        conn: &mut MySqlConnection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError> {
        if self
            .dead_letter_on(&mut *conn, message_id, consumer)
            .await?
        {
            return Ok(InboxClaim::DeadLetter);
        }
        Ok(if self.try_claim(conn, message_id, consumer).await? {
            InboxClaim::Claimed
        } else {
            InboxClaim::Duplicate
        })
    }

    /// One more failure in a transaction of its own: an upsert (`ON DUPLICATE KEY
    /// UPDATE`, whose assignments run left to right: `dead_at` sees the new count) and
    /// the count read back under its lock.
    async fn record_failure(
        &self,
        msg: &IncomingMessage,
        consumer: &str,
        error: &str,
        max_attempts: u32,
    ) -> Result<FailureCount, OutboxError> {
        let s = &self.s;
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let headers = serde_json::to_string(&msg.headers).unwrap_or_else(|_| "{}".into());
        let mut tx = self.pool.begin().await.map_err(db("inbox_failure"))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.inbox_failures
                    (message_id, consumer, event_type, attempts, last_error, payload, headers, dead_at)
             VALUES (?, ?, ?, 1, ?, ?, ?, CASE WHEN 1 >= ? THEN NOW(6) END)
             ON DUPLICATE KEY UPDATE
                    attempts = attempts + 1,
                    last_error = VALUES(last_error),
                    last_failed_at = NOW(6),
                    dead_at = COALESCE(dead_at, CASE WHEN attempts >= ? THEN NOW(6) END)"
        )))
        .bind(msg.id)
        .bind(consumer)
        .bind(&msg.event_type)
        .bind(outboxkit_core::sanitize_error(error))
        .bind(&msg.payload)
        .bind(headers)
        .bind(max)
        .bind(max)
        .execute(&mut *tx)
        .await
        .map_err(db("inbox_failure"))?;
        let (attempts, dead): (i32, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT attempts, dead_at IS NOT NULL FROM {s}.inbox_failures
              WHERE message_id = ? AND consumer = ?"
        )))
        .bind(msg.id)
        .bind(consumer)
        .fetch_one(&mut *tx)
        .await
        .map_err(db("inbox_failure"))?;
        tx.commit().await.map_err(db("inbox_failure"))?;
        Ok(FailureCount {
            attempts: u32::try_from(attempts).unwrap_or(0),
            dead: dead != 0,
        })
    }

    async fn is_dead(&self, message_id: Uuid, consumer: &str) -> Result<bool, OutboxError> {
        self.dead_letter_on(&self.pool, message_id, consumer).await
    }

    async fn consumer_dead_letters(
        &self,
        consumer: Option<&str>,
        limit_rows: usize,
    ) -> Result<Vec<ConsumerDeadLetter>, OutboxError> {
        let s = &self.s;
        #[allow(clippy::type_complexity)] // reason: one row of the query, read once
        let rows: Vec<(
            Uuid,
            String,
            String,
            String,
            i32,
            DateTime<Utc>,
            Option<Vec<u8>>,
        )> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT message_id, consumer, event_type, last_error, attempts, dead_at, payload
                   FROM {s}.inbox_failures
                  WHERE dead_at IS NOT NULL AND (? IS NULL OR consumer = ?)
                  ORDER BY dead_at LIMIT ?"
        )))
        .bind(consumer)
        .bind(consumer)
        .bind(limit(limit_rows))
        .fetch_all(&self.pool)
        .await
        .map_err(db("inbox_dead_letters"))?;
        Ok(rows
            .into_iter()
            .map(
                |(message_id, consumer, event_type, last_error, attempts, dead_at, payload)| {
                    ConsumerDeadLetter {
                        message_id,
                        consumer,
                        event_type,
                        last_error,
                        attempts: u32::try_from(attempts).unwrap_or(0),
                        dead_at,
                        payload: payload.unwrap_or_default(),
                    }
                },
            )
            .collect())
    }
}

/// Columns read back for a stored durable-inbox message.
const INBOX_COLUMNS: &str = "m.id, m.seq, m.event_type, m.source, m.aggregate_type, \
    m.aggregate_id, m.aggregate_version, m.tenant_id, m.partition_key, m.correlation_id, \
    m.causation_id, m.occurred_at, m.traceparent, m.tracestate, m.headers, m.payload, \
    m.received_at, m.attempts, m.claim_token, \
    TIMESTAMPDIFF(MICROSECOND, m.received_at, NOW(6)) / 1e6 AS age_secs";

fn decode_stored(row: &MySqlRow) -> Result<StoredMessage, OutboxError> {
    let id: Uuid = row.try_get("id").map_err(db("inbox_decode"))?;
    let d = |e: sqlx::Error| OutboxError::Decode {
        id: id.to_string(),
        reason: e.to_string(),
    };
    let mut msg = IncomingMessage::new(
        id,
        row.try_get::<String, _>("event_type").map_err(d)?,
        row.try_get::<Vec<u8>, _>("payload").map_err(d)?,
    );
    msg.source = row.try_get("source").map_err(d)?;
    msg.aggregate_type = row.try_get("aggregate_type").map_err(d)?;
    msg.aggregate_id = row.try_get("aggregate_id").map_err(d)?;
    msg.aggregate_version = row.try_get("aggregate_version").map_err(d)?;
    msg.tenant_id = row.try_get("tenant_id").map_err(d)?;
    msg.partition_key = row.try_get("partition_key").map_err(d)?;
    msg.correlation_id = row.try_get("correlation_id").map_err(d)?;
    msg.causation_id = row.try_get("causation_id").map_err(d)?;
    msg.occurred_at = row.try_get("occurred_at").map_err(d)?;
    msg.traceparent = row
        .try_get::<Option<String>, _>("traceparent")
        .map_err(d)?
        .as_deref()
        .and_then(TraceParent::parse);
    msg.tracestate = row.try_get("tracestate").map_err(d)?;
    let headers: String = row.try_get("headers").map_err(d)?;
    msg.headers = serde_json::from_str::<Headers>(&headers).map_err(|e| OutboxError::Decode {
        id: id.to_string(),
        reason: format!("headers: {e}"),
    })?;
    let attempts: i32 = row.try_get("attempts").map_err(d)?;
    msg.redelivered = attempts > 1;
    msg.delivery_count = u64::try_from(attempts).ok();
    let age: Option<f64> = row.try_get("age_secs").map_err(d)?;
    Ok(StoredMessage::new(
        msg,
        attempts,
        row.try_get("claim_token").map_err(d)?,
        row.try_get("received_at").map_err(d)?,
        Duration::from_secs_f64(age.unwrap_or(0.0).max(0.0)),
    ))
}

#[async_trait]
impl DurableInbox for MySqlInbox {
    /// A plain `INSERT` in autocommit; a duplicate key means stored before (`false`).
    async fn store(&self, msg: &IncomingMessage) -> Result<bool, OutboxError> {
        let s = &self.s;
        let headers = serde_json::to_string(&msg.headers).unwrap_or_else(|_| "{}".into());
        let inserted = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.inbox_messages (id, event_type, source, aggregate_type, aggregate_id,
                 aggregate_version, tenant_id, partition_key, correlation_id, causation_id,
                 occurred_at, traceparent, tracestate, headers, payload)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )))
        .bind(msg.id)
        .bind(&msg.event_type)
        .bind(msg.source.as_deref())
        .bind(msg.aggregate_type.as_deref())
        .bind(msg.aggregate_id.as_deref())
        .bind(msg.aggregate_version)
        .bind(msg.tenant_id.as_deref())
        .bind(msg.partition_key.as_deref())
        .bind(msg.correlation_id.as_deref())
        .bind(msg.causation_id.as_deref())
        .bind(msg.occurred_at)
        .bind(msg.traceparent.map(|t| t.to_string()))
        .bind(msg.tracestate.as_deref())
        .bind(headers)
        .bind(&msg.payload)
        .execute(&self.pool)
        .await;
        match inserted {
            Ok(done) => Ok(done.rows_affected() == 1),
            Err(e) if error_number(&e) == Some(DUPLICATE_KEY) => Ok(false),
            Err(e) => Err(db("inbox_store")(e)),
        }
    }

    /// As the outbox's claim, without the crash-loop guard: one `READ COMMITTED`
    /// transaction locking candidates with `FOR UPDATE SKIP LOCKED`.
    async fn claim(
        &self,
        batch_size: usize,
        lease: Duration,
    ) -> Result<Vec<StoredMessage>, OutboxError> {
        const OP: &str = "inbox_claim_stored";
        let s = &self.s;
        let token = Uuid::new_v4();
        let mut tx = self
            .pool
            .begin_with(BEGIN_READ_COMMITTED)
            .await
            .map_err(db(OP))?;
        let ids: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT m.id FROM {s}.inbox_messages m
              WHERE m.phase = 0 AND m.visible_at <= NOW(6)
                AND (m.status = 0 OR m.lease_until < NOW(6))
              ORDER BY m.visible_at, m.seq LIMIT ? FOR UPDATE SKIP LOCKED"
        )))
        .bind(limit(batch_size.max(1)))
        .fetch_all(&mut *tx)
        .await
        .map_err(db(OP))?;
        if ids.is_empty() {
            tx.commit().await.map_err(db(OP))?;
            return Ok(Vec::new());
        }
        let list = placeholders(ids.len());
        let mut update = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.inbox_messages
                SET lease_until = NOW(6) + INTERVAL ? MICROSECOND, claim_token = ?,
                    attempts = attempts + 1, status = 9
              WHERE id IN ({list})"
        )))
        .bind(micros(lease))
        .bind(token);
        for id in &ids {
            update = update.bind(*id);
        }
        update.execute(&mut *tx).await.map_err(db(OP))?;
        let mut read = sqlx::query(AssertSqlSafe(format!(
            "SELECT {INBOX_COLUMNS} FROM {s}.inbox_messages m WHERE m.id IN ({list}) ORDER BY m.seq"
        )));
        for id in &ids {
            read = read.bind(*id);
        }
        let rows = read.fetch_all(&mut *tx).await.map_err(db(OP))?;
        tx.commit().await.map_err(db(OP))?;
        rows.iter().map(decode_stored).collect()
    }

    async fn complete(
        &self,
        completions: &[InboxCompletion],
    ) -> Result<CompleteReport, OutboxError> {
        if completions.is_empty() {
            return Ok(CompleteReport::default());
        }
        let s = &self.s;
        // This call's mark on the rows it changes (see the outbox's completion).
        let nonce = Uuid::new_v4();
        let mut rows = Vec::with_capacity(completions.len());
        for c in completions {
            // Outcome codes: 1 done, 0 retry, 3 dead, 10 defer (New without charge).
            let (kind, delay, error): (i16, i64, Option<&str>) = match &c.outcome {
                InboxOutcome::Done => (1, 0, None),
                InboxOutcome::Retry { delay, error } => (0, micros(*delay), Some(error)),
                InboxOutcome::Dead { error } => (3, 0, Some(error)),
                InboxOutcome::Defer { delay } => (10, micros(*delay), None),
            };
            let mut row = serde_json::Map::new();
            row.insert("i".into(), c.id.simple().to_string().into());
            row.insert("t".into(), c.claim_token.simple().to_string().into());
            row.insert("s".into(), kind.into());
            row.insert("d".into(), delay.into());
            if let Some(e) = error {
                row.insert(
                    "e".into(),
                    outboxkit_core::sanitize_error(e).into_owned().into(),
                );
            }
            rows.push(serde_json::Value::Object(row));
        }
        let applied = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.inbox_messages m
               JOIN JSON_TABLE(?, '$[*]' COLUMNS (i CHAR(32) PATH '$.i', t CHAR(32) PATH '$.t',
                    s INT PATH '$.s', d BIGINT PATH '$.d', e TEXT PATH '$.e')) u
                 ON m.id = UNHEX(u.i)
                SET m.attempts = CASE WHEN u.s = 10 THEN GREATEST(m.attempts - 1, 0) ELSE m.attempts END,
                    m.visible_at = CASE WHEN u.s IN (0, 10)
                                        THEN NOW(6) + INTERVAL u.d MICROSECOND
                                        ELSE m.visible_at END,
                    m.last_error = COALESCE(u.e, m.last_error),
                    m.processed_at = CASE WHEN u.s = 1 THEN NOW(6) END,
                    m.lease_until = NULL,
                    m.claim_token = NULL,
                    m.completed_token = ?,
                    m.status = CASE WHEN u.s = 10 THEN 0 ELSE u.s END
              WHERE m.claim_token = UNHEX(u.t) AND m.status = 9"
        )))
        .bind(serde_json::Value::Array(rows).to_string())
        .bind(nonce)
        .execute(&self.pool)
        .await
        .map_err(db("inbox_complete"))?
        .rows_affected();
        if applied >= completions.len() as u64 {
            return Ok(CompleteReport {
                applied,
                fenced: Vec::new(),
            });
        }
        let mut read = sqlx::query_scalar::<_, Uuid>(AssertSqlSafe(format!(
            "SELECT id FROM {s}.inbox_messages WHERE completed_token = ? AND id IN ({})",
            placeholders(completions.len())
        )))
        .bind(nonce);
        for c in completions {
            read = read.bind(c.id);
        }
        let done: std::collections::HashSet<Uuid> = read
            .fetch_all(&self.pool)
            .await
            .map_err(db("inbox_complete"))?
            .into_iter()
            .collect();
        Ok(CompleteReport {
            applied,
            fenced: completions
                .iter()
                .filter(|c| !done.contains(&c.id))
                .map(|c| c.id)
                .collect(),
        })
    }

    async fn purge_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        let s = &self.s;
        Ok(sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {s}.inbox_messages
              WHERE phase = 1 AND processed_at <= NOW(6) - INTERVAL ? MICROSECOND
              ORDER BY phase, processed_at LIMIT ?"
        )))
        .bind(micros(older_than))
        .bind(limit(batch_size))
        .execute(&self.pool)
        .await
        .map_err(db("inbox_purge_processed"))?
        .rows_affected())
    }
}
