//! [`MssqlOutbox`]: enqueue inside the caller's transaction, and the [`OutboxStore`] the
//! dispatcher uses.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, NaiveDateTime, Utc};
use outboxkit_core::{
    BlockedKey, ClaimedBatch, CompleteReport, Completion, CompletionOutcome, Headers,
    MessageFilter, MessageStatus, NewMessage, OnDead, OutboxError, OutboxMessage, OutboxProducer,
    OutboxStats, OutboxStore, Poison, PoisonRow, ReplayReport, SentRetention, sanitize_error,
};
use serde_json::value::RawValue;
use tiberius::{FromSql, Row, ToSql};
use tracing::Instrument as _;
use uuid::Uuid;

use crate::config::MssqlConfig;
use crate::connection::{MssqlClient, MssqlPool, MssqlTransaction};
use crate::error::db;
use crate::inbox::MssqlInbox;
use crate::sql::{Queries, like_escape, millis};

/// The SQL Server outbox: a pool plus the SQL rendered for one schema. Cheap to clone.
///
/// Writes go through [`OutboxProducer`] ([`enqueue`](OutboxProducer::enqueue) /
/// [`enqueue_batch`](OutboxProducer::enqueue_batch)) on the caller's own client, inside the caller's transaction, so the events commit or
/// roll back with the business rows. tiberius has no transaction object: either use
/// [`begin`](Self::begin) (a pooled connection with an open transaction, see
/// [`MssqlTransaction`]), or run `BEGIN TRAN` / `COMMIT` yourself on your client and
/// pass that client. The relay side is the [`OutboxStore`] impl.
#[derive(Debug, Clone)]
pub struct MssqlOutbox {
    pool: MssqlPool,
    schema: Arc<str>,
    q: Arc<Queries>,
    /// Where the previous ordered claim stopped walking the keys (`order_hash`); shared
    /// by clones, so one relay's claims go round-robin over the keys.
    key_cursor: Arc<Mutex<Option<Vec<u8>>>>,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
    max_payload_bytes: usize,
}

impl MssqlOutbox {
    /// An outbox over `pool` with the settings of `config`: its schema (run
    /// [`migrate`](Self::migrate) first),
    /// [sent retention](MssqlConfig::with_sent_retention),
    /// [crash-loop limit](MssqlConfig::with_crash_loop_limit) and
    /// [payload limit](MssqlConfig::with_max_payload_bytes); its connection string and
    /// pool settings are not used (the pool is yours).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid schema name.
    pub fn new(pool: MssqlPool, config: &MssqlConfig) -> Result<Self, OutboxError> {
        let schema = config.schema();
        crate::config::validate_schema(schema)?;
        Ok(Self {
            pool,
            schema: schema.into(),
            q: Arc::new(Queries::new(schema)),
            key_cursor: Arc::default(),
            sent_retention: config.sent_retention(),
            crash_loop_limit: config.crash_loop_limit(),
            max_payload_bytes: config.max_payload_bytes(),
        })
    }

    /// Opens a pool with `config`'s connection string and pool settings and takes its
    /// other settings, as [`new`](Self::new). One connection is opened eagerly, so that a
    /// wrong address, a down server or bad credentials fail here with the server's own
    /// reason. The tables are not touched: [`migrate`](Self::migrate) creates or upgrades
    /// them.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for a missing or malformed connection string or schema;
    /// [`OutboxError::Database`] (kind `Unavailable` for an unreachable server or a
    /// timeout, `Permanent` for a failed login) with a [`ConnectError`](crate::ConnectError)
    /// source naming the address, never the password.
    pub async fn connect(config: &MssqlConfig) -> Result<Self, OutboxError> {
        let pool = config.connect().await?;
        Self::new(pool, config)
    }

    /// The inbox in this outbox's schema and pool: the one way to have a [`MssqlInbox`]
    /// ([`migrate`](Self::migrate) creates its tables with the outbox's). A consumer
    /// whose inbox lives in another database connects a store to that database
    /// (`MssqlOutbox::connect(&inbox_config)?.inbox()`); its URL, pool and schema
    /// settings are the inbox's.
    pub fn inbox(&self) -> MssqlInbox {
        MssqlInbox::with_queries(self.pool.clone(), &self.schema)
    }

    /// The payload limit of enqueue, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Claims without an outcome after which a row is a suspected crash loop (see
    /// [`Poison::CrashLoop`](outboxkit_core::Poison::CrashLoop)).
    pub fn crash_loop_limit(&self) -> u32 {
        self.crash_loop_limit
    }

    /// What completions do with sent messages.
    pub fn sent_retention(&self) -> SentRetention {
        self.sent_retention
    }

    /// The crash-loop limit as the claims' `int` parameter (limits beyond `i32::MAX`
    /// are never reached: the count is an `int` too).
    fn crash_loop_limit_param(&self) -> i32 {
        i32::try_from(self.crash_loop_limit).unwrap_or(i32::MAX)
    }

    /// The completion statement of the configured retention.
    fn complete_statement(&self) -> &str {
        match self.sent_retention {
            SentRetention::Delete => &self.q.complete_deleting_sent,
            _ => &self.q.complete,
        }
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
    pub fn pool(&self) -> &MssqlPool {
        &self.pool
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Borrows a pooled connection and begins a transaction on it, for the caller's
    /// business statements and [`enqueue`](OutboxProducer::enqueue) (see
    /// [`MssqlPool::begin`]).
    ///
    /// # Errors
    /// [`OutboxError::Database`] when no connection can be had.
    pub async fn begin(&self) -> Result<MssqlTransaction, OutboxError> {
        self.pool.begin().await
    }
}

/// Enqueueing on the caller's client, inside the caller's transaction: `&mut tx` of an
/// [`MssqlTransaction`] ([`MssqlOutbox::begin`]), or a client of yours on which
/// `BEGIN TRAN` ran. The rows are visible to the relay when the transaction commits.
#[async_trait]
impl OutboxProducer for MssqlOutbox {
    type Connection = MssqlClient;

    /// Writes `messages` on `client` (inside the caller's transaction: `BEGIN TRAN` already
    /// run, or an [`MssqlTransaction`]) in one statement (`INSERT ... SELECT FROM
    /// OPENJSON(@P1)`, the rows travelling as one JSON parameter), preserving their
    /// order in `seq`. Returns their ids. `visible_at` is `SYSUTCDATETIME()` plus the
    /// message's delay, computed by the server.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] ([`InvalidMessage::PayloadTooLarge`](outboxkit_core::InvalidMessage::PayloadTooLarge))
    /// when any payload is longer than [`max_payload_bytes`](MssqlOutbox::max_payload_bytes):
    /// no message of the batch is written and the transaction is untouched.
    /// [`OutboxError::Database`] when the insert fails; nothing is written then (with
    /// `XACT_ABORT ON`, the session default on this crate's connections, the caller's
    /// transaction is rolled back; otherwise roll it back yourself).
    async fn enqueue_batch(
        &self,
        client: &mut MssqlClient,
        messages: &[NewMessage],
    ) -> Result<Vec<Uuid>, OutboxError> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let n = messages.len();
        let rows = encode_batch(messages, self.max_payload_bytes)?;
        client
            .execute(&*self.q.enqueue, &[&rows])
            .instrument(tracing::debug_span!("outbox.enqueue", messages = n))
            .await
            .map_err(db("enqueue"))?;
        Ok(messages.iter().map(|m| m.id).collect())
    }
}

/// The JSON array `enqueue` sends as `@P1`, once every payload is known to be at most
/// `max_payload_bytes` long (else the first one that is not, as
/// [`InvalidMessage::PayloadTooLarge`](outboxkit_core::InvalidMessage::PayloadTooLarge)).
fn encode_batch(messages: &[NewMessage], max_payload_bytes: usize) -> Result<String, OutboxError> {
    for m in messages {
        m.check_payload_size(max_payload_bytes)?;
    }
    let rows: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            let headers = serde_json::to_string(&m.headers).map_err(|e| OutboxError::Decode {
                id: m.id.to_string(),
                reason: e.to_string(),
            })?;
            Ok(serde_json::json!({
                "id": m.id,
                "aggregate_type": m.aggregate_type,
                "aggregate_id": m.aggregate_id,
                "aggregate_version": m.aggregate_version,
                "event_type": m.event_type,
                // The payload travels as a JSON string, so its text is stored byte for
                // byte as the producer wrote it.
                "payload": m.payload.get(),
                "headers": headers,
                "tenant_id": m.tenant_id,
                "routing_key": m.routing_key,
                "partition_key": m.partition_key,
                "occurred_at": m.occurred_at.map(datetime2_text),
                "delay_ms": m.deliver_after.map_or(0, millis),
            }))
        })
        .collect::<Result<_, OutboxError>>()?;
    serde_json::to_string(&rows).map_err(|e| OutboxError::Decode {
        id: "batch".into(),
        reason: e.to_string(),
    })
}

/// The JSON array `complete` sends as `@P1` (read by `COMPLETIONS` in `sql.rs`). Every
/// error text goes through [`sanitize_error`]: NUL characters escaped, texts longer than
/// [`MAX_ERROR_BYTES`](outboxkit_core::store::MAX_ERROR_BYTES) cut.
fn encode_completions(completions: &[Completion]) -> String {
    let batch: Vec<serde_json::Value> = completions
        .iter()
        .map(|c| {
            let (status, delay, error, release) = match &c.outcome {
                CompletionOutcome::Sent => (MessageStatus::Sent, 0, None, false),
                CompletionOutcome::Retry { delay, error } => (
                    MessageStatus::New,
                    millis(*delay),
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
            let held_for = match &c.outcome {
                CompletionOutcome::Hold { destination, .. } => Some(destination.as_str()),
                _ => None,
            };
            serde_json::json!({
                "id": c.id,
                "token": c.claim_token,
                "status": status.code(),
                "delay_ms": delay,
                "error": error.map(sanitize_error),
                "release": release,
                "held_for": held_for,
            })
        })
        .collect();
    serde_json::Value::Array(batch).to_string()
}

/// An instant as `datetime2` text (ISO 8601, UTC, microseconds, no zone suffix).
fn datetime2_text(at: DateTime<Utc>) -> String {
    at.naive_utc().format("%Y-%m-%dT%H:%M:%S%.6f").to_string()
}

/// A required column of `row`.
pub(crate) fn req<'a, T: FromSql<'a>>(row: &'a Row, col: &str, id: &str) -> Result<T, OutboxError> {
    opt(row, col, id)?.ok_or_else(|| OutboxError::Decode {
        id: id.to_owned(),
        reason: format!("column {col} is NULL"),
    })
}

/// A nullable column of `row`.
pub(crate) fn opt<'a, T: FromSql<'a>>(
    row: &'a Row,
    col: &str,
    id: &str,
) -> Result<Option<T>, OutboxError> {
    row.try_get::<T, _>(col).map_err(|e| OutboxError::Decode {
        id: id.to_owned(),
        reason: format!("column {col}: {e}"),
    })
}

/// A `datetime2` column read as UTC.
pub(crate) fn time(row: &Row, col: &str, id: &str) -> Result<Option<DateTime<Utc>>, OutboxError> {
    Ok(opt::<NaiveDateTime>(row, col, id)?.map(|t| t.and_utc()))
}

fn req_time(row: &Row, col: &str, id: &str) -> Result<DateTime<Utc>, OutboxError> {
    time(row, col, id)?.ok_or_else(|| OutboxError::Decode {
        id: id.to_owned(),
        reason: format!("column {col} is NULL"),
    })
}

/// The `id` column of a row, for error messages and as the first decoded value.
pub(crate) fn row_id(row: &Row) -> Result<Uuid, OutboxError> {
    req::<Uuid>(row, "id", "?")
}

/// How strictly [`decode_row`] reads `headers`.
#[derive(Clone, Copy)]
pub(crate) enum HeaderDecoding {
    /// An object of strings or a decode error: for publishing.
    Strict,
    /// Whatever is there, made into strings: for showing rows (`get`, dead letters).
    Lossy,
}

/// Decodes a row of the outbox column list.
pub(crate) fn decode_row(
    row: &Row,
    decoding: HeaderDecoding,
) -> Result<OutboxMessage, OutboxError> {
    let id = row_id(row)?;
    let sid = id.to_string();
    let s = sid.as_str();
    let payload: &str = req(row, "payload", s)?;
    let payload = RawValue::from_string(payload.to_owned()).map_err(|e| OutboxError::Decode {
        id: sid.clone(),
        reason: format!("payload: {e}"),
    })?;
    let headers: &str = req(row, "headers", s)?;
    let headers: serde_json::Value =
        serde_json::from_str(headers).map_err(|e| OutboxError::Decode {
            id: sid.clone(),
            reason: format!("headers are not JSON: {e}"),
        })?;
    let headers: Headers = match decoding {
        HeaderDecoding::Strict => {
            outboxkit_core::headers_from_json(headers).map_err(|reason| OutboxError::Decode {
                id: sid.clone(),
                reason,
            })?
        }
        HeaderDecoding::Lossy => outboxkit_core::headers_from_json_lossy(headers),
    };
    let status: i16 = req(row, "status", s)?;
    let owned = |v: Option<&str>| v.map(str::to_owned);
    Ok(OutboxMessage {
        id,
        seq: req(row, "seq", s)?,
        aggregate_type: req::<&str>(row, "aggregate_type", s)?.to_owned(),
        aggregate_id: req::<&str>(row, "aggregate_id", s)?.to_owned(),
        aggregate_version: req(row, "aggregate_version", s)?,
        event_type: req::<&str>(row, "event_type", s)?.to_owned(),
        payload,
        headers,
        tenant_id: owned(opt(row, "tenant_id", s)?),
        routing_key: owned(opt(row, "routing_key", s)?),
        partition_key: owned(opt(row, "partition_key", s)?),
        occurred_at: req_time(row, "occurred_at", s)?,
        created_at: req_time(row, "created_at", s)?,
        visible_at: req_time(row, "visible_at", s)?,
        attempts: req(row, "attempts", s)?,
        status: MessageStatus::from_code(status)?,
        last_error: owned(opt(row, "last_error", s)?),
        claim_token: opt(row, "claim_token", s)?,
        lease_until: time(row, "lease_until", s)?,
        sent_at: time(row, "sent_at", s)?,
    })
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The rows of a claim under `token`: a row the claim moved to `Dead` (status 3, the
/// crash-loop guard) is a [`Poison::CrashLoop`] with its count of claims alone
/// (`unfinished_alone`, unchanged by the kill) and is not decoded; a row that does not
/// decode is a [`Poison::Undecodable`] (it stays `Processing` under the claim for the
/// dispatcher to complete as `Dead`); the rest are messages in `seq` order.
fn claimed(rows: &[Row], token: Uuid) -> Result<ClaimedBatch, OutboxError> {
    let mut messages = Vec::with_capacity(rows.len());
    let mut poison = Vec::new();
    for row in rows {
        let id = row_id(row)?.to_string();
        let status: i16 = req(row, "status", &id)?;
        if status == MessageStatus::Dead.code() {
            let alone: i32 = req(row, "unfinished_alone", &id)?;
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

/// A poison row from the plain columns every row can give.
fn poison_row(row: &Row, poison: Poison) -> Result<PoisonRow, OutboxError> {
    let id = row_id(row)?;
    let sid = id.to_string();
    let s = sid.as_str();
    Ok(PoisonRow {
        id,
        seq: req(row, "seq", s)?,
        aggregate_type: req::<&str>(row, "aggregate_type", s)?.to_owned(),
        aggregate_id: req::<&str>(row, "aggregate_id", s)?.to_owned(),
        partition_key: opt::<&str>(row, "partition_key", s)?.map(str::to_owned),
        poison,
    })
}

/// The parameters of `FILTER` (see `sql.rs`), owned; also those of the listing filter
/// of `ops.rs`.
pub(crate) struct FilterParams {
    ids: Option<String>,
    from: Option<NaiveDateTime>,
    to: Option<NaiveDateTime>,
    tenant: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    error: Option<String>,
}

impl FilterParams {
    pub(crate) fn new(f: &MessageFilter) -> Result<Self, OutboxError> {
        let ids = if f.ids.is_empty() {
            None
        } else {
            Some(
                serde_json::to_string(&f.ids).map_err(|e| OutboxError::Decode {
                    id: "filter".into(),
                    reason: e.to_string(),
                })?,
            )
        };
        Ok(Self {
            ids,
            from: f.from.map(|t| t.naive_utc()),
            to: f.to.map(|t| t.naive_utc()),
            tenant: f.tenant_id.clone(),
            aggregate_type: f.aggregate_type.clone(),
            aggregate_id: f.aggregate_id.clone(),
            event_type: f.event_type.clone(),
            error: f.error_contains.as_deref().map(like_escape),
        })
    }

    pub(crate) fn params(&self) -> [&dyn ToSql; 8] {
        [
            &self.ids,
            &self.from,
            &self.to,
            &self.tenant,
            &self.aggregate_type,
            &self.aggregate_id,
            &self.event_type,
            &self.error,
        ]
    }
}

#[async_trait]
impl OutboxStore for MssqlOutbox {
    async fn claim(&self, batch_size: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let rows = self
            .pool
            .rows(
                "claim",
                &self.q.claim,
                &[
                    &limit(batch_size),
                    &millis(lease),
                    &token,
                    &self.crash_loop_limit_param(),
                ],
            )
            .await?;
        claimed(&rows, token)
    }

    async fn claim_ordered(
        &self,
        batch_size: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let sql = match on_dead {
            OnDead::Block => &self.q.claim_ordered_block,
            OnDead::Skip => &self.q.claim_ordered_skip,
        };
        let cursor: Option<Vec<u8>> = self.key_cursor.lock().ok().and_then(|c| c.clone());
        let rows = self
            .pool
            .rows(
                "claim_ordered",
                sql,
                &[
                    &limit(batch_size),
                    &millis(lease),
                    &token,
                    &cursor,
                    &self.crash_loop_limit_param(),
                ],
            )
            .await?;
        // The statement returns the claimed rows, then one row with the last key it
        // visited: the next ordered claim starts after it.
        let (cursor_rows, claimed_rows): (Vec<Row>, Vec<Row>) = rows
            .into_iter()
            .partition(|row| row.columns().iter().any(|c| c.name() == "next_cursor"));
        if let Some(row) = cursor_rows.first() {
            let next = row
                .try_get::<&[u8], _>("next_cursor")
                .map_err(db("claim_ordered"))?;
            if let (Some(next), Ok(mut slot)) = (next, self.key_cursor.lock()) {
                *slot = Some(next.to_vec());
            }
        }
        claimed(&claimed_rows, token)
    }

    async fn blocked_keys(&self, limit_rows: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        let rows = self
            .pool
            .rows("blocked_keys", &self.q.blocked_keys, &[&limit(limit_rows)])
            .await?;
        rows.iter()
            .map(|row| {
                let id = row_id(row)?;
                let sid = id.to_string();
                let s = sid.as_str();
                let status: i16 = req(row, "status", s)?;
                let waiting: i64 = req(row, "waiting", s)?;
                Ok(BlockedKey::new(
                    req::<&str>(row, "order_key", s)?.to_owned(),
                    id,
                    req(row, "seq", s)?,
                    MessageStatus::from_code(status)?,
                    req(row, "attempts", s)?,
                    opt::<&str>(row, "last_error", s)?.map(str::to_owned),
                    time(row, "first_failed_at", s)?,
                    time(row, "retry_at", s)?,
                    count(waiting),
                ))
            })
            .collect()
    }

    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        if completions.is_empty() {
            return Ok(CompleteReport::default());
        }
        let batch = encode_completions(completions);
        let rows = self
            .pool
            .rows("complete", self.complete_statement(), &[&batch])
            .await?;
        let applied: HashSet<Uuid> = rows
            .iter()
            .map(row_id)
            .collect::<Result<_, OutboxError>>()?;
        let fenced = completions
            .iter()
            .map(|c| c.id)
            .filter(|id| !applied.contains(id))
            .collect();
        Ok(CompleteReport {
            applied: applied.len() as u64,
            fenced,
        })
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        let rows = self.pool.rows("get", &self.q.get, &[&id]).await?;
        rows.first()
            .map(|r| decode_row(r, HeaderDecoding::Lossy))
            .transpose()
    }

    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        let rows = self.pool.rows("stats", &self.q.stats, &[]).await?;
        let row = rows.first().ok_or_else(|| OutboxError::Decode {
            id: "stats".into(),
            reason: "no row".into(),
        })?;
        let get = |i: usize| -> Result<u64, OutboxError> {
            row.try_get::<i64, _>(i)
                .map(|v| count(v.unwrap_or(0)))
                .map_err(db("stats"))
        };
        let age: Option<i64> = row.try_get(4).map_err(db("stats"))?;
        let mut stats = OutboxStats::default();
        stats.new = get(0)?;
        stats.processing = get(1)?;
        stats.sent = get(2)?;
        stats.dead = get(3)?;
        stats.oldest_pending_age = age.map(|ms| Duration::from_millis(count(ms)));
        Ok(stats)
    }

    async fn dead_letters(
        &self,
        filter: &MessageFilter,
        limit_rows: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        let f = FilterParams::new(filter)?;
        let n = limit(limit_rows);
        let mut params: Vec<&dyn ToSql> = f.params().to_vec();
        params.push(&n);
        let rows = self
            .pool
            .rows("dead_letters", &self.q.dead_letters, &params)
            .await?;
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
        let f = FilterParams::new(filter)?;
        let rows = self
            .pool
            .rows("replay", &self.q.replay_count, &f.params())
            .await?;
        let matched = rows
            .first()
            .map(|r| r.try_get::<i64, _>(0))
            .transpose()
            .map_err(db("replay"))?
            .flatten()
            .map_or(0, count);
        let replayed = if dry_run {
            0
        } else {
            self.pool
                .affected("replay", &self.q.replay, &f.params())
                .await?
        };
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
        let json = serde_json::to_string(destinations).map_err(|e| OutboxError::Decode {
            id: "destinations".into(),
            reason: e.to_string(),
        })?;
        let rows = self
            .pool
            .rows(
                "claim_held",
                &self.q.claim_held,
                &[
                    &json,
                    &millis(lease),
                    &token,
                    &i32::from(order.is_some()),
                    &i32::from(order == Some(OnDead::Block)),
                ],
            )
            .await?;
        claimed(&rows, token)
    }

    async fn release_held(&self, destination: &str, limit_rows: usize) -> Result<u64, OutboxError> {
        self.pool
            .affected(
                "release_held",
                &self.q.release_held,
                &[&destination, &limit(limit_rows)],
            )
            .await
    }

    async fn held_destinations(
        &self,
        after: &str,
        limit_rows: usize,
    ) -> Result<Vec<String>, OutboxError> {
        let rows = self
            .pool
            .rows(
                "held_destinations",
                &self.q.held_destinations,
                &[&after, &limit(limit_rows)],
            )
            .await?;
        rows.iter()
            .map(|row| req::<&str>(row, "destination", "held_destinations").map(str::to_owned))
            .collect()
    }

    async fn purge_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.pool
            .affected(
                "purge_sent",
                &self.q.purge_sent,
                &[&millis(older_than), &limit(batch_size)],
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outboxkit_core::DEFAULT_MAX_PAYLOAD_BYTES;

    #[test]
    fn batches_encode_as_json_rows_in_order() {
        let a = NewMessage::builder("order", "1", "Placed")
            .payload_json(r#"{ "spaced" : [1, 2] }"#)
            .partition_key("p-1")
            .header("x", "y")
            .build()
            .expect("valid");
        let b = NewMessage::builder("order", "2", "Placed")
            .payload(&serde_json::json!(7))
            .build()
            .expect("valid");
        let text =
            encode_batch(&[a.clone(), b.clone()], DEFAULT_MAX_PAYLOAD_BYTES).expect("encodes");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0]["id"], a.id.to_string());
        assert_eq!(rows[1]["id"], b.id.to_string());
        assert_eq!(
            rows[0]["payload"], r#"{ "spaced" : [1, 2] }"#,
            "payload text kept byte for byte"
        );
        assert_eq!(rows[0]["headers"], r#"{"x":"y"}"#);
        assert_eq!(rows[0]["partition_key"], "p-1");
        assert!(rows[1]["partition_key"].is_null());
        assert!(
            rows[0]["occurred_at"].is_null(),
            "no client time unless stated"
        );
        assert_eq!(rows[0]["delay_ms"], 0);
    }

    /// `enqueue_batch` sends nothing when any payload of the batch is over the limit:
    /// the statement's only parameter is never built.
    #[test]
    fn payloads_over_the_limit_stop_the_whole_batch() {
        let message = |payload: &str| {
            NewMessage::builder("order", "1", "Placed")
                .payload_json(payload)
                .build()
                .expect("valid")
        };
        let max = DEFAULT_MAX_PAYLOAD_BYTES;
        let string_of = |len: usize| format!("\"{}\"", "x".repeat(len - 2));
        let small = message("{}");
        let at_limit = message(&string_of(max));
        let over = message(&string_of(max + 1));
        let err = encode_batch(&[small.clone(), over], max).expect_err("over the limit");
        assert!(
            matches!(
                err,
                OutboxError::InvalidMessage(outboxkit_core::InvalidMessage::PayloadTooLarge { size, max: m })
                    if size == max + 1 && m == max
            ),
            "{err:?}"
        );
        let text = encode_batch(&[small, at_limit], max).expect("at the limit");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
        assert_eq!(rows[1]["payload"].as_str().map(str::len), Some(max));
        assert!(matches!(
            encode_batch(&[message(&string_of(17))], 16),
            Err(OutboxError::InvalidMessage(
                outboxkit_core::InvalidMessage::PayloadTooLarge { size: 17, max: 16 }
            ))
        ));
    }

    #[test]
    fn completion_errors_are_sanitized() {
        let (id, token) = (Uuid::new_v4(), Uuid::new_v4());
        let long = "é".repeat(outboxkit_core::store::MAX_ERROR_BYTES);
        let text = encode_completions(&[
            Completion {
                id,
                claim_token: token,
                outcome: CompletionOutcome::Dead {
                    error: "broker said \0 no".into(),
                },
            },
            Completion {
                id,
                claim_token: token,
                outcome: CompletionOutcome::Retry {
                    delay: Duration::from_millis(1500),
                    error: long.clone(),
                },
            },
            Completion {
                id,
                claim_token: token,
                outcome: CompletionOutcome::Release,
            },
        ]);
        let rows: Vec<serde_json::Value> = serde_json::from_str(&text).expect("json");
        assert_eq!(rows[0]["error"], "broker said \\0 no", "NUL escaped");
        assert_eq!(rows[0]["status"], 3);
        let cut = rows[1]["error"].as_str().expect("text");
        assert!(cut.len() <= outboxkit_core::store::MAX_ERROR_BYTES && cut.ends_with('…'));
        assert_eq!(cut, sanitize_error(&long));
        assert_eq!(rows[1]["delay_ms"], 1500);
        assert!(rows[2]["error"].is_null());
        assert_eq!(rows[2]["release"], true);
        assert_eq!(rows[0]["token"], token.to_string());
    }

    #[test]
    fn instants_are_datetime2_text() {
        let at = DateTime::parse_from_rfc3339("2026-01-02T03:04:05.123456789Z")
            .expect("time")
            .with_timezone(&Utc);
        assert_eq!(datetime2_text(at), "2026-01-02T03:04:05.123456");
    }
}
