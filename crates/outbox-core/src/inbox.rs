//! Optional inbox capabilities, next to the required [`InboxStore`]:
//!
//! - [`VersionTracking`]: the last applied `aggregate_version` per consumer and
//!   aggregate, for stale and out-of-order detection;
//! - [`ConsumerDeadLetters`]: failure counts per `(message, consumer)` and the consumer
//!   dead letters a poison message ends as;
//! - [`DurableInbox`]: received messages stored first (and acked at once), then claimed
//!   by processors with fenced leases, like the outbox.
//!
//! Each trait has batch methods for the batched consumers (one transaction for many
//! deliveries): [`InboxStore::try_claim_batch`],
//! [`ConsumerDeadLetters::claim_batch_unless_dead`],
//! [`VersionTracking::applied_versions`] / [`record_versions`](VersionTracking::record_versions)
//! and [`DurableInbox::store_batch`]. Their defaults call the per-message methods in a
//! loop (in sorted order, so that concurrent batches do not deadlock), so a backend works
//! in batch mode without them; a backend overrides them to send one statement per batch
//! (PostgreSQL does).
//!
//! The `outboxkit-inbox` crate drives them; backends implement them.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::OutboxError;
use crate::store::{CompleteReport, InboxStore};
use crate::wire::IncomingMessage;

/// The order in which batch methods take their locks: the indices of `items` sorted by
/// value, each distinct value once (its first occurrence). E.g. `[3, 1, 3, 2, 1]` →
/// `[1, 3, 0]`. Every default batch method of the inbox traits follows it, and backends
/// overriding them should too, so that two transactions locking overlapping batches
/// wait for each other instead of deadlocking.
pub fn lock_order<T: Ord>(items: &[T]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    // Stable: equal values keep their order, so the first occurrence comes first.
    order.sort_by(|&a, &b| items[a].cmp(&items[b]));
    order.dedup_by(|b, a| items[*a] == items[*b]);
    order
}

/// One aggregate as one consumer's version tracking keys it: the row
/// [`VersionTracking::applied_versions`] locks. Ordered field by field (consumer, then
/// aggregate type, then id): the order in which a batch locks its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VersionKey<'a> {
    /// Consumer (handler) name.
    pub consumer: &'a str,
    /// Aggregate type.
    pub aggregate_type: &'a str,
    /// Aggregate id.
    pub aggregate_id: &'a str,
}

/// Last applied aggregate version per `(consumer, aggregate_type, aggregate_id)`.
#[async_trait]
pub trait VersionTracking: InboxStore {
    /// The last version `consumer` applied for the aggregate, locking that record on
    /// `conn` until the transaction ends (so two messages of one aggregate are ordered).
    /// `None` when the consumer has applied nothing of it yet.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn applied_version(
        &self,
        conn: &mut Self::Connection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Option<i64>, OutboxError>;

    /// Records `version` as applied (only ever raises the stored version).
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn record_version(
        &self,
        conn: &mut Self::Connection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<(), OutboxError>;

    /// [`applied_version`](Self::applied_version) for many keys on one transaction: one
    /// result per key, in order (a key repeated in `keys` gets the same result each
    /// time). Every key's record is created if missing and locked until the transaction
    /// ends. Stores MUST lock the records in a deterministic order (the default: sorted
    /// by [`VersionKey`]'s order), so that two batches sharing aggregates wait for each
    /// other instead of deadlocking, and SHOULD do it in one statement (PostgreSQL does).
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn applied_versions(
        &self,
        conn: &mut Self::Connection,
        keys: &[VersionKey<'_>],
    ) -> Result<Vec<Option<i64>>, OutboxError> {
        let mut versions = vec![None; keys.len()];
        for i in lock_order(keys) {
            let key = keys[i];
            let applied = self
                .applied_version(conn, key.consumer, key.aggregate_type, key.aggregate_id)
                .await?;
            for (slot, other) in versions.iter_mut().zip(keys) {
                if *other == key {
                    *slot = applied;
                }
            }
        }
        Ok(versions)
    }

    /// [`record_version`](Self::record_version) for many keys on one transaction (whose
    /// records [`applied_versions`](Self::applied_versions) locked): each stored version
    /// is raised to the largest version given for its key, never lowered. Stores SHOULD
    /// do it in one statement (PostgreSQL does); the default records them one by one.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn record_versions(
        &self,
        conn: &mut Self::Connection,
        versions: &[(VersionKey<'_>, i64)],
    ) -> Result<(), OutboxError> {
        for (key, version) in versions {
            self.record_version(
                conn,
                key.consumer,
                key.aggregate_type,
                key.aggregate_id,
                *version,
            )
            .await?;
        }
        Ok(())
    }
}

/// What a failure left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureCount {
    /// Failures of this `(message, consumer)` so far, this one included.
    pub attempts: u32,
    /// Whether the message is now a consumer dead letter.
    pub dead: bool,
}

/// A message a consumer gave up on. Built by backends, so not `#[non_exhaustive]`.
#[derive(Debug, Clone)]
pub struct ConsumerDeadLetter {
    /// Message id.
    pub message_id: Uuid,
    /// Consumer (handler) name.
    pub consumer: String,
    /// Event type.
    pub event_type: String,
    /// The last error.
    pub last_error: String,
    /// Failures counted.
    pub attempts: u32,
    /// When it was declared dead (database clock).
    pub dead_at: DateTime<Utc>,
    /// The payload as received.
    pub payload: Vec<u8>,
}

/// What claiming `(message_id, consumer)` inside the consumer's transaction found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxClaim {
    /// First time: recorded on the transaction; run the handler.
    Claimed,
    /// Already recorded (a redelivery or a duplicate): skip, nothing was written.
    Duplicate,
    /// A consumer dead letter of this consumer: skip, nothing was written (a replay
    /// clears the dead letter first).
    DeadLetter,
}

/// Failure counting and consumer dead letters.
#[async_trait]
pub trait ConsumerDeadLetters: InboxStore {
    /// Claims `(message_id, consumer)` on `conn` as [`InboxStore::try_claim`] does,
    /// unless the message is a consumer dead letter of `consumer`. Stores SHOULD do both
    /// in one statement on `conn` (PostgreSQL does): this is the idempotent consumer's
    /// only inbox statement per message and handler. The default asks
    /// [`is_dead`](Self::is_dead) first, then claims.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn claim_unless_dead(
        &self,
        conn: &mut Self::Connection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<InboxClaim, OutboxError> {
        if self.is_dead(message_id, consumer).await? {
            return Ok(InboxClaim::DeadLetter);
        }
        Ok(if self.try_claim(conn, message_id, consumer).await? {
            InboxClaim::Claimed
        } else {
            InboxClaim::Duplicate
        })
    }

    /// [`claim_unless_dead`](Self::claim_unless_dead) for many `(message_id, consumer)`
    /// pairs on one transaction: one [`InboxClaim`] per pair, in order. A pair repeated
    /// in `pairs` is claimed at most once, by its first occurrence (the others are
    /// [`InboxClaim::Duplicate`], or [`InboxClaim::DeadLetter`] for a dead letter). As
    /// with [`InboxStore::try_claim_batch`], stores MUST take the locks in a
    /// deterministic order and SHOULD claim the whole batch in one statement
    /// (PostgreSQL does: the batched idempotent consumer's only inbox statement per
    /// batch). The default calls `claim_unless_dead` pair by pair, sorted by
    /// `(message_id, consumer)`.
    ///
    /// # Errors
    /// [`OutboxError::Database`]; nothing can be assumed claimed.
    async fn claim_batch_unless_dead(
        &self,
        conn: &mut Self::Connection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<InboxClaim>, OutboxError> {
        let mut claims = vec![InboxClaim::Duplicate; pairs.len()];
        for i in lock_order(pairs) {
            let (message_id, consumer) = pairs[i];
            let claim = self.claim_unless_dead(conn, message_id, consumer).await?;
            claims[i] = claim;
            if claim == InboxClaim::DeadLetter {
                for (slot, other) in claims.iter_mut().zip(pairs) {
                    if *other == pairs[i] {
                        *slot = InboxClaim::DeadLetter;
                    }
                }
            }
        }
        Ok(claims)
    }

    /// Counts one failure of `consumer` on `msg` in its own transaction; when the count
    /// reaches `max_attempts` the message is recorded as a consumer dead letter (with
    /// its payload, error and count). Stores MUST take any message (a text the database
    /// cannot hold, such as a NUL character in PostgreSQL, is written escaped) and MAY
    /// cut `error` as [`sanitize_error`](crate::sanitize_error) does: a failure that
    /// cannot be recorded would leave the consumer deferring the message forever.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn record_failure(
        &self,
        msg: &IncomingMessage,
        consumer: &str,
        error: &str,
        max_attempts: u32,
    ) -> Result<FailureCount, OutboxError>;

    /// Whether `(message_id, consumer)` is a consumer dead letter.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn is_dead(&self, message_id: Uuid, consumer: &str) -> Result<bool, OutboxError>;

    /// Consumer dead letters, oldest first, optionally of one consumer.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn consumer_dead_letters(
        &self,
        consumer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConsumerDeadLetter>, OutboxError>;
}

/// A stored durable-inbox message handed to a processor.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StoredMessage {
    /// The message as received.
    pub message: IncomingMessage,
    /// Claims so far, this one included.
    pub attempts: i32,
    /// Fencing token of this claim.
    pub claim_token: Uuid,
    /// When it was stored (database clock).
    pub received_at: DateTime<Utc>,
    /// How long ago it was stored, by the database clock at claim time.
    pub age: Duration,
}

impl StoredMessage {
    /// Assembles a claimed row (for backends).
    pub fn new(
        message: IncomingMessage,
        attempts: i32,
        claim_token: Uuid,
        received_at: DateTime<Utc>,
        age: Duration,
    ) -> Self {
        Self {
            message,
            attempts,
            claim_token,
            received_at,
            age,
        }
    }
}

/// What to record for a processed durable-inbox message.
#[derive(Debug, Clone, PartialEq)]
pub enum InboxOutcome {
    /// Every handler succeeded (or skipped): Processing → Done (code 1).
    Done,
    /// A handler failed: Processing → New, visible after `delay`.
    Retry {
        /// Backoff.
        delay: Duration,
        /// Stored as `last_error`.
        error: String,
    },
    /// Given up: Processing → Dead (code 3).
    Dead {
        /// Stored as `last_error`.
        error: String,
    },
    /// Not processed yet (waiting for a predecessor): Processing → New after `delay`,
    /// without charging the attempt.
    Defer {
        /// Wait before the next claim.
        delay: Duration,
    },
}

/// One durable-inbox completion.
#[derive(Debug, Clone, PartialEq)]
pub struct InboxCompletion {
    /// Message id.
    pub id: Uuid,
    /// The claim's fencing token.
    pub claim_token: Uuid,
    /// What to record.
    pub outcome: InboxOutcome,
}

/// The durable inbox: store on delivery, process later with fenced leases.
#[async_trait]
pub trait DurableInbox: InboxStore {
    /// Stores `msg` unless a message with its id is already stored. Returns whether it
    /// was new. Stores MUST take any decodable message: a text the database cannot hold
    /// (a NUL character in PostgreSQL) is stored escaped, and claimed back that way.
    ///
    /// # Errors
    /// [`OutboxError::Database`]: the delivery must then not be acked.
    async fn store(&self, msg: &IncomingMessage) -> Result<bool, OutboxError>;

    /// [`store`](Self::store) for many messages: one result per message, in order
    /// (`true`: it was new). A message id repeated in `msgs` is stored once, by its first
    /// occurrence. Stores MUST insert in a deterministic order (e.g. sorted by id), so that
    /// two receivers storing overlapping batches do not deadlock, and SHOULD store the
    /// batch in one statement (PostgreSQL does). The default stores the messages one by
    /// one, sorted by id.
    ///
    /// # Errors
    /// [`OutboxError::Database`]: none of the deliveries may then be acked. Some of them
    /// may be stored already (with the default); their redeliveries are duplicates.
    async fn store_batch(&self, msgs: &[IncomingMessage]) -> Result<Vec<bool>, OutboxError> {
        let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
        let mut new = vec![false; msgs.len()];
        for i in lock_order(&ids) {
            new[i] = self.store(&msgs[i]).await?;
        }
        Ok(new)
    }

    /// Claims up to `batch_size` stored messages (New and visible, or Processing with an
    /// expired lease), oldest first, skipping rows locked by other processors; sets a
    /// lease, a fresh claim token and `attempts + 1`.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn claim(
        &self,
        batch_size: usize,
        lease: Duration,
    ) -> Result<Vec<StoredMessage>, OutboxError>;

    /// Records outcomes in one statement, fenced by claim token.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn complete(
        &self,
        completions: &[InboxCompletion],
    ) -> Result<CompleteReport, OutboxError>;

    /// Deletes up to `batch_size` Done messages processed more than `older_than` ago.
    ///
    /// # Errors
    /// [`OutboxError::Database`].
    async fn purge_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_order_keeps_first_occurrences_in_value_order() {
        assert_eq!(lock_order(&[3, 1, 3, 2, 1]), [1, 3, 0]);
        assert!(lock_order::<u8>(&[]).is_empty());
        let a = VersionKey {
            consumer: "a",
            aggregate_type: "order",
            aggregate_id: "2",
        };
        let b = VersionKey {
            aggregate_id: "10",
            ..a
        };
        assert_eq!(lock_order(&[a, b, a]), [1, 0], "\"10\" < \"2\" as text");
    }
}
