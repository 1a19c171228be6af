//! Ordered delivery per partition key: the dispatcher's [`Ordering`] setting, the
//! [`OnDead`] policy and the [`BlockedKey`] report.
//!
//! # The guarantee of [`Ordering::PerKey`]
//! The key of a message is its `partition_key`, or, when that is `None`, its
//! `aggregate_type` and `aggregate_id` ([`OutboxMessage::order_key`]). For any key:
//! - the broker receives the key's messages in `seq` order (first receipts: a message
//!   republished after a crash may arrive again, later, and the inbox drops it);
//! - a message is never published while an earlier message of the same key is `New`
//!   (including one waiting out a retry backoff or a delay) or `Processing`;
//! - an earlier message that went `Dead` blocks the key until it is replayed or its row
//!   deleted ([`OnDead::Block`], the default), or is passed over ([`OnDead::Skip`]).
//!
//! Different keys proceed in parallel, inside a batch, across batches and across
//! dispatcher instances: a claim takes a key only through its first unfinished message
//! (the key's head), locked so that two claimers never hold messages of one key at once.
//! Keys are served round-robin (a store walks its keys from where its previous ordered
//! claim stopped), so a busy key cannot starve the others.
//! Inside a claimed batch the dispatcher publishes in waves (the first message of every
//! key, then the second, ...), awaiting the broker's confirmations between waves, so a
//! failed message stops the rest of its key in that batch.
//!
//! Order is `seq` order among committed messages. Two transactions that write the same
//! key concurrently have no order of their own: their messages are ordered as they
//! become visible to the claim, which may differ from `seq` when the one with the lower
//! `seq` commits last.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::message::{MessageStatus, OutboxMessage};

/// How the dispatcher orders publishes (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ordering {
    /// No order is promised; the fastest mode (the default).
    #[default]
    Unordered,
    /// FIFO per key (`partition_key`, else aggregate type and id); keys in parallel.
    PerKey {
        /// What a `Dead` message does to the messages of its key behind it.
        on_dead: OnDead,
    },
}

impl Ordering {
    /// `PerKey` with the default [`OnDead::Block`].
    pub fn per_key() -> Self {
        Self::PerKey {
            on_dead: OnDead::Block,
        }
    }

    /// Whether this is a per-key mode.
    pub fn is_ordered(&self) -> bool {
        matches!(self, Self::PerKey { .. })
    }
}

/// What a `Dead` message does to the later messages of its key in
/// [`Ordering::PerKey`] mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum OnDead {
    /// The key stops until the dead message is replayed (it then goes first, e.g.
    /// `outbox dead replay --id ...`) or an operator deletes its row because it must
    /// never go out. Nothing of the key is published out of order. The default.
    #[default]
    Block,
    /// The key continues with its next message; the dead one stays dead for an
    /// operator, and a later replay publishes it after its successors.
    Skip,
}

/// The ordering key of a message, borrowed from it: equal keys must be delivered in
/// order. Stores use their own encoding of the same pair (PostgreSQL: the `order_key`
/// column, `p:<partition_key>` or `a:<len(aggregate_type)>:<aggregate_type>:<aggregate_id>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OrderKey<'a> {
    /// The message's `partition_key`.
    Partition(&'a str),
    /// No partition key: the aggregate `(aggregate_type, aggregate_id)`.
    Aggregate(&'a str, &'a str),
}

impl std::fmt::Display for OrderKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Partition(key) => write!(f, "{key}"),
            Self::Aggregate(kind, id) => write!(f, "{kind}/{id}"),
        }
    }
}

impl OutboxMessage {
    /// The message's ordering key: `partition_key`, else its aggregate.
    pub fn order_key(&self) -> OrderKey<'_> {
        match &self.partition_key {
            Some(key) => OrderKey::Partition(key),
            None => OrderKey::Aggregate(&self.aggregate_type, &self.aggregate_id),
        }
    }
}

/// A key whose first unfinished message (its head) cannot be published now, so the
/// key's later messages wait: the head is in a retry backoff, or `Dead` (which blocks
/// only under [`OnDead::Block`]). Reported by
/// [`OutboxStore::blocked_keys`](crate::OutboxStore::blocked_keys) for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlockedKey {
    /// The key as the store encodes it (PostgreSQL: `p:<partition key>` or
    /// `a:<len>:<aggregate type>:<aggregate id>`).
    pub key: String,
    /// Id of the head message.
    pub head_id: Uuid,
    /// Its `seq`.
    pub head_seq: i64,
    /// Its status: `New` (waiting out a retry backoff) or `Dead`.
    pub status: MessageStatus,
    /// Its attempts so far.
    pub attempts: i32,
    /// Its last error.
    pub last_error: Option<String>,
    /// When the head first failed (database clock): since then the key waits.
    pub blocked_since: Option<DateTime<Utc>>,
    /// When a `New` head becomes claimable again (database clock); `None` for `Dead`.
    pub retry_at: Option<DateTime<Utc>>,
    /// New or Processing messages of the key behind the head.
    pub waiting: u64,
}

impl BlockedKey {
    /// A report row (for stores).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        key: String,
        head_id: Uuid,
        head_seq: i64,
        status: MessageStatus,
        attempts: i32,
        last_error: Option<String>,
        blocked_since: Option<DateTime<Utc>>,
        retry_at: Option<DateTime<Utc>>,
        waiting: u64,
    ) -> Self {
        Self {
            key,
            head_id,
            head_seq,
            status,
            attempts,
            last_error,
            blocked_since,
            retry_at,
            waiting,
        }
    }
}
