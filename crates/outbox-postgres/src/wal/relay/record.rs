//! What the relay writes to the outbox table: outcomes (`Sent` or deleted, `Dead`),
//! the rows a new session skips, the crash-loop guard's count.

use std::time::Duration;

use outbox_core::{EventPublisher, OutboxMessage, SentRetention};
use sqlx::AssertSqlSafe;
use std::sync::atomic::Ordering;
use tokio_util::sync::CancellationToken;
use tracing::warn;
use uuid::Uuid;

use super::WalRelay;
use crate::error::db;
use crate::sql::quoted_schema;
use crate::wal::WalError;

/// How long [`WalRelay::record`] retries an unavailable database while holding the
/// replication session.
const RECORD_HOLD: Duration = Duration::from_secs(3);

impl<P: EventPublisher> WalRelay<P> {
    /// Counts one more start whose first pending message is `id`; returns the count
    /// (0 when the row is no longer pending).
    pub(super) async fn bump_alone(&self, id: Uuid) -> Result<i64, WalError> {
        let sql = format!(
            "UPDATE {}.outbox_messages SET unfinished_alone = unfinished_alone + 1 \
             WHERE id = $1 AND status = 0 RETURNING unfinished_alone::bigint",
            quoted_schema(self.outbox.schema())
        );
        let n: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.outbox.pool())
            .await
            .map_err(db("wal crash-loop guard"))?;
        Ok(n.unwrap_or(0))
    }

    pub(super) async fn reset_alone(&self, id: Uuid) -> Result<(), WalError> {
        let sql = format!(
            "UPDATE {}.outbox_messages SET unfinished_alone = 0 \
             WHERE id = $1 AND status = 0 AND unfinished_alone <> 0",
            quoted_schema(self.outbox.schema())
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(id)
            .execute(self.outbox.pool())
            .await
            .map_err(db("wal crash-loop guard"))?;
        Ok(())
    }

    /// The ids of `messages` whose rows are still `New` in the table.
    pub(super) async fn still_pending(
        &self,
        messages: &[OutboxMessage],
    ) -> Result<std::collections::HashSet<Uuid>, WalError> {
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
        let sql = format!(
            "SELECT id FROM {}.outbox_messages WHERE id = ANY($1) AND status = 0",
            quoted_schema(self.outbox.schema())
        );
        let pending: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(ids)
            .fetch_all(self.outbox.pool())
            .await
            .map_err(db("wal pending"))?;
        Ok(pending.into_iter().collect())
    }

    /// Records published messages (`Sent`, or deleted) and dead ones, retrying a
    /// database that is unavailable for up to [`RECORD_HOLD`]; then the error ends the
    /// replication session (the next one replays from the confirmed position and skips
    /// what was recorded). `Ok(false)`: shutdown came first.
    ///
    /// Why not retry for as long as it takes: a PostgreSQL shutting down (`pg_ctl stop
    /// -m fast`, a restart) refuses new connections and then waits for every walsender
    /// to see its client confirm the last WAL it sent. A relay that held its replication
    /// session open while waiting to record would never confirm, and the server would
    /// never finish stopping (found by `cargo xtask chaos -- --source wal`).
    pub(super) async fn record(
        &self,
        sent: &[Uuid],
        dead: &[(Uuid, String)],
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        if sent.is_empty() && dead.is_empty() {
            return Ok(true);
        }
        let schema = quoted_schema(self.outbox.schema());
        let mut backoff = Duration::from_millis(200);
        let started = tokio::time::Instant::now();
        loop {
            match self.record_once(&schema, sent, dead).await {
                Ok(()) => break,
                Err(e) if e.is_retryable() && started.elapsed() >= RECORD_HOLD => {
                    warn!(error = %e, "cannot record outcomes; ending the replication session (a server shutting down waits for it)");
                    return Err(e);
                }
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, "cannot record outcomes; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(false),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = outbox_core::retry::outage_backoff(backoff, Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
        self.counters
            .published
            .fetch_add(sent.len() as u64, Ordering::Relaxed);
        self.counters
            .dead
            .fetch_add(dead.len() as u64, Ordering::Relaxed);
        outbox_core::metrics::completed(sent.len(), 0, 0);
        Ok(true)
    }

    pub(super) async fn record_once(
        &self,
        schema: &str,
        sent: &[Uuid],
        dead: &[(Uuid, String)],
    ) -> Result<(), WalError> {
        if !sent.is_empty() {
            let sql = match self.outbox.sent_retention() {
                SentRetention::Delete => format!(
                    "DELETE FROM {schema}.outbox_messages WHERE id = ANY($1) AND status = 0"
                ),
                _ => format!(
                    "UPDATE {schema}.outbox_messages \
                     SET status = 1, sent_at = now(), attempts = attempts + 1, last_error = NULL \
                     WHERE id = ANY($1) AND status = 0"
                ),
            };
            sqlx::query(AssertSqlSafe(sql))
                .bind(sent)
                .execute(self.outbox.pool())
                .await
                .map_err(db("wal record sent"))?;
        }
        if !dead.is_empty() {
            let (ids, errors): (Vec<Uuid>, Vec<String>) = dead.iter().cloned().unzip();
            let sql = format!(
                "UPDATE {schema}.outbox_messages AS m \
                 SET status = 3, last_error = d.error, attempts = m.attempts + 1 \
                 FROM unnest($1::uuid[], $2::text[]) AS d(id, error) \
                 WHERE m.id = d.id AND m.status = 0"
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(ids)
                .bind(errors)
                .execute(self.outbox.pool())
                .await
                .map_err(db("wal record dead"))?;
        }
        Ok(())
    }
}
