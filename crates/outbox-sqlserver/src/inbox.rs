//! [`MssqlInbox`]: the consumer's dedup records, claimed inside the consumer's
//! transaction, and the optional inbox capabilities.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::inbox::{
    ConsumerDeadLetter, ConsumerDeadLetters, DurableInbox, FailureCount, InboxClaim,
    InboxCompletion, InboxOutcome, StoredMessage, VersionTracking, lock_order,
};
use outboxkit_core::wire::{IncomingMessage, TraceParent};
use outboxkit_core::{CompleteReport, ErrorKind, Headers, InboxStore, OutboxError};
use tiberius::Row;
use uuid::Uuid;

use crate::connection::{MssqlClient, MssqlPool, MssqlTransaction};
use crate::error::db;
use crate::sql::{InboxQueries, Queries, millis};
use crate::store::{opt, req, row_id, time};

/// Inbox records in `{schema}.inbox_records` (created by the same migrations as the
/// outbox), plus version tracking, consumer dead letters and the durable inbox. Cheap to
/// clone.
///
/// [`try_claim`](InboxStore::try_claim) inserts the record on the caller's transaction,
/// so it commits with the handler's effects or not at all, taking only the lock of its
/// own key (no `HOLDLOCK`, whose key-range locks, held for the whole handler, would make
/// concurrent handlers of new messages wait for one another). A concurrent claim of the
/// same `(message_id, consumer)` waits on the first transaction's lock of that key, then
/// finds the row (a duplicate key, caught in the statement: `false`) or, if the first
/// rolled back, inserts it: at most one of them returns `true` and commits.
/// [`applied_version`](VersionTracking::applied_version) creates and locks the version
/// record the same way.
///
/// Per message and handler the idempotent consumer sends, on the one pooled connection
/// of its transaction: the begin, one batch that checks for a consumer dead letter and
/// claims ([`claim_unless_dead`](ConsumerDeadLetters::claim_unless_dead); the batched
/// consumer claims a whole batch in one round trip), the handler's own statements, and
/// one commit batch that commits only a transaction the handler's statements left
/// committable ([`commit`](InboxStore::commit)). It never borrows a second connection
/// while it holds one: deliveries beyond the pool's size wait for a connection to
/// begin, not holders for one another. See `docs/sqlserver.md`.
#[derive(Debug, Clone)]
pub struct MssqlInbox {
    pool: MssqlPool,
    q: Arc<Queries>,
    iq: Arc<InboxQueries>,
}

impl MssqlInbox {
    /// `schema` validated already.
    pub(crate) fn with_queries(pool: MssqlPool, schema: &str) -> Self {
        Self {
            pool,
            q: Arc::new(Queries::new(schema)),
            iq: Arc::new(InboxQueries::new(schema)),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &MssqlPool {
        &self.pool
    }
}

fn limit(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The longest consumer name, in UTF-16 code units: the `consumer` columns are
/// `nvarchar(255)`.
const MAX_CONSUMER_LEN: usize = 255;

/// A consumer name the tables can hold: not empty, at most [`MAX_CONSUMER_LEN`] UTF-16
/// code units (a longer one would fail every claim with a truncation error).
fn valid_consumer(consumer: &str) -> Result<(), OutboxError> {
    if consumer.is_empty() {
        return Err(OutboxError::Config(
            "consumer name must not be empty".into(),
        ));
    }
    let len = consumer.encode_utf16().count();
    if len > MAX_CONSUMER_LEN {
        return Err(OutboxError::Config(format!(
            "consumer name is {len} UTF-16 code units long; SQL Server's inbox tables hold at most {MAX_CONSUMER_LEN}"
        )));
    }
    Ok(())
}

#[async_trait]
impl InboxStore for MssqlInbox {
    type Connection = MssqlClient;
    type Transaction = MssqlTransaction;

    /// Begins the transaction with `IMPLICIT_TRANSACTIONS ON` and keeps its id in the
    /// session context, in one plain batch: under `XACT_ABORT ON` a handler's failed
    /// statement rolls the transaction back at once, and a statement the handler sends
    /// after catching that error then begins a transaction of its own instead of
    /// committing on its own; [`commit`](Self::commit) rolls it back.
    async fn begin(&self) -> Result<MssqlTransaction, OutboxError> {
        self.pool.begin_with("inbox_begin", &self.iq.begin).await
    }

    /// Commits only the transaction [`begin`](Self::begin) began, while it can still
    /// commit, in one batch that reads `XACT_STATE()` and the transaction's id first
    /// (see [`MssqlTransaction::commit`]): a transaction a handler's failed statement
    /// aborted (rolled back at once under `XACT_ABORT ON`, or doomed) is
    /// [`OutboxError::TransactionAborted`], never a commit, and a transaction that
    /// statements sent after the abort began is rolled back with them. The batch turns
    /// `IMPLICIT_TRANSACTIONS` off again.
    async fn commit(&self, tx: MssqlTransaction) -> Result<(), OutboxError> {
        tx.commit_with(&self.iq.commit, "inbox_commit").await
    }

    /// Rolls back whatever transaction is open and turns `IMPLICIT_TRANSACTIONS` off
    /// again.
    async fn rollback(&self, tx: MssqlTransaction) -> Result<(), OutboxError> {
        tx.rollback_with(&self.iq.rollback, "inbox_rollback").await
    }

    async fn try_claim(
        &self,
        conn: &mut MssqlClient,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<bool, OutboxError> {
        valid_consumer(consumer)?;
        // Read from the statement's `claimed` row, not the DONE token: the caller's
        // session may run with SET NOCOUNT ON, which would make every claim look like a
        // duplicate.
        let row = conn
            .query(&*self.q.inbox_claim, &[&message_id, &consumer])
            .await
            .map_err(db("inbox_claim"))?
            .into_results()
            .await
            .map_err(db("inbox_claim"))?
            .into_iter()
            .flatten()
            .next();
        let claimed = match row {
            Some(row) => row
                .try_get::<i32, _>("claimed")
                .map_err(db("inbox_claim"))?,
            None => None,
        };
        Ok(claimed == Some(1))
    }

    /// A tiberius error's kind, by its server error number (the crate's classification:
    /// deadlocks and lock timeouts `Transient`, a lost connection `Unavailable`, the
    /// statement's data refused `InvalidData`, the rest `Permanent`), and a pool or
    /// connect error's kind ([`ConnectError::kind`](crate::ConnectError::kind)).
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        if let Some(e) = error.downcast_ref::<tiberius::error::Error>() {
            return Some(crate::error::classify(e));
        }
        error
            .downcast_ref::<crate::ConnectError>()
            .map(crate::ConnectError::kind)
    }

    async fn purge(&self, older_than: Duration, batch_size: usize) -> Result<u64, OutboxError> {
        self.pool
            .affected(
                "inbox_purge",
                &self.q.inbox_purge,
                &[&millis(older_than), &limit(batch_size)],
            )
            .await
    }
}

#[async_trait]
impl VersionTracking for MssqlInbox {
    async fn applied_version(
        &self,
        conn: &mut MssqlClient,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Option<i64>, OutboxError> {
        valid_consumer(consumer)?;
        let results = conn
            .query(
                &*self.iq.version_get,
                &[&consumer, &aggregate_type, &aggregate_id],
            )
            .await
            .map_err(db("inbox_version"))?
            .into_results()
            .await
            .map_err(db("inbox_version"))?;
        let row = results.into_iter().flatten().next();
        match row {
            Some(row) => row.try_get::<i64, _>(0).map_err(db("inbox_version")),
            None => Ok(None),
        }
    }

    /// Raises the stored version, only inside a transaction that can still commit
    /// (`XACT_STATE() = 1`) and, within an inbox transaction, only while that is still
    /// the one [`begin`](InboxStore::begin) began: it runs after the handler, and after
    /// a handler's failed statement `XACT_ABORT ON` has already rolled the transaction
    /// back, so the update would commit without the message's effect, with a
    /// transaction a later statement began (or on its own), and the redelivered message
    /// would then be skipped as stale. That is [`OutboxError::TransactionAborted`]
    /// instead; so is a call outside any transaction.
    async fn record_version(
        &self,
        conn: &mut MssqlClient,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<(), OutboxError> {
        valid_consumer(consumer)?;
        let state = conn
            .query(
                &*self.iq.version_set,
                &[&consumer, &aggregate_type, &aggregate_id, &version],
            )
            .await
            .map_err(db("inbox_version"))?
            .into_row()
            .await
            .map_err(db("inbox_version"))?
            .map(|row| row.try_get::<i32, _>("state"))
            .transpose()
            .map_err(db("inbox_version"))?
            .flatten();
        if state == Some(1) {
            Ok(())
        } else {
            Err(OutboxError::TransactionAborted {
                operation: "inbox_version",
            })
        }
    }
}

/// The `claimed` / `dead` columns of a claim row as an [`InboxClaim`].
fn inbox_claim(row: &Row, operation: &'static str) -> Result<InboxClaim, OutboxError> {
    let claimed = row.try_get::<i32, _>("claimed").map_err(db(operation))?;
    let dead = row.try_get::<i32, _>("dead").map_err(db(operation))?;
    Ok(match (claimed, dead) {
        (Some(1), _) => InboxClaim::Claimed,
        (_, Some(1)) => InboxClaim::DeadLetter,
        _ => InboxClaim::Duplicate,
    })
}

/// The distinct pairs of `pairs`, in `order` (their lock order), as the JSON array the
/// batch claim reads: `[{"id": ..., "consumer": ...}, ...]`, array index = position in
/// `order`.
fn pairs_json(pairs: &[(Uuid, &str)], order: &[usize]) -> String {
    serde_json::Value::Array(
        order
            .iter()
            .map(|&i| serde_json::json!({ "id": pairs[i].0, "consumer": pairs[i].1 }))
            .collect(),
    )
    .to_string()
}

/// One [`InboxClaim`] per pair of `pairs` from the batch claim's rows (`found`: the
/// array index into `order`, and what the claim of that pair found). A pair repeated in
/// `pairs` is a duplicate of its first occurrence, or a dead letter with it.
///
/// # Errors
/// [`OutboxError::Decode`] when a pair got no row.
fn spread_claims(
    pairs: &[(Uuid, &str)],
    order: &[usize],
    found: &[(usize, InboxClaim)],
) -> Result<Vec<InboxClaim>, OutboxError> {
    let mut claims = vec![InboxClaim::Duplicate; pairs.len()];
    let mut seen = vec![false; order.len()];
    for &(ord, claim) in found {
        let Some(&i) = order.get(ord) else { continue };
        seen[ord] = true;
        claims[i] = claim;
        if claim == InboxClaim::DeadLetter {
            for (slot, pair) in claims.iter_mut().zip(pairs) {
                if *pair == pairs[i] {
                    *slot = InboxClaim::DeadLetter;
                }
            }
        }
    }
    if let Some(missing) = seen.iter().position(|seen| !seen) {
        return Err(OutboxError::Decode {
            id: pairs[order[missing]].0.to_string(),
            reason: "the batch claim returned no row for this pair".into(),
        });
    }
    Ok(claims)
}

#[async_trait]
impl ConsumerDeadLetters for MssqlInbox {
    /// One statement on `conn`: the dead-letter check and the claim together, so the
    /// consumer never borrows a second pooled connection while its transaction holds
    /// one (the default's [`is_dead`](ConsumerDeadLetters::is_dead) on the pool
    /// waited, with every connection held by consumer transactions, until the acquire
    /// timeout, and every delivery was deferred). Locks as
    /// [`try_claim`](InboxStore::try_claim) does: its own key only.
    async fn claim_unless_dead(
        &self,
        conn: &mut MssqlClient,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError> {
        valid_consumer(consumer)?;
        let row = conn
            .query(&*self.iq.claim_unless_dead, &[&message_id, &consumer])
            .await
            .map_err(db("inbox_claim"))?
            .into_row()
            .await
            .map_err(db("inbox_claim"))?
            .ok_or_else(|| OutboxError::Decode {
                id: message_id.to_string(),
                reason: "the claim returned no row".into(),
            })?;
        inbox_claim(&row, "inbox_claim")
    }

    /// One round trip on `conn` for the whole batch: the pairs are claimed one by one
    /// in [`lock_order`] inside one T-SQL batch, each as
    /// [`claim_unless_dead`](ConsumerDeadLetters::claim_unless_dead) does.
    async fn claim_batch_unless_dead(
        &self,
        conn: &mut MssqlClient,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<InboxClaim>, OutboxError> {
        for (_, consumer) in pairs {
            valid_consumer(consumer)?;
        }
        let order = lock_order(pairs);
        if order.is_empty() {
            return Ok(Vec::new());
        }
        let rows = conn
            .query(
                &*self.iq.claim_batch_unless_dead,
                &[&pairs_json(pairs, &order).as_str()],
            )
            .await
            .map_err(db("inbox_claim_batch"))?
            .into_results()
            .await
            .map_err(db("inbox_claim_batch"))?;
        let mut found = Vec::with_capacity(order.len());
        for row in rows.iter().flatten() {
            let ord = row
                .try_get::<i32, _>("ord")
                .map_err(db("inbox_claim_batch"))?
                .and_then(|ord| usize::try_from(ord).ok());
            if let Some(ord) = ord {
                found.push((ord, inbox_claim(row, "inbox_claim_batch")?));
            }
        }
        spread_claims(pairs, &order, &found)
    }

    async fn record_failure(
        &self,
        msg: &IncomingMessage,
        consumer: &str,
        error: &str,
        max_attempts: u32,
    ) -> Result<FailureCount, OutboxError> {
        valid_consumer(consumer)?;
        let headers = serde_json::to_string(&msg.headers).unwrap_or_else(|_| "{}".into());
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let rows = self
            .pool
            .rows(
                "inbox_failure",
                &self.iq.failure,
                &[
                    &msg.id,
                    &consumer,
                    &msg.event_type.as_str(),
                    &error,
                    &max,
                    &msg.payload.as_slice(),
                    &headers.as_str(),
                ],
            )
            .await?;
        let row = rows.first().ok_or_else(|| OutboxError::Decode {
            id: msg.id.to_string(),
            reason: "the failure upsert returned no row".into(),
        })?;
        let attempts: i32 = row
            .try_get(0)
            .map_err(db("inbox_failure"))?
            .unwrap_or_default();
        let dead: bool = row
            .try_get(1)
            .map_err(db("inbox_failure"))?
            .unwrap_or_default();
        Ok(FailureCount {
            attempts: u32::try_from(attempts).unwrap_or(0),
            dead,
        })
    }

    async fn is_dead(&self, message_id: Uuid, consumer: &str) -> Result<bool, OutboxError> {
        let rows = self
            .pool
            .rows("inbox_is_dead", &self.iq.is_dead, &[&message_id, &consumer])
            .await?;
        Ok(rows
            .first()
            .map(|r| r.try_get::<bool, _>(0))
            .transpose()
            .map_err(db("inbox_is_dead"))?
            .flatten()
            .unwrap_or(false))
    }

    async fn consumer_dead_letters(
        &self,
        consumer: Option<&str>,
        limit_rows: usize,
    ) -> Result<Vec<ConsumerDeadLetter>, OutboxError> {
        let rows = self
            .pool
            .rows(
                "inbox_dead_letters",
                &self.iq.dead_letters,
                &[&consumer, &limit(limit_rows)],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let message_id: Uuid = req(row, "message_id", "?")?;
                let sid = message_id.to_string();
                let s = sid.as_str();
                let attempts: i32 = req(row, "attempts", s)?;
                Ok(ConsumerDeadLetter {
                    message_id,
                    consumer: req::<&str>(row, "consumer", s)?.to_owned(),
                    event_type: req::<&str>(row, "event_type", s)?.to_owned(),
                    last_error: req::<&str>(row, "last_error", s)?.to_owned(),
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    dead_at: time(row, "dead_at", s)?.ok_or_else(|| OutboxError::Decode {
                        id: sid.clone(),
                        reason: "dead_at is NULL".into(),
                    })?,
                    payload: row
                        .try_get::<&[u8], _>(6)
                        .map_err(db("inbox_dead_letters"))?
                        .unwrap_or_default()
                        .to_vec(),
                })
            })
            .collect()
    }
}

fn decode_stored(row: &Row) -> Result<(i64, StoredMessage), OutboxError> {
    let id = row_id(row)?;
    let sid = id.to_string();
    let s = sid.as_str();
    let text = |col: &str| -> Result<Option<String>, OutboxError> {
        Ok(opt::<&str>(row, col, s)?.map(str::to_owned))
    };
    let mut msg = IncomingMessage::new(
        id,
        req::<&str>(row, "event_type", s)?,
        req::<&[u8]>(row, "payload", s)?.to_vec(),
    );
    msg.source = text("source")?;
    msg.aggregate_type = text("aggregate_type")?;
    msg.aggregate_id = text("aggregate_id")?;
    msg.aggregate_version = opt(row, "aggregate_version", s)?;
    msg.tenant_id = text("tenant_id")?;
    msg.partition_key = text("partition_key")?;
    msg.correlation_id = text("correlation_id")?;
    msg.causation_id = text("causation_id")?;
    msg.occurred_at = time(row, "occurred_at", s)?;
    msg.traceparent = text("traceparent")?.as_deref().and_then(TraceParent::parse);
    msg.tracestate = text("tracestate")?;
    msg.headers =
        serde_json::from_str::<Headers>(req::<&str>(row, "headers", s)?).map_err(|e| {
            OutboxError::Decode {
                id: sid.clone(),
                reason: format!("headers: {e}"),
            }
        })?;
    let attempts: i32 = req(row, "attempts", s)?;
    msg.redelivered = attempts > 1;
    msg.delivery_count = u64::try_from(attempts).ok();
    let age_ms: i64 = opt(row, "age_ms", s)?.unwrap_or(0);
    let received_at = time(row, "received_at", s)?.ok_or_else(|| OutboxError::Decode {
        id: sid.clone(),
        reason: "received_at is NULL".into(),
    })?;
    Ok((
        req(row, "seq", s)?,
        StoredMessage::new(
            msg,
            attempts,
            req(row, "claim_token", s)?,
            received_at,
            Duration::from_millis(u64::try_from(age_ms).unwrap_or(0)),
        ),
    ))
}

#[async_trait]
impl DurableInbox for MssqlInbox {
    async fn store(&self, msg: &IncomingMessage) -> Result<bool, OutboxError> {
        let headers = serde_json::to_string(&msg.headers).unwrap_or_else(|_| "{}".into());
        let occurred = msg.occurred_at.map(|t| t.naive_utc());
        let traceparent = msg.traceparent.map(|t| t.to_string());
        // `OUTPUT inserted.id` yields a row only when the message was new.
        let inserted = self
            .pool
            .rows(
                "inbox_store",
                &self.iq.store,
                &[
                    &msg.id,
                    &msg.event_type.as_str(),
                    &msg.source.as_deref(),
                    &msg.aggregate_type.as_deref(),
                    &msg.aggregate_id.as_deref(),
                    &msg.aggregate_version,
                    &msg.tenant_id.as_deref(),
                    &msg.partition_key.as_deref(),
                    &msg.correlation_id.as_deref(),
                    &msg.causation_id.as_deref(),
                    &occurred,
                    &traceparent.as_deref(),
                    &msg.tracestate.as_deref(),
                    &headers.as_str(),
                    &msg.payload.as_slice(),
                ],
            )
            .await?;
        Ok(inserted.len() == 1)
    }

    async fn claim(
        &self,
        batch_size: usize,
        lease: Duration,
    ) -> Result<Vec<StoredMessage>, OutboxError> {
        let rows = self
            .pool
            .rows(
                "inbox_claim_stored",
                &self.iq.claim,
                &[&limit(batch_size), &millis(lease), &Uuid::new_v4()],
            )
            .await?;
        let mut out = rows
            .iter()
            .map(decode_stored)
            .collect::<Result<Vec<_>, OutboxError>>()?;
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
        let batch: Vec<serde_json::Value> = completions
            .iter()
            .map(|c| {
                let (kind, delay, error): (i16, i64, Option<&str>) = match &c.outcome {
                    InboxOutcome::Done => (1, 0, None),
                    InboxOutcome::Retry { delay, error } => (0, millis(*delay), Some(error)),
                    InboxOutcome::Dead { error } => (3, 0, Some(error)),
                    InboxOutcome::Defer { delay } => (10, millis(*delay), None),
                };
                serde_json::json!({
                    "id": c.id,
                    "token": c.claim_token,
                    "kind": kind,
                    "delay_ms": delay,
                    "error": error,
                })
            })
            .collect();
        let batch = serde_json::Value::Array(batch).to_string();
        let rows = self
            .pool
            .rows("inbox_complete", &self.iq.complete, &[&batch])
            .await?;
        let applied: HashSet<Uuid> = rows
            .iter()
            .map(row_id)
            .collect::<Result<_, OutboxError>>()?;
        Ok(CompleteReport {
            applied: applied.len() as u64,
            fenced: completions
                .iter()
                .map(|c| c.id)
                .filter(|id| !applied.contains(id))
                .collect(),
        })
    }

    async fn purge_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        self.pool
            .affected(
                "inbox_purge_processed",
                &self.iq.purge_processed,
                &[&millis(older_than), &limit(batch_size)],
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An inbox over a pool that never connects (nothing here talks to a server; bb8
    /// needs a tokio runtime to build one).
    fn offline_inbox() -> MssqlInbox {
        let manager =
            crate::MssqlConnectionManager::new(tiberius::Config::new(), Duration::from_secs(1));
        let pool = MssqlPool::from_bb8(
            bb8::Pool::builder().build_unchecked(manager),
            Duration::from_secs(1),
        );
        MssqlInbox::with_queries(pool, crate::DEFAULT_SCHEMA)
    }

    #[tokio::test]
    async fn classify_knows_tiberius_and_pool_errors_only() {
        let inbox = offline_inbox();
        let reset = tiberius::error::Error::Io {
            kind: std::io::ErrorKind::ConnectionReset,
            message: "reset".into(),
        };
        assert_eq!(inbox.classify(&reset), Some(ErrorKind::Unavailable));
        let protocol = tiberius::error::Error::Protocol("bad token".into());
        assert_eq!(inbox.classify(&protocol), Some(ErrorKind::Permanent));
        let starved = crate::ConnectError::PoolTimeout(Duration::from_secs(10));
        assert_eq!(inbox.classify(&starved), Some(ErrorKind::Unavailable));
        // Not this driver's: the caller goes on down the source chain.
        let other = std::io::Error::other("a handler's own error");
        assert_eq!(inbox.classify(&other), None);
        let wrapped = OutboxError::Database {
            kind: ErrorKind::Transient,
            operation: "x",
            source: Box::new(reset),
        };
        assert_eq!(
            inbox.classify(&wrapped),
            None,
            "looks at this one error only"
        );
    }

    #[test]
    fn a_batch_is_sent_in_lock_order_and_answered_per_pair() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let pairs = [(b, "x"), (a, "y"), (b, "x"), (a, "x"), (b, "w")];
        let order = lock_order(&pairs);
        assert_eq!(
            order,
            [3, 1, 4, 0],
            "sorted by (message id, consumer), once each"
        );
        let json: serde_json::Value =
            serde_json::from_str(&pairs_json(&pairs, &order)).expect("JSON");
        assert_eq!(
            json,
            serde_json::json!([
                { "id": a, "consumer": "x" },
                { "id": a, "consumer": "y" },
                { "id": b, "consumer": "w" },
                { "id": b, "consumer": "x" },
            ])
        );
        // Rows come back by array index, in any order.
        let found = [
            (3, InboxClaim::DeadLetter),
            (0, InboxClaim::Claimed),
            (2, InboxClaim::Duplicate),
            (1, InboxClaim::Claimed),
        ];
        assert_eq!(
            spread_claims(&pairs, &order, &found).expect("every pair answered"),
            [
                InboxClaim::DeadLetter,
                InboxClaim::Claimed,
                InboxClaim::DeadLetter, // the repeat of a dead letter is one too
                InboxClaim::Claimed,
                InboxClaim::Duplicate,
            ]
        );
        // A repeat of a claimed pair is a duplicate of it.
        let found = [
            (3, InboxClaim::Claimed),
            (0, InboxClaim::Claimed),
            (2, InboxClaim::Claimed),
            (1, InboxClaim::Claimed),
        ];
        let claims = spread_claims(&pairs, &order, &found).expect("answered");
        assert_eq!(claims[0], InboxClaim::Claimed);
        assert_eq!(claims[2], InboxClaim::Duplicate);
        // A pair without an answer is an error, never a silent duplicate (which would
        // be acked unprocessed).
        assert!(matches!(
            spread_claims(&pairs, &order, &found[..3]),
            Err(OutboxError::Decode { .. })
        ));
    }

    #[test]
    fn consumer_names_fit_the_tables() {
        assert!(valid_consumer("projector").is_ok());
        assert!(valid_consumer(&"c".repeat(MAX_CONSUMER_LEN)).is_ok());
        // 255 characters of two UTF-8 bytes each: 510 bytes, still 255 code units.
        assert!(valid_consumer(&"é".repeat(MAX_CONSUMER_LEN)).is_ok());
        for bad in [String::new(), "c".repeat(MAX_CONSUMER_LEN + 1)] {
            assert!(
                matches!(valid_consumer(&bad), Err(OutboxError::Config(_))),
                "{} characters",
                bad.len()
            );
        }
        // An astral character is two UTF-16 code units.
        assert!(valid_consumer(&"𝄞".repeat(128)).is_err());
    }
}
