//! The ordered-delivery and the store-conformance properties that apply to the WAL
//! relay.
//!
//! Ordered delivery per key by the WAL relay (`outboxkit_postgres::wal::WalRelay`, feature
//! `wal`, `with_ordering(Ordering::PerKey { on_dead: OnDead::Skip })`: `outbox relay --source wal --ordering
//! per-key-skip`), in process, over the real PostgreSQL (`wal_level = logical`) and each broker,
//! RabbitMQ and NATS JetStream: the ordered-delivery suite's properties that apply to a
//! relay reading a replication slot, with the suite's real consumer
//! (`outboxkit_testkit::ordered`) checking every key's first receipts.
//!
//! - 100 keys written by 4 concurrent producers in transactions of 100 rows while the
//!   relay runs: every key in order, each message published once;
//! - a transient failure of one message parks its key only: other keys flow during its
//!   backoff, the key's order holds after the retry;
//! - a permanent failure is dead and its key continues (the WAL relay's rule is the
//!   polling relay's `OnDead::Skip`);
//! - a relay killed mid-batch (its task dropped, its replication connection gone) and
//!   a new one: every key's first receipts in order;
//! - a parked row whose publish by the sweeper kills the relay every time: dead after
//!   the crash-loop limit, the innocent parked row beside it and the rest of its key
//!   published;
//! - a relay killed while a key has a parked message, then messages of that key
//!   written and a new relay started: they wait behind the parked one (the new session
//!   reads the parked keys from the table).
//!
//!
//! And a row enqueued and spoiled in one transaction is dead, never published (found by
//! `cargo xtask chaos -- --source wal`).
//!
//! And what the store conformance suite asks of every writer of outcomes: error texts
//! from the broker are stored sanitized (a NUL byte escaped, a long text cut), so an
//! outcome is never refused by the database.
//!
//! Each test has its own schema, slot and publication, dropped by a guard also on
//! panic.
#![cfg(feature = "wal")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::database_url;
use common::wal::{HoldBatch, WalOutbox};
use outboxkit_core::conformance::keyed;
use outboxkit_core::{
    EventPublisher, MessageStatus, OutboxMessage, OutboxProducer, OutboxStore as _, PublishError,
    PublishOutcome,
};
use outboxkit_core::{OnDead, Ordering};
use outboxkit_postgres::wal::WalRelayConfig;
use outboxkit_testkit::ordered::{
    Broker, Faulty, Nats, Rabbit, assert_in_order, key_names, position, retry_after,
};
use outboxkit_testkit::rabbit::eventually;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Per-key order on (`--ordering per-key-skip`).
fn config() -> WalRelayConfig {
    WalRelayConfig::new(database_url())
        .with_standby_interval(Duration::from_millis(100))
        .with_ordering(Ordering::PerKey {
            on_dead: OnDead::Skip,
        })
}

/// 100 keys of 100 messages from 4 producers at once while the relay runs.
async fn many_keys_from_concurrent_producers_arrive_in_order<B: Broker>() {
    let w = Arc::new(WalOutbox::new().await);
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let token = CancellationToken::new();
    let relay = w.spawn(broker.publisher().await, config(), &token);

    let names = key_names(100);
    let producers: Vec<_> = (0..4)
        .map(|p| {
            let w = Arc::clone(&w);
            let mine: Vec<String> = names.iter().skip(p).step_by(4).cloned().collect();
            tokio::spawn(async move {
                let refs: Vec<&str> = mine.iter().map(String::as_str).collect();
                w.enqueue(&keyed(&refs, 100, "Ordered")).await;
            })
        })
        .collect();
    for p in producers {
        p.await.expect("producer");
    }
    let received = eventually(Duration::from_secs(180), || async {
        log.lock().expect("lock").len() >= 10_000
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        received,
        "10,000 received: {}",
        log.lock().expect("lock").len()
    );
    assert_eq!((stats.published, stats.dead), (10_000, 0), "{stats:?}");
    assert_in_order(&log.lock().expect("lock"), 100, 100);
    broker.cleanup().await;
}

/// A light load (one message per transaction, a little apart) with a linger: batches
/// gathered after the relay waited for the stream (`with_linger`) keep every key in
/// order and lose nothing. (Without one, every other test here runs that path.)
async fn a_lingering_relay_keeps_every_key_in_order<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let token = CancellationToken::new();
    let relay = w.spawn(
        broker.publisher().await,
        config().with_linger(Duration::from_millis(5)),
        &token,
    );
    let names = key_names(10);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    for msg in keyed(&refs, 20, "Ordered") {
        w.enqueue(std::slice::from_ref(&msg)).await;
        // The load's shape (the relay idle between commits), not a wait for a result.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let received = eventually(Duration::from_secs(60), || async {
        log.lock().expect("lock").len() >= 200
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        received,
        "200 received: {}",
        log.lock().expect("lock").len()
    );
    assert_eq!((stats.published, stats.dead), (200, 0), "{stats:?}");
    assert_in_order(&log.lock().expect("lock"), 10, 20);
    broker.cleanup().await;
}

/// A steady stream whose commits come closer together than the linger: the linger is
/// counted from the end of the batch's first transaction, so the first message goes
/// out about one linger after its commit. (Found by the bench: a linger renewed by every change of
/// the stream held a batch until it was full; with a 2 ms linger at 500 messages/s
/// the WAL relay's p50 was 9.5 ms and its p99 83 ms.)
async fn a_steady_stream_does_not_hold_a_lingering_batch<B: Broker>() {
    const LINGER: Duration = Duration::from_millis(300);
    const GAP: Duration = Duration::from_millis(20);
    const MOST: usize = 300;
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let token = CancellationToken::new();
    let relay = w.spawn(
        broker.publisher().await,
        config().with_linger(LINGER),
        &token,
    );
    // One message per transaction, closer together than the linger, until the first
    // arrives (or MOST are written: a batch held until the stream pauses).
    let names = key_names(1);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut written = 0;
    for msg in keyed(&refs, MOST, "Steady") {
        if !log.lock().expect("lock").is_empty() {
            break;
        }
        w.enqueue(std::slice::from_ref(&msg)).await;
        written += 1;
        // The load's shape (a commit every 20 ms), not a wait for a result.
        tokio::time::sleep(GAP).await;
    }
    let all = eventually(Duration::from_secs(60), || async {
        log.lock().expect("lock").len() >= written
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    // 300 ms of linger is 15 commits; 150 leaves room for a slow machine and none for
    // a batch held until the producer stops.
    assert!(
        written < MOST / 2,
        "the first message arrived only after {written} commits, {:?} apart, with a linger of {LINGER:?}",
        GAP
    );
    assert!(
        all,
        "{written} received: {}",
        log.lock().expect("lock").len()
    );
    assert_eq!(
        (stats.published, stats.dead),
        (written as u64, 0),
        "{stats:?}"
    );
    assert_in_order(&log.lock().expect("lock"), 1, written as u64);
    broker.cleanup().await;
}

/// key-7's fourth message fails once: key-7 is parked for the backoff, the others go.
async fn a_transient_failure_parks_only_its_key<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let names = key_names(20);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let msgs = keyed(&refs, 50, "Ordered");
    let victim = msgs
        .iter()
        .find(|m| m.aggregate_id == "key-7-3")
        .expect("victim")
        .id;
    let token = CancellationToken::new();
    let relay = w.spawn(
        Arc::new(Faulty::new(broker.publisher().await, &[(victim, false, 1)])),
        config().with_retry(retry_after(Duration::from_secs(2), 5)),
        &token,
    );
    w.enqueue(&msgs).await;
    let received = eventually(Duration::from_secs(60), || async {
        log.lock().expect("lock").len() >= 1000
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        received,
        "all 1,000 received: {}",
        log.lock().expect("lock").len()
    );
    assert_eq!(stats.dead, 0, "{stats:?}");
    let log = log.lock().expect("lock").clone();
    assert_in_order(&log, 20, 50);
    let before = position(&log, "key-7", 2).expect("key-7 #2");
    let after = position(&log, "key-7", 3).expect("key-7 #3");
    let others_meanwhile = log[before..after]
        .iter()
        .filter(|a| a.key != "key-7")
        .count();
    assert!(
        others_meanwhile >= 400,
        "other keys flowed during key-7's backoff: {others_meanwhile} messages"
    );
    let row = w.outbox.get(victim).await.expect("get").expect("row");
    assert_eq!(
        (row.status, row.attempts),
        (MessageStatus::Sent, 2),
        "failed once, then sent"
    );
    broker.cleanup().await;
}

/// A message that can never be published is dead; its key goes on without it.
async fn a_permanent_failure_is_dead_and_its_key_continues<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["k"], 10, "Ordered");
    let poison = msgs[4].id;
    let token = CancellationToken::new();
    let relay = w.spawn(
        Arc::new(Faulty::new(broker.publisher().await, &[(poison, true, 1)])),
        config(),
        &token,
    );
    w.enqueue(&msgs).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 9
        })
        .await,
        "the key continues past its dead message"
    );
    token.cancel();
    let stats = relay.await.expect("join");
    assert_eq!(stats.dead, 1, "{stats:?}");
    let ns: Vec<u64> = log.lock().expect("lock").iter().map(|a| a.n).collect();
    assert_eq!(
        ns,
        vec![0, 1, 2, 3, 5, 6, 7, 8, 9],
        "in order, without the dead one"
    );
    assert_eq!(
        w.outbox
            .get(poison)
            .await
            .expect("get")
            .expect("row")
            .status,
        MessageStatus::Dead
    );
    broker.cleanup().await;
}

/// Publishes its first `calls` calls for real, then hangs: a relay that dies mid-batch.
struct DiesAfter<P> {
    inner: Arc<P>,
    calls: Mutex<u32>,
}

#[async_trait::async_trait]
impl<P: EventPublisher> EventPublisher for DiesAfter<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let go = {
            let mut calls = self.calls.lock().expect("lock");
            let go = *calls > 0;
            *calls = calls.saturating_sub(1);
            go
        };
        if go {
            self.inner.publish_batch(messages).await
        } else {
            std::future::pending().await
        }
    }
}

/// A relay dropped while a publish hangs, a second one takes the slot: first receipts
/// in order for every key.
async fn a_relay_killed_mid_batch_breaks_no_keys_order<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let names = key_names(10);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    w.enqueue(&keyed(&refs, 20, "Ordered")).await;
    let real = broker.publisher().await;
    // A new session publishes 1, 1, 2, 4, ... messages per round: 4 rounds are 8.
    let doomed = w.relay(
        Arc::new(DiesAfter {
            inner: Arc::clone(&real),
            calls: Mutex::new(4),
        }),
        config(),
    );
    let killed = tokio::spawn(async move { doomed.run(CancellationToken::new()).await });
    assert!(
        eventually(Duration::from_secs(20), || async {
            log.lock().expect("lock").len() >= 8
        })
        .await,
        "the doomed relay published its first rounds"
    );
    killed.abort();
    let _ = killed.await;

    let token = CancellationToken::new();
    let rescuer = w.spawn(real, config(), &token);
    assert!(
        eventually(Duration::from_secs(60), || async {
            w.outbox.stats().await.expect("stats").sent == 200
        })
        .await,
        "everything sent by the second relay"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 200
        })
        .await,
        "200 received"
    );
    token.cancel();
    rescuer.await.expect("join");
    assert_in_order(&log.lock().expect("lock"), 10, 20);
    broker.cleanup().await;
}

/// key `a`'s third message fails and is parked for 3 s; the relay is killed; the rest
/// of `a` is written and a new relay starts: it parks them behind the first relay's
/// parked message, which goes first.
async fn a_new_session_keeps_a_parked_key_waiting<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["a"], 10, "Ordered");
    let victim = msgs[2].id;
    let token = CancellationToken::new();
    let first = w.spawn(
        Arc::new(Faulty::new(broker.publisher().await, &[(victim, false, 1)])),
        config().with_retry(retry_after(Duration::from_secs(3), 5)),
        &token,
    );
    w.enqueue(&msgs[..5]).await;
    let parked = |n: i64| {
        let outbox = w.outbox.clone();
        async move {
            let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM {}.outbox_messages WHERE status = 9",
                outbox.schema()
            )))
            .fetch_one(outbox.pool())
            .await
            .expect("count");
            count == n
        }
    };
    // a-0 and a-1 sent; a-2 failed and parked, a-3 and a-4 parked behind it.
    assert!(
        eventually(Duration::from_secs(20), || parked(3)).await,
        "three rows of key a parked"
    );
    first.abort();
    let _ = first.await;
    w.enqueue(&msgs[5..]).await;
    let second = w.spawn(broker.publisher().await, config(), &token);
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 10
        })
        .await,
        "all 10 received: {:?}",
        log.lock()
            .expect("lock")
            .iter()
            .map(|a| a.n)
            .collect::<Vec<_>>()
    );
    token.cancel();
    second.await.expect("join");
    assert_in_order(&log.lock().expect("lock"), 1, 10);
    broker.cleanup().await;
}

/// Fails every message with a text PostgreSQL cannot store as it is: `permanent` ones
/// with a NUL byte, the others transiently with 10,000 bytes.
struct Unprintable<P> {
    inner: Arc<P>,
    permanent: Uuid,
    transient: Uuid,
}

#[async_trait::async_trait]
impl<P: EventPublisher> EventPublisher for Unprintable<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let pass: Vec<OutboxMessage> = messages
            .iter()
            .filter(|m| m.id != self.permanent && m.id != self.transient)
            .cloned()
            .collect();
        let mut passed = self.inner.publish_batch(&pass).await.into_iter();
        messages
            .iter()
            .map(|m| {
                if m.id == self.permanent {
                    PublishOutcome::Permanent(PublishError::Invalid("broker said \0 no".into()))
                } else if m.id == self.transient {
                    PublishOutcome::Transient(PublishError::Other {
                        kind: outboxkit_core::ErrorKind::Transient,
                        message: "é".repeat(5_000),
                        source: None,
                    })
                } else {
                    passed.next().expect("one outcome per message")
                }
            })
            .collect()
    }
}

/// A dead message's and a parked message's error texts are stored sanitized, and the
/// relay goes on.
async fn error_texts_are_stored_sanitized<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["a", "b", "c"], 2, "Sanitized");
    let (permanent, transient) = (msgs[0].id, msgs[1].id);
    let token = CancellationToken::new();
    let relay = w.spawn(
        Arc::new(Unprintable {
            inner: broker.publisher().await,
            permanent,
            transient,
        }),
        config().with_retry(retry_after(Duration::from_secs(60), 5)),
        &token,
    );
    w.enqueue(&msgs).await;
    // c-0 and c-1 go; a-1 goes (a-0 is dead, its key continues); b-1 waits behind b-0.
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 3
        })
        .await,
        "the other messages are published"
    );
    let dead = w.outbox.get(permanent).await.expect("get").expect("row");
    assert_eq!(dead.status, MessageStatus::Dead);
    assert_eq!(
        dead.last_error.as_deref(),
        Some("invalid destination or header: broker said \\0 no")
    );
    let parked = w.outbox.get(transient).await.expect("get").expect("row");
    let text = parked.last_error.expect("error");
    assert!(text.len() <= 4096 && text.ends_with('…'), "{}", text.len());
    assert!(!relay.is_finished(), "the relay goes on");
    token.cancel();
    relay.await.expect("join");
    broker.cleanup().await;
}

/// Fails `victim`'s first publish transiently (so that it is parked), and hangs on
/// every later call that holds it: a relay that dies while its sweeper publishes it.
/// `y` fails its first publish too, and goes on the next.
struct KillsTheSweeper<P> {
    inner: Arc<P>,
    victim: Uuid,
    first_failures: Arc<Mutex<std::collections::HashSet<Uuid>>>,
}

#[async_trait::async_trait]
impl<P: EventPublisher> EventPublisher for KillsTheSweeper<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let failing: Option<Vec<bool>> = {
            let mut first = self.first_failures.lock().expect("lock");
            let hang = messages
                .iter()
                .any(|m| m.id == self.victim && !first.contains(&m.id));
            (!hang).then(|| messages.iter().map(|m| first.remove(&m.id)).collect())
        };
        let Some(failing) = failing else {
            return std::future::pending().await;
        };
        let pass: Vec<OutboxMessage> = messages
            .iter()
            .zip(&failing)
            .filter(|(_, f)| !**f)
            .map(|(m, _)| m.clone())
            .collect();
        let mut passed = self.inner.publish_batch(&pass).await.into_iter();
        failing
            .iter()
            .map(|f| {
                if *f {
                    PublishOutcome::Transient(PublishError::Other {
                        kind: outboxkit_core::ErrorKind::Transient,
                        message: "injected transient failure".into(),
                        source: None,
                    })
                } else {
                    passed.next().expect("one outcome per message")
                }
            })
            .collect()
    }
}

/// A parked row whose publish by the sweeper kills the relay, every time: after the
/// crash-loop limit of claims without an outcome it is dead, and the innocent parked
/// row claimed with it, and the rest of its key, are published.
async fn a_parked_row_that_kills_the_relay_dies_alone<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let mut msgs = keyed(&["x"], 3, "Sweeper");
    msgs.extend(keyed(&["y"], 1, "Sweeper"));
    let victim = msgs[1].id;
    let first_failures = Arc::new(Mutex::new([victim, msgs[3].id].into_iter().collect()));
    let config = || {
        config()
            .with_retry(retry_after(Duration::from_millis(200), 10))
            .with_lease(Duration::from_millis(500))
            .with_crash_loop_limit(2)
    };
    let counted = || {
        let outbox = w.outbox.clone();
        async move {
            let (alone, status): (i32, i16) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT unfinished_alone, status FROM {}.outbox_messages WHERE id = $1",
                outbox.schema()
            )))
            .bind(victim)
            .fetch_one(outbox.pool())
            .await
            .expect("victim");
            (alone, status)
        }
    };
    w.enqueue(&msgs).await;
    let mut starts = 0;
    loop {
        let (before, status) = counted().await;
        if status == 3 {
            break;
        }
        assert!(
            starts < 8,
            "the victim is dead within the limit: {starts} starts"
        );
        starts += 1;
        let relay = w.relay(
            Arc::new(KillsTheSweeper {
                inner: broker.publisher().await,
                victim,
                first_failures: Arc::clone(&first_failures),
            }),
            config(),
        );
        let task = tokio::spawn(async move { relay.run(CancellationToken::new()).await });
        // Claimed by the sweeper (and hanging), or dead.
        assert!(
            eventually(Duration::from_secs(20), || async {
                let (now, status) = counted().await;
                now > before || status == 3
            })
            .await,
            "the sweeper claims the victim"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        task.abort();
        let _ = task.await;
    }
    let token = CancellationToken::new();
    let relay = w.spawn(broker.publisher().await, config(), &token);
    assert!(
        eventually(Duration::from_secs(30), || async {
            w.outbox.stats().await.expect("stats").sent == 3
        })
        .await,
        "the other three are sent"
    );
    token.cancel();
    relay.await.expect("join");
    let row = w.outbox.get(victim).await.expect("get").expect("row");
    assert_eq!(row.status, MessageStatus::Dead);
    assert!(
        row.last_error
            .as_deref()
            .is_some_and(|e| e.contains("suspected crash loop")),
        "{:?}",
        row.last_error
    );
    let firsts: Vec<(String, u64)> = log
        .lock()
        .expect("lock")
        .iter()
        .map(|a| (a.key.clone(), a.n))
        .collect();
    for expected in [
        ("x".to_owned(), 0),
        ("x".to_owned(), 2),
        ("y".to_owned(), 0),
    ] {
        assert!(firsts.contains(&expected), "{expected:?} in {firsts:?}");
    }
    broker.cleanup().await;
}

/// A row enqueued and spoiled in the same transaction (headers that are not a JSON
/// object of strings, as a trigger or another producer might write them) is dead, never
/// published; the good message beside it is.
async fn a_row_spoiled_in_its_own_transaction_is_dead<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["spoiled", "good"], 1, "Spoiled");
    let spoiled = msgs[0].id;
    let token = CancellationToken::new();
    let relay = w.spawn(broker.publisher().await, config(), &token);
    let mut tx = w.outbox.begin().await.expect("begin");
    w.outbox
        .enqueue_batch(&mut tx, &msgs)
        .await
        .expect("enqueue");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {}.outbox_messages SET headers = '{{\"retries\": 3}}' WHERE id = $1",
        w.outbox.schema()
    )))
    .bind(spoiled)
    .execute(&mut *tx)
    .await
    .expect("spoil");
    tx.commit().await.expect("commit");
    assert!(
        eventually(Duration::from_secs(30), || async {
            w.outbox
                .get(spoiled)
                .await
                .expect("get")
                .is_some_and(|m| m.status == MessageStatus::Dead)
        })
        .await,
        "the spoiled row is dead"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            !log.lock().expect("lock").is_empty()
        })
        .await,
        "the good one is published"
    );
    token.cancel();
    relay.await.expect("join");
    let keys: Vec<String> = log
        .lock()
        .expect("lock")
        .iter()
        .map(|a| a.key.clone())
        .collect();
    assert_eq!(
        keys,
        vec!["good".to_owned()],
        "the spoiled row never reaches the broker"
    );
    broker.cleanup().await;
}

/// Batches in flight (the pipeline), without per-key order: while `k`'s first
/// message is being published (held), its next three, each in a transaction of its
/// own, are published too; then the first fails (transiently). The three, taken by the
/// broker, are parked behind it and published again after it (their rows recorded
/// sent no earlier than the first's), and every row is sent. Over RabbitMQ each of
/// them is received again after the first, in order; JetStream drops the republish
/// as a duplicate within its window (the unordered mode's documented limit).
async fn a_failure_in_flight_parks_its_key_in_the_later_batches<B: Broker>() {
    let w = WalOutbox::new().await;
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["k"], 4, "Ordered");
    let victim = msgs[0].id;
    let publisher = Arc::new(HoldBatch::new(
        Faulty::new(broker.publisher().await, &[(victim, false, 1)]),
        victim,
    ));
    let token = CancellationToken::new();
    // Batches of 10: past the careful start (as many messages as a batch) with the
    // warm-up, unordered (the default).
    let relay = w.spawn(
        Arc::clone(&publisher),
        WalRelayConfig::new(database_url())
            .with_standby_interval(Duration::from_millis(100))
            .with_batch_size(10)
            .with_retry(retry_after(Duration::from_millis(500), 5)),
        &token,
    );
    w.enqueue(&keyed(&["warm"], 20, "Ordered")).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 20
        })
        .await,
        "the warm-up is received"
    );

    w.enqueue(&msgs[..1]).await;
    tokio::time::timeout(Duration::from_secs(30), publisher.held.notified())
        .await
        .expect("the first message's batch is being published");
    for m in &msgs[1..] {
        w.enqueue(std::slice::from_ref(m)).await;
    }
    let later_published = eventually(Duration::from_secs(30), || async {
        let log = log.lock().expect("lock");
        (1..4).all(|n| position(&log, "k", n).is_some())
    })
    .await;
    publisher.release.notify_one();
    assert!(
        later_published,
        "the later batches are published while the first one is in flight"
    );
    let all_sent = eventually(Duration::from_secs(60), || async {
        w.outbox.stats().await.expect("stats").sent == 24
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(all_sent, "every row sent: {stats:?}");
    assert_eq!(stats.dead, 0, "{stats:?}");
    let mut sent_at = Vec::new();
    for m in &msgs {
        let row = w.outbox.get(m.id).await.expect("get").expect("row");
        sent_at.push(row.sent_at.expect("sent"));
    }
    assert!(
        sent_at[1..].iter().all(|t| *t >= sent_at[0]),
        "k's later messages recorded sent after it was republished behind the first: {sent_at:?}"
    );
    if !B::DROPS_REPUBLISHED {
        let log = log.lock().expect("lock").clone();
        let first = position(&log, "k", 0).expect("k #0 received");
        let last: Vec<usize> = (1..4)
            .map(|n| {
                log.iter()
                    .rposition(|a| a.key == "k" && a.n == n)
                    .expect("received")
            })
            .collect();
        assert!(
            first < last[0] && last.windows(2).all(|p| p[0] < p[1]),
            "k's later messages received again after its first, in order: first at {first}, last receipts at {last:?}"
        );
    }
    let row = w.outbox.get(victim).await.expect("get").expect("row");
    assert_eq!(
        (row.status, row.attempts),
        (MessageStatus::Sent, 2),
        "failed once, then sent"
    );
    broker.cleanup().await;
}

macro_rules! wal_ordered_tests {
    ($module:ident, $broker:ident) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn many_keys_from_concurrent_producers_arrive_in_order() {
                super::many_keys_from_concurrent_producers_arrive_in_order::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lingering_relay_keeps_every_key_in_order() {
                super::a_lingering_relay_keeps_every_key_in_order::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_steady_stream_does_not_hold_a_lingering_batch() {
                super::a_steady_stream_does_not_hold_a_lingering_batch::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_transient_failure_parks_only_its_key() {
                super::a_transient_failure_parks_only_its_key::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_permanent_failure_is_dead_and_its_key_continues() {
                super::a_permanent_failure_is_dead_and_its_key_continues::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_relay_killed_mid_batch_breaks_no_keys_order() {
                super::a_relay_killed_mid_batch_breaks_no_keys_order::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_new_session_keeps_a_parked_key_waiting() {
                super::a_new_session_keeps_a_parked_key_waiting::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_parked_row_that_kills_the_relay_dies_alone() {
                super::a_parked_row_that_kills_the_relay_dies_alone::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_spoiled_in_its_own_transaction_is_dead() {
                super::a_row_spoiled_in_its_own_transaction_is_dead::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failure_in_flight_parks_its_key_in_the_later_batches() {
                super::a_failure_in_flight_parks_its_key_in_the_later_batches::<$broker>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn error_texts_are_stored_sanitized() {
                super::error_texts_are_stored_sanitized::<$broker>().await;
            }
        }
    };
}

wal_ordered_tests!(rabbit, Rabbit);
wal_ordered_tests!(nats, Nats);

/// An invalid setting is refused where the relay is built (`WalRelay::new`), with the
/// typed error naming it, before any connection; `setup` refuses a bad name before
/// creating anything.
#[tokio::test]
async fn an_invalid_config_is_refused_where_the_relay_is_built() {
    use outboxkit_postgres::wal::{WalConfig, WalError, WalRelay};
    let outbox = common::fresh_outbox_kept().await;
    let publisher = Arc::new(outboxkit_memory::MemoryPublisher::new());
    let relay = |wal: WalConfig, config: WalRelayConfig| {
        WalRelay::new(outbox.clone(), wal, Arc::clone(&publisher), config).map(drop)
    };
    let good = WalConfig::new(outbox.schema());
    let err = relay(
        good.clone().with_slot("Not-A-Slot"),
        WalRelayConfig::new(database_url()),
    )
    .expect_err("a bad slot name");
    assert!(
        matches!(&err, WalError::InvalidName { what: "slot", .. }),
        "{err}"
    );
    let err = relay(
        good.clone(),
        WalRelayConfig::new(database_url()).with_ordering(Ordering::per_key()),
    )
    .expect_err("OnDead::Block");
    assert!(
        matches!(&err, WalError::InvalidConfig { field: "ordering", reason } if reason.contains("OnDead::Skip")),
        "{err}"
    );
    let err = relay(good.clone(), WalRelayConfig::new("")).expect_err("no URL");
    assert!(
        matches!(&err, WalError::InvalidConfig { field: "url", .. }),
        "{err}"
    );
    relay(good, WalRelayConfig::new(database_url())).expect("valid");
    let bad = WalConfig::new(outbox.schema()).with_publication("x;drop");
    let err = outboxkit_postgres::wal::setup(&outbox, &bad)
        .await
        .expect_err("a bad publication name");
    assert!(
        matches!(
            &err,
            WalError::InvalidName {
                what: "publication",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(publisher.published_count(), 0, "nothing was published");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{}\" CASCADE",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("drop the schema");
}
