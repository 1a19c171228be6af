//! Fast tests of the dispatcher's decisions over a small in-process store and publisher.
//! (The real stores and brokers are exercised by the backends' integration tests.)

use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use async_trait::async_trait;
use chrono::Utc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::*;
use crate::error::{ErrorKind, OutboxError, PublishError};
use crate::message::{MessageStatus, NewMessage, OutboxMessage};
use crate::ordering::{BlockedKey, OnDead};
use crate::publisher::PublishOutcome;
use crate::store::{
    ClaimedBatch, CompleteReport, Completion, CompletionOutcome, MessageFilter, OutboxStats,
    OutboxStore, Poison, PoisonRow, ReplayReport,
};

fn message(n: usize) -> OutboxMessage {
    let new = NewMessage::builder("order", format!("o-{n}"), "OrderPlaced")
        .payload(&n)
        .build()
        .expect("valid");
    let mut m = OutboxMessage::claimed_from(new, Utc::now());
    m.status = MessageStatus::New;
    m.attempts = 0;
    m.claim_token = None;
    m.seq = n as i64;
    m
}

/// Rows in memory; claims take New rows in order; completions apply when the token
/// matches. `reject_completions` makes every completion fail with that kind.
#[derive(Default)]
struct Rows {
    rows: StdMutex<Vec<OutboxMessage>>,
    poison: StdMutex<Vec<PoisonRow>>,
    reject_completions: Option<ErrorKind>,
    claims: AtomicUsize,
    /// Held rows' destinations, by id.
    held: StdMutex<std::collections::HashMap<Uuid, String>>,
}

impl Rows {
    fn with(n: usize) -> Self {
        let rows = Self::default();
        rows.rows.lock().expect("lock").extend((0..n).map(message));
        rows
    }

    fn statuses(&self) -> Vec<(MessageStatus, i32)> {
        let rows = self.rows.lock().expect("lock");
        rows.iter().map(|m| (m.status, m.attempts)).collect()
    }
}

#[async_trait]
impl OutboxStore for Rows {
    async fn claim(
        &self,
        batch_size: usize,
        _lease: Duration,
    ) -> Result<ClaimedBatch, OutboxError> {
        self.claims.fetch_add(1, SeqCst);
        let token = Uuid::new_v4();
        let mut rows = self.rows.lock().expect("lock");
        let mut messages = Vec::new();
        let now = Utc::now();
        for m in rows
            .iter_mut()
            .filter(|m| m.status == MessageStatus::New && m.visible_at <= now)
        {
            if messages.len() == batch_size {
                break;
            }
            m.status = MessageStatus::Processing;
            m.claim_token = Some(token);
            m.attempts += 1;
            messages.push(m.clone());
        }
        let poison = std::mem::take(&mut *self.poison.lock().expect("lock"));
        Ok(ClaimedBatch::new(messages, poison))
    }

    async fn claim_ordered(
        &self,
        batch_size: usize,
        lease: Duration,
        _on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        self.claim(batch_size, lease).await
    }

    async fn blocked_keys(&self, _limit: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        Ok(Vec::new())
    }

    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        if let Some(kind) = self.reject_completions {
            return Err(OutboxError::Database {
                kind,
                operation: "complete",
                source: "rejected by the test".into(),
            });
        }
        let mut rows = self.rows.lock().expect("lock");
        let mut report = CompleteReport::default();
        for c in completions {
            let Some(m) = rows
                .iter_mut()
                .find(|m| m.id == c.id && m.claim_token == Some(c.claim_token))
            else {
                report.fenced.push(c.id);
                continue;
            };
            report.applied += 1;
            m.claim_token = None;
            match &c.outcome {
                CompletionOutcome::Sent => m.status = MessageStatus::Sent,
                CompletionOutcome::Retry { error, .. } => {
                    m.status = MessageStatus::New;
                    m.last_error = Some(error.clone());
                }
                CompletionOutcome::Dead { error } => {
                    m.status = MessageStatus::Dead;
                    m.last_error = Some(error.clone());
                }
                CompletionOutcome::Release => {
                    m.status = MessageStatus::New;
                    m.attempts -= 1;
                }
                CompletionOutcome::Hold { destination, error } => {
                    m.status = MessageStatus::New;
                    m.attempts -= 1;
                    m.visible_at = chrono::DateTime::<Utc>::MAX_UTC;
                    m.last_error = Some(error.clone());
                    self.held
                        .lock()
                        .expect("lock")
                        .insert(m.id, destination.clone());
                }
            }
        }
        Ok(report)
    }

    async fn claim_held(
        &self,
        destinations: &[String],
        _lease: Duration,
        _order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        let token = Uuid::new_v4();
        let mut rows = self.rows.lock().expect("lock");
        let mut held = self.held.lock().expect("lock");
        let mut messages = Vec::new();
        for dest in destinations {
            let Some(m) = rows.iter_mut().find(|m| {
                m.status == MessageStatus::New && held.get(&m.id).is_some_and(|d| d == dest)
            }) else {
                continue;
            };
            held.remove(&m.id);
            m.status = MessageStatus::Processing;
            m.visible_at = Utc::now();
            m.claim_token = Some(token);
            m.attempts += 1;
            messages.push(m.clone());
        }
        Ok(ClaimedBatch::new(messages, Vec::new()))
    }

    async fn release_held(&self, destination: &str, limit: usize) -> Result<u64, OutboxError> {
        let mut rows = self.rows.lock().expect("lock");
        let mut held = self.held.lock().expect("lock");
        let mut released = 0;
        for m in rows.iter_mut() {
            if released as usize == limit {
                break;
            }
            if m.status == MessageStatus::New && held.get(&m.id).is_some_and(|d| d == destination) {
                held.remove(&m.id);
                m.visible_at = Utc::now();
                released += 1;
            }
        }
        Ok(released)
    }

    async fn held_destinations(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>, OutboxError> {
        let held = self.held.lock().expect("lock");
        let all: std::collections::BTreeSet<&String> =
            held.values().filter(|d| d.as_str() > after).collect();
        Ok(all.into_iter().take(limit).cloned().collect())
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        Ok(self
            .rows
            .lock()
            .expect("lock")
            .iter()
            .find(|m| m.id == id)
            .cloned())
    }

    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        Ok(OutboxStats::default())
    }

    async fn dead_letters(
        &self,
        _filter: &MessageFilter,
        _limit: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        Ok(Vec::new())
    }

    async fn replay(
        &self,
        _filter: &MessageFilter,
        _dry_run: bool,
    ) -> Result<ReplayReport, OutboxError> {
        Ok(ReplayReport::default())
    }

    async fn purge_sent(
        &self,
        _older_than: Duration,
        _batch_size: usize,
    ) -> Result<u64, OutboxError> {
        Ok(0)
    }
}

/// What the fake publisher does with one call.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Every message is confirmed.
    Confirm,
    /// The broker is unavailable for the first `n` calls, then confirms.
    OutageFor(usize),
    /// Panics when the batch holds the message with this aggregate id.
    PanicOn(&'static str),
    /// Never answers.
    Hang,
    /// Fails every message with a transient error of its own (not an outage).
    FailEach,
}

struct Broker {
    behaviour: Behaviour,
    calls: AtomicUsize,
    /// Sizes of the calls.
    batches: StdMutex<Vec<usize>>,
    publish_timeout: Option<Duration>,
}

impl Broker {
    fn new(behaviour: Behaviour) -> Self {
        Self {
            behaviour,
            calls: AtomicUsize::new(0),
            batches: StdMutex::default(),
            publish_timeout: None,
        }
    }
}

#[async_trait]
impl EventPublisher for Broker {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let call = self.calls.fetch_add(1, SeqCst);
        self.batches.lock().expect("lock").push(messages.len());
        match self.behaviour {
            Behaviour::Confirm => messages.iter().map(|_| PublishOutcome::Published).collect(),
            Behaviour::OutageFor(n) if call < n => messages
                .iter()
                .map(|_| {
                    PublishOutcome::Transient(PublishError::unavailable(
                        "connection.blocked (memory alarm)",
                        None,
                    ))
                })
                .collect(),
            Behaviour::OutageFor(_) => messages.iter().map(|_| PublishOutcome::Published).collect(),
            Behaviour::PanicOn(id) => {
                assert!(
                    !messages.iter().any(|m| m.aggregate_id == id),
                    "a header the transport cannot handle"
                );
                messages.iter().map(|_| PublishOutcome::Published).collect()
            }
            Behaviour::Hang => std::future::pending().await,
            Behaviour::FailEach => messages
                .iter()
                .map(|_| {
                    PublishOutcome::Transient(PublishError::Other {
                        kind: ErrorKind::Transient,
                        message: "this message failed".into(),
                        source: None,
                    })
                })
                .collect(),
        }
    }

    fn publish_timeout(&self) -> Option<Duration> {
        self.publish_timeout
    }
}

fn dispatcher(rows: Rows, broker: Broker, config: DispatcherConfig) -> Dispatcher<Rows, Broker> {
    Dispatcher::new(Arc::new(rows), Arc::new(broker), config).expect("valid config")
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..2_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

#[test]
fn each_outcome_stays_with_its_own_message() {
    let d = dispatcher(
        Rows::default(),
        Broker::new(Behaviour::Confirm),
        DispatcherConfig::new(),
    );
    let untokened = message(0);
    let mut claimed = message(1);
    claimed.claim_token = Some(Uuid::new_v4());
    let outcomes = vec![
        Some(PublishOutcome::Permanent(PublishError::Invalid(
            "bad header".into(),
        ))),
        Some(PublishOutcome::Published),
    ];
    let (completions, report) = d.decide(&[untokened, claimed.clone()], outcomes, &[], &[]);
    assert_eq!(
        completions,
        vec![Completion {
            id: claimed.id,
            claim_token: claimed.claim_token.expect("token"),
            outcome: CompletionOutcome::Sent,
        }],
        "the second message keeps its own outcome (Published), not the first one's"
    );
    assert_eq!((report.published, report.dead), (1, 0));
}

#[test]
fn poison_rows_are_dead_alone() {
    let d = dispatcher(
        Rows::default(),
        Broker::new(Behaviour::Confirm),
        DispatcherConfig::new(),
    );
    let mut good = message(1);
    good.claim_token = Some(Uuid::new_v4());
    let token = Uuid::new_v4();
    let poison = [
        PoisonRow {
            id: Uuid::from_u128(7),
            seq: 7,
            aggregate_type: "order".into(),
            aggregate_id: "o-7".into(),
            partition_key: None,
            poison: Poison::Undecodable {
                claim_token: token,
                reason: "headers must be a JSON object of strings".into(),
            },
        },
        PoisonRow {
            id: Uuid::from_u128(8),
            seq: 8,
            aggregate_type: "order".into(),
            aggregate_id: "o-8".into(),
            partition_key: None,
            poison: Poison::CrashLoop { claims_alone: 5 },
        },
    ];
    let (completions, report) = d.decide(
        &[good.clone()],
        vec![Some(PublishOutcome::Published)],
        &poison,
        &[],
    );
    assert_eq!(
        completions.len(),
        2,
        "the crash-loop row is already dead in the store"
    );
    assert_eq!(completions[0].outcome, CompletionOutcome::Sent);
    assert_eq!(completions[1].id, Uuid::from_u128(7));
    assert_eq!(completions[1].claim_token, token);
    assert!(
        matches!(&completions[1].outcome, CompletionOutcome::Dead { error } if error.contains("undecodable row: headers"))
    );
    assert_eq!((report.claimed, report.dead, report.poison), (3, 2, 2));
}

#[tokio::test]
async fn a_message_the_publisher_panics_on_is_dead_and_the_rest_published() {
    let rows = Rows::with(5);
    rows.rows.lock().expect("lock")[2].aggregate_id = "poison".into();
    let d = dispatcher(
        rows,
        Broker::new(Behaviour::PanicOn("poison")),
        DispatcherConfig::new(),
    );
    let report = d.run_batch().await.expect("batch");
    assert_eq!((report.published, report.dead), (4, 1), "{report:?}");
    let statuses = d.store.statuses();
    assert_eq!(statuses[2].0, MessageStatus::Dead);
    let dead = d.store.rows.lock().expect("lock")[2]
        .last_error
        .clone()
        .unwrap_or_default();
    assert!(dead.contains("panicked on this message alone"), "{dead}");
    assert!(
        statuses
            .iter()
            .enumerate()
            .all(|(i, s)| i == 2 || s.0 == MessageStatus::Sent)
    );
}

#[tokio::test(start_paused = true)]
async fn a_degraded_broker_opens_the_circuit_charges_nothing_and_a_trial_closes_it() {
    let config = DispatcherConfig::new()
        .with_batch_size(10)
        .with_probe_backoff(Duration::from_millis(100), Duration::from_secs(1));
    let d = dispatcher(Rows::with(25), Broker::new(Behaviour::OutageFor(3)), config);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let d = d.clone();
        let shutdown = shutdown.clone();
        async move { d.run(shutdown).await }
    });
    wait_until("every row is sent", || {
        d.store
            .statuses()
            .iter()
            .all(|s| s.0 == MessageStatus::Sent)
    })
    .await;
    shutdown.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!(stats.dead + stats.retried, 0, "{stats:?}");
    assert_eq!(stats.circuit_opened, 1, "{stats:?}");
    assert!(
        d.store.statuses().iter().all(|s| s.1 == 1),
        "one attempt each: the outage charged none"
    );
    let batches = d.publisher.batches.lock().expect("lock").clone();
    // The first batch met the outage; then trials of one message until one got through.
    assert_eq!(batches[..3], [10, 1, 1], "{batches:?}");
}

#[tokio::test]
async fn a_completion_the_store_rejects_stops_the_run() {
    let mut rows = Rows::with(3_000);
    rows.reject_completions = Some(ErrorKind::Permanent);
    let d = dispatcher(
        rows,
        Broker::new(Behaviour::Confirm),
        DispatcherConfig::new().with_batch_size(10),
    );
    let err = tokio::time::timeout(Duration::from_secs(10), d.run(CancellationToken::new()))
        .await
        .expect("the run stops by itself")
        .expect_err("fatal");
    assert!(err.to_string().contains("rejected by the test"), "{err}");
    let claims = d.store.claims.load(SeqCst);
    assert!(
        claims < 20,
        "claiming stopped at once, not after {claims} claims"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_behind_a_hung_broker_releases_within_the_drain_timeout() {
    let config = DispatcherConfig::new()
        .with_batch_size(10)
        .with_drain_timeout(Duration::from_secs(3));
    let d = dispatcher(Rows::with(50), Broker::new(Behaviour::Hang), config);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let d = d.clone();
        let shutdown = shutdown.clone();
        async move { d.run(shutdown).await }
    });
    wait_until("two publishes hang", || d.publisher.calls.load(SeqCst) == 2).await;
    let started = tokio::time::Instant::now();
    shutdown.cancel();
    let stats = run.await.expect("task").expect("run");
    assert!(started.elapsed() <= Duration::from_secs(3) + Duration::from_millis(100));
    assert_eq!(stats.published, 0);
    assert!(
        d.store
            .statuses()
            .iter()
            .all(|s| *s == (MessageStatus::New, 0)),
        "every claimed row is released without charge: {:?}",
        d.store.statuses()
    );
}

#[tokio::test]
async fn a_lease_shorter_than_two_publishes_is_refused() {
    let mut broker = Broker::new(Behaviour::Confirm);
    broker.publish_timeout = Some(Duration::from_secs(20));
    let rows = Arc::new(Rows::with(1));
    let err = Dispatcher::new(Arc::clone(&rows), Arc::new(broker), DispatcherConfig::new())
        .expect_err("30 s < 40 s");
    assert!(
        matches!(err, OutboxError::InvalidConfig { field: "lease", .. }),
        "{err}"
    );
    assert_eq!(rows.claims.load(SeqCst), 0, "nothing was claimed");
}

#[tokio::test]
async fn an_invalid_config_is_refused_where_the_dispatcher_is_built() {
    let rows = Arc::new(Rows::with(1));
    let broker = Arc::new(Broker::new(Behaviour::Confirm));
    for (config, expected) in [
        (DispatcherConfig::new().with_batch_size(0), "batch_size"),
        (DispatcherConfig::new().with_concurrency(0), "concurrency"),
    ] {
        let err =
            Dispatcher::new(Arc::clone(&rows), Arc::clone(&broker), config).expect_err("refused");
        assert!(
            matches!(err, OutboxError::InvalidConfig { field, .. } if field == expected),
            "{err}"
        );
    }
    assert_eq!(rows.claims.load(SeqCst), 0, "nothing was claimed");
    assert_eq!(broker.calls.load(SeqCst), 0, "nothing was published");
}

#[tokio::test]
async fn a_transient_failure_of_one_message_is_retried_until_its_attempts_run_out() {
    let retry = crate::RetryPolicies::new(
        crate::RetryPolicy::new()
            .with_base(1.0)
            .with_cap(Duration::ZERO)
            .with_jitter(Duration::ZERO)
            .with_max_attempts(3),
    );
    let d = dispatcher(
        Rows::with(1),
        Broker::new(Behaviour::FailEach),
        DispatcherConfig::new().with_retry(retry),
    );
    let mut reports = Vec::new();
    for _ in 0..3 {
        reports.push(d.run_batch().await.expect("batch"));
    }
    assert_eq!(
        reports
            .iter()
            .map(|r| (r.retried, r.dead))
            .collect::<Vec<_>>(),
        [(1, 0), (1, 0), (0, 1)]
    );
    let m = d.store.rows.lock().expect("lock")[0].clone();
    assert_eq!((m.status, m.attempts), (MessageStatus::Dead, 3));
    let error = m.last_error.unwrap_or_default();
    assert!(
        error.contains("attempts exhausted (3/3): this message failed"),
        "{error}"
    );
    assert!(!d.circuit_open(), "a message's own failure is no outage");
}
