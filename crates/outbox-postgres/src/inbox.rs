//! [`PgInbox`]: the consumer's dedup records, claimed inside the consumer's transaction.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{InboxStore, OutboxError};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::error::db;
use crate::sql::{Queries, sql};

/// Inbox records in `{schema}.inbox_records` (created by the same migrations as the
/// outbox). Cheap to clone.
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
}

impl PgInbox {
    /// An inbox over `pool` in `schema` (migrated by [`crate::migrate()`]).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for an invalid schema name.
    pub fn new(pool: PgPool, schema: &str) -> Result<Self, OutboxError> {
        crate::config::validate_schema(schema)?;
        Ok(Self {
            pool,
            q: Arc::new(Queries::new(schema)),
        })
    }

    /// The pool (handy for beginning the consumer's transaction).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

#[async_trait]
impl InboxStore for PgInbox {
    type Connection = PgConnection;

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
