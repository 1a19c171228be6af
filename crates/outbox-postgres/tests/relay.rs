//! The dispatcher end to end on the real PostgreSQL and RabbitMQ: exclusivity under
//! concurrency, lease reclaim after a crash, retry, dead letters.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::fresh_outbox;
use common::rabbit::{eventually, fixture, reject_when_full};
use lapin::types::FieldTable;
use outboxkit_core::{
    Dispatcher, DispatcherConfig, EventPublisher, MessageStatus, NewMessage, OutboxMessage,
    OutboxProducer, OutboxStore, PublishOutcome, RetryPolicies, RetryPolicy,
};
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};
use tokio_util::sync::CancellationToken;

async fn publisher(exchange: &str, max_payload: Option<usize>) -> Arc<RabbitPublisher> {
    let mut b = RabbitConfig::new(common::rabbit::amqp_url())
        .with_exchange(exchange)
        .with_declare_exchange(false);
    if let Some(max) = max_payload {
        b = b.with_max_payload_bytes(max);
    }
    Arc::new(RabbitPublisher::connect(b).await.expect("publisher"))
}

async fn enqueue(outbox: &PgOutbox, msgs: &[NewMessage]) -> Vec<uuid::Uuid> {
    let mut tx = outbox.begin().await.expect("begin");
    let mut ids = Vec::new();
    for chunk in msgs.chunks(1000) {
        ids.extend(outbox.enqueue_batch(&mut tx, chunk).await.expect("enqueue"));
    }
    tx.commit().await.expect("commit");
    ids
}

fn events(n: usize, event_type: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", i.to_string(), event_type)
                .payload(&serde_json::json!({ "i": i }))
                .build()
                .expect("valid")
        })
        .collect()
}

fn fast_retry(max_attempts: u32) -> RetryPolicies {
    RetryPolicies::new(
        RetryPolicy::new()
            .with_base(1.0)
            .with_cap(Duration::from_millis(200))
            .with_jitter(Duration::ZERO)
            .with_max_attempts(max_attempts),
    )
}

fn spawn<S: OutboxStore, P: EventPublisher>(
    d: &Dispatcher<S, P>,
    token: &CancellationToken,
) -> tokio::task::JoinHandle<Result<outboxkit_core::DispatcherStats, outboxkit_core::OutboxError>> {
    let d = d.clone();
    let t = token.clone();
    tokio::spawn(async move { d.run(t).await })
}

async fn status_of(outbox: &PgOutbox, id: uuid::Uuid) -> OutboxMessage {
    outbox.get(id).await.expect("get").expect("row")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_dispatchers_publish_10000_messages_exactly_once() {
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    let fx = fixture(true, FieldTable::default()).await;
    let counts = fx.counter().await;
    let ids: HashSet<String> = enqueue(&outbox, &events(10_000, "OrderPlaced"))
        .await
        .into_iter()
        .map(|u| u.to_string())
        .collect();

    let token = CancellationToken::new();
    let mut dispatchers = Vec::new();
    for _ in 0..4 {
        let d = Dispatcher::new(
            Arc::clone(&outbox),
            publisher(&fx.exchange, None).await,
            DispatcherConfig::new().with_batch_size(100),
        )
        .expect("valid dispatcher config");
        dispatchers.push((d.clone(), spawn(&d, &token)));
    }
    let all_sent = eventually(Duration::from_secs(120), || async {
        outbox.stats().await.expect("stats").sent == 10_000
    })
    .await;
    assert!(all_sent, "all 10,000 sent: {:?}", outbox.stats().await);
    let all_received = eventually(Duration::from_secs(60), || async {
        counts.lock().expect("lock").len() == 10_000
    })
    .await;
    token.cancel();
    let mut published = 0;
    for (_, handle) in dispatchers {
        let stats = handle.await.expect("join").expect("run");
        published += stats.published;
        assert_eq!(stats.dead + stats.retried + stats.fenced, 0, "{stats:?}");
    }
    assert!(
        all_received,
        "consumer saw {} distinct ids",
        counts.lock().expect("lock").len()
    );
    assert_eq!(
        published, 10_000,
        "each message published by exactly one dispatcher"
    );
    let counts = counts.lock().expect("lock");
    assert!(counts.values().all(|&c| c == 1), "a message arrived twice");
    assert_eq!(
        counts.keys().cloned().collect::<HashSet<_>>(),
        ids,
        "exactly the enqueued ids arrived"
    );
}

/// A publisher that publishes for real and then never returns: a dispatcher that dies
/// after publishing and before recording the outcome.
struct DiesAfterPublish(Arc<RabbitPublisher>);

#[async_trait::async_trait]
impl EventPublisher for DiesAfterPublish {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let _ = self.0.publish_batch(messages).await;
        std::future::pending().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_killed_mid_batch_loses_nothing_after_lease_expiry() {
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    let fx = fixture(true, FieldTable::default()).await;
    let counts = fx.counter().await;
    let ids = enqueue(&outbox, &events(50, "OrderPlaced")).await;
    let real = publisher(&fx.exchange, None).await;

    let doomed = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(DiesAfterPublish(Arc::clone(&real))),
        DispatcherConfig::new()
            .with_batch_size(20)
            .with_concurrency(1)
            .with_lease(Duration::from_secs(2)),
    )
    .expect("valid dispatcher config");
    let killed = tokio::spawn(async move { doomed.run_batch().await });
    // Wait until the doomed dispatcher has published its batch, then kill it.
    assert!(
        eventually(Duration::from_secs(20), || async {
            counts.lock().expect("lock").len() >= 20
        })
        .await
    );
    killed.abort();
    let held: Vec<_> = {
        let mut v = Vec::new();
        for id in &ids {
            if status_of(&outbox, *id).await.status == MessageStatus::Processing {
                v.push(*id);
            }
        }
        v
    };
    assert_eq!(held.len(), 20, "the dead dispatcher holds its batch");

    let token = CancellationToken::new();
    let rescuer = Dispatcher::new(
        Arc::clone(&outbox),
        real,
        DispatcherConfig::new().with_poll_interval(Duration::from_millis(100)),
    )
    .expect("valid dispatcher config");
    let handle = spawn(&rescuer, &token);
    assert!(
        eventually(Duration::from_secs(30), || async {
            outbox.stats().await.expect("stats").sent == 50
        })
        .await,
        "all sent after reclaim"
    );
    token.cancel();
    handle.await.expect("join").expect("run");
    for id in &held {
        assert_eq!(status_of(&outbox, *id).await.attempts, 2, "reclaimed once");
    }
    // Every republished copy is confirmed by now, but may still be on its way to the
    // test's consumer: wait for all 70 deliveries (50 + the 20 republished).
    assert!(
        eventually(Duration::from_secs(10), || async {
            counts.lock().expect("lock").values().sum::<usize>() >= 70
        })
        .await,
        "{:?}",
        counts.lock().expect("lock").values().sum::<usize>()
    );
    let counts = counts.lock().expect("lock");
    assert_eq!(counts.len(), 50, "every message arrived");
    let dupes = counts.values().filter(|&&c| c == 2).count();
    assert_eq!(
        dupes, 20,
        "the abandoned batch is published again (at-least-once; the inbox absorbs it)"
    );
}

/// A queue at its `x-max-length` with `reject-publish` nacks the publish: that
/// destination (the routing key) cannot take messages, so its circuit opens and the
/// message is deferred without an attempt charged (the refusal is recorded as its last
/// error); the broker's circuit stays closed. Once there is room a trial publish gets it
/// through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_nack_defers_the_message_and_charges_nothing() {
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    let fx = fixture(true, reject_when_full(1)).await;
    fx.publish_raw(b"filler").await; // the queue is full: the broker nacks publishes
    let id = enqueue(&outbox, &events(1, "OrderPlaced")).await[0];
    let token = CancellationToken::new();
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        publisher(&fx.exchange, None).await,
        DispatcherConfig::new()
            .with_retry(fast_retry(2))
            .with_poll_interval(Duration::from_millis(50))
            .with_probe_backoff(Duration::from_millis(100), Duration::from_millis(500)),
    )
    .expect("valid dispatcher config");
    let handle = spawn(&d, &token);
    assert!(
        eventually(Duration::from_secs(20), || async {
            d.stats().destination_circuits_opened >= 1 && d.stats().deferred >= 3
        })
        .await,
        "the nack opens the destination's circuit and trials are deferred: {:?}",
        d.stats()
    );
    assert_eq!(d.stats().circuit_opened, 0, "the broker itself is fine");
    let m = status_of(&outbox, id).await;
    assert_ne!(
        m.status,
        MessageStatus::Dead,
        "a nack is not the message's fault"
    );
    assert!(m.attempts <= 1, "no attempt charged: {m:?}");
    assert!(m.last_error.is_some(), "the refusal is recorded: {m:?}");

    fx.purge().await; // room again: the next trial goes through
    assert!(
        eventually(Duration::from_secs(20), || async {
            status_of(&outbox, id).await.status == MessageStatus::Sent
        })
        .await
    );
    token.cancel();
    let stats = handle.await.expect("join").expect("run");
    assert!(
        stats.retried == 0 && stats.published == 1 && stats.dead == 0,
        "{stats:?}"
    );
    assert_eq!(status_of(&outbox, id).await.attempts, 1);
    assert!(!d.circuit_open(), "the broker's circuit never opened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failures_are_dead_at_once() {
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    // Unroutable: the exchange has no queue.
    let lonely = fixture(false, FieldTable::default()).await;
    let unroutable = enqueue(&outbox, &events(1, "NobodyListens")).await[0];
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        publisher(&lonely.exchange, None).await,
        DispatcherConfig::new(),
    )
    .expect("valid dispatcher config");
    let report = d.run_batch().await.expect("batch");
    assert_eq!(report.dead, 1, "{report:?}");
    let m = status_of(&outbox, unroutable).await;
    assert_eq!((m.status, m.attempts), (MessageStatus::Dead, 1));
    assert!(
        m.last_error.as_deref().unwrap_or("").contains("unroutable"),
        "{:?}",
        m.last_error
    );

    // Too large for the configured limit.
    let fx = fixture(true, FieldTable::default()).await;
    let big = NewMessage::builder("order", "1", "Big")
        .payload(&"x".repeat(2000))
        .build()
        .expect("valid");
    let big_id = enqueue(&outbox, &[big]).await[0];
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        publisher(&fx.exchange, Some(1024)).await,
        DispatcherConfig::new(),
    )
    .expect("valid dispatcher config");
    let report = d.run_batch().await.expect("batch");
    assert_eq!(report.dead, 1, "{report:?}");
    let m = status_of(&outbox, big_id).await;
    assert_eq!((m.status, m.attempts), (MessageStatus::Dead, 1));
    assert!(
        m.last_error.as_deref().unwrap_or("").contains("exceeds"),
        "{:?}",
        m.last_error
    );
}

/// The real publisher behind 30 ms of extra latency per batch: a slow broker.
struct SlowBroker(Arc<RabbitPublisher>);

#[async_trait::async_trait]
impl EventPublisher for SlowBroker {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let outcomes = self.0.publish_batch(messages).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        outcomes
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_bound_by_its_broker_says_so_in_its_stats() {
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    let fx = fixture(true, FieldTable::default()).await;
    enqueue(&outbox, &events(1000, "OrderPlaced")).await;
    let token = CancellationToken::new();
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(SlowBroker(publisher(&fx.exchange, None).await)),
        DispatcherConfig::new()
            .with_batch_size(100)
            .with_concurrency(2)
            .with_poll_interval(Duration::from_millis(20)),
    )
    .expect("valid dispatcher config");
    let handle = spawn(&d, &token);
    assert!(
        eventually(Duration::from_secs(60), || async {
            d.stats().published == 1000
        })
        .await,
        "{:?}",
        d.stats()
    );
    token.cancel();
    let stats = handle.await.expect("join").expect("run");
    // Ten batches of at least 30 ms each were published.
    assert!(stats.publish_micros >= 10 * 30_000, "{stats:?}");
    // The store kept claimed batches ready for the slow broker: the publishers mostly
    // published, and waited for claims only at the start and after the backlog.
    assert!(
        stats.claim_wait_micros < stats.publish_micros / 2,
        "{stats:?}"
    );
}
