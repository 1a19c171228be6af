//! [`MssqlInbox`]: the consumer's dedup records, claimed inside the consumer's
//! transaction, and the optional inbox capabilities.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::inbox::{
    ConsumerDeadLetter, ConsumerDeadLetters, DurableInbox, FailureCount, InboxCompletion,
    InboxOutcome, StoredMessage, VersionTracking,
};
use outbox_core::wire::{IncomingMessage, TraceParent};
use outbox_core::{CompleteReport, Headers, InboxStore, OutboxError};
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
/// record the same way. See `docs/sqlserver.md`.
#[derive(Debug, Clone)]
pub struct MssqlInbox {
    pool: MssqlPool,
    q: Arc<Queries>,
    iq: Arc<InboxQueries>,
}

impl MssqlInbox {
    /// An inbox over `pool` in `schema` (migrated by [`crate::migrate()`]).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid schema name.
    pub fn new(pool: MssqlPool, schema: &str) -> Result<Self, OutboxError> {
        crate::config::validate_schema(schema)?;
        Ok(Self {
            pool,
            q: Arc::new(Queries::new(schema)),
            iq: Arc::new(InboxQueries::new(schema)),
        })
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

    async fn begin(&self) -> Result<MssqlTransaction, OutboxError> {
        self.pool.begin().await
    }

    async fn commit(&self, tx: MssqlTransaction) -> Result<(), OutboxError> {
        tx.commit().await
    }

    async fn rollback(&self, tx: MssqlTransaction) -> Result<(), OutboxError> {
        tx.rollback().await
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

    async fn record_version(
        &self,
        conn: &mut MssqlClient,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<(), OutboxError> {
        valid_consumer(consumer)?;
        conn.execute(
            &*self.iq.version_set,
            &[&consumer, &aggregate_type, &aggregate_id, &version],
        )
        .await
        .map_err(db("inbox_version"))?;
        Ok(())
    }
}

#[async_trait]
impl ConsumerDeadLetters for MssqlInbox {
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
