//! The operations capability every SQL backend implements: [`OutboxAdmin`], the
//! queries behind the `outbox` binary's commands (stats, reconcile, dead letters of
//! both sides, retention), and the backend-neutral types they return.
//!
//! [`OutboxStore`] holds what the relay needs (claim, complete) plus the outbox side's
//! dead letters, replay and purge; [`OutboxAdmin`] adds what an operator needs. Both
//! `outboxkit-postgres` (`PgOutbox`) and `outboxkit-sqlserver` (`MssqlOutbox`) implement it,
//! so the binary runs every command on either database through `dyn OutboxAdmin`.
//!
//! The inbox queries read the inbox tables of the **same schema** as the outbox (the
//! layout of the examples: producer and consumer share a database). These are admin
//! queries: the breakdowns scan the table; run them against a replica when it is huge.
//!
//! The report structs are built by the backends, so their fields are public and
//! exhaustive (a new field is a breaking change of this module); the filter
//! ([`InboxDeadFilter`]) is `#[non_exhaustive]` and built with [`InboxDeadFilter::new`].
//!
//! The browsing queries of the `outbox dashboard` ([`OutboxAdmin::list_messages`],
//! [`OutboxAdmin::count_messages`], [`OutboxAdmin::sent_per_minute`]) are built for a
//! table of millions of rows: listings are keyset-paged ([`MessageCursor`]) along an
//! index of the listed state, counts are bounded.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDate, Utc};
use uuid::Uuid;

use crate::{MessageFilter, MessageStatus, OnDead, OutboxError, OutboxStats, OutboxStore};

/// How many pending (and dead) rows [`OutboxAdmin::pending_stats`], the relay's gauges,
/// counts at most: beyond it the gauges say "at least this many".
pub const PENDING_STATS_BOUND: i64 = 10_000;

/// What keeps completed rows' remains in the outbox table
/// ([`OutboxAdmin::vacuum_pressure`]): the dead row versions waiting for VACUUM, and the
/// oldest transaction that VACUUM may not remove them past (it holds the xmin horizon
/// back, PostgreSQL's name for the oldest snapshot still in use).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct VacuumPressure {
    /// Dead row versions of the outbox table by the database's statistics
    /// (PostgreSQL: `pg_stat_user_tables.n_dead_tup`, an estimate updated as
    /// transactions end).
    pub dead_rows: u64,
    /// Live rows by the same statistics (`n_live_tup`), sent rows kept included.
    pub live_rows: u64,
    /// When the table was last vacuumed, by hand or by autovacuum; `None`: never
    /// since the statistics were reset.
    pub last_vacuum: Option<DateTime<Utc>>,
    /// Age of the oldest transaction of the database that holds a snapshot or a
    /// transaction id (or of the oldest prepared transaction), database clock;
    /// `None` when there is none, or only sessions whose start the role may not see
    /// (grant it `pg_read_all_stats`).
    pub oldest_transaction_age: Option<Duration>,
    /// Who that transaction is: `pid 4711 (psql, reporting), idle in transaction`, or
    /// `prepared transaction 'gid'`.
    pub oldest_transaction: Option<String>,
}

/// Counts of one `(event_type, tenant_id)` group.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupStats {
    /// Event type.
    pub event_type: String,
    /// Tenant (`None`: messages without a tenant).
    pub tenant_id: Option<String>,
    /// Rows `New`.
    pub new: u64,
    /// Rows `Processing`.
    pub processing: u64,
    /// Rows `Sent` (still in the table, i.e. not purged yet).
    pub sent: u64,
    /// Rows `Dead`.
    pub dead: u64,
    /// The group's queue lag in seconds: how long its oldest `New`/`Processing` row
    /// has been due (see [`OutboxStats::oldest_pending_age`]); `None` when none is due.
    pub oldest_pending_age_secs: Option<f64>,
}

/// One reconciliation line: for a UTC day, tenant, event type and consumer, how many
/// messages were written to the outbox and how many that consumer recorded as processed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReconcileRow {
    /// UTC day of the outbox row's `created_at`.
    pub day: NaiveDate,
    /// Tenant (`None`: no tenant).
    pub tenant_id: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Consumer (handler) name.
    pub consumer: String,
    /// Outbox rows written (any status, not yet purged).
    pub written: u64,
    /// Of those, messages with an inbox record of `consumer` (handled, or skipped as a
    /// stale version, which also counts as handled).
    pub processed: u64,
    /// Of those, consumer dead letters of `consumer`.
    pub dead: u64,
    /// `written - processed`: messages the consumer has not (yet) handled, dead letters
    /// included. Zero after a clean run.
    pub missing: i64,
}

/// Selects consumer-side dead letters. Empty fields match everything; set fields are
/// combined with AND.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxDeadFilter {
    /// Only these message ids.
    pub ids: Vec<Uuid>,
    /// Time `>= from` (consumer dead letters: `dead_at`; durable inbox: `received_at`).
    pub from: Option<DateTime<Utc>>,
    /// Time `< to` (same columns as `from`).
    pub to: Option<DateTime<Utc>>,
    /// Consumer name equals (durable inbox rows: `last_error` starts with
    /// `"<consumer>: "`, which is how the processor names the failing handler).
    pub consumer: Option<String>,
    /// Event type equals.
    pub event_type: Option<String>,
    /// Last error contains this text, case-insensitive and literally: `%`, `_` and `\`
    /// match themselves (they are no `LIKE` wildcards).
    pub error_contains: Option<String>,
}

impl InboxDeadFilter {
    /// A filter matching everything.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Where a consumer-side dead letter lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InboxDeadKind {
    /// An idempotent consumer gave up (`inbox_failures` row with `dead_at`).
    Consumer,
    /// A durable-inbox message went `Dead` (`inbox_messages.status = 3`).
    Durable,
}

/// A consumer-side dead letter (no payload: listings never show payloads).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InboxDeadLetter {
    /// Which table it is in.
    pub kind: InboxDeadKind,
    /// Message id.
    pub message_id: Uuid,
    /// Consumer name (`None` for durable rows: the failing handler is named in
    /// `last_error`).
    pub consumer: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Last error.
    pub last_error: Option<String>,
    /// Failures or claims counted.
    pub attempts: i32,
    /// `dead_at` (consumer) or `received_at` (durable), database clock.
    pub at: DateTime<Utc>,
}

/// What [`OutboxAdmin::replay_inbox_dead_letters`] does with the dead letters its
/// filter matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InboxReplayMode {
    /// Count them ([`InboxReplayReport::matched`]); change nothing.
    DryRun,
    /// Make them processable again: durable-inbox rows back to `New`; for
    /// idempotent-consumer dead letters the message's outbox row back to `New` (the
    /// relay publishes it again) and the failure row deleted. A dead letter whose outbox
    /// row is gone is kept and counted as [`failed`](InboxReplayReport::failed).
    Republish,
    /// As [`Republish`](Self::Republish) for durable-inbox rows, but for
    /// idempotent-consumer dead letters only delete the failure rows: the operator
    /// arranges the redelivery (e.g. the message came from another database).
    ClearOnly,
}

/// What [`OutboxAdmin::replay_inbox_dead_letters`] did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct InboxReplayReport {
    /// Dead letters matching the filter.
    pub matched: u64,
    /// Made processable again (0 on a dry run).
    pub replayed: u64,
    /// Matched but not replayable: consumer dead letters whose message is not in this
    /// outbox (purged, or produced elsewhere) in [`InboxReplayMode::Republish`], or rows
    /// that changed meanwhile.
    pub failed: u64,
    /// Wall time, in seconds.
    pub elapsed_secs: f64,
}

/// Which outbox rows [`OutboxAdmin::list_messages`] walks, and in which order. Each
/// order follows an index the backends keep for that state, with `seq` breaking ties.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageState {
    /// `New` and `Processing` rows, in claim order: `(visible_at, seq)` ascending (the
    /// next message the relay takes comes first).
    Pending,
    /// `Dead` rows, newest first: `(created_at, seq)` descending.
    Dead,
    /// `Sent` rows still in the table, most recently sent first: `(sent_at, seq)`
    /// descending (none under `SentRetention::Delete`).
    Sent,
}

impl MessageState {
    /// The state's name in URLs and reports: `pending`, `dead` or `sent`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Dead => "dead",
            Self::Sent => "sent",
        }
    }

    /// Parses [`as_str`](Self::as_str)'s names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "pending" => Some(Self::Pending),
            "dead" => Some(Self::Dead),
            "sent" => Some(Self::Sent),
            _ => None,
        }
    }
}

/// A position in a listing of [`OutboxAdmin::list_messages`]: the sort key of the last
/// row of the previous page (`at` is `visible_at`, `created_at` or `sent_at` by
/// [`MessageState`]). The next page starts strictly after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageCursor {
    /// The row's time of the state's order, as the database stored it.
    pub at: DateTime<Utc>,
    /// The row's `seq`.
    pub seq: i64,
}

/// A listed outbox message: what a listing shows, without payload or headers (read
/// one message with [`OutboxStore::get`] for those).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MessageSummary {
    /// Message id.
    pub id: Uuid,
    /// Insertion order.
    pub seq: i64,
    /// Status.
    pub status: MessageStatus,
    /// Event type.
    pub event_type: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Tenant.
    pub tenant_id: Option<String>,
    /// When the row was written (database clock).
    pub created_at: DateTime<Utc>,
    /// Not claimable before (database clock).
    pub visible_at: DateTime<Utc>,
    /// When the broker confirmed it (database clock).
    pub sent_at: Option<DateTime<Utc>>,
    /// Claims so far.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
}

impl MessageSummary {
    /// The cursor that continues a listing of `state` after this row.
    pub fn cursor(&self, state: MessageState) -> MessageCursor {
        let at = match state {
            MessageState::Pending => self.visible_at,
            MessageState::Dead => self.created_at,
            MessageState::Sent => self.sent_at.unwrap_or(self.created_at),
        };
        MessageCursor { at, seq: self.seq }
    }
}

/// What the dashboard passes as `scan` to [`OutboxAdmin::list_messages`] and
/// [`OutboxAdmin::count_messages`]: filtered listings and counts examine at most this
/// many rows of a state per call.
pub const DEFAULT_SCAN_BOUND: u64 = 25_000;

/// One page of [`OutboxAdmin::list_messages`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagePage {
    /// The matching rows, in the state's order.
    pub rows: Vec<MessageSummary>,
    /// Where the next page starts: after the last row when the page is full, after the
    /// last row examined when the scan bound came first; `None` when nothing follows.
    pub next: Option<MessageCursor>,
}

/// What [`OutboxAdmin::count_messages`] counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageCount {
    /// Matching rows counted.
    pub matching: u64,
    /// Whether that is all of them: neither the count's bound nor the scan bound was
    /// reached. When `false`, at least `matching` rows match.
    pub exact: bool,
}

/// What a relay reports about itself at each of its health checks
/// ([`OutboxAdmin::record_heartbeat`]), so that operators see every relay from the
/// database: which run, since when, their circuit and health.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayHeartbeat {
    /// The relay process's id, fresh at each start.
    pub relay_id: Uuid,
    /// The host it runs on.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// Its version (the `outbox` binary's).
    pub version: String,
    /// Whether its circuit is open (not claiming, probing the broker).
    pub circuit_open: bool,
    /// Whether its health check passes.
    pub healthy: bool,
    /// Messages it published since it started.
    pub published: u64,
    /// Why it is unhealthy (empty when healthy), at most 1,000 characters.
    pub detail: String,
}

impl RelayHeartbeat {
    /// The heartbeat of relay `relay_id` on `host`, process `pid`, `version`: healthy,
    /// circuit closed, nothing published yet.
    pub fn new(
        relay_id: Uuid,
        host: impl Into<String>,
        pid: u32,
        version: impl Into<String>,
    ) -> Self {
        Self {
            relay_id,
            host: host.into(),
            pid,
            version: version.into(),
            circuit_open: false,
            healthy: true,
            published: 0,
            detail: String::new(),
        }
    }
}

/// A relay as the database last heard of it ([`OutboxAdmin::relays_seen`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RelaySeen {
    /// The relay process's id.
    pub relay_id: Uuid,
    /// Its host.
    pub host: String,
    /// Its process id.
    pub pid: i64,
    /// Its version.
    pub version: String,
    /// Its first heartbeat (database clock).
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat (database clock).
    pub last_seen_at: DateTime<Utc>,
    /// How long ago that was, by the database clock.
    pub silent_for: Duration,
    /// Whether its circuit was open then.
    pub circuit_open: bool,
    /// Whether it was healthy then.
    pub healthy: bool,
    /// Messages it had published then.
    pub published: u64,
    /// Why it was unhealthy.
    pub detail: String,
}

/// Messages sent per minute over a recent window ([`OutboxAdmin::sent_per_minute`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SentPerMinute {
    /// The database clock when counted: the end of the window.
    pub until: DateTime<Utc>,
    /// One count per minute of the window, oldest first: `counts[i]` holds the rows
    /// whose `sent_at` is in `(until - (n - i) min, until - (n - i - 1) min]`, so the
    /// last one is the minute just ended.
    pub counts: Vec<u64>,
}

impl SentPerMinute {
    /// Buckets rows by their age in whole minutes (`ages[k] = (minutes_ago, count)`,
    /// `minutes_ago` 0 for the last minute), for the backends: ages outside
    /// `0..minutes` are clamped into it (a clock step can make one negative).
    pub fn from_ages(until: DateTime<Utc>, minutes: usize, ages: &[(i64, u64)]) -> Self {
        let mut counts = vec![0u64; minutes];
        if minutes > 0 {
            for &(ago, n) in ages {
                let ago = usize::try_from(ago.max(0))
                    .unwrap_or(usize::MAX)
                    .min(minutes - 1);
                counts[minutes - 1 - ago] += n;
            }
        }
        Self { until, counts }
    }
}

/// Operator queries of an outbox backend, over the outbox and inbox tables of one
/// schema. Object safe: the `outbox` binary holds a `Box<dyn OutboxAdmin>` chosen by
/// the database URL.
///
/// Every method returns [`OutboxError::Database`] on database failure, and changes
/// nothing when it fails (each write is one statement or one transaction).
#[async_trait]
pub trait OutboxAdmin: OutboxStore {
    /// The backend's name for messages and logs (`"postgres"`, `"sqlserver"`).
    fn backend(&self) -> &'static str;

    /// The schema this outbox lives in (unquoted).
    fn schema(&self) -> &str;

    /// Applies the pending migrations of this schema (idempotent, serialized between
    /// concurrent callers by a database lock); returns the versions applied by this
    /// call, oldest first (empty when up to date).
    ///
    /// # Errors
    /// [`OutboxError::Database`]; [`OutboxError::Config`] when the database holds a
    /// newer migration than this build knows.
    async fn migrate(&self) -> Result<Vec<i32>, OutboxError>;

    /// Counts by status and the oldest pending age, per `(event_type, tenant_id)`,
    /// ordered by event type then tenant (no tenant first). Scans the table.
    async fn stats_by_group(&self) -> Result<Vec<GroupStats>, OutboxError>;

    /// The relay's periodic gauges: like [`OutboxStore::stats`] but **bounded**, so it
    /// costs the same at a backlog of a million rows as at an empty table:
    ///
    /// - `new` and `processing` count the first [`PENDING_STATS_BOUND`] pending rows
    ///   in claim order; when `new + processing` equals the bound, at least that many
    ///   are pending;
    /// - `dead` counts at most [`PENDING_STATS_BOUND`] rows;
    /// - `oldest_pending_age` is the queue lag among those same rows, counted from
    ///   when each became due (see [`OutboxStats::oldest_pending_age`]);
    /// - `sent` is not counted (left 0).
    async fn pending_stats(&self) -> Result<OutboxStats, OutboxError>;

    /// How long the oldest claimable message (`New` and visible) has been waiting, by
    /// the database clock; `None` when nothing is claimable. With `ordered =
    /// Some(on_dead)` (per-key mode) a message is claimable only when no earlier
    /// message of its key is in flight, in a retry backoff or (under
    /// [`OnDead::Block`]) `Dead`. Examines a bounded number of the oldest visible
    /// messages so the cost stays flat under a large backlog.
    async fn oldest_claimable_wait(
        &self,
        ordered: Option<OnDead>,
    ) -> Result<Option<Duration>, OutboxError>;

    /// Per UTC day, tenant, event type and consumer in `[from, to)`: messages written
    /// to the outbox against those the consumer recorded as processed (and its dead
    /// letters). A consumer is expected for an event type when it has an inbox record
    /// or a consumer dead letter for at least one message of that type in the window,
    /// or when it is named in `consumers` (which also restricts the output to those
    /// consumers when not empty). Purged rows are not counted.
    ///
    /// # Errors
    /// [`OutboxError::Config`] when `to <= from`.
    async fn reconcile(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        consumers: &[String],
    ) -> Result<Vec<ReconcileRow>, OutboxError>;

    /// Moves up to `batch_size` `Sent` rows whose `sent_at` is older than `older_than`
    /// into the outbox archive table; returns how many moved. Call until it returns
    /// less than `batch_size`. Rows locked by others are skipped.
    async fn archive_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError>;

    /// Deletes up to `batch_size` inbox records (the idempotent consumer's dedup rows)
    /// older than `older_than`; returns how many went. A purged record no longer
    /// absorbs duplicates of its message. Same as the backend's
    /// [`InboxStore::purge`](crate::InboxStore::purge) on this schema.
    async fn purge_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError>;

    /// Deletes up to `batch_size` durable-inbox rows that finished (`Processed`) more
    /// than `older_than` ago; returns how many went. Same as the backend's
    /// [`DurableInbox::purge_processed`](crate::DurableInbox::purge_processed).
    async fn purge_inbox_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError>;

    /// Moves up to `batch_size` inbox records older than `older_than` into the inbox
    /// archive table; returns how many moved. The dedup caveat of
    /// [`purge_inbox_records`](Self::purge_inbox_records) applies.
    async fn archive_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError>;

    /// Consumer-side dead letters matching `filter`: idempotent-consumer dead letters
    /// then durable-inbox `Dead` rows, each oldest first, at most `limit` in all.
    async fn inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        limit: usize,
    ) -> Result<Vec<InboxDeadLetter>, OutboxError>;

    /// Makes consumer-side dead letters matching `filter` processable again, in one
    /// transaction, as `mode` says ([`InboxReplayMode::DryRun`] only counts them).
    ///
    /// - **Durable inbox** `Dead` rows go back to `New`, visible now, attempts 0; the
    ///   handlers that had succeeded keep their records and do not run again.
    /// - **Idempotent-consumer** dead letters: the message's outbox row (same id, same
    ///   schema) goes back to `New` (from `Sent` or `Dead`) so the relay publishes it
    ///   again, and the failure row is deleted. When the outbox row is gone the dead
    ///   letter is counted as `failed` and kept, unless the mode is
    ///   [`InboxReplayMode::ClearOnly`]: then only the failure rows are deleted and the
    ///   operator arranges the redelivery.
    async fn replay_inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        mode: InboxReplayMode,
    ) -> Result<InboxReplayReport, OutboxError>;

    /// One page of the outbox rows in `state` matching `filter` (its `ids`, time window
    /// on `created_at`, tenant, aggregate, event type and error text, as for
    /// [`OutboxStore::dead_letters`]), in the state's order ([`MessageState`]),
    /// starting strictly after `after` (`None`: the first page), at most `limit` rows,
    /// and the cursor that continues it ([`MessagePage::next`]).
    ///
    /// Implementations MUST page by key (`WHERE (at, seq) > cursor ORDER BY at, seq`,
    /// or `<` for the descending states), never by offset, and SHOULD walk an index
    /// of the state, so that any page costs the same at a million rows as at ten.
    ///
    /// With a filter set (any field of `filter`), implementations MUST examine at most
    /// `scan` rows of the state after `after` (the *horizon*: the key of the `scan`-th
    /// row, found on the index), so that a filter few rows match costs no more than
    /// `scan` rows per call: when fewer than `limit` rows match before the horizon,
    /// `next` is the horizon and the caller continues from there. An empty filter
    /// examines only the rows it returns. `next` is `None` once the state has no rows
    /// after those examined.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn list_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        after: Option<MessageCursor>,
        limit: usize,
        scan: u64,
    ) -> Result<MessagePage, OutboxError>;

    /// How many rows in `state` match `filter`, bounded twice so that the cost is
    /// bounded like [`pending_stats`](Self::pending_stats)': implementations MUST stop
    /// counting at `bound` matching rows, and, with a filter set, MUST examine only the
    /// first `scan` rows of the state in its order. [`MessageCount::exact`] says
    /// whether neither bound was reached.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn count_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        bound: u64,
        scan: u64,
    ) -> Result<MessageCount, OutboxError>;

    /// Rows that went `Sent` per minute over the last `minutes` minutes, by `sent_at`
    /// and the database clock ([`SentPerMinute`]). Only rows still in the table are
    /// seen: under `SentRetention::Delete`, or after a purge, they are not. The cost
    /// grows with the rows sent in the window (implementations SHOULD read them through
    /// the sent index).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn sent_per_minute(&self, minutes: u32) -> Result<SentPerMinute, OutboxError>;

    /// The outbox table's dead row versions and the oldest transaction holding back
    /// their removal ([`VacuumPressure`]); `None` from a backend without such a notion
    /// (the default). Reads statistics views only: cheap at any table size. The relay
    /// exports it as gauges and warns on `/healthz` (docs/operations.md).
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn vacuum_pressure(&self) -> Result<Option<VacuumPressure>, OutboxError> {
        Ok(None)
    }

    /// Records `beat` in the schema's `outbox_relays` table: inserts the relay's row
    /// (`started_at` and `last_seen_at` the database clock) or updates it
    /// (`last_seen_at` and the reported state), and deletes the rows of relays not
    /// heard of for a day. The relay calls it at each health check (every 5 seconds by
    /// default): one row per relay process, one small write per check.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure (e.g. the migration that adds the
    /// table not applied yet).
    async fn record_heartbeat(&self, beat: &RelayHeartbeat) -> Result<(), OutboxError>;

    /// The relays heard of within `within` (by `last_seen_at`, database clock), most
    /// recently heard first, at most `limit`.
    ///
    /// # Errors
    /// [`OutboxError::Database`] on database failure.
    async fn relays_seen(
        &self,
        within: Duration,
        limit: usize,
    ) -> Result<Vec<RelaySeen>, OutboxError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sent_per_minute_buckets_oldest_first_and_clamps() {
        let until = Utc::now();
        let s = SentPerMinute::from_ages(until, 3, &[(0, 5), (2, 1), (7, 2), (-1, 1)]);
        assert_eq!(s.counts, vec![3, 0, 6]);
        assert!(
            SentPerMinute::from_ages(until, 0, &[(0, 1)])
                .counts
                .is_empty()
        );
    }

    #[test]
    fn states_round_trip_their_names() {
        for state in [
            MessageState::Pending,
            MessageState::Dead,
            MessageState::Sent,
        ] {
            assert_eq!(MessageState::from_name(state.as_str()), Some(state));
        }
        assert_eq!(MessageState::from_name("new"), None);
    }
}
