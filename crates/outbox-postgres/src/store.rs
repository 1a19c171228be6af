//! [`PgOutbox`]: enqueue inside the caller's transaction, and the [`OutboxStore`] the
//! dispatcher uses.

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
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use tracing::Instrument as _;
use uuid::Uuid;

use crate::config::PgConfig;
use crate::error::db;
use crate::floor::ClaimFloor;
use crate::inbox::PgInbox;
use crate::sql::{Queries, like_escape, sql};

/// The PostgreSQL outbox: a pool plus the SQL rendered for one schema. Cheap to clone.
///
/// Writes go through [`OutboxProducer`] ([`enqueue`](OutboxProducer::enqueue) /
/// [`enqueue_batch`](OutboxProducer::enqueue_batch)) on the caller's own transaction
/// ([`begin`](Self::begin), or any `&mut PgConnection` of theirs), so the events commit
/// or roll back with the business rows. The relay side is the [`OutboxStore`] impl,
/// whose push wake-up (`LISTEN` on [`NOTIFY_CHANNEL`](crate::NOTIFY_CHANNEL)) the
/// dispatcher starts itself.
#[derive(Debug, Clone)]
pub struct PgOutbox {
    pool: PgPool,
    schema: Arc<str>,
    q: Arc<Queries>,
    /// Where the last ordered claim stopped walking keys (shared by clones).
    key_cursor: Arc<std::sync::Mutex<String>>,
    /// Where an unordered claim starts walking the pending index (shared by clones).
    floor: Arc<ClaimFloor>,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
    max_payload_bytes: usize,
    listener_keepalive: std::time::Duration,
}

impl PgOutbox {
    /// An outbox over `pool` with the settings of `config`: its schema (run
    /// [`migrate`](Self::migrate) first), [sent retention](PgConfig::with_sent_retention),
    /// [crash-loop limit](PgConfig::with_crash_loop_limit),
    /// [payload limit](PgConfig::with_max_payload_bytes) and
    /// [listener keepalive](PgConfig::with_listener_keepalive); its URL and pool settings
    /// are not used (the pool is yours). `PgConfig::default()` gives the defaults.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid schema name.
    pub fn new(pool: PgPool, config: &PgConfig) -> Result<Self, OutboxError> {
        let schema = config.schema();
        crate::config::validate_schema(schema)?;
        Ok(Self {
            pool,
            schema: schema.into(),
            q: Arc::new(Queries::new(schema)),
            key_cursor: Arc::default(),
            floor: Arc::default(),
            sent_retention: config.sent_retention(),
            crash_loop_limit: config.crash_loop_limit(),
            max_payload_bytes: config.max_payload_bytes(),
            listener_keepalive: config.listener_keepalive(),
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
    pub async fn connect(config: &PgConfig) -> Result<Self, OutboxError> {
        let pool = config.connect().await?;
        Self::new(pool, config)
    }

    /// Begins a transaction on the pool: write the business rows and
    /// [`enqueue`](OutboxProducer::enqueue) the events on it (`&mut tx`), then commit (as
    /// `MssqlOutbox::begin` on SQL Server).
    ///
    /// # Errors
    /// [`OutboxError::Database`] when no connection can be had or `BEGIN` fails.
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, Postgres>, OutboxError> {
        self.pool.begin().await.map_err(db("begin"))
    }

    /// The inbox in this outbox's schema and pool: the one way to have a [`PgInbox`]
    /// ([`migrate`](Self::migrate) creates its tables with the outbox's). A consumer
    /// whose inbox lives in another database connects a store to that database
    /// (`PgOutbox::connect(&inbox_config)?.inbox()`); its URL, pool and schema
    /// settings are the inbox's.
    pub fn inbox(&self) -> PgInbox {
        PgInbox::with_queries(self.pool.clone(), &self.schema)
    }

    /// How long the wake listener may go without a word from its connection before it
    /// checks it.
    pub fn listener_keepalive(&self) -> std::time::Duration {
        self.listener_keepalive
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

    /// Creates the schema if needed and applies pending migrations to it; returns the
    /// versions applied.
    ///
    /// Every table of the schema is created: the outbox's and the inbox's
    /// ([`inbox`](Self::inbox)). Each migration runs once, in its own transaction, under a
    /// lock on the schema name, so several processes may migrate at start-up.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid schema name or when the database
    /// already has a newer version than this crate knows ([`LATEST_VERSION`](crate::LATEST_VERSION));
    /// [`OutboxError::Database`] when a statement fails (that migration is rolled back).
    pub async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        crate::migrate::migrate(&self.pool, &self.schema).await
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The claim floor (see the [`OutboxStore`] impl's `claim`): the `visible_at` from
    /// which unordered claims walk the pending index, `None` before its first refresh.
    /// For tests.
    #[doc(hidden)]
    pub fn claim_floor(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        self.floor.get()
    }

    /// [`complete`](OutboxStore::complete) of a batch whose outcomes are all `Sent`:
    /// ids and claim tokens only (`sql.rs`, `complete_sent` and `delete_sent`).
    async fn complete_sent(
        &self,
        completions: &[Completion],
    ) -> Result<CompleteReport, OutboxError> {
        let ids: Vec<Uuid> = completions.iter().map(|c| c.id).collect();
        let tokens: Vec<Uuid> = completions.iter().map(|c| c.claim_token).collect();
        let statement = match self.sent_retention {
            SentRetention::Delete => &self.q.delete_sent,
            _ => &self.q.complete_sent,
        };
        let applied: Vec<Uuid> = sqlx::query_scalar(sql(statement))
            .bind(&ids)
            .bind(&tokens)
            .fetch_all(&self.pool)
            .await
            .map_err(db("complete"))?;
        Ok(report(ids, &applied))
    }

    fn crash_loop_limit_param(&self) -> i32 {
        i32::try_from(self.crash_loop_limit).unwrap_or(i32::MAX)
    }

    fn bind_filter<'q>(
        query: Query<'q, Postgres, PgArguments>,
        f: &'q MessageFilter,
    ) -> Query<'q, Postgres, PgArguments> {
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
}

/// Decodes a row of [`Queries`]' column list.
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
fn decode_claim(rows: &[PgRow], token: Uuid) -> Result<ClaimedBatch, OutboxError> {
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
fn poison_row(row: &PgRow, poison: Poison) -> Result<PoisonRow, OutboxError> {
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

/// A full row decoded as the claim decodes it for publishing (headers strictly).
#[cfg(feature = "wal")]
pub(crate) fn decode_for_publish(row: &PgRow) -> Result<OutboxMessage, OutboxError> {
    decode_row(row, HeaderDecoding::Strict)
}

#[cfg(feature = "wal")]
impl PgOutbox {
    /// The rows of `ids` that exist (one query; in no particular order), each decoded as
    /// the claim decodes it for publishing (headers strictly, unlike
    /// [`get`](OutboxStore::get), which shows whatever is there):
    /// [`OutboxError::Decode`] for a row that cannot be published as it is.
    ///
    /// # Errors
    /// [`OutboxError::Database`] when the query fails or a row's id cannot be read.
    pub(crate) async fn get_many_for_publish(
        &self,
        ids: &[Uuid],
    ) -> Result<Vec<(Uuid, Result<OutboxMessage, OutboxError>)>, OutboxError> {
        let rows = sqlx::query(sql(&self.q.get_many))
            .bind(ids)
            .fetch_all(&self.pool)
            .await
            .map_err(db("get"))?;
        rows.iter()
            .map(|row| {
                let id: Uuid = row.try_get("id").map_err(db("decode"))?;
                Ok((id, decode_for_publish(row)))
            })
            .collect()
    }
}

fn decode_row(row: &PgRow, headers: HeaderDecoding) -> Result<OutboxMessage, OutboxError> {
    let id: Uuid = row.try_get("id").map_err(db("decode"))?;
    let decode_err = |reason: String| OutboxError::Decode {
        id: id.to_string(),
        reason,
    };
    let payload: String = row.try_get("payload").map_err(db("decode"))?;
    let payload =
        RawValue::from_string(payload).map_err(|e| decode_err(format!("payload: {e}")))?;
    let raw: Json<serde_json::Value> = row.try_get("headers").map_err(db("decode"))?;
    let headers: Headers = match headers {
        HeaderDecoding::Strict => outboxkit_core::headers_from_json(raw.0).map_err(decode_err)?,
        HeaderDecoding::Lossy => outboxkit_core::headers_from_json_lossy(raw.0),
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

/// What a completion of `ids` did, `applied` being the ids its statement returned.
fn report(ids: Vec<Uuid>, applied: &[Uuid]) -> CompleteReport {
    let fenced = if applied.len() == ids.len() {
        Vec::new()
    } else {
        let done: std::collections::HashSet<Uuid> = applied.iter().copied().collect();
        ids.into_iter().filter(|id| !done.contains(id)).collect()
    };
    CompleteReport {
        applied: applied.len() as u64,
        fenced,
    }
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Enqueueing on the caller's transaction: `&mut tx` of a
/// `sqlx::Transaction<'_, Postgres>` ([`PgOutbox::begin`] or your pool's), or any
/// `&mut PgConnection` inside a transaction. The rows are visible to the relay when it
/// commits (and its commit sends the `NOTIFY` on [`NOTIFY_CHANNEL`](crate::NOTIFY_CHANNEL)
/// that wakes the relays).
#[async_trait]
impl OutboxProducer for PgOutbox {
    type Connection = PgConnection;

    /// Writes `messages` on `conn` in one statement (`INSERT ... SELECT FROM UNNEST`),
    /// preserving their order in `seq`. Returns their ids.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] ([`InvalidMessage::PayloadTooLarge`](outboxkit_core::InvalidMessage::PayloadTooLarge))
    /// when any payload is longer than [`max_payload_bytes`](PgOutbox::max_payload_bytes):
    /// no message of the batch is written and the transaction is untouched.
    /// [`OutboxError::Database`] when the insert fails; nothing is written then.
    async fn enqueue_batch(
        &self,
        conn: &mut PgConnection,
        messages: &[NewMessage],
    ) -> Result<Vec<Uuid>, OutboxError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        for m in messages {
            m.check_payload_size(self.max_payload_bytes)?;
        }
        let n = messages.len();
        let mut ids = Vec::with_capacity(n);
        let mut aggregate_types = Vec::with_capacity(n);
        let mut aggregate_ids = Vec::with_capacity(n);
        let mut versions = Vec::with_capacity(n);
        let mut event_types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut tenants = Vec::with_capacity(n);
        let mut routing_keys = Vec::with_capacity(n);
        let mut partition_keys = Vec::with_capacity(n);
        let mut occurred = Vec::with_capacity(n);
        let mut delays = Vec::with_capacity(n);
        for m in messages {
            ids.push(m.id);
            aggregate_types.push(m.aggregate_type.as_str());
            aggregate_ids.push(m.aggregate_id.as_str());
            versions.push(m.aggregate_version);
            event_types.push(m.event_type.as_str());
            payloads.push(m.payload.get());
            headers.push(
                serde_json::to_string(&m.headers).map_err(|e| OutboxError::Decode {
                    id: m.id.to_string(),
                    reason: e.to_string(),
                })?,
            );
            tenants.push(m.tenant_id.as_deref());
            routing_keys.push(m.routing_key.as_deref());
            partition_keys.push(m.partition_key.as_deref());
            occurred.push(m.occurred_at);
            delays.push(m.deliver_after.map_or(0.0, |d| d.as_secs_f64()));
        }
        sqlx::query(sql(&self.q.enqueue))
            .bind(&ids)
            .bind(&aggregate_types)
            .bind(&aggregate_ids)
            .bind(&versions)
            .bind(&event_types)
            .bind(&payloads)
            .bind(&headers)
            .bind(&tenants)
            .bind(&routing_keys)
            .bind(&partition_keys)
            .bind(&occurred)
            .bind(&delays)
            .execute(&mut *conn)
            .instrument(enqueue_span(messages))
            .await
            .map_err(db("enqueue"))?;
        Ok(ids)
    }
}

#[async_trait]
impl OutboxStore for PgOutbox {
    /// One statement (see `sql.rs`). The walk of the pending index starts at the claim
    /// floor, kept in the background (`floor.rs`), so its cost does not grow with the
    /// dead index entries that completed rows leave behind while VACUUM cannot remove
    /// them (autovacuum behind, or a transaction holding the xmin horizon back).
    async fn claim(&self, batch_size: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let rows = sqlx::query(sql(&self.q.claim))
            .bind(limit(batch_size))
            .bind(lease.as_secs_f64())
            .bind(token)
            .bind(self.crash_loop_limit_param())
            .bind(self.floor.get())
            .fetch_all(&self.pool)
            .await
            .map_err(db("claim"))?;
        self.floor.refresh_if_due(&self.pool, &self.q.claim_floor);
        decode_claim(&rows, token)
    }

    async fn claim_ordered(
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
        let rows = sqlx::query(sql(&self.q.claim_ordered))
            .bind(limit(batch_size))
            .bind(lease.as_secs_f64())
            .bind(token)
            .bind(on_dead == OnDead::Block)
            .bind(&cursor)
            .bind(self.crash_loop_limit_param())
            .fetch_all(&self.pool)
            .await
            .map_err(db("claim_ordered"))?;
        // Keys were visited after the cursor, then from the start up to it: the last one
        // visited is the greatest key at or below the cursor if the walk wrapped, else
        // the greatest key. The next claim starts after it.
        let mut after: Option<String> = None;
        let mut wrapped: Option<String> = None;
        for row in &rows {
            let key: String = row.try_get("order_key").map_err(db("claim_ordered"))?;
            let slot = if key > cursor {
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
                Ok(BlockedKey::new(
                    row.try_get("order_key").map_err(db("blocked_keys"))?,
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

    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        if completions.is_empty() {
            return Ok(CompleteReport::default());
        }
        let n = completions.len();
        if completions
            .iter()
            .all(|c| matches!(c.outcome, CompletionOutcome::Sent))
        {
            return self.complete_sent(completions).await;
        }
        let (mut ids, mut tokens, mut statuses) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut delays, mut errors, mut releases) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut held: Vec<Option<&str>> = Vec::with_capacity(n);
        for c in completions {
            ids.push(c.id);
            tokens.push(c.claim_token);
            held.push(match &c.outcome {
                CompletionOutcome::Hold { destination, .. } => Some(destination.as_str()),
                _ => None,
            });
            let (status, delay, error, release) = match &c.outcome {
                CompletionOutcome::Sent => (MessageStatus::Sent, 0.0, None, false),
                CompletionOutcome::Retry { delay, error } => (
                    MessageStatus::New,
                    delay.as_secs_f64(),
                    Some(error.as_str()),
                    false,
                ),
                CompletionOutcome::Dead { error } => {
                    (MessageStatus::Dead, 0.0, Some(error.as_str()), false)
                }
                CompletionOutcome::Release => (MessageStatus::New, 0.0, None, true),
                CompletionOutcome::Hold { error, .. } => {
                    (MessageStatus::New, 0.0, Some(error.as_str()), true)
                }
            };
            statuses.push(status.code());
            delays.push(delay);
            errors.push(error.map(|e| sanitize_error(e).into_owned()));
            releases.push(release);
        }
        let statement = match self.sent_retention {
            SentRetention::Delete => &self.q.complete_deleting_sent,
            _ => &self.q.complete,
        };
        let applied: Vec<Uuid> = sqlx::query_scalar(sql(statement))
            .bind(&ids)
            .bind(&tokens)
            .bind(&statuses)
            .bind(&delays)
            .bind(&errors)
            .bind(&releases)
            .bind(&held)
            .fetch_all(&self.pool)
            .await
            .map_err(db("complete"))?;
        Ok(report(ids, &applied))
    }

    async fn claim_held(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        if destinations.is_empty() {
            return Ok(ClaimedBatch::default());
        }
        let token = Uuid::new_v4();
        let rows = sqlx::query(sql(&self.q.claim_held))
            .bind(destinations)
            .bind(lease.as_secs_f64())
            .bind(token)
            .bind(order.is_some())
            .bind(order == Some(OnDead::Block))
            .fetch_all(&self.pool)
            .await
            .map_err(db("claim_held"))?;
        decode_claim(&rows, token)
    }

    async fn release_held(&self, destination: &str, limit: usize) -> Result<u64, OutboxError> {
        let done = sqlx::query(sql(&self.q.release_held))
            .bind(destination)
            .bind(self::limit(limit))
            .execute(&self.pool)
            .await
            .map_err(db("release_held"))?;
        Ok(done.rows_affected())
    }

    async fn held_destinations(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>, OutboxError> {
        sqlx::query_scalar(sql(&self.q.held_destinations))
            .bind(after)
            .bind(self::limit(limit))
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
        let rows = Self::bind_filter(sqlx::query(sql(&self.q.dead_letters)), filter)
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
        let matched: i64 = Self::bind_filter(sqlx::query(sql(&self.q.replay_count)), filter)
            .fetch_one(&self.pool)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(db("replay"))?;
        let replayed = if dry_run {
            0
        } else {
            Self::bind_filter(sqlx::query(sql(&self.q.replay)), filter)
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
            .bind(older_than.as_secs_f64())
            .bind(limit(batch_size))
            .execute(&self.pool)
            .await
            .map_err(db("purge_sent"))?
            .rows_affected())
    }

    /// The `LISTEN` wake-up: wakes the relay whenever a transaction that inserted rows
    /// into this schema commits (migration 7's trigger sends `NOTIFY` on
    /// [`NOTIFY_CHANNEL`](crate::NOTIFY_CHANNEL)), holding one connection of the pool
    /// while it runs. It reconnects by itself (backoff up to 30 s), wakes once after
    /// every (re)connection, and wakes every
    /// [`OUTAGE_WAKE_INTERVAL`](crate::OUTAGE_WAKE_INTERVAL) while it cannot listen; a
    /// connection quiet for [`listener_keepalive`](PgOutbox::listener_keepalive) is
    /// checked with a query. A pool of one connection gets no listener (it would hold
    /// the relay's only connection): `None`, with a warning, and the relay polls.
    fn spawn_wake_source(
        &self,
        wake: outboxkit_core::WakeHandle,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if self.pool.options().get_max_connections() < 2 {
            tracing::warn!(
                schema = %self.schema,
                "the outbox's pool has one connection, which the LISTEN wake-up would hold: no push wake-up, the relay polls (give the pool at least 2 connections)"
            );
            return None;
        }
        Some(crate::listen::spawn(self, wake, shutdown))
    }
}
