//! [`MemoryOutbox`]: the outbox table in memory, implementing [`OutboxStore`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound::{Excluded, Unbounded};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outboxkit_core::{
    BlockedKey, CancellationToken, ClaimedBatch, CompleteReport, Completion, CompletionOutcome,
    DEFAULT_CRASH_LOOP_LIMIT, DEFAULT_MAX_PAYLOAD_BYTES, ErrorKind, MessageFilter, MessageStatus,
    NewMessage, OnDead, OutboxError, OutboxMessage, OutboxProducer, OutboxStats, OutboxStore,
    Poison, PoisonRow, ReplayReport, SentRetention, WakeHandle, headers_from_json,
    headers_from_json_lossy, sanitize_error,
};
use uuid::Uuid;

use crate::clock::{Clock, after, before};
use crate::inbox::MemoryInbox;

/// The outbox table in memory: every [`OutboxStore`] property of the contract (the
/// conformance suite checks them), and the [`OutboxProducer`] on a
/// [`MemoryOutboxTransaction`] of its own ([`begin`](Self::begin)): messages enqueued on it are
/// stored when it commits, and not at all if it is dropped uncommitted.
///
/// ```
/// use outboxkit_core::{NewMessage, OutboxProducer};
/// use outboxkit_memory::MemoryOutbox;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), outboxkit_core::OutboxError> {
/// let outbox = MemoryOutbox::new();
/// let mut tx = outbox.begin();
/// outbox
///     .enqueue(&mut tx, &NewMessage::builder("order", "1", "OrderPlaced").payload(&1).build()?)
///     .await?;
/// assert!(outbox.is_empty(), "staged, not stored");
/// tx.commit()?;
/// assert_eq!(outbox.len(), 1);
/// # Ok(())
/// # }
/// ```
///
/// All operations take one mutex for the whole table, so each is atomic, as a SQL
/// statement is: two claimers never take the same message, and a per-key claim never
/// shares a key with another. Times come from the handle's [`Clock`].
///
/// Cheap to clone: clones share the table. [`with_sent_retention`](Self::with_sent_retention)
/// gives another handle over the same table; give handles of one table one clock.
///
/// Not durable and not shared between processes: for tests, examples, and as a
/// readable reference of the contract. Its push wake-up
/// ([`spawn_wake_source`](OutboxStore::spawn_wake_source), started by the dispatcher)
/// wakes the relay on every commit that stored messages.
#[derive(Debug, Clone)]
pub struct MemoryOutbox {
    table: Arc<Mutex<Table>>,
    clock: Clock,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
    max_payload_bytes: usize,
    /// Bumped by every commit that stored messages: the store's push wake-up watches it.
    committed: Arc<tokio::sync::watch::Sender<u64>>,
    /// The records of [`inbox`](Self::inbox) (shared by clones).
    inbox: MemoryInbox,
}

impl Default for MemoryOutbox {
    fn default() -> Self {
        Self::new()
    }
}

/// One stored message with the store-side columns an [`OutboxMessage`] does not carry.
#[derive(Debug)]
struct Row {
    msg: OutboxMessage,
    /// Headers overwritten with JSON text that does not decode: the text and why.
    bad_headers: Option<(String, String)>,
    /// Claims since the last recorded outcome.
    unfinished_claims: u32,
    /// Of those, claims of the row alone (as a suspect): the crash-loop guard's count.
    unfinished_alone: u32,
    /// When the message first failed (retry or dead), for `blocked_keys`.
    first_failed_at: Option<DateTime<Utc>>,
    /// The ordering key, encoded as PostgreSQL does.
    key: String,
}

impl Row {
    /// The message with its headers as an operator sees them (bad headers made lossy).
    fn shown(&self) -> OutboxMessage {
        let mut msg = self.msg.clone();
        if let Some((text, _)) = &self.bad_headers {
            msg.headers = match serde_json::from_str(text) {
                Ok(value) => headers_from_json_lossy(value),
                Err(_) => [("(headers)".to_owned(), text.clone())].into(),
            };
        }
        msg
    }
}

/// The ordering key of a message, encoded as PostgreSQL's `order_key` column:
/// `p:<partition key>` or `a:<len(aggregate_type)>:<aggregate_type>:<aggregate_id>`.
fn encode_key(msg: &OutboxMessage) -> String {
    match &msg.partition_key {
        Some(key) => format!("p:{key}"),
        None => format!(
            "a:{}:{}:{}",
            msg.aggregate_type.len(),
            msg.aggregate_type,
            msg.aggregate_id
        ),
    }
}

/// Rows are in phase 0 (New or Processing: pending), 1 (Sent) or 3 (Dead).
fn pending(status: MessageStatus) -> bool {
    matches!(status, MessageStatus::New | MessageStatus::Processing)
}

/// What the claims walk, kept in step with every row change.
#[derive(Debug, Default)]
struct Index {
    /// Pending rows by `(visible_at, seq)`: the claim's walk.
    pending: BTreeSet<(DateTime<Utc>, i64)>,
    /// Pending rows' `seq`s per key.
    key_pending: BTreeMap<String, BTreeSet<i64>>,
    /// Dead rows' `seq`s per key.
    key_dead: HashMap<String, BTreeSet<i64>>,
}

fn set_insert<K: Ord>(map_entry: Option<&mut BTreeSet<K>>, value: K) -> Option<BTreeSet<K>> {
    match map_entry {
        Some(set) => {
            set.insert(value);
            None
        }
        None => Some(BTreeSet::from([value])),
    }
}

impl Index {
    fn insert(&mut self, status: MessageStatus, visible_at: DateTime<Utc>, seq: i64, key: &str) {
        if pending(status) {
            self.pending.insert((visible_at, seq));
            if let Some(new) = set_insert(self.key_pending.get_mut(key), seq) {
                self.key_pending.insert(key.to_owned(), new);
            }
        } else if status == MessageStatus::Dead
            && let Some(new) = set_insert(self.key_dead.get_mut(key), seq)
        {
            self.key_dead.insert(key.to_owned(), new);
        }
    }

    fn remove(&mut self, status: MessageStatus, visible_at: DateTime<Utc>, seq: i64, key: &str) {
        if pending(status) {
            self.pending.remove(&(visible_at, seq));
            if let Some(set) = self.key_pending.get_mut(key) {
                set.remove(&seq);
                if set.is_empty() {
                    self.key_pending.remove(key);
                }
            }
        } else if status == MessageStatus::Dead
            && let Some(set) = self.key_dead.get_mut(key)
        {
            set.remove(&seq);
            if set.is_empty() {
                self.key_dead.remove(key);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    rows: BTreeMap<i64, Row>,
    ids: HashMap<Uuid, i64>,
    index: Index,
    next_seq: i64,
    /// The last key of the previous ordered claim (round-robin cursor).
    cursor: String,
    /// Held rows' `seq`s by destination ([`CompletionOutcome::Hold`]).
    held: BTreeMap<String, BTreeSet<i64>>,
}

/// The `visible_at` of a held row: 9999-12-31, as the SQL stores write it.
fn held_visible_at() -> DateTime<Utc> {
    chrono::NaiveDate::from_ymd_opt(9999, 12, 31)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map_or(DateTime::<Utc>::MAX_UTC, |t| t.and_utc())
}

/// What claiming one row came to.
enum Taken {
    Message(OutboxMessage),
    Poison(PoisonRow),
}

impl Table {
    /// Changes row `seq` with `f`, keeping the index in step.
    fn update(&mut self, seq: i64, f: impl FnOnce(&mut Row)) {
        let Self { rows, index, .. } = self;
        let Some(row) = rows.get_mut(&seq) else {
            return;
        };
        let before = (row.msg.status, row.msg.visible_at);
        f(row);
        if before != (row.msg.status, row.msg.visible_at) {
            index.remove(before.0, before.1, seq, &row.key);
            index.insert(row.msg.status, row.msg.visible_at, seq, &row.key);
        }
    }

    fn delete(&mut self, seq: i64) {
        if let Some(row) = self.rows.remove(&seq) {
            self.ids.remove(&row.msg.id);
            self.index
                .remove(row.msg.status, row.msg.visible_at, seq, &row.key);
        }
    }

    /// New and visible, or Processing with an expired lease.
    /// Whether row `seq` is a suspect: Processing with an expired lease (its last claim
    /// ended without an outcome).
    fn suspect(&self, seq: i64) -> bool {
        self.rows
            .get(&seq)
            .is_some_and(|row| row.msg.status == MessageStatus::Processing)
    }

    /// The crash-loop guard's isolation, on `picked` claimable rows in claim order: the
    /// first alone when it is a suspect, else every row that is not one.
    fn isolate(&self, picked: Vec<i64>) -> Vec<i64> {
        match picked.first() {
            Some(&first) if self.suspect(first) => vec![first],
            _ => picked
                .into_iter()
                .filter(|&seq| !self.suspect(seq))
                .collect(),
        }
    }

    fn claimable(&self, seq: i64, now: DateTime<Utc>) -> bool {
        self.rows.get(&seq).is_some_and(|row| match row.msg.status {
            MessageStatus::New => row.msg.visible_at <= now,
            MessageStatus::Processing => row.msg.lease_until.is_none_or(|l| l < now),
            _ => false,
        })
    }

    /// Claims row `seq` under `token`, or moves it to Dead when the crash-loop guard
    /// catches it.
    fn take(
        &mut self,
        seq: i64,
        now: DateTime<Utc>,
        lease: Duration,
        token: Uuid,
        crash_loop_limit: u32,
    ) -> Option<Taken> {
        let alone = self.suspect(seq);
        let (claims, claims_alone) = {
            let row = self.rows.get(&seq)?;
            (row.unfinished_claims, row.unfinished_alone)
        };
        if alone && claims_alone >= crash_loop_limit {
            self.update(seq, |row| {
                row.msg.status = MessageStatus::Dead;
                row.msg.lease_until = None;
                row.msg.claim_token = None;
                row.msg.last_error = Some(crash_loop_error(claims, claims_alone));
                row.first_failed_at.get_or_insert(now);
            });
            let row = self.rows.get(&seq)?;
            return Some(Taken::Poison(poison_row(
                row,
                Poison::CrashLoop { claims_alone },
            )));
        }
        self.update(seq, |row| {
            row.msg.status = MessageStatus::Processing;
            row.msg.lease_until = Some(after(now, lease));
            row.msg.claim_token = Some(token);
            row.msg.attempts = row.msg.attempts.saturating_add(1);
            row.unfinished_claims += 1;
            row.unfinished_alone += u32::from(alone);
        });
        let row = self.rows.get(&seq)?;
        Some(match &row.bad_headers {
            Some((_, reason)) => Taken::Poison(poison_row(
                row,
                Poison::Undecodable {
                    claim_token: token,
                    reason: reason.clone(),
                },
            )),
            None => Taken::Message(row.msg.clone()),
        })
    }

    fn take_all(
        &mut self,
        mut seqs: Vec<i64>,
        now: DateTime<Utc>,
        lease: Duration,
        crash_loop_limit: u32,
    ) -> ClaimedBatch {
        seqs.sort_unstable();
        let token = Uuid::new_v4();
        let mut messages = Vec::with_capacity(seqs.len());
        let mut poison = Vec::new();
        for seq in seqs {
            match self.take(seq, now, lease, token, crash_loop_limit) {
                Some(Taken::Message(m)) => messages.push(m),
                Some(Taken::Poison(p)) => poison.push(p),
                None => {}
            }
        }
        ClaimedBatch::new(messages, poison)
    }

    /// Row `seq` is held no more (claimed as a trial, or released): visible now.
    fn unhold(&mut self, dest: &str, seq: i64, now: DateTime<Utc>) {
        if let Some(set) = self.held.get_mut(dest) {
            set.remove(&seq);
            if set.is_empty() {
                self.held.remove(dest);
            }
        }
        self.update(seq, |row| row.msg.visible_at = now);
    }

    /// Whether row `seq` heads its key: no earlier pending row of its key, nor (with
    /// `block`) an earlier Dead one.
    fn heads_its_key(&self, seq: i64, block: bool) -> bool {
        let Some(row) = self.rows.get(&seq) else {
            return false;
        };
        let first = |set: Option<&BTreeSet<i64>>| set.and_then(|s| s.first().copied());
        first(self.index.key_pending.get(&row.key)).is_none_or(|f| f >= seq)
            && !(block && first(self.index.key_dead.get(&row.key)).is_some_and(|d| d < seq))
    }

    /// The keys of an ordered claim, walked from after the cursor, wrapping around.
    fn keys_from_cursor(&self) -> impl Iterator<Item = (&String, &BTreeSet<i64>)> {
        let cursor = self.cursor.as_str();
        self.index
            .key_pending
            .range::<str, _>((Excluded(cursor), Unbounded))
            .chain(
                self.index
                    .key_pending
                    .range::<str, _>((Unbounded, std::ops::Bound::Included(cursor))),
            )
    }

    /// Whether a Dead row of `key` lies strictly between `from` and `to` (`seq`s).
    fn dead_between(&self, key: &str, from: i64, to: i64) -> bool {
        from < to
            && self
                .index
                .key_dead
                .get(key)
                .is_some_and(|dead| dead.range(from + 1..to).next().is_some())
    }

    /// The rows an ordered claim takes, as PostgreSQL's statement picks them: up to
    /// `batch_size` keys whose head is claimable (and, under Block, not behind a Dead
    /// row), up to `batch_size / keys` rows of each key's run from its head (under
    /// Block, stopping at the next Dead row), the claimable prefix of each run, and of
    /// all of them the first `batch_size` by `seq`.
    fn ordered_pick(&self, batch_size: usize, now: DateTime<Utc>, block: bool) -> Vec<i64> {
        let mut heads: Vec<(&str, &BTreeSet<i64>, i64)> = Vec::new();
        for (key, seqs) in self.keys_from_cursor() {
            if heads.len() >= batch_size {
                break;
            }
            let Some(&head) = seqs.first() else { continue };
            let behind_dead = block
                && self
                    .index
                    .key_dead
                    .get(key.as_str())
                    .is_some_and(|dead| dead.first().is_some_and(|&d| d < head));
            if self.claimable(head, now) && !behind_dead {
                heads.push((key, seqs, head));
            }
        }
        if heads.is_empty() {
            return Vec::new();
        }
        // A suspect head is claimed alone (the first in `seq` order).
        if let Some(&(_, _, head)) = heads
            .iter()
            .filter(|&&(_, _, head)| self.suspect(head))
            .min_by_key(|&&(_, _, head)| head)
        {
            return vec![head];
        }
        let per_key = (batch_size / heads.len()).max(1);
        let mut picked = Vec::new();
        for (key, seqs, head) in heads {
            for &seq in seqs.range(head..).take(per_key) {
                // A run stops before a suspect: it will be a head, claimed alone.
                if (block && self.dead_between(key, head, seq))
                    || !self.claimable(seq, now)
                    || self.suspect(seq)
                {
                    break;
                }
                picked.push(seq);
            }
        }
        picked.sort_unstable();
        picked.truncate(batch_size);
        picked
    }
}

/// The `last_error` of a row the crash-loop guard moved to Dead, as PostgreSQL words it.
fn crash_loop_error(claims: u32, claims_alone: u32) -> String {
    format!(
        "suspected crash loop: claimed alone {claims_alone} times without an outcome ({claims} claims without an outcome in all; each relay holding it stopped, crashed or lost its lease before recording one); replay it once the cause is fixed"
    )
}

fn poison_row(row: &Row, poison: Poison) -> PoisonRow {
    PoisonRow {
        id: row.msg.id,
        seq: row.msg.seq,
        aggregate_type: row.msg.aggregate_type.clone(),
        aggregate_id: row.msg.aggregate_id.clone(),
        partition_key: row.msg.partition_key.clone(),
        poison,
    }
}

fn matches(filter: &MessageFilter, m: &OutboxMessage) -> bool {
    let eq =
        |want: &Option<String>, have: Option<&str>| want.as_deref().is_none_or(|w| have == Some(w));
    m.status == MessageStatus::Dead
        && (filter.ids.is_empty() || filter.ids.contains(&m.id))
        && filter.from.is_none_or(|from| m.created_at >= from)
        && filter.to.is_none_or(|to| m.created_at < to)
        && eq(&filter.tenant_id, m.tenant_id.as_deref())
        && eq(&filter.aggregate_type, Some(&m.aggregate_type))
        && eq(&filter.aggregate_id, Some(&m.aggregate_id))
        && eq(&filter.event_type, Some(&m.event_type))
        && filter.error_contains.as_deref().is_none_or(|text| {
            m.last_error
                .as_deref()
                .is_some_and(|e| e.to_lowercase().contains(&text.to_lowercase()))
        })
}

impl MemoryOutbox {
    /// An empty outbox with the defaults: a [`Clock::tokio`] clock,
    /// [`SentRetention::Keep`], the crash-loop limit [`DEFAULT_CRASH_LOOP_LIMIT`] and a
    /// payload limit of [`DEFAULT_MAX_PAYLOAD_BYTES`].
    pub fn new() -> Self {
        Self {
            table: Arc::default(),
            clock: Clock::default(),
            sent_retention: SentRetention::Keep,
            crash_loop_limit: DEFAULT_CRASH_LOOP_LIMIT,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            committed: Arc::new(tokio::sync::watch::Sender::new(0)),
            inbox: MemoryInbox::new(),
        }
    }

    /// The inbox beside this outbox, on the same clock: the one way to have a
    /// [`MemoryInbox`], as `PgOutbox::inbox` is on PostgreSQL. Every call (and every
    /// clone's) gives a handle over the same records.
    pub fn inbox(&self) -> MemoryInbox {
        self.inbox.clone().with_clock(self.clock.clone())
    }

    /// Nothing to create: the tables are in memory from [`new`](Self::new). Returns no
    /// version, so that code written against a SQL store's `migrate` (which returns the
    /// versions it applied) runs unchanged.
    ///
    /// # Errors
    /// None; the `Result` is the SQL stores' shape.
    pub async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        Ok(Vec::new())
    }

    /// Takes every time from `clock` (default [`Clock::tokio`]). Set it before
    /// enqueueing: times already recorded are not moved.
    #[must_use]
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// A handle over the same table whose `Sent` completions follow `retention`
    /// (default [`SentRetention::Keep`]).
    #[must_use]
    pub fn with_sent_retention(mut self, retention: SentRetention) -> Self {
        self.sent_retention = retention;
        self
    }

    /// Claims without an outcome after which a claim moves a row to `Dead` (default
    /// [`DEFAULT_CRASH_LOOP_LIMIT`]; at least 1).
    #[must_use]
    pub fn with_crash_loop_limit(mut self, limit: u32) -> Self {
        self.crash_loop_limit = limit.max(1);
        self
    }

    /// The longest payload `enqueue` accepts, in bytes of JSON text (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`]).
    #[must_use]
    pub fn with_max_payload_bytes(mut self, max: usize) -> Self {
        self.max_payload_bytes = max;
        self
    }

    /// The clock the store takes its times from.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    fn lock(&self, operation: &'static str) -> Result<MutexGuard<'_, Table>, OutboxError> {
        self.table.lock().map_err(|_| OutboxError::Database {
            kind: ErrorKind::Permanent,
            operation,
            source: "the in-memory table's lock is poisoned (a thread panicked holding it)".into(),
        })
    }

    /// Begins a transaction: messages [`enqueue`](OutboxProducer::enqueue)d on it
    /// (`&mut tx`) are staged in it, invisible to every claim, until
    /// [`MemoryOutboxTransaction::commit`] stores them all at once; a transaction dropped (or
    /// [rolled back](MemoryOutboxTransaction::rollback)) uncommitted stores nothing.
    pub fn begin(&self) -> MemoryOutboxTransaction {
        MemoryOutboxTransaction {
            outbox: self.clone(),
            staged: Vec::new(),
        }
    }

    /// Stores `messages` at once, in order: `New`, `created_at = now`, visible after
    /// their `deliver_after` delay, the next `seq`s. Returns their ids.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] when a payload is longer than the payload limit;
    /// [`OutboxError::Database`] with [`ErrorKind::Permanent`] when an id is already
    /// stored or repeated in `messages` (a primary key violation). Nothing is stored
    /// then.
    fn store(&self, messages: Vec<NewMessage>) -> Result<Vec<Uuid>, OutboxError> {
        let mut fresh = std::collections::HashSet::with_capacity(messages.len());
        for m in &messages {
            m.check_payload_size(self.max_payload_bytes)?;
            if !fresh.insert(m.id) {
                return Err(duplicate(m.id));
            }
        }
        let mut table = self.lock("commit")?;
        if let Some(m) = messages.iter().find(|m| table.ids.contains_key(&m.id)) {
            return Err(duplicate(m.id));
        }
        let now = self.clock.now();
        let mut ids = Vec::with_capacity(messages.len());
        for new in messages {
            table.next_seq += 1;
            let seq = table.next_seq;
            let visible_at = after(now, new.deliver_after.unwrap_or_default());
            let mut msg = OutboxMessage::claimed_from(new, now);
            msg.seq = seq;
            msg.visible_at = visible_at;
            msg.attempts = 0;
            msg.status = MessageStatus::New;
            msg.claim_token = None;
            let key = encode_key(&msg);
            table.index.insert(msg.status, msg.visible_at, seq, &key);
            table.ids.insert(msg.id, seq);
            ids.push(msg.id);
            table.rows.insert(
                seq,
                Row {
                    msg,
                    bad_headers: None,
                    unfinished_claims: 0,
                    unfinished_alone: 0,
                    first_failed_at: None,
                    key,
                },
            );
        }
        drop(table);
        if !ids.is_empty() {
            self.committed.send_modify(|n| *n = n.wrapping_add(1));
        }
        Ok(ids)
    }

    /// Overwrites the stored headers of message `id` with the JSON text `json`, as a
    /// trigger, a migration or another language's producer might write them: a fault
    /// injection. Text that is not a JSON object of strings makes the row poison
    /// ([`Poison::Undecodable`]) at its next claim. Returns whether the message exists.
    #[doc(hidden)] // reason: a fault-injection hook for the shared store suites, not API
    pub fn set_headers_json(&self, id: Uuid, json: &str) -> bool {
        let Ok(mut table) = self.lock("set_headers_json") else {
            return false;
        };
        let Some(&seq) = table.ids.get(&id) else {
            return false;
        };
        let decoded = serde_json::from_str(json)
            .map_err(|e| format!("headers are not JSON: {e}"))
            .and_then(headers_from_json);
        table.update(seq, |row| match decoded {
            Ok(headers) => {
                row.msg.headers = headers;
                row.bad_headers = None;
            }
            Err(reason) => row.bad_headers = Some((json.to_owned(), reason)),
        });
        true
    }

    /// Every stored message, in `seq` order (a snapshot, for assertions).
    pub fn messages(&self) -> Vec<OutboxMessage> {
        self.lock("messages")
            .map(|t| t.rows.values().map(Row::shown).collect())
            .unwrap_or_default()
    }

    /// Stored messages with status `status`, in `seq` order.
    pub fn messages_with_status(&self, status: MessageStatus) -> Vec<OutboxMessage> {
        self.lock("messages")
            .map(|t| {
                t.rows
                    .values()
                    .filter(|r| r.msg.status == status)
                    .map(Row::shown)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Number of stored messages, whatever their status.
    pub fn len(&self) -> usize {
        self.lock("len").map(|t| t.rows.len()).unwrap_or_default()
    }

    /// Whether no message is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn duplicate(id: Uuid) -> OutboxError {
    OutboxError::Database {
        kind: ErrorKind::Permanent,
        operation: "enqueue",
        source: format!("duplicate message id {id}").into(),
    }
}

/// A transaction of a [`MemoryOutbox`] ([`MemoryOutbox::begin`]), the
/// [`Connection`](OutboxProducer::Connection) its [`OutboxProducer`] writes on: the
/// messages enqueued on it are staged, invisible to every claim, until
/// [`commit`](Self::commit) stores them all at once. Dropped without a commit (or
/// [rolled back](Self::rollback)) it stores nothing.
#[derive(Debug)]
#[must_use = "a transaction dropped without `commit` stores nothing"]
pub struct MemoryOutboxTransaction {
    outbox: MemoryOutbox,
    staged: Vec<NewMessage>,
}

impl MemoryOutboxTransaction {
    /// Stores every staged message atomically, in the order enqueued (their `seq`s
    /// follow it), as the outbox that began the transaction: `New`, `created_at = now`,
    /// visible after each message's `deliver_after` delay. Wakes the relays watching the
    /// store (its push wake-up).
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] when a payload is longer than the outbox's
    /// payload limit; [`OutboxError::Database`] with [`ErrorKind::Permanent`] when an
    /// id is already stored (committed by another transaction since it was enqueued) or
    /// was enqueued twice (a primary key violation). Nothing of the transaction is
    /// stored then.
    pub fn commit(self) -> Result<(), OutboxError> {
        self.outbox.store(self.staged).map(drop)
    }

    /// Discards the staged messages (as dropping the transaction does).
    pub fn rollback(self) {}

    /// The messages staged so far, in order.
    pub fn staged(&self) -> &[NewMessage] {
        &self.staged
    }
}

/// Stages the messages in the caller's [`MemoryOutboxTransaction`]; see
/// [`MemoryOutboxTransaction::commit`] for when they are stored.
#[async_trait]
impl OutboxProducer for MemoryOutbox {
    type Connection = MemoryOutboxTransaction;

    /// Stages `messages` in `conn`, after the checks a SQL store's insert makes: every
    /// payload within the payload limit, and no id already stored, staged or repeated
    /// in `messages`. Returns their ids.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] when a payload is longer than the payload limit;
    /// [`OutboxError::Database`] with [`ErrorKind::Permanent`] for a duplicate id;
    /// [`OutboxError::Config`] when `conn` was begun by a store over another table.
    /// Nothing of the batch is staged then.
    async fn enqueue_batch(
        &self,
        conn: &mut MemoryOutboxTransaction,
        messages: &[NewMessage],
    ) -> Result<Vec<Uuid>, OutboxError> {
        if !Arc::ptr_eq(&self.table, &conn.outbox.table) {
            return Err(OutboxError::Config(
                "this MemoryOutboxTransaction was begun by a MemoryOutbox over another table"
                    .to_owned(),
            ));
        }
        let mut fresh: std::collections::HashSet<Uuid> = conn.staged.iter().map(|m| m.id).collect();
        for m in messages {
            m.check_payload_size(self.max_payload_bytes)?;
            if !fresh.insert(m.id) {
                return Err(duplicate(m.id));
            }
        }
        {
            let table = self.lock("enqueue")?;
            if let Some(m) = messages.iter().find(|m| table.ids.contains_key(&m.id)) {
                return Err(duplicate(m.id));
            }
        }
        conn.staged.extend_from_slice(messages);
        Ok(messages.iter().map(|m| m.id).collect())
    }
}

#[async_trait]
impl OutboxStore for MemoryOutbox {
    async fn claim(&self, batch_size: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError> {
        let mut table = self.lock("claim")?;
        let now = self.clock.now();
        let picked: Vec<i64> = table
            .index
            .pending
            .range(..=(now, i64::MAX))
            .map(|&(_, seq)| seq)
            .filter(|&seq| table.claimable(seq, now))
            .take(batch_size)
            .collect();
        let picked = table.isolate(picked);
        Ok(table.take_all(picked, now, lease, self.crash_loop_limit))
    }

    async fn claim_ordered(
        &self,
        batch_size: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        let mut table = self.lock("claim_ordered")?;
        let now = self.clock.now();
        let picked = table.ordered_pick(batch_size, now, on_dead == OnDead::Block);
        // The next ordered claim starts after the last key visited, as PostgreSQL's.
        let cursor = table.cursor.clone();
        let (mut after_cursor, mut wrapped): (Option<&str>, Option<&str>) = (None, None);
        for seq in &picked {
            let Some(row) = table.rows.get(seq) else {
                continue;
            };
            let key = row.key.as_str();
            let slot = if key > cursor.as_str() {
                &mut after_cursor
            } else {
                &mut wrapped
            };
            if slot.is_none_or(|k| key > k) {
                *slot = Some(key);
            }
        }
        if let Some(last) = wrapped.or(after_cursor) {
            table.cursor = last.to_owned();
        }
        Ok(table.take_all(picked, now, lease, self.crash_loop_limit))
    }

    async fn blocked_keys(&self, limit: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        let table = self.lock("blocked_keys")?;
        let now = self.clock.now();
        let mut keys: BTreeSet<&str> = table.index.key_dead.keys().map(String::as_str).collect();
        for &(_, seq) in table
            .index
            .pending
            .range((Excluded((now, i64::MAX)), Unbounded))
        {
            if let Some(row) = table.rows.get(&seq)
                && row.msg.status == MessageStatus::New
                && row.msg.attempts > 0
            {
                keys.insert(&row.key);
            }
        }
        let mut blocked: Vec<(Option<DateTime<Utc>>, i64, BlockedKey)> = Vec::new();
        for key in keys {
            let first_pending = table
                .index
                .key_pending
                .get(key)
                .and_then(|s| s.first().copied());
            let first_dead = table
                .index
                .key_dead
                .get(key)
                .and_then(|s| s.first().copied());
            let Some(head) = first_pending.into_iter().chain(first_dead).min() else {
                continue;
            };
            let Some(row) = table.rows.get(&head) else {
                continue;
            };
            let m = &row.msg;
            let is_blocked = m.status == MessageStatus::Dead
                || (m.status == MessageStatus::New && m.attempts > 0 && m.visible_at > now);
            if !is_blocked {
                continue;
            }
            let waiting = table
                .index
                .key_pending
                .get(key)
                .map_or(0, |s| s.range(head + 1..).count() as u64);
            blocked.push((
                row.first_failed_at,
                head,
                BlockedKey::new(
                    key.to_owned(),
                    m.id,
                    m.seq,
                    m.status,
                    m.attempts,
                    m.last_error.clone(),
                    row.first_failed_at,
                    (m.status == MessageStatus::New).then_some(m.visible_at),
                    waiting,
                ),
            ));
        }
        // Longest blocked first (NULLS LAST), then by seq.
        blocked.sort_by_key(|(since, seq, _)| (since.is_none(), *since, *seq));
        Ok(blocked
            .into_iter()
            .take(limit)
            .map(|(_, _, key)| key)
            .collect())
    }

    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        let mut table = self.lock("complete")?;
        let now = self.clock.now();
        let mut report = CompleteReport::default();
        for c in completions {
            if let CompletionOutcome::Hold { destination, .. } = &c.outcome
                && let Some(&seq) = table.ids.get(&c.id)
                && table.rows.get(&seq).is_some_and(|row| {
                    row.msg.status == MessageStatus::Processing
                        && row.msg.claim_token == Some(c.claim_token)
                })
            {
                table
                    .held
                    .entry(destination.clone())
                    .or_default()
                    .insert(seq);
            }
            let seq = table.ids.get(&c.id).copied().filter(|seq| {
                table.rows.get(seq).is_some_and(|row| {
                    row.msg.status == MessageStatus::Processing
                        && row.msg.claim_token == Some(c.claim_token)
                })
            });
            let Some(seq) = seq else {
                report.fenced.push(c.id);
                continue;
            };
            report.applied += 1;
            if c.outcome == CompletionOutcome::Sent && self.sent_retention == SentRetention::Delete
            {
                table.delete(seq);
                continue;
            }
            table.update(seq, |row| {
                let m = &mut row.msg;
                m.lease_until = None;
                m.claim_token = None;
                m.sent_at = None;
                row.unfinished_claims = 0;
                row.unfinished_alone = 0;
                match &c.outcome {
                    CompletionOutcome::Sent => {
                        m.status = MessageStatus::Sent;
                        m.sent_at = Some(now);
                    }
                    CompletionOutcome::Retry { delay, error } => {
                        m.status = MessageStatus::New;
                        m.visible_at = after(now, *delay);
                        m.last_error = Some(sanitize_error(error).into_owned());
                        row.first_failed_at.get_or_insert(now);
                    }
                    CompletionOutcome::Dead { error } => {
                        m.status = MessageStatus::Dead;
                        m.last_error = Some(sanitize_error(error).into_owned());
                        row.first_failed_at.get_or_insert(now);
                    }
                    CompletionOutcome::Release => {
                        m.status = MessageStatus::New;
                        m.attempts = (m.attempts - 1).max(0);
                    }
                    CompletionOutcome::Hold { error, .. } => {
                        m.status = MessageStatus::New;
                        m.attempts = (m.attempts - 1).max(0);
                        m.visible_at = held_visible_at();
                        m.last_error = Some(sanitize_error(error).into_owned());
                        row.first_failed_at.get_or_insert(now);
                    }
                }
            });
        }
        Ok(report)
    }

    async fn claim_held(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        let mut table = self.lock("claim_held")?;
        let now = self.clock.now();
        let block = order == Some(OnDead::Block);
        let mut picked = Vec::new();
        for dest in destinations {
            let first = table.held.get(dest).and_then(|set| {
                set.iter()
                    .copied()
                    .find(|&seq| order.is_none() || table.heads_its_key(seq, block))
            });
            if let Some(seq) = first {
                table.unhold(dest, seq, now);
                picked.push(seq);
            }
        }
        Ok(table.take_all(picked, now, lease, self.crash_loop_limit))
    }

    async fn release_held(&self, destination: &str, limit: usize) -> Result<u64, OutboxError> {
        let mut table = self.lock("release_held")?;
        let now = self.clock.now();
        let seqs: Vec<i64> = table
            .held
            .get(destination)
            .map(|set| set.iter().copied().take(limit).collect())
            .unwrap_or_default();
        for &seq in &seqs {
            table.unhold(destination, seq, now);
        }
        Ok(seqs.len() as u64)
    }

    async fn held_destinations(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>, OutboxError> {
        let table = self.lock("held_destinations")?;
        Ok(table
            .held
            .range::<str, _>((Excluded(after), Unbounded))
            .take(limit)
            .map(|(d, _)| d.clone())
            .collect())
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        let table = self.lock("get")?;
        Ok(table
            .ids
            .get(&id)
            .and_then(|seq| table.rows.get(seq))
            .map(Row::shown))
    }

    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        let table = self.lock("stats")?;
        let now = self.clock.now();
        let mut stats = OutboxStats::default();
        let mut oldest: Option<DateTime<Utc>> = None;
        for row in table.rows.values() {
            match row.msg.status {
                MessageStatus::New => stats.new += 1,
                MessageStatus::Processing => stats.processing += 1,
                MessageStatus::Sent => stats.sent += 1,
                MessageStatus::Dead => stats.dead += 1,
            }
            // Due from visible_at, or from the first failure when earlier (the SQL
            // stores' `LEAST(visible_at, first_failed_at)`); not late before it is due.
            let due = row
                .first_failed_at
                .map_or(row.msg.visible_at, |f| f.min(row.msg.visible_at));
            if pending(row.msg.status) && due <= now {
                oldest = Some(oldest.map_or(due, |o| o.min(due)));
            }
        }
        stats.oldest_pending_age = oldest.map(|o| (now - o).to_std().unwrap_or_default());
        Ok(stats)
    }

    async fn dead_letters(
        &self,
        filter: &MessageFilter,
        limit: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        let table = self.lock("dead_letters")?;
        let mut dead: Vec<&Row> = table
            .rows
            .values()
            .filter(|row| matches(filter, &row.msg))
            .collect();
        dead.sort_by_key(|row| (row.msg.created_at, row.msg.seq));
        Ok(dead.into_iter().take(limit).map(Row::shown).collect())
    }

    async fn replay(
        &self,
        filter: &MessageFilter,
        dry_run: bool,
    ) -> Result<ReplayReport, OutboxError> {
        let started = std::time::Instant::now();
        let mut table = self.lock("replay")?;
        let now = self.clock.now();
        let seqs: Vec<i64> = table
            .rows
            .iter()
            .filter(|(_, row)| matches(filter, &row.msg))
            .map(|(&seq, _)| seq)
            .collect();
        let matched = seqs.len() as u64;
        if !dry_run {
            for &seq in &seqs {
                table.update(seq, |row| {
                    row.msg.status = MessageStatus::New;
                    row.msg.attempts = 0;
                    row.msg.visible_at = now;
                    row.msg.lease_until = None;
                    row.msg.claim_token = None;
                    row.unfinished_claims = 0;
                    row.unfinished_alone = 0;
                });
            }
        }
        Ok(ReplayReport {
            matched,
            replayed: if dry_run { 0 } else { matched },
            failed: 0,
            elapsed: started.elapsed(),
        })
    }

    async fn purge_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        let mut table = self.lock("purge_sent")?;
        let cutoff = before(self.clock.now(), older_than);
        let seqs: Vec<i64> = table
            .rows
            .iter()
            .filter(|(_, row)| {
                row.msg.status == MessageStatus::Sent
                    && row.msg.sent_at.is_some_and(|at| at <= cutoff)
            })
            .map(|(&seq, _)| seq)
            .take(batch_size)
            .collect();
        for &seq in &seqs {
            table.delete(seq);
        }
        Ok(seqs.len() as u64)
    }

    /// Wakes the relay after every [`MemoryOutboxTransaction::commit`] that stored messages
    /// (on any handle over this table), until `shutdown` is cancelled or every handle
    /// of the table is dropped.
    fn spawn_wake_source(
        &self,
        wake: WakeHandle,
        shutdown: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        // Subscribed before returning, so a commit right after is not missed; one
        // wake-up now for a commit before it.
        let mut committed = self.committed.subscribe();
        wake.wake();
        Some(tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = committed.changed() => match changed {
                        Ok(()) => wake.wake(),
                        Err(_) => return, // every handle of the table is gone
                    },
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use outboxkit_core::InvalidMessage;

    use super::*;

    #[tokio::test]
    async fn a_manual_clock_drives_leases_and_delays() {
        let clock = Clock::manual(Utc::now());
        let store = MemoryOutbox::new().with_clock(clock.clone());
        let later = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&1)
            .deliver_after(Duration::from_secs(5))
            .build()
            .expect("valid");
        let mut tx = store.begin();
        let id = store.enqueue(&mut tx, &later).await.expect("enqueue");
        tx.commit().expect("commit");
        let lease = Duration::from_secs(10);
        assert!(store.claim(10, lease).await.expect("claim").is_empty());
        assert!(clock.advance(Duration::from_secs(5)));
        let first = store.claim(10, lease).await.expect("claim").messages;
        assert_eq!(first.len(), 1, "visible once its delay has passed");
        assert_eq!(first[0].lease_until, Some(after(clock.now(), lease)));
        clock.advance(lease);
        assert!(
            store.claim(10, lease).await.expect("claim").is_empty(),
            "a lease ending exactly now still holds"
        );
        clock.advance(Duration::from_millis(1));
        let second = store.claim(10, lease).await.expect("claim").messages;
        assert_eq!((second[0].id, second[0].attempts), (id, 2), "reclaimed");
    }

    fn message(aggregate_id: &str) -> NewMessage {
        NewMessage::builder("order", aggregate_id, "OrderPlaced")
            .payload(&1)
            .build()
            .expect("valid")
    }

    fn ids(messages: &[OutboxMessage]) -> Vec<Uuid> {
        messages.iter().map(|m| m.id).collect()
    }

    #[tokio::test]
    async fn a_commit_stores_every_staged_message_in_order() {
        let store = MemoryOutbox::new();
        let mut tx = store.begin();
        let first = store
            .enqueue(&mut tx, &message("1"))
            .await
            .expect("enqueue");
        let rest = store
            .enqueue_batch(&mut tx, &[message("2"), message("3")])
            .await
            .expect("enqueue_batch");
        assert_eq!(tx.staged().len(), 3);
        assert!(store.is_empty(), "staged, not stored, before the commit");
        assert!(
            store
                .claim(10, Duration::from_secs(30))
                .await
                .expect("claim")
                .is_empty(),
            "a claim sees nothing uncommitted"
        );
        tx.commit().expect("commit");
        let stored = store.messages();
        assert_eq!(
            ids(&stored),
            [vec![first], rest].concat(),
            "in enqueue order"
        );
        assert!(stored.windows(2).all(|w| w[0].seq < w[1].seq));
        assert!(stored.iter().all(|m| m.status == MessageStatus::New));
    }

    #[tokio::test]
    async fn a_transaction_rolled_back_or_dropped_stores_nothing() {
        let store = MemoryOutbox::new();
        let mut rolled_back = store.begin();
        store
            .enqueue(&mut rolled_back, &message("1"))
            .await
            .expect("enqueue");
        rolled_back.rollback();
        {
            let mut dropped = store.begin();
            store
                .enqueue(&mut dropped, &message("2"))
                .await
                .expect("enqueue");
        }
        assert!(store.is_empty());
        store.begin().commit().expect("an empty commit");
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn an_oversized_payload_is_refused_at_enqueue_and_stages_nothing() {
        let store = MemoryOutbox::new().with_max_payload_bytes(8);
        let big = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&"0123456789")
            .build()
            .expect("valid");
        let mut tx = store.begin();
        let err = store
            .enqueue_batch(&mut tx, &[message("1"), big.clone()])
            .await
            .expect_err("too large");
        assert!(
            matches!(
                err,
                OutboxError::InvalidMessage(InvalidMessage::PayloadTooLarge { max: 8, .. })
            ),
            "{err}"
        );
        assert!(tx.staged().is_empty(), "nothing of the batch is staged");
        // Staged through a handle with a larger limit, the commit still checks the
        // limit of the outbox that began the transaction.
        let roomy = store.clone().with_max_payload_bytes(1024);
        roomy
            .enqueue(&mut tx, &big)
            .await
            .expect("within 1024 bytes");
        let err = tx
            .commit()
            .expect_err("over the limit of the beginning store");
        assert!(matches!(err, OutboxError::InvalidMessage(_)), "{err}");
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn duplicate_ids_are_refused_and_a_failed_commit_stores_nothing() {
        let store = MemoryOutbox::new();
        let taken = message("1");
        let mut tx = store.begin();
        store.enqueue(&mut tx, &taken).await.expect("enqueue");
        let err = store
            .enqueue(&mut tx, &taken)
            .await
            .expect_err("staged already");
        assert!(
            matches!(
                err,
                OutboxError::Database {
                    kind: ErrorKind::Permanent,
                    ..
                }
            ),
            "{err}"
        );
        // Two transactions stage the same id; the second to commit loses, whole.
        let mut other = store.begin();
        store
            .enqueue(&mut other, &message("2"))
            .await
            .expect("enqueue");
        store
            .enqueue(&mut other, &taken)
            .await
            .expect("not stored yet");
        tx.commit().expect("commit");
        let err = other.commit().expect_err("the id is taken now");
        assert!(
            matches!(
                err,
                OutboxError::Database {
                    kind: ErrorKind::Permanent,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            ids(&store.messages()),
            [taken.id],
            "nothing of the failed commit"
        );
        let mut late = store.begin();
        let err = store
            .enqueue(&mut late, &taken)
            .await
            .expect_err("stored already");
        assert!(matches!(err, OutboxError::Database { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_transaction_belongs_to_its_table() {
        let store = MemoryOutbox::new();
        let mut elsewhere = MemoryOutbox::new().begin();
        let err = store
            .enqueue(&mut elsewhere, &message("1"))
            .await
            .expect_err("another table");
        assert!(matches!(err, OutboxError::Config(_)), "{err}");
    }

    #[tokio::test]
    async fn save_events_drains_the_aggregate_into_the_transaction() {
        let store = MemoryOutbox::new();
        let mut events = outboxkit_core::DomainEvents::new();
        events.raise(message("1"));
        events.raise(message("2"));
        let mut tx = store.begin();
        let saved = store.save_events(&mut tx, &mut events).await.expect("save");
        assert!(events.pending().is_empty());
        tx.commit().expect("commit");
        assert_eq!(ids(&store.messages()), saved);
    }
}
