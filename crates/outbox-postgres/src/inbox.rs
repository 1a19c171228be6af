//! [`PgInbox`]: the consumer's dedup records, claimed inside the consumer's transaction.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outboxkit_core::inbox::{
    ConsumerDeadLetter, ConsumerDeadLetters, DurableInbox, FailureCount, InboxClaim,
    InboxCompletion, InboxOutcome, StoredMessage, VersionKey, VersionTracking, lock_order,
};
use outboxkit_core::wire::{IncomingMessage, TraceParent};
use outboxkit_core::{CompleteReport, ErrorKind, Headers, InboxStore, OutboxError};
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Postgres, Row};
use uuid::Uuid;

use crate::error::db;
use crate::sql::{InboxQueries, Queries, sql};

/// Inbox records in `{schema}.inbox_records` (created by the same migrations as the
/// outbox). Cheap to clone.
///
/// Per message and handler the idempotent consumer sends, on one pooled connection:
/// `BEGIN`, one statement that checks for a consumer dead letter and claims the record
/// ([`claim_unless_dead`](ConsumerDeadLetters::claim_unless_dead)), the handler's own
/// statements, `SELECT 1` (which fails on a transaction the handler left aborted: see
/// [`commit`](InboxStore::commit)), `COMMIT`; with version tracking, one statement that
/// creates, locks and reads the aggregate's version row and one that raises it. sqlx adds a ping when the
/// connection goes back to the pool, and another before each acquire unless the pool
/// is built with `test_before_acquire(false)` (as [`PgOutbox::connect`](crate::PgOutbox::connect) does).
///
/// The batched consumer (`IdempotentConsumer` as a `BatchDeliveryHandler`) sends, per
/// batch: `BEGIN`, one statement claiming every `(message, handler)` pair of the batch
/// with its dead-letter check
/// ([`claim_batch_unless_dead`](ConsumerDeadLetters::claim_batch_unless_dead)), with
/// version tracking one statement locking every aggregate's version row
/// ([`applied_versions`](VersionTracking::applied_versions)), the handlers' own
/// statements, with versions one statement raising them
/// ([`record_versions`](VersionTracking::record_versions)), `SELECT 1`, `COMMIT`: 4
/// (6 with versions) round trips of ours per batch plus the handlers' own, and sqlx's
/// ping on release (counted by the inbox's `a_batch_of_100_takes_about_one_round_trip_per_message`:
/// about 1.05 round trips per message in batches of 100 with a one-statement handler). The durable
/// receiver stores a batch in one statement ([`store_batch`](DurableInbox::store_batch)).
/// Each batch statement takes its locks in sorted order (see
/// [`lock_order`]), so concurrent batches wait for each other instead of deadlocking.
///
/// [`try_claim`](InboxStore::try_claim) runs `INSERT ... ON CONFLICT DO NOTHING` on the
/// caller's transaction: the record commits with the handler's effects or not at all. A
/// concurrent claim of the same `(message_id, consumer)` waits on the first
/// transaction's unique-index entry and then sees the conflict, so at most one of them
/// returns `true` and commits.
#[derive(Debug, Clone)]
pub struct PgInbox {
    pool: PgPool,
    q: Arc<Queries>,
    iq: Arc<InboxQueries>,
}

impl PgInbox {
    /// `schema` validated already.
    pub(crate) fn with_queries(pool: PgPool, schema: &str) -> Self {
        Self {
            pool,
            q: Arc::new(Queries::new(schema)),
            iq: Arc::new(InboxQueries::new(schema)),
        }
    }

    /// The pool (handy for beginning the consumer's transaction).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

#[async_trait]
impl InboxStore for PgInbox {
    type Connection = PgConnection;
    type Transaction = sqlx::Transaction<'static, Postgres>;

    async fn begin(&self) -> Result<Self::Transaction, OutboxError> {
        self.pool.begin().await.map_err(db("inbox_begin"))
    }

    /// Checks first that `tx` is not aborted: PostgreSQL answers `COMMIT` on an aborted
    /// transaction with the tag `ROLLBACK` rather than an error, and sqlx's `commit`
    /// does not look at the tag. One `SELECT 1` (a round trip) fails with `25P02` on an
    /// aborted transaction: [`OutboxError::TransactionAborted`].
    async fn commit(&self, mut tx: Self::Transaction) -> Result<(), OutboxError> {
        sqlx::raw_sql("SELECT 1")
            .execute(&mut *tx)
            .await
            .map_err(db("inbox_commit"))?;
        tx.commit().await.map_err(db("inbox_commit"))
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<(), OutboxError> {
        tx.rollback().await.map_err(db("inbox_rollback"))
    }

    async fn try_claim(
        &self,
        conn: &mut PgConnection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<bool, OutboxError> {
        if consumer.is_empty() {
            return Err(OutboxError::Config(
                "consumer name must not be empty".into(),
            ));
        }
        let inserted = sqlx::query(sql(&self.q.inbox_claim))
            .bind(message_id)
            .bind(consumer)
            .execute(&mut *conn)
            .await
            .map_err(db("inbox_claim"))?
            .rows_affected();
        Ok(inserted == 1)
    }

    /// One statement for the whole batch.
    async fn try_claim_batch(
        &self,
        conn: &mut PgConnection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<bool>, OutboxError> {
        let order = checked_order(pairs)?;
        if order.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, consumers): (Vec<Uuid>, Vec<&str>) = order.iter().map(|&i| pairs[i]).unzip();
        let inserted: Vec<(Uuid, String)> = sqlx::query_as(sql(&self.iq.claim_batch))
            .bind(&ids)
            .bind(&consumers)
            .fetch_all(&mut *conn)
            .await
            .map_err(db("inbox_claim_batch"))?;
        let inserted: std::collections::HashSet<(Uuid, &str)> =
            inserted.iter().map(|(id, c)| (*id, c.as_str())).collect();
        let mut claimed = vec![false; pairs.len()];
        for &i in &order {
            claimed[i] = inserted.contains(&pairs[i]);
        }
        Ok(claimed)
    }

    /// A `sqlx::Error`'s kind, by its SQLSTATE (the crate's error classification).
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        error
            .downcast_ref::<sqlx::Error>()
            .map(crate::error::classify)
    }

    async fn purge(&self, older_than: Duration, batch_size: usize) -> Result<u64, OutboxError> {
        Ok(sqlx::query(sql(&self.q.inbox_purge))
            .bind(older_than.as_secs_f64())
            .bind(i64::try_from(batch_size).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(db("inbox_purge"))?
            .rows_affected())
    }
}

/// The lock order of `pairs` ([`lock_order`]), after checking that no consumer name is
/// empty.
fn checked_order(pairs: &[(Uuid, &str)]) -> Result<Vec<usize>, OutboxError> {
    if pairs.iter().any(|(_, consumer)| consumer.is_empty()) {
        return Err(OutboxError::Config(
            "consumer name must not be empty".into(),
        ));
    }
    Ok(lock_order(pairs))
}

/// `text` as PostgreSQL's `text` and `jsonb` can hold it: every NUL character (SQLSTATE
/// 22021 in `text`, "unsupported Unicode escape sequence" in `jsonb`) replaced by the two
/// characters `\0`, as [`outboxkit_core::sanitize_error`] does for error texts. Our
/// producers cannot send a NUL (the message builder refuses control characters), but
/// another producer, or a SQL Server outbox (whose `nvarchar` holds one), can; such a
/// message must not become one the consumer can neither store nor dead-letter. Version
/// keys go through it too: an aggregate id with a NUL shares its version record with the
/// same id spelled with a literal `\0` (an accepted collision; no other text changes).
fn pg_text(text: &str) -> std::borrow::Cow<'_, str> {
    if text.contains('\0') {
        std::borrow::Cow::Owned(text.replace('\0', "\\0"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// [`pg_text`] for an optional text.
fn pg_opt_text(text: Option<&str>) -> Option<std::borrow::Cow<'_, str>> {
    text.map(pg_text)
}

/// `headers` as the JSON text of a `jsonb` column, names and values through [`pg_text`].
fn pg_headers(headers: &Headers) -> String {
    let json = if headers
        .iter()
        .any(|(name, value)| name.contains('\0') || value.contains('\0'))
    {
        let clean: Headers = headers
            .iter()
            .map(|(name, value)| (pg_text(name).into_owned(), pg_text(value).into_owned()))
            .collect();
        serde_json::to_string(&clean)
    } else {
        serde_json::to_string(headers)
    };
    json.unwrap_or_else(|_| "{}".into())
}

#[async_trait]
impl VersionTracking for PgInbox {
    async fn applied_version(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Option<i64>, OutboxError> {
        // One statement creates the row if missing and locks it: two messages of one
        // aggregate for one consumer are handled one after the other.
        sqlx::query_scalar(sql(&self.iq.version_lock))
            .bind(consumer)
            .bind(pg_text(aggregate_type))
            .bind(pg_text(aggregate_id))
            .fetch_one(&mut *conn)
            .await
            .map_err(db("inbox_version"))
    }

    async fn record_version(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<(), OutboxError> {
        sqlx::query(sql(&self.iq.version_set))
            .bind(consumer)
            .bind(pg_text(aggregate_type))
            .bind(pg_text(aggregate_id))
            .bind(version)
            .execute(&mut *conn)
            .await
            .map_err(db("inbox_version"))?;
        Ok(())
    }

    /// One statement locking every key's row, in [`lock_order`].
    async fn applied_versions(
        &self,
        conn: &mut PgConnection,
        keys: &[VersionKey<'_>],
    ) -> Result<Vec<Option<i64>>, OutboxError> {
        let order = lock_order(keys);
        if order.is_empty() {
            return Ok(Vec::new());
        }
        let mut consumers = Vec::with_capacity(order.len());
        let mut types = Vec::with_capacity(order.len());
        let mut ids = Vec::with_capacity(order.len());
        for &i in &order {
            consumers.push(keys[i].consumer);
            types.push(pg_text(keys[i].aggregate_type));
            ids.push(pg_text(keys[i].aggregate_id));
        }
        let rows: Vec<(String, String, String, Option<i64>)> =
            sqlx::query_as(sql(&self.iq.version_lock_batch))
                .bind(&consumers)
                .bind(&types)
                .bind(&ids)
                .fetch_all(&mut *conn)
                .await
                .map_err(db("inbox_version_batch"))?;
        let applied: std::collections::HashMap<(&str, &str, &str), Option<i64>> = rows
            .iter()
            .map(|(c, t, id, v)| ((c.as_str(), t.as_str(), id.as_str()), *v))
            .collect();
        Ok(keys
            .iter()
            .map(|k| {
                let (t, id) = (pg_text(k.aggregate_type), pg_text(k.aggregate_id));
                applied
                    .get(&(k.consumer, t.as_ref(), id.as_ref()))
                    .copied()
                    .flatten()
            })
            .collect())
    }

    /// One statement for every key (the largest version given per key).
    async fn record_versions(
        &self,
        conn: &mut PgConnection,
        versions: &[(VersionKey<'_>, i64)],
    ) -> Result<(), OutboxError> {
        let mut highest: std::collections::BTreeMap<VersionKey<'_>, i64> =
            std::collections::BTreeMap::new();
        for (key, version) in versions {
            let v = highest.entry(*key).or_insert(*version);
            *v = (*v).max(*version);
        }
        if highest.is_empty() {
            return Ok(());
        }
        let mut consumers = Vec::with_capacity(highest.len());
        let mut types = Vec::with_capacity(highest.len());
        let mut ids = Vec::with_capacity(highest.len());
        let mut values = Vec::with_capacity(highest.len());
        for (key, version) in &highest {
            consumers.push(key.consumer);
            types.push(pg_text(key.aggregate_type));
            ids.push(pg_text(key.aggregate_id));
            values.push(*version);
        }
        sqlx::query(sql(&self.iq.version_set_batch))
            .bind(&consumers)
            .bind(&types)
            .bind(&ids)
            .bind(&values)
            .execute(&mut *conn)
            .await
            .map_err(db("inbox_version_batch"))?;
        Ok(())
    }
}

#[async_trait]
impl ConsumerDeadLetters for PgInbox {
    /// One statement on `conn`: the dead-letter check and the claim together.
    async fn claim_unless_dead(
        &self,
        conn: &mut PgConnection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError> {
        if consumer.is_empty() {
            return Err(OutboxError::Config(
                "consumer name must not be empty".into(),
            ));
        }
        let (claimed, dead): (i64, bool) = sqlx::query_as(sql(&self.iq.claim_unless_dead))
            .bind(message_id)
            .bind(consumer)
            .fetch_one(&mut *conn)
            .await
            .map_err(db("inbox_claim"))?;
        Ok(match (claimed, dead) {
            (1, _) => InboxClaim::Claimed,
            (_, true) => InboxClaim::DeadLetter,
            _ => InboxClaim::Duplicate,
        })
    }

    /// One statement on `conn` for the whole batch: the dead-letter checks and the
    /// claims together, in [`lock_order`].
    async fn claim_batch_unless_dead(
        &self,
        conn: &mut PgConnection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<InboxClaim>, OutboxError> {
        let order = checked_order(pairs)?;
        if order.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, consumers): (Vec<Uuid>, Vec<&str>) = order.iter().map(|&i| pairs[i]).unzip();
        let rows: Vec<(i64, bool, bool)> = sqlx::query_as(sql(&self.iq.claim_batch_unless_dead))
            .bind(&ids)
            .bind(&consumers)
            .fetch_all(&mut *conn)
            .await
            .map_err(db("inbox_claim_batch"))?;
        // A pair repeated in `pairs` is a duplicate of its first occurrence (or dead).
        let mut claims = vec![InboxClaim::Duplicate; pairs.len()];
        let mut by_pair = std::collections::HashMap::with_capacity(order.len());
        for (ord, claimed, dead) in rows {
            let Some(&i) = usize::try_from(ord - 1).ok().and_then(|k| order.get(k)) else {
                continue;
            };
            let claim = match (claimed, dead) {
                (true, _) => InboxClaim::Claimed,
                (_, true) => InboxClaim::DeadLetter,
                _ => InboxClaim::Duplicate,
            };
            claims[i] = claim;
            by_pair.insert(pairs[i], (i, claim));
        }
        for (j, pair) in pairs.iter().enumerate() {
            if let Some(&(first, claim)) = by_pair.get(pair)
                && first != j
                && claim == InboxClaim::DeadLetter
            {
                claims[j] = InboxClaim::DeadLetter;
            }
        }
        Ok(claims)
    }

    async fn record_failure(
        &self,
        msg: &IncomingMessage,
        consumer: &str,
        error: &str,
        max_attempts: u32,
    ) -> Result<FailureCount, OutboxError> {
        let (attempts, dead): (i32, bool) = sqlx::query_as(sql(&self.iq.failure))
            .bind(msg.id)
            .bind(consumer)
            .bind(pg_text(&msg.event_type))
            .bind(outboxkit_core::sanitize_error(error))
            .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
            .bind(&msg.payload)
            .bind(pg_headers(&msg.headers))
            .fetch_one(&self.pool)
            .await
            .map_err(db("inbox_failure"))?;
        Ok(FailureCount {
            attempts: u32::try_from(attempts).unwrap_or(0),
            dead,
        })
    }

    async fn is_dead(&self, message_id: Uuid, consumer: &str) -> Result<bool, OutboxError> {
        sqlx::query_scalar(sql(&self.iq.is_dead))
            .bind(message_id)
            .bind(consumer)
            .fetch_one(&self.pool)
            .await
            .map_err(db("inbox_is_dead"))
    }

    async fn consumer_dead_letters(
        &self,
        consumer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConsumerDeadLetter>, OutboxError> {
        let rows: Vec<(Uuid, String, String, String, i32, DateTime<Utc>, Vec<u8>)> =
            sqlx::query_as(sql(&self.iq.dead_letters))
                .bind(consumer)
                .bind(i64::try_from(limit).unwrap_or(i64::MAX))
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
                        payload,
                    }
                },
            )
            .collect())
    }
}

fn decode_stored(row: &PgRow) -> Result<StoredMessage, OutboxError> {
    let get_err = db("inbox_decode");
    let id: Uuid = row.try_get("id").map_err(get_err)?;
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
    msg.headers = row.try_get::<Json<Headers>, _>("headers").map_err(d)?.0;
    let attempts: i32 = row.try_get("attempts").map_err(d)?;
    msg.redelivered = attempts > 1;
    msg.delivery_count = u64::try_from(attempts).ok();
    let age: f64 = row.try_get("age_secs").map_err(d)?;
    Ok(StoredMessage::new(
        msg,
        attempts,
        row.try_get("claim_token").map_err(d)?,
        row.try_get("received_at").map_err(d)?,
        Duration::from_secs_f64(age.max(0.0)),
    ))
}

#[async_trait]
impl DurableInbox for PgInbox {
    async fn store(&self, msg: &IncomingMessage) -> Result<bool, OutboxError> {
        let inserted = sqlx::query(sql(&self.iq.store))
            .bind(msg.id)
            .bind(pg_text(&msg.event_type))
            .bind(pg_opt_text(msg.source.as_deref()))
            .bind(pg_opt_text(msg.aggregate_type.as_deref()))
            .bind(pg_opt_text(msg.aggregate_id.as_deref()))
            .bind(msg.aggregate_version)
            .bind(pg_opt_text(msg.tenant_id.as_deref()))
            .bind(pg_opt_text(msg.partition_key.as_deref()))
            .bind(pg_opt_text(msg.correlation_id.as_deref()))
            .bind(pg_opt_text(msg.causation_id.as_deref()))
            .bind(msg.occurred_at)
            .bind(msg.traceparent.map(|t| t.to_string()))
            .bind(pg_opt_text(msg.tracestate.as_deref()))
            .bind(pg_headers(&msg.headers))
            .bind(&msg.payload)
            .execute(&self.pool)
            .await
            .map_err(db("inbox_store"))?
            .rows_affected();
        Ok(inserted == 1)
    }

    /// One `INSERT … SELECT FROM UNNEST … ON CONFLICT DO NOTHING` for the batch, in id
    /// order.
    async fn store_batch(&self, msgs: &[IncomingMessage]) -> Result<Vec<bool>, OutboxError> {
        let all_ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
        let order = lock_order(&all_ids);
        if order.is_empty() {
            return Ok(Vec::new());
        }
        let n = order.len();
        let mut ids = Vec::with_capacity(n);
        let mut event_types = Vec::with_capacity(n);
        let mut sources = Vec::with_capacity(n);
        let mut aggregate_types = Vec::with_capacity(n);
        let mut aggregate_ids = Vec::with_capacity(n);
        let mut versions = Vec::with_capacity(n);
        let mut tenants = Vec::with_capacity(n);
        let mut partition_keys = Vec::with_capacity(n);
        let mut correlation_ids = Vec::with_capacity(n);
        let mut causation_ids = Vec::with_capacity(n);
        let mut occurred = Vec::with_capacity(n);
        let mut traceparents = Vec::with_capacity(n);
        let mut tracestates = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        for &i in &order {
            let msg = &msgs[i];
            ids.push(msg.id);
            event_types.push(pg_text(&msg.event_type));
            sources.push(pg_opt_text(msg.source.as_deref()));
            aggregate_types.push(pg_opt_text(msg.aggregate_type.as_deref()));
            aggregate_ids.push(pg_opt_text(msg.aggregate_id.as_deref()));
            versions.push(msg.aggregate_version);
            tenants.push(pg_opt_text(msg.tenant_id.as_deref()));
            partition_keys.push(pg_opt_text(msg.partition_key.as_deref()));
            correlation_ids.push(pg_opt_text(msg.correlation_id.as_deref()));
            causation_ids.push(pg_opt_text(msg.causation_id.as_deref()));
            occurred.push(msg.occurred_at);
            traceparents.push(msg.traceparent.map(|t| t.to_string()));
            tracestates.push(pg_opt_text(msg.tracestate.as_deref()));
            headers.push(pg_headers(&msg.headers));
            payloads.push(msg.payload.as_slice());
        }
        let inserted: Vec<Uuid> = sqlx::query_scalar(sql(&self.iq.store_batch))
            .bind(&ids)
            .bind(&event_types)
            .bind(&sources)
            .bind(&aggregate_types)
            .bind(&aggregate_ids)
            .bind(&versions)
            .bind(&tenants)
            .bind(&partition_keys)
            .bind(&correlation_ids)
            .bind(&causation_ids)
            .bind(&occurred)
            .bind(&traceparents)
            .bind(&tracestates)
            .bind(&headers)
            .bind(&payloads)
            .fetch_all(&self.pool)
            .await
            .map_err(db("inbox_store_batch"))?;
        let inserted: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
        let mut new = vec![false; msgs.len()];
        for &i in &order {
            new[i] = inserted.contains(&msgs[i].id);
        }
        Ok(new)
    }

    async fn claim(
        &self,
        batch_size: usize,
        lease: Duration,
    ) -> Result<Vec<StoredMessage>, OutboxError> {
        let rows = sqlx::query(sql(&self.iq.claim))
            .bind(i64::try_from(batch_size).unwrap_or(i64::MAX))
            .bind(lease.as_secs_f64())
            .bind(Uuid::new_v4())
            .fetch_all(&self.pool)
            .await
            .map_err(db("inbox_claim_stored"))?;
        let mut out: Vec<(i64, StoredMessage)> = rows
            .iter()
            .map(|r| {
                Ok((
                    r.try_get::<i64, _>("seq").map_err(db("inbox_decode"))?,
                    decode_stored(r)?,
                ))
            })
            .collect::<Result<_, OutboxError>>()?;
        out.sort_unstable_by_key(|(seq, _)| *seq);
        Ok(out.into_iter().map(|(_, m)| m).collect())
    }

    async fn complete(
        &self,
        completions: &[InboxCompletion],
    ) -> Result<CompleteReport, OutboxError> {
        if completions.is_empty() {
            return Ok(CompleteReport::default());
        }
        let mut ids = Vec::with_capacity(completions.len());
        let mut tokens = Vec::with_capacity(completions.len());
        let mut kinds = Vec::with_capacity(completions.len());
        let mut delays = Vec::with_capacity(completions.len());
        let mut errors = Vec::with_capacity(completions.len());
        for c in completions {
            ids.push(c.id);
            tokens.push(c.claim_token);
            let (kind, delay, error): (i16, f64, Option<&str>) = match &c.outcome {
                InboxOutcome::Done => (1, 0.0, None),
                InboxOutcome::Retry { delay, error } => (0, delay.as_secs_f64(), Some(error)),
                InboxOutcome::Dead { error } => (3, 0.0, Some(error)),
                InboxOutcome::Defer { delay } => (10, delay.as_secs_f64(), None),
            };
            kinds.push(kind);
            delays.push(delay);
            errors.push(error);
        }
        let applied: Vec<Uuid> = sqlx::query_scalar(sql(&self.iq.complete))
            .bind(&ids)
            .bind(&tokens)
            .bind(&kinds)
            .bind(&delays)
            .bind(&errors)
            .fetch_all(&self.pool)
            .await
            .map_err(db("inbox_complete"))?;
        let done: std::collections::HashSet<Uuid> = applied.iter().copied().collect();
        Ok(CompleteReport {
            applied: applied.len() as u64,
            fenced: ids.into_iter().filter(|id| !done.contains(id)).collect(),
        })
    }

    async fn purge_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        Ok(sqlx::query(sql(&self.iq.purge_processed))
            .bind(older_than.as_secs_f64())
            .bind(i64::try_from(batch_size).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(db("inbox_purge_processed"))?
            .rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_characters_are_escaped_and_nothing_else_changes() {
        assert!(matches!(
            pg_text("plain \\0 text"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(pg_text("a\0b\0"), "a\\0b\\0");
        let mut headers = Headers::new();
        headers.insert("plain".into(), "value".into());
        assert_eq!(pg_headers(&headers), r#"{"plain":"value"}"#);
        headers.insert("n\0ame".into(), "va\0lue".into());
        let json: serde_json::Value = serde_json::from_str(&pg_headers(&headers)).expect("JSON");
        assert_eq!(json["n\\0ame"], "va\\0lue");
        assert_eq!(json["plain"], "value");
        assert!(!pg_headers(&headers).contains("\\u0000"));
    }
}
