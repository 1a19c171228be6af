//! Store traits: [`OutboxStore`] (the relay's side of the outbox table) and
//! [`InboxStore`] (the consumer's dedup records), with the types they exchange.
//!
//! Enqueueing is not part of [`OutboxStore`]: it runs inside the caller's own
//! transaction, whose type belongs to the backend (`&mut PgConnection` for PostgreSQL),
//! so it is a trait of its own, [`OutboxProducer`](crate::OutboxProducer), with the
//! connection as an associated type.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::dispatcher::WakeHandle;
use crate::error::{ErrorKind, OutboxError};
use crate::message::OutboxMessage;
use crate::ordering::{BlockedKey, OnDead};

/// Checks a schema name before a backend splices it into SQL (the only identifier that
/// is not a bind parameter): `[a-z_][a-z0-9_]{0,62}`, which fits PostgreSQL's 63-byte
/// identifiers and SQL Server's and holds no quote character. Backends MUST still quote
/// it (`"name"`, `[name]`): reserved words such as `user` and `select` match too.
///
/// # Errors
/// [`OutboxError::Config`] naming the rule when `schema` breaks it.
pub fn validate_schema(schema: &str) -> Result<(), OutboxError> {
    let mut chars = schema.chars();
    let ok = schema.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(OutboxError::Config(format!(
            "schema name {schema:?} must match [a-z_][a-z0-9_]{{0,62}}"
        )))
    }
}

/// What to record for one claimed message. Exhaustive on purpose: every store must
/// handle every outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum CompletionOutcome {
    /// Processing → Sent, `sent_at = now()`; under [`SentRetention::Delete`] the row is
    /// deleted instead.
    Sent,
    /// Processing → New, `visible_at = now() + delay`, `last_error = error`.
    Retry {
        /// Backoff before the next claim.
        delay: Duration,
        /// The failure, stored as `last_error`.
        error: String,
    },
    /// Processing → Dead with `last_error = error`.
    Dead {
        /// The failure, stored as `last_error`.
        error: String,
    },
    /// Processing → New without charging the attempt (`attempts - 1`), visible at once:
    /// used when the broker is down or the dispatcher shuts down holding messages.
    Release,
    /// Processing → New without charging the attempt (`attempts - 1`), **held** for
    /// `destination`: out of every claim's path (`visible_at` at 9999-12-31, far past
    /// any claim and still a time every client decodes) until
    /// that destination's trial succeeds, `last_error = error`. The message's
    /// destination (a full queue or stream) refused it while others take messages, so
    /// the dispatcher parks it until one row of the destination, claimed alone with
    /// [`OutboxStore::claim_held`], is confirmed; then [`OutboxStore::release_held`]
    /// makes the destination's held rows claimable again. A held row costs nothing per
    /// trial period: it is written once when held and once when released.
    Hold {
        /// The destination that holds it (the dispatcher's circuit name).
        destination: String,
        /// Why, stored as `last_error`.
        error: String,
    },
}

/// What a store does with a message once the broker has confirmed it (a
/// [`CompletionOutcome::Sent`] completion). Set on the backend's configuration, e.g.
/// `PgConfig::with_sent_retention`; every completion of that store follows it.
///
/// - [`Keep`](Self::Keep) (the default) marks the row `Sent` with `sent_at` and leaves it
///   for [`OutboxStore::purge_sent`] (or `outbox purge`, which can archive it) to remove
///   after a retention age. The kept rows are what `outbox reconcile` compares with the
///   consumers' inbox records, what [`OutboxStats::sent`] counts and what
///   [`OutboxStore::get`] finds after delivery.
/// - [`Delete`](Self::Delete) deletes the row in the completion statement itself, the
///   way MassTransit's and Wolverine's outboxes remove delivered messages: retention
///   with an age of zero. A delete is much cheaper for the database than an update (no
///   new row version, no index entries: on PostgreSQL the claim and completion of a
///   message take about 8 µs inside the database instead of 15; docs/performance.md
///   has the relay's figures), and sent rows never accumulate, so
///   no purge of them is needed. In exchange there is no record of
///   delivered messages in the outbox: `reconcile` sees only the rows still there
///   (pending and dead ones), `stats` counts no sent rows, and `get` returns `None`
///   for a delivered message. Retries, dead letters, releases and the fencing by claim
///   token are unchanged: only a `Sent` completion whose token matches deletes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SentRetention {
    /// Keep sent rows as `Sent`, with `sent_at`, until they are purged.
    #[default]
    Keep,
    /// Delete each row in the completion that records it as sent.
    Delete,
}

impl SentRetention {
    /// The configuration name: `keep` or `delete`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::Delete => "delete",
        }
    }
}

impl std::fmt::Display for SentRetention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SentRetention {
    type Err = OutboxError;

    /// Parses `keep` or `delete` (ASCII case-insensitive).
    ///
    /// # Errors
    /// [`OutboxError::Config`] naming the value and the accepted ones.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "keep" => Ok(Self::Keep),
            "delete" => Ok(Self::Delete),
            _ => Err(OutboxError::Config(format!(
                "sent retention {s:?} is not one of: keep, delete"
            ))),
        }
    }
}

/// Default of the crash-loop guard: a row claimed alone this many times in a row without
/// any outcome being recorded is moved to `Dead` at its next claim (see
/// [`Poison::CrashLoop`]).
pub const DEFAULT_CRASH_LOOP_LIMIT: u32 = 5;

/// Longest `last_error` a store writes, in bytes: longer texts are cut at a character
/// boundary by [`sanitize_error`].
pub const MAX_ERROR_BYTES: usize = 4096;

/// `error` as a store may write it into `last_error`: every NUL character (which
/// PostgreSQL's `text` cannot hold, SQLSTATE 22021) replaced by the two characters `\0`,
/// and the text cut to [`MAX_ERROR_BYTES`] at a character boundary, ending in `…` when
/// cut. Broker and driver error texts go into `last_error` unfiltered otherwise, and a
/// completion that fails on one of them would fail its whole batch.
pub fn sanitize_error(error: &str) -> std::borrow::Cow<'_, str> {
    if error.len() <= MAX_ERROR_BYTES && !error.contains('\0') {
        return std::borrow::Cow::Borrowed(error);
    }
    let mut out = String::with_capacity(error.len().min(MAX_ERROR_BYTES));
    for c in error.chars() {
        let piece_len = if c == '\0' { 2 } else { c.len_utf8() };
        if out.len() + piece_len > MAX_ERROR_BYTES - '…'.len_utf8() {
            out.push('…');
            break;
        }
        if c == '\0' {
            out.push_str("\\0");
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// What one claim took: the messages to publish, and the claimed rows that must not be
/// published ([`PoisonRow`]s). A claim never fails because of one row's content.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ClaimedBatch {
    /// Claimed messages (`Processing` under one claim token), in `seq` order.
    pub messages: Vec<OutboxMessage>,
    /// Claimed rows that cannot or must not be published, each alone.
    pub poison: Vec<PoisonRow>,
}

impl ClaimedBatch {
    /// A batch of `messages` and `poison` rows.
    pub fn new(messages: Vec<OutboxMessage>, poison: Vec<PoisonRow>) -> Self {
        Self { messages, poison }
    }

    /// Whether the claim took nothing at all.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty() && self.poison.is_empty()
    }

    /// Rows taken by the claim: messages and poison rows.
    pub fn len(&self) -> usize {
        self.messages.len() + self.poison.len()
    }
}

/// A claimed row that is not handed to a publisher. The rest of its batch is unaffected
/// (in [`Ordering::PerKey`](crate::Ordering::PerKey) mode under [`OnDead::Block`], the
/// later messages of its key in the batch are released: the row is `Dead` and blocks
/// them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoisonRow {
    /// The row's id.
    pub id: Uuid,
    /// The row's `seq`.
    pub seq: i64,
    /// The row's `aggregate_type`, for its ordering key.
    pub aggregate_type: String,
    /// The row's `aggregate_id`, for its ordering key.
    pub aggregate_id: String,
    /// The row's `partition_key`, for its ordering key.
    pub partition_key: Option<String>,
    /// What is wrong with it.
    pub poison: Poison,
}

impl PoisonRow {
    /// The row's ordering key, as [`OutboxMessage::order_key`].
    pub fn order_key(&self) -> crate::ordering::OrderKey<'_> {
        match &self.partition_key {
            Some(key) => crate::ordering::OrderKey::Partition(key),
            None => crate::ordering::OrderKey::Aggregate(&self.aggregate_type, &self.aggregate_id),
        }
    }
}

/// Why a claimed row is poison.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Poison {
    /// The row was claimed (it is `Processing` under `claim_token`) but its columns do
    /// not make an [`OutboxMessage`] (for example `headers` that are not a JSON object of
    /// strings, written by a trigger, a migration or another language's producer). The
    /// dispatcher completes it as `Dead` with `reason` in `last_error`.
    Undecodable {
        /// The claim's fencing token.
        claim_token: Uuid,
        /// What could not be decoded.
        reason: String,
    },
    /// The claim itself moved the row to `Dead`: it had been claimed **alone**
    /// `claims_alone` times in a row without any outcome being recorded (each relay
    /// holding it, and only it, stopped, crashed or lost its lease first), the mark of a
    /// row that crashes whatever relay publishes it. The store's crash-loop limit
    /// ([`DEFAULT_CRASH_LOOP_LIMIT`] by default) sets the count; `last_error` says
    /// "suspected crash loop". Nothing is left to complete. See the crash-loop guard in
    /// [`OutboxStore`]'s contract.
    CrashLoop {
        /// Claims of the row alone that ended without an outcome, before this one.
        claims_alone: u32,
    },
}

impl std::fmt::Display for Poison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Undecodable { reason, .. } => write!(f, "undecodable row: {reason}"),
            Self::CrashLoop { claims_alone } => write!(
                f,
                "suspected crash loop: claimed alone {claims_alone} times without an outcome"
            ),
        }
    }
}

/// One completion: which message, under which claim, with what outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The message id.
    pub id: Uuid,
    /// The fencing token received with the claim.
    pub claim_token: Uuid,
    /// What to record.
    pub outcome: CompletionOutcome,
}

/// What [`OutboxStore::complete`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompleteReport {
    /// Completions applied.
    pub applied: u64,
    /// Ids whose completion changed nothing because the claim token no longer matched
    /// (the lease expired and another dispatcher reclaimed the message, or it was
    /// completed already).
    pub fenced: Vec<Uuid>,
}

/// Counts by status and the queue lag.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows with status New.
    pub new: u64,
    /// Rows with status Processing.
    pub processing: u64,
    /// Rows with status Sent.
    pub sent: u64,
    /// Rows with status Dead.
    pub dead: u64,
    /// The queue lag: how long the oldest New or Processing row has been due, by the
    /// database clock; `None` when no pending row is due. A row is due from its
    /// `visible_at` (a delayed message is not late before its time), or from its first
    /// failure when that is earlier: a row waiting out a retry backoff, or held back
    /// because its destination refused it, was due then and is still not out, so it
    /// counts as late from then (a replayed dead letter too, from its first failure).
    pub oldest_pending_age: Option<Duration>,
}

/// Selects messages for dead-letter listing and replay. Empty fields match everything;
/// set fields are combined with AND.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MessageFilter {
    /// Only these ids.
    pub ids: Vec<Uuid>,
    /// `created_at >= from`.
    pub from: Option<DateTime<Utc>>,
    /// `created_at < to`.
    pub to: Option<DateTime<Utc>>,
    /// Tenant equals.
    pub tenant_id: Option<String>,
    /// Aggregate type equals.
    pub aggregate_type: Option<String>,
    /// Aggregate id equals.
    pub aggregate_id: Option<String>,
    /// Event type equals.
    pub event_type: Option<String>,
    /// `last_error` contains this text, case-insensitive and literally: a store MUST
    /// match `%`, `_`, `[` and `\` as themselves, never as `LIKE` wildcards or escapes.
    pub error_contains: Option<String>,
}

impl MessageFilter {
    /// A filter matching everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only these ids.
    #[must_use]
    pub fn with_ids(mut self, ids: impl IntoIterator<Item = Uuid>) -> Self {
        self.ids = ids.into_iter().collect();
        self
    }

    /// Only this event type.
    #[must_use]
    pub fn with_event_type(mut self, event_type: impl Into<String>) -> Self {
        self.event_type = Some(event_type.into());
        self
    }

    /// Only this tenant.
    #[must_use]
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant_id = Some(tenant.into());
        self
    }

    /// Only errors containing `text`.
    #[must_use]
    pub fn with_error_containing(mut self, text: impl Into<String>) -> Self {
        self.error_contains = Some(text.into());
        self
    }
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Dead messages matching the filter.
    pub matched: u64,
    /// Messages moved back to New (0 on a dry run).
    pub replayed: u64,
    /// Matched messages that could not be replayed (they left `Dead` meanwhile).
    pub failed: u64,
    /// Wall time spent.
    pub elapsed: Duration,
}

/// The relay's view of an outbox table.
///
/// # Contract
/// Every implementation MUST hold these properties (the `conformance` feature states
/// them as executable tests):
/// - [`claim`](Self::claim) atomically takes up to `batch_size` messages that are `New`
///   with `visible_at <= now` or `Processing` with an expired lease, oldest
///   `(visible_at, seq)` first, skipping rows another claimer has locked; it sets them
///   `Processing`, `lease_until = now + lease`, a fresh `claim_token` and
///   `attempts + 1`, and commits before returning. No message is handed to two live
///   claims at once.
/// - A claim never fails because of one row's content: a claimed row that cannot be
///   decoded is returned as [`Poison::Undecodable`] (still `Processing` under the claim's
///   token) beside the rest of the batch.
/// - The **crash-loop guard** isolates before it kills. A row whose previous claim
///   ended without an outcome (it is `Processing` with an expired lease: its claimer
///   stopped, crashed or lost its lease first) is a *suspect*. When the first claimable
///   row in claim order is a suspect, the claim takes that row **alone** (a batch of
///   one); otherwise it takes no suspect at all. Only claims alone count toward the
///   store's crash-loop limit (default [`DEFAULT_CRASH_LOOP_LIMIT`]); every completion
///   (any outcome, a release included) resets the counts. A suspect already claimed
///   alone that many times without an outcome is not claimed but moved to `Dead` by the
///   claim, with a `last_error` starting "suspected crash loop", and returned as
///   [`Poison::CrashLoop`] (the claim returns nothing else). So the batch-mates of a row
///   that crashes the relay, and what a relay held when it was killed or restarted,
///   are each claimed alone once and published; only a row that crashes a relay on its
///   own reaches the limit. In per-key order ([`claim_ordered`](Self::claim_ordered)) a
///   suspect is claimed alone when it is the head of its key, and a key's run stops
///   before a suspect. Stores keep both counts (every claim without an outcome, and
///   those alone) for operators.
/// - [`complete`](Self::complete) applies all completions in one round trip, each only
///   where the status is `Processing` and the `claim_token` matches; others are reported
///   as fenced and left unchanged. A `Sent` completion marks the row `Sent` with
///   `sent_at = now`, or deletes it when the store is configured with
///   [`SentRetention::Delete`]. Error texts are written through [`sanitize_error`], so
///   no error text can make a completion fail.
/// - A row completed with [`CompletionOutcome::Hold`] is `New` but claimed by neither
///   [`claim`](Self::claim) nor [`claim_ordered`](Self::claim_ordered) (in per-key
///   order it blocks the later rows of its key, as a row waiting out a backoff does)
///   until [`release_held`](Self::release_held) releases its destination or
///   [`claim_held`](Self::claim_held) takes it as the destination's trial.
///   [`held_destinations`](Self::held_destinations) finds every destination that holds
///   rows, so a relay that restarts tries them: nothing is held forever.
/// - Every time is taken from the database clock; the caller supplies durations only.
#[async_trait]
pub trait OutboxStore: Send + Sync + 'static {
    /// Claims a batch (see the trait contract). Messages are returned in `seq` order;
    /// rows that must not be published are returned as [`ClaimedBatch::poison`] (they
    /// count toward `batch_size`).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure (nothing is claimed then).
    async fn claim(&self, batch_size: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError>;

    /// Claims for [`Ordering::PerKey`](crate::Ordering::PerKey) mode: like
    /// [`claim`](Self::claim), but only messages whose key is free. For each key
    /// (`partition_key`, else aggregate type and id) it takes at most a run of the
    /// key's first unfinished messages, in `seq` order, and only if every earlier
    /// unfinished message of the key is in the same claim. A key is not free while any
    /// message of it is `Processing` under a live lease, `New` but not yet visible
    /// (retry backoff, delay), or, under [`OnDead::Block`], `Dead`. Claimable messages
    /// of the run are `New` and visible or `Processing` with an expired lease. Keys are
    /// served round-robin: the store walks the keys with pending messages from where
    /// its previous ordered claim stopped, wrapping around, so every key gets its turn
    /// (there is no age order across keys). Concurrent claimers never hold messages of
    /// the same key at once: each locks the key's head row (skipping it when another
    /// claimer holds it). Returns the messages in `seq` order, and poison rows as
    /// [`claim`](Self::claim) does (a crash-loop row is `Dead`, so under
    /// [`OnDead::Block`] it stops its key).
    ///
    /// # Errors
    /// As [`claim`](Self::claim).
    async fn claim_ordered(
        &self,
        batch_size: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError>;

    /// Claims the trials of held destinations: for each of `destinations`, its held row
    /// ([`CompletionOutcome::Hold`]) with the lowest `seq` (in per-key order, `order =
    /// Some(on_dead)`, only a row that is the head of its key: no earlier pending row of
    /// its key, nor, under [`OnDead::Block`], an earlier `Dead` one), skipping rows
    /// locked by other claimers. Each is claimed as [`claim`](Self::claim) claims (status
    /// `Processing`, lease, fresh token, `attempts + 1`) and is no longer held: its
    /// `visible_at` is now, so that a relay that dies holding it leaves an ordinary
    /// expired lease for any claim to take. At most one message per destination; a
    /// destination with no such row has none in the batch. Commits before returning.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure (nothing is claimed then).
    async fn claim_held(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError>;

    /// Releases up to `limit` held rows of `destination` (lowest `seq` first): `New`,
    /// visible now, no longer held; returns how many. Call repeatedly until it returns
    /// less than `limit`: each call is one short statement, so that releasing a large
    /// backlog never locks it all at once.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn release_held(&self, destination: &str, limit: usize) -> Result<u64, OutboxError>;

    /// The destinations that hold rows, in ascending order (the store's order of text:
    /// the column's collation, binary in MySQL and SQL Server), those after `after`
    /// (`""`: from the first), at most `limit`. Its cost SHOULD grow with the
    /// destinations listed, not with the rows they hold.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn held_destinations(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>, OutboxError>;

    /// Keys whose head (first unfinished message, `Dead` included) is `Dead` or waiting
    /// out a retry backoff, longest blocked first, at most `limit`. Under
    /// [`OnDead::Skip`] a `Dead` head does not block the relay; it is listed anyway so
    /// operators see it.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn blocked_keys(&self, limit: usize) -> Result<Vec<BlockedKey>, OutboxError>;

    /// Records the outcomes of claimed messages, fenced by their claim tokens, and resets
    /// each applied row's count of claims without an outcome.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure (nothing is changed then).
    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError>;

    /// One message by id.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn get(&self, id: Uuid) -> Result<Option<OutboxMessage>, OutboxError>;

    /// Counts by status and the age of the oldest pending message.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn stats(&self) -> Result<OutboxStats, OutboxError>;

    /// Dead messages matching `filter`, oldest first, at most `limit`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn dead_letters(
        &self,
        filter: &MessageFilter,
        limit: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError>;

    /// Moves dead messages matching `filter` back to New, visible now, with attempts
    /// reset to 0 (Dead → New). With `dry_run` only counts them.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn replay(
        &self,
        filter: &MessageFilter,
        dry_run: bool,
    ) -> Result<ReplayReport, OutboxError>;

    /// Deletes up to `batch_size` Sent messages whose `sent_at` is older than
    /// `older_than`; returns how many. Call repeatedly until it returns 0.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn purge_sent(&self, older_than: Duration, batch_size: usize)
    -> Result<u64, OutboxError>;

    /// Starts the store's push wake-up, if it has one: a task that calls
    /// [`WakeHandle::wake`] soon after a transaction that enqueued messages commits, so
    /// that the relay claims them at once instead of at its next poll, until `shutdown`
    /// is cancelled. Returns the task, or `None` (the default) when the store has no
    /// such signal and the relay only polls.
    ///
    /// [`Dispatcher::run`](crate::Dispatcher::run) calls it itself, once per run, when
    /// its claimer first finds less than a full batch (unless
    /// [`DispatcherConfig::with_push_wake`](crate::DispatcherConfig::with_push_wake)
    /// turned it off), and cancels `shutdown` when it stops; programs do not call it.
    /// Implementations MUST return at once (spawning the work on the current tokio
    /// runtime) and the task MUST end soon after `shutdown` is cancelled. A commit the
    /// source may have missed while it started (before it listened) MUST be covered by
    /// one wake-up once it listens. A wake-up is only a hint: a store MAY wake
    /// spuriously, and MUST NOT rely on being heard (the relay's poll remains the
    /// fallback).
    fn spawn_wake_source(
        &self,
        wake: WakeHandle,
        shutdown: CancellationToken,
    ) -> Option<JoinHandle<()>> {
        let _ = (wake, shutdown);
        None
    }
}

/// The consumer's dedup records: `(message_id, consumer)` claimed inside the consumer's
/// own transaction, so the record commits or rolls back with the handler's effects.
#[async_trait]
pub trait InboxStore: Send + Sync + 'static {
    /// The backend's connection type handlers work on (e.g. `PgConnection`).
    type Connection: Send;

    /// A live transaction that dereferences to [`Connection`](Self::Connection)
    /// (e.g. `sqlx::Transaction<'static, Postgres>`).
    type Transaction: std::ops::DerefMut<Target = Self::Connection> + Send;

    /// Begins a transaction.
    ///
    /// # Errors
    /// [`OutboxError::Database`] when no connection can be had.
    async fn begin(&self) -> Result<Self::Transaction, OutboxError>;

    /// Commits `tx`.
    ///
    /// A commit is only a commit when the database says so. Stores MUST return
    /// [`OutboxError::TransactionAborted`] when `tx` was already aborted by a failed
    /// statement whose error its user caught and ignored (PostgreSQL answers `COMMIT`
    /// on such a transaction with the tag `ROLLBACK`, not an error; SQL Server dooms
    /// it, `XACT_STATE() = -1`, or rolls it back at once under `XACT_ABORT ON`): the
    /// inbox would otherwise acknowledge a delivery whose effects and inbox record were
    /// rolled back.
    ///
    /// # Errors
    /// [`OutboxError::TransactionAborted`] as above (nothing was committed);
    /// [`OutboxError::Database`]: the transaction's effects are then not durable (a
    /// constraint checked at commit fails with [`ErrorKind::InvalidData`]).
    async fn commit(&self, tx: Self::Transaction) -> Result<(), OutboxError>;

    /// Rolls `tx` back.
    ///
    /// # Errors
    /// [`OutboxError::Database`] (the server rolls back anyway when the connection
    /// closes).
    async fn rollback(&self, tx: Self::Transaction) -> Result<(), OutboxError>;

    /// Records `(message_id, consumer)` on `conn` (which should be inside a
    /// transaction). Returns `true` if this is the first time, `false` for a duplicate:
    /// a record committed earlier, or a claim of the same pair earlier in this same
    /// transaction. Concurrent claims of the same pair MUST NOT both return `true` once
    /// committed: the second waits for the first's transaction, and gets `false` if it
    /// committed, `true` if it rolled back. A rolled-back claim leaves no record. (The
    /// inbox conformance suite, `inbox_conformance_tests!`, checks all of it.)
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn try_claim(
        &self,
        conn: &mut Self::Connection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<bool, OutboxError>;

    /// [`try_claim`](Self::try_claim) for many `(message_id, consumer)` pairs on one
    /// transaction: one result per pair, in order (`true`: first time). A pair repeated
    /// in `pairs` is claimed at most once, by its first occurrence. Stores MUST take the
    /// pairs' locks in a deterministic order (e.g. sorted), so that two transactions
    /// claiming overlapping batches wait for each other instead of deadlocking, and
    /// SHOULD do it in one statement (PostgreSQL does). The default claims the pairs one
    /// by one, sorted by `(message_id, consumer)`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure; nothing can be assumed claimed.
    async fn try_claim_batch(
        &self,
        conn: &mut Self::Connection,
        pairs: &[(Uuid, &str)],
    ) -> Result<Vec<bool>, OutboxError> {
        let mut claimed = vec![false; pairs.len()];
        for i in crate::inbox::lock_order(pairs) {
            let (message_id, consumer) = pairs[i];
            claimed[i] = self.try_claim(conn, message_id, consumer).await?;
        }
        Ok(claimed)
    }

    /// The kind of `error` when it is an error of this store's database driver (e.g. a
    /// `sqlx::Error` for PostgreSQL), else `None`. Looks at `error` alone; callers walk
    /// its `source()` chain. The inbox asks it about a handler's error to tell the
    /// database's hiccups ([`ErrorKind::Transient`]: a deadlock, a statement timeout;
    /// [`ErrorKind::Unavailable`]: a lost connection), which are retried without
    /// charging the message, from the handler's own failure. The default knows no
    /// driver.
    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        let _ = error;
        None
    }

    /// Deletes up to `batch_size` inbox records whose age is at least `older_than`
    /// (so `Duration::ZERO` purges every committed record); returns how many. A duplicate that arrives after its record was purged is processed again,
    /// so `older_than` must exceed the longest redelivery or replay horizon.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn purge(&self, older_than: Duration, batch_size: usize) -> Result<u64, OutboxError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_lose_nul_bytes_and_excess_length() {
        assert!(matches!(
            sanitize_error("plain"),
            std::borrow::Cow::Borrowed("plain")
        ));
        assert_eq!(sanitize_error("a\0b"), "a\\0b");
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = sanitize_error(&long);
        assert!(cut.len() <= MAX_ERROR_BYTES, "{}", cut.len());
        assert!(cut.ends_with('…'));
        let nuls = "\0".repeat(MAX_ERROR_BYTES);
        let cut = sanitize_error(&nuls);
        assert!(cut.len() <= MAX_ERROR_BYTES && !cut.contains('\0'));
    }

    #[test]
    fn sent_retention_parses_its_names_and_rejects_others() {
        for r in [SentRetention::Keep, SentRetention::Delete] {
            assert_eq!(r.as_str().parse::<SentRetention>().ok(), Some(r));
            assert_eq!(r.to_string(), r.as_str());
        }
        assert_eq!(
            "DELETE".parse::<SentRetention>().ok(),
            Some(SentRetention::Delete)
        );
        assert_eq!(SentRetention::default(), SentRetention::Keep);
        let err = "archive"
            .parse::<SentRetention>()
            .expect_err("not a retention");
        assert!(
            matches!(err, OutboxError::Config(ref m) if m.contains("archive")),
            "{err}"
        );
    }
}
