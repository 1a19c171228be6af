//! [`MemoryInbox`]: the consumer's dedup records in memory, implementing
//! [`InboxStore`], [`ConsumerDeadLetters`] and [`VersionTracking`].

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{
    ConsumerDeadLetter, ConsumerDeadLetters, FailureCount, InboxStore, OutboxError, VersionTracking,
};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::clock::{Clock, before};

/// A record a transaction locks until it ends, as a SQL row lock.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum LockKey {
    Claim(Uuid, String),
    Version(String, String, String),
}

#[derive(Debug, Default)]
struct State {
    /// Committed `(message_id, consumer)` records and when they were written.
    records: HashMap<(Uuid, String), DateTime<Utc>>,
    /// Failures counted per `(message_id, consumer)`.
    failures: HashMap<(Uuid, String), u32>,
    /// Consumer dead letters by `(message_id, consumer)`.
    dead: HashMap<(Uuid, String), ConsumerDeadLetter>,
    /// Last applied version per `(consumer, aggregate_type, aggregate_id)`.
    versions: HashMap<(String, String, String), i64>,
    /// Records locked by live transactions, and by which.
    locks: HashMap<LockKey, u64>,
    next_tx: u64,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a transaction ends (its locks are released).
    released: Notify,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; recover anyway rather than cascade.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The inbox records in memory. Records claimed inside a [`MemoryTransaction`] become
/// visible to others when it commits and vanish when it rolls back (or is dropped).
/// A record claimed by a live transaction is locked: a second transaction claiming it
/// waits until the first ends, then sees the duplicate or claims it, as with a SQL
/// unique row. Cheap to clone: clones share the records.
///
/// Not durable and not shared between processes.
///
/// Had from [`MemoryOutbox::inbox`](crate::MemoryOutbox::inbox).
#[derive(Debug, Clone)]
pub struct MemoryInbox {
    shared: Arc<Shared>,
    clock: Clock,
}

/// What a [`MemoryTransaction`] holds: the writes it will make visible at commit. The
/// [`InboxStore::Connection`] of [`MemoryInbox`]; handlers receive it.
#[derive(Debug, Default)]
pub struct MemoryConnection {
    tx: u64,
    claims: Vec<(Uuid, String)>,
    versions: BTreeMap<(String, String, String), i64>,
    locks: Vec<LockKey>,
}

impl MemoryConnection {
    /// The `(message_id, consumer)` pairs claimed on this transaction so far.
    pub fn claims(&self) -> &[(Uuid, String)] {
        &self.claims
    }
}

/// A live transaction of a [`MemoryInbox`]: commit with [`InboxStore::commit`]; a
/// rollback, or dropping it, discards its claims and releases its locks.
#[derive(Debug)]
pub struct MemoryTransaction {
    conn: MemoryConnection,
    shared: Arc<Shared>,
    done: bool,
}

impl std::ops::Deref for MemoryTransaction {
    type Target = MemoryConnection;
    fn deref(&self) -> &MemoryConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for MemoryTransaction {
    fn deref_mut(&mut self) -> &mut MemoryConnection {
        &mut self.conn
    }
}

impl Drop for MemoryTransaction {
    fn drop(&mut self) {
        if !self.done {
            release(&mut self.shared.state(), &self.conn);
            self.shared.released.notify_waiters();
        }
    }
}

fn release(state: &mut State, conn: &MemoryConnection) {
    for key in &conn.locks {
        if state.locks.get(key) == Some(&conn.tx) {
            state.locks.remove(key);
        }
    }
}

impl MemoryInbox {
    /// An empty inbox on a [`Clock::tokio`] clock.
    pub(crate) fn new() -> Self {
        Self {
            shared: Arc::default(),
            clock: Clock::default(),
        }
    }

    /// Takes record times from `clock` (default [`Clock::tokio`]).
    #[must_use]
    pub(crate) fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Committed records, whatever the consumer.
    pub fn len(&self) -> usize {
        self.shared.state().records.len()
    }

    /// Whether no record is committed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `(message_id, consumer)` is committed.
    pub fn contains(&self, message_id: Uuid, consumer: &str) -> bool {
        self.shared
            .state()
            .records
            .contains_key(&(message_id, consumer.to_owned()))
    }

    /// Takes `key`'s lock for `conn`, waiting while another transaction holds it, then
    /// runs `f` on the state under the same mutex.
    async fn locked<T>(
        &self,
        conn: &mut MemoryConnection,
        key: LockKey,
        f: impl FnOnce(&mut State, &mut MemoryConnection) -> T,
    ) -> T {
        loop {
            let released = self.shared.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut state = self.shared.state();
                match state.locks.get(&key) {
                    Some(&holder) if holder != conn.tx => {}
                    Some(_) => return f(&mut state, conn),
                    None => {
                        state.locks.insert(key.clone(), conn.tx);
                        conn.locks.push(key);
                        return f(&mut state, conn);
                    }
                }
            }
            released.await;
        }
    }
}

#[async_trait]
impl InboxStore for MemoryInbox {
    type Connection = MemoryConnection;
    type Transaction = MemoryTransaction;

    async fn begin(&self) -> Result<MemoryTransaction, OutboxError> {
        let tx = {
            let mut state = self.shared.state();
            state.next_tx += 1;
            state.next_tx
        };
        Ok(MemoryTransaction {
            conn: MemoryConnection {
                tx,
                ..MemoryConnection::default()
            },
            shared: Arc::clone(&self.shared),
            done: false,
        })
    }

    async fn commit(&self, mut tx: MemoryTransaction) -> Result<(), OutboxError> {
        let now = self.clock.now();
        {
            let mut state = self.shared.state();
            for claim in std::mem::take(&mut tx.conn.claims) {
                state.records.entry(claim).or_insert(now);
            }
            for (key, version) in std::mem::take(&mut tx.conn.versions) {
                let stored = state.versions.entry(key).or_insert(version);
                *stored = (*stored).max(version);
            }
            release(&mut state, &tx.conn);
            tx.done = true;
        }
        self.shared.released.notify_waiters();
        Ok(())
    }

    async fn rollback(&self, tx: MemoryTransaction) -> Result<(), OutboxError> {
        drop(tx); // discards the claims, releases the locks
        Ok(())
    }

    async fn try_claim(
        &self,
        conn: &mut MemoryConnection,
        message_id: Uuid,
        consumer: &str,
    ) -> Result<bool, OutboxError> {
        let pair = (message_id, consumer.to_owned());
        let key = LockKey::Claim(message_id, consumer.to_owned());
        Ok(self
            .locked(conn, key, |state, conn| {
                if state.records.contains_key(&pair) || conn.claims.contains(&pair) {
                    false
                } else {
                    conn.claims.push(pair);
                    true
                }
            })
            .await)
    }

    async fn purge(&self, older_than: Duration, batch_size: usize) -> Result<u64, OutboxError> {
        let cutoff = before(self.clock.now(), older_than);
        let mut state = self.shared.state();
        let old: Vec<(Uuid, String)> = state
            .records
            .iter()
            .filter(|(_, at)| **at <= cutoff)
            .map(|(pair, _)| pair.clone())
            .take(batch_size)
            .collect();
        for pair in &old {
            state.records.remove(pair);
        }
        Ok(old.len() as u64)
    }
}

#[async_trait]
impl ConsumerDeadLetters for MemoryInbox {
    async fn record_failure(
        &self,
        msg: &IncomingMessage,
        consumer: &str,
        error: &str,
        max_attempts: u32,
    ) -> Result<FailureCount, OutboxError> {
        let now = self.clock.now();
        let mut state = self.shared.state();
        let pair = (msg.id, consumer.to_owned());
        let attempts = {
            let count = state.failures.entry(pair.clone()).or_insert(0);
            *count += 1;
            *count
        };
        let dead = attempts >= max_attempts;
        if dead {
            state.dead.insert(
                pair,
                ConsumerDeadLetter {
                    message_id: msg.id,
                    consumer: consumer.to_owned(),
                    event_type: msg.event_type.clone(),
                    last_error: outboxkit_core::sanitize_error(error).into_owned(),
                    attempts,
                    dead_at: now,
                    payload: msg.payload.clone(),
                },
            );
        }
        Ok(FailureCount { attempts, dead })
    }

    async fn is_dead(&self, message_id: Uuid, consumer: &str) -> Result<bool, OutboxError> {
        Ok(self
            .shared
            .state()
            .dead
            .contains_key(&(message_id, consumer.to_owned())))
    }

    async fn consumer_dead_letters(
        &self,
        consumer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ConsumerDeadLetter>, OutboxError> {
        let state = self.shared.state();
        let mut dead: Vec<ConsumerDeadLetter> = state
            .dead
            .values()
            .filter(|d| consumer.is_none_or(|c| d.consumer == c))
            .cloned()
            .collect();
        dead.sort_by_key(|d| (d.dead_at, d.message_id));
        dead.truncate(limit);
        Ok(dead)
    }
}

#[async_trait]
impl VersionTracking for MemoryInbox {
    async fn applied_version(
        &self,
        conn: &mut MemoryConnection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
    ) -> Result<Option<i64>, OutboxError> {
        let key = (
            consumer.to_owned(),
            aggregate_type.to_owned(),
            aggregate_id.to_owned(),
        );
        let lock = LockKey::Version(key.0.clone(), key.1.clone(), key.2.clone());
        Ok(self
            .locked(conn, lock, |state, conn| {
                let committed = state.versions.get(&key).copied();
                let mine = conn.versions.get(&key).copied();
                committed.max(mine)
            })
            .await)
    }

    async fn record_version(
        &self,
        conn: &mut MemoryConnection,
        consumer: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        version: i64,
    ) -> Result<(), OutboxError> {
        let key = (
            consumer.to_owned(),
            aggregate_type.to_owned(),
            aggregate_id.to_owned(),
        );
        let lock = LockKey::Version(key.0.clone(), key.1.clone(), key.2.clone());
        self.locked(conn, lock, |_, conn| {
            let stored = conn.versions.entry(key).or_insert(version);
            *stored = (*stored).max(version);
        })
        .await;
        Ok(())
    }
}
