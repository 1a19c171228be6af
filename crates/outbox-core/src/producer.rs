//! [`OutboxProducer`]: how an application writes messages into an outbox, inside its own
//! transaction. Every store implements it, with its own connection type:
//!
//! | store | [`Connection`](OutboxProducer::Connection) | a transaction |
//! |---|---|---|
//! | `outboxkit_postgres::PgOutbox` | `sqlx::PgConnection` | `outbox.begin()` or `pool.begin()` (`&mut tx`) |
//! | `outboxkit_mysql::MySqlOutbox` | `sqlx::MySqlConnection` | `outbox.begin()` or `pool.begin()` (`&mut tx`) |
//! | `outboxkit_sqlserver::MssqlOutbox` | `outboxkit_sqlserver::MssqlClient` | `outbox.begin()` (`&mut tx`), or `BEGIN TRAN` on a client of yours |
//! | `outboxkit_memory::MemoryOutbox` | `outboxkit_memory::MemoryOutboxTransaction` | `outbox.begin()` (`&mut tx`) |
//!
//! Code that only writes events can be written once for every store, against
//! `P: OutboxProducer` and a `&mut P::Connection`; beginning and committing the
//! transaction stays with the caller, who owns the business rows too.

use async_trait::async_trait;
use uuid::Uuid;

use crate::domain::EventSource;
use crate::error::OutboxError;
use crate::message::NewMessage;

/// Writes messages into an outbox on the caller's connection, inside the caller's
/// transaction.
///
/// # Contract
/// - The messages written by [`enqueue`](Self::enqueue) and
///   [`enqueue_batch`](Self::enqueue_batch) become visible to the relay (its
///   [`OutboxStore::claim`](crate::OutboxStore::claim)) exactly when the caller's
///   transaction commits, and not at all if it rolls back (or is dropped without a
///   commit). Implementations MUST NOT commit, open or end a transaction themselves.
/// - A message whose payload is longer than the store's payload limit MUST be refused
///   with [`OutboxError::InvalidMessage`]
///   ([`InvalidMessage::PayloadTooLarge`](crate::InvalidMessage::PayloadTooLarge))
///   before anything is written: the whole batch is refused and the transaction is left
///   untouched.
/// - A batch keeps its order: its messages get rising `seq` values in slice order, so
///   the relay claims them in that order.
/// - An id already stored (or repeated in the batch) is refused (a primary key
///   violation, [`OutboxError::Database`]) at the latest when the transaction commits;
///   SQL stores refuse it at the insert and leave the caller's transaction aborted, to
///   be rolled back.
/// - Stores SHOULD write a batch in one statement (or as few as the database allows).
#[async_trait]
pub trait OutboxProducer: Send + Sync {
    /// The caller's connection, inside the caller's transaction: `PgConnection` for
    /// PostgreSQL (pass `&mut tx` for a `sqlx::Transaction`), `MySqlConnection`, the SQL
    /// Server client, `MemoryOutboxTransaction` for the in-memory store.
    type Connection: ?Sized + Send;

    /// Writes one message on `conn`. Returns its id.
    ///
    /// # Errors
    /// As [`enqueue_batch`](Self::enqueue_batch).
    async fn enqueue(
        &self,
        conn: &mut Self::Connection,
        message: &NewMessage,
    ) -> Result<Uuid, OutboxError> {
        self.enqueue_batch(conn, std::slice::from_ref(message))
            .await?;
        Ok(message.id)
    }

    /// Writes `messages` on `conn`, in order (see the trait's contract). Returns their
    /// ids, in the same order. An empty slice writes nothing.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] when a payload is over the store's limit (nothing
    /// is written, the transaction is untouched); [`OutboxError::Database`] when the
    /// write fails (roll the transaction back: part of the batch may be written in it).
    async fn enqueue_batch(
        &self,
        conn: &mut Self::Connection,
        messages: &[NewMessage],
    ) -> Result<Vec<Uuid>, OutboxError>;

    /// Drains the aggregate's pending [`DomainEvents`](crate::DomainEvents) into the
    /// outbox on `conn` with [`enqueue_batch`](Self::enqueue_batch). On failure the
    /// events are put back, so the caller can retry the unit of work; on success they
    /// are gone from the aggregate and cannot be written twice.
    ///
    /// # Errors
    /// As [`enqueue_batch`](Self::enqueue_batch).
    async fn save_events<A>(
        &self,
        conn: &mut Self::Connection,
        aggregate: &mut A,
    ) -> Result<Vec<Uuid>, OutboxError>
    where
        A: EventSource + Send + ?Sized,
    {
        let events = aggregate.domain_events().take();
        match self.enqueue_batch(conn, &events).await {
            Ok(ids) => Ok(ids),
            Err(e) => {
                aggregate.domain_events().restore(events);
                Err(e)
            }
        }
    }
}
