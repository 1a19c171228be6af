//! The dispatcher (relay) over the in-memory store and publisher: its decisions, the
//! circuit breaker, shutdown, per-key order and the wake handle, with no database or
//! broker. Every test runs on paused tokio time (`start_paused`): leases, backoffs,
//! poll waits and drains pass in virtual time, so the suite takes milliseconds and the
//! durations asserted are exact.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::Duration;

use outboxkit_core::{
    Dispatcher, DispatcherConfig, DispatcherStats, MessageFilter, MessageStatus, NewMessage,
    OnDead, Ordering, OutboxError, OutboxMessage, OutboxProducer, OutboxStore, RetryPolicies,
    RetryPolicy,
};
use outboxkit_memory::{MemoryOutbox, MemoryPublisher, Scripted};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn message(aggregate_id: &str, event_type: &str) -> NewMessage {
    NewMessage::builder("order", aggregate_id, event_type)
        .payload(&serde_json::json!({ "id": aggregate_id }))
        .build()
        .expect("valid message")
}

/// `per_key` messages for each key, interleaved across keys (`seq` interleaves them);
/// aggregate id `"{key}-{n}"`.
fn keyed(keys: &[&str], per_key: usize) -> Vec<NewMessage> {
    let mut out = Vec::new();
    for n in 0..per_key {
        for key in keys {
            out.push(
                NewMessage::builder("order", format!("{key}-{n}"), "OrderPlaced")
                    .partition_key(*key)
                    .payload(&n)
                    .build()
                    .expect("valid message"),
            );
        }
    }
    out
}

/// A policy without jitter, so delays are exact: `base^attempts` seconds.
fn exact_policy(base: f64, max_attempts: u32) -> RetryPolicy {
    RetryPolicy::new()
        .with_base(base)
        .with_jitter(Duration::ZERO)
        .with_max_attempts(max_attempts)
}

fn dispatcher(
    store: &MemoryOutbox,
    publisher: &MemoryPublisher,
    config: DispatcherConfig,
) -> Dispatcher<MemoryOutbox, MemoryPublisher> {
    Dispatcher::new(Arc::new(store.clone()), Arc::new(publisher.clone()), config)
        .expect("valid dispatcher config")
}

/// Runs `d` until the returned token is cancelled.
fn spawn(
    d: &Dispatcher<MemoryOutbox, MemoryPublisher>,
) -> (
    CancellationToken,
    JoinHandle<Result<DispatcherStats, OutboxError>>,
) {
    let token = CancellationToken::new();
    let d = d.clone();
    let t = token.clone();
    (token, tokio::spawn(async move { d.run(t).await }))
}

/// Polls `done` every 10 ms of (virtual) time; panics naming `what` after 10 minutes.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Enqueues `messages` in one transaction and commits it; returns their ids.
async fn committed(
    store: &MemoryOutbox,
    messages: impl IntoIterator<Item = NewMessage>,
) -> Vec<Uuid> {
    let messages: Vec<NewMessage> = messages.into_iter().collect();
    let mut tx = store.begin();
    let ids = store
        .enqueue_batch(&mut tx, &messages)
        .await
        .expect("enqueue");
    tx.commit().expect("commit");
    ids
}

async fn row(store: &MemoryOutbox, id: Uuid) -> OutboxMessage {
    store.get(id).await.expect("get").expect("row exists")
}

fn by_aggregate(store: &MemoryOutbox, aggregate_id: &str) -> OutboxMessage {
    store
        .messages()
        .into_iter()
        .find(|m| m.aggregate_id == aggregate_id)
        .expect("row exists")
}

/// The aggregate ids of the confirmed messages, in the order the broker confirmed them.
fn confirmed(publisher: &MemoryPublisher) -> Vec<String> {
    publisher
        .published()
        .into_iter()
        .map(|m| m.aggregate_id)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_confirmed_message_is_sent() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    let id = committed(&store, [message("1", "OrderPlaced")]).await[0];
    let report = dispatcher(&store, &publisher, DispatcherConfig::new())
        .run_batch()
        .await
        .expect("batch");
    assert_eq!((report.claimed, report.published), (1, 1));
    assert_eq!(publisher.published_ids(), [id], "the broker got it once");
    let sent = row(&store, id).await;
    assert_eq!(sent.status, MessageStatus::Sent);
    assert_eq!(sent.attempts, 1);
    assert_eq!(sent.sent_at, Some(store.clock().now()));
    assert_eq!(sent.claim_token, None);
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_is_retried_after_the_policys_backoff() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    let id = committed(&store, [message("1", "OrderPlaced")]).await[0];
    let config = DispatcherConfig::new().with_retry(RetryPolicies::new(exact_policy(2.0, 5)));
    let d = dispatcher(&store, &publisher, config);

    publisher.script([Scripted::Nack, Scripted::Nack]);
    let report = d.run_batch().await.expect("batch");
    assert_eq!((report.retried, report.dead, report.outage), (1, 0, false));
    let first = row(&store, id).await;
    assert_eq!(first.status, MessageStatus::New);
    assert_eq!(first.attempts, 1, "the failed attempt is charged");
    assert_eq!(
        (first.visible_at - store.clock().now()).to_std().ok(),
        Some(Duration::from_secs(2)),
        "2^1 s backoff"
    );
    assert!(
        first
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("nack")),
        "{:?}",
        first.last_error
    );
    let hidden = d.run_batch().await.expect("batch");
    assert_eq!(hidden.claimed, 0, "hidden during its backoff");

    tokio::time::advance(Duration::from_secs(2)).await;
    d.run_batch().await.expect("batch");
    let second = row(&store, id).await;
    assert_eq!(second.attempts, 2);
    assert_eq!(
        (second.visible_at - store.clock().now()).to_std().ok(),
        Some(Duration::from_secs(4)),
        "2^2 s backoff: exponential"
    );

    tokio::time::advance(Duration::from_secs(4)).await;
    let report = d.run_batch().await.expect("batch");
    assert_eq!(report.published, 1, "the third attempt goes through");
    assert_eq!(row(&store, id).await.status, MessageStatus::Sent);
    assert_eq!(publisher.offered(), [id, id, id], "offered three times");
}

#[tokio::test(start_paused = true)]
async fn a_permanent_failure_is_dead_at_once_and_alone() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    let ids = committed(
        &store,
        [
            message("1", "OrderPlaced"),
            message("2", "OrderPlaced"),
            message("3", "OrderPlaced"),
        ],
    )
    .await;
    publisher.script([
        Scripted::Confirm,
        Scripted::Unroutable,
        Scripted::TooLarge { max: 1 },
    ]);
    let report = dispatcher(&store, &publisher, DispatcherConfig::new())
        .run_batch()
        .await
        .expect("batch");
    assert_eq!((report.published, report.dead, report.retried), (1, 2, 0));
    assert_eq!(row(&store, ids[0]).await.status, MessageStatus::Sent);
    for (id, words) in [(ids[1], "NO_ROUTE"), (ids[2], "exceeds the broker limit")] {
        let dead = row(&store, id).await;
        assert_eq!(dead.status, MessageStatus::Dead);
        assert_eq!(dead.attempts, 1, "dead on its first attempt");
        assert!(
            dead.last_error
                .as_deref()
                .is_some_and(|e| e.contains(words)),
            "{:?}",
            dead.last_error
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_message_is_dead_when_its_attempts_run_out() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new().with_rule(|_| Some(Scripted::Nack));
    let id = committed(&store, [message("1", "OrderPlaced")]).await[0];
    let config = DispatcherConfig::new().with_retry(RetryPolicies::new(exact_policy(1.0, 3)));
    let d = dispatcher(&store, &publisher, config);
    for attempt in 1..=3 {
        let report = d.run_batch().await.expect("batch");
        assert_eq!(report.claimed, 1, "attempt {attempt} claims it");
        let r = row(&store, id).await;
        assert_eq!(r.attempts, attempt);
        let want = if attempt < 3 {
            MessageStatus::New
        } else {
            MessageStatus::Dead
        };
        assert_eq!(r.status, want, "after attempt {attempt}");
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let dead = row(&store, id).await;
    assert!(
        dead.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("attempts exhausted (3/3)")),
        "{:?}",
        dead.last_error
    );
    assert_eq!(d.run_batch().await.expect("batch").claimed, 0);
}

#[tokio::test(start_paused = true)]
async fn retry_policies_are_overridden_by_event_type() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new().with_rule(|_| Some(Scripted::Nack));
    let ids = committed(&store, [message("1", "Flaky"), message("2", "Patient")]).await;
    let config = DispatcherConfig::new().with_retry(
        RetryPolicies::new(exact_policy(10.0, 8)).with_override("Flaky", exact_policy(2.0, 1)),
    );
    let report = dispatcher(&store, &publisher, config)
        .run_batch()
        .await
        .expect("batch");
    assert_eq!((report.dead, report.retried), (1, 1));
    assert_eq!(
        row(&store, ids[0]).await.status,
        MessageStatus::Dead,
        "Flaky: one attempt only"
    );
    let patient = row(&store, ids[1]).await;
    assert_eq!(patient.status, MessageStatus::New);
    assert_eq!(
        (patient.visible_at - store.clock().now()).to_std().ok(),
        Some(Duration::from_secs(10)),
        "the default policy's 10^1 s"
    );
}

#[tokio::test(start_paused = true)]
async fn a_publisher_panic_kills_only_its_message() {
    let store = MemoryOutbox::new();
    let publisher =
        MemoryPublisher::new().with_rule(|m| (m.aggregate_id == "2").then_some(Scripted::Panic));
    let ids = committed(
        &store,
        [
            message("1", "OrderPlaced"),
            message("2", "OrderPlaced"),
            message("3", "OrderPlaced"),
        ],
    )
    .await;
    let report = dispatcher(&store, &publisher, DispatcherConfig::new())
        .run_batch()
        .await
        .expect("batch");
    assert_eq!((report.published, report.dead), (2, 1));
    assert_eq!(row(&store, ids[1]).await.status, MessageStatus::Dead);
    assert_eq!(publisher.published_ids(), [ids[0], ids[2]]);
    assert_eq!(
        publisher.call_sizes(),
        [3, 1, 1, 1],
        "the batch, then one message at a time"
    );
}

#[tokio::test(start_paused = true)]
async fn an_outage_opens_the_circuit_charges_nothing_and_a_trial_closes_it() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new().with_probe_backoff(Duration::from_secs(1), Duration::from_secs(8)),
    );
    let (token, run) = spawn(&d);
    // Started while the broker was up; it goes down before the messages come.
    wait_until("the start's readiness check", || {
        publisher.ready_checks() >= 1
    })
    .await;
    publisher.set_down(true);
    committed(
        &store,
        (0..5).map(|i| message(&i.to_string(), "OrderPlaced")),
    )
    .await;
    d.wake_handle().wake();
    wait_until("the circuit opens", || d.circuit_open()).await;
    // Probes go on (1 s, 2 s, 4 s, 8 s, 8 s ...) while the broker is down.
    wait_until("five probes", || publisher.ready_checks() >= 6).await;
    assert!(d.circuit_open());
    let rows = store.messages();
    assert!(
        rows.iter()
            .all(|m| m.status == MessageStatus::New && m.attempts == 0),
        "released without charge, never dead: {rows:?}"
    );
    assert_eq!(publisher.calls(), 1, "no publish while the circuit is open");

    publisher.set_down(false);
    assert!(publisher.wait_published(5, Duration::from_secs(60)).await);
    assert!(!d.circuit_open(), "the trial closed the circuit");
    let sizes = publisher.call_sizes();
    assert_eq!(&sizes[..2], [5, 1], "the failed batch, then a trial of one");
    let stats = d.stats();
    assert_eq!((stats.circuit_opened, stats.dead, stats.retried), (1, 0, 0));
    token.cancel();
    run.await.expect("task").expect("run");
    assert!(
        store
            .messages()
            .iter()
            .all(|m| m.status == MessageStatus::Sent && m.attempts == 1),
        "each charged only for its successful attempt"
    );
}

/// A relay started (or restarted) while the broker is down claims nothing: every row
/// stays `New`, uncharged and unheld, until a probe finds the broker ready; then a
/// trial of one, then the rest.
#[tokio::test(start_paused = true)]
async fn a_dispatcher_started_while_the_broker_is_down_claims_nothing() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    committed(
        &store,
        (0..5).map(|i| message(&i.to_string(), "OrderPlaced")),
    )
    .await;
    publisher.set_down(true);
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new().with_probe_backoff(Duration::from_secs(1), Duration::from_secs(8)),
    );
    let (token, run) = spawn(&d);
    wait_until("three probes", || publisher.ready_checks() >= 3).await;
    assert!(d.circuit_open(), "the circuit starts open");
    assert_eq!(publisher.calls(), 0, "nothing published");
    assert_eq!(d.stats().claimed, 0, "nothing claimed");
    let rows = store.messages();
    assert!(
        rows.iter()
            .all(|m| m.status == MessageStatus::New && m.attempts == 0 && m.claim_token.is_none()),
        "untouched: {rows:?}"
    );
    publisher.set_down(false);
    assert!(publisher.wait_published(5, Duration::from_secs(60)).await);
    assert_eq!(
        publisher.call_sizes(),
        [1, 4],
        "a trial of one, then the rest"
    );
    token.cancel();
    run.await.expect("task").expect("run");
    assert!(
        store
            .messages()
            .iter()
            .all(|m| m.status == MessageStatus::Sent && m.attempts == 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_destination_that_refuses_messages_is_tried_one_message_at_a_time() {
    let store = MemoryOutbox::new();
    // check_ready succeeds (the connection is fine) but a full queue rejects messages.
    let publisher = MemoryPublisher::new();
    publisher.script_calls([Scripted::Rejected, Scripted::Rejected, Scripted::Rejected]);
    committed(
        &store,
        (0..4).map(|i| message(&i.to_string(), "OrderPlaced")),
    )
    .await;
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new().with_probe_backoff(Duration::from_secs(1), Duration::from_secs(30)),
    );
    let (token, run) = spawn(&d);
    let opened = Instant::now();
    assert!(publisher.wait_published(4, Duration::from_secs(60)).await);
    // Trials after 1 s and 2 s fail; the one after another 4 s succeeds.
    assert!(
        opened.elapsed() >= Duration::from_secs(7),
        "{:?}",
        opened.elapsed()
    );
    assert_eq!(&publisher.call_sizes()[..4], [4, 1, 1, 1]);
    token.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!(
        (
            stats.destination_circuits_opened,
            stats.circuit_opened,
            stats.published,
            stats.dead
        ),
        (1, 0, 4, 0),
        "the destination's circuit, not the broker's"
    );
    assert!(store.messages().iter().all(|m| m.attempts == 1));
}

/// One destination full (its messages refused), the other fine: the full one's
/// messages are held back, uncharged, while every message of the other is published
/// at once; when the full one takes messages again, its messages follow, none dead.
#[tokio::test(start_paused = true)]
async fn a_full_destination_holds_back_only_its_own_messages() {
    let full = Arc::new(AtomicBool::new(true));
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new().with_rule({
        let full = Arc::clone(&full);
        move |m| (m.event_type == "ToFull" && full.load(SeqCst)).then_some(Scripted::Rejected)
    });
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new()
            .with_batch_size(20)
            .with_probe_backoff(Duration::from_millis(500), Duration::from_secs(4)),
    );
    let (token, run) = spawn(&d);
    for round in 0..10 {
        committed(
            &store,
            (0..10).flat_map(|i| {
                let id = format!("{round}-{i}");
                [message(&id, "ToFull"), message(&id, "ToOther")]
            }),
        )
        .await;
        d.wake_handle().wake();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let late: Vec<_> = store
            .messages()
            .into_iter()
            .filter(|m| m.event_type == "ToOther" && m.status != MessageStatus::Sent)
            .collect();
        assert!(
            late.is_empty(),
            "round {round}: the other destination's messages go within a second: {late:?}"
        );
    }
    let to_full: Vec<_> = store
        .messages()
        .into_iter()
        .filter(|m| m.event_type == "ToFull")
        .collect();
    assert!(
        to_full
            .iter()
            .all(|m| m.status == MessageStatus::New && m.attempts == 0),
        "held back, uncharged: {to_full:?}"
    );
    assert!(d.destination_circuit_open() && !d.circuit_open());
    full.store(false, SeqCst);
    assert!(
        publisher
            .wait_published(200, Duration::from_secs(120))
            .await
    );
    token.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!((stats.dead, stats.retried, stats.circuit_opened), (0, 0, 0));
    assert!(
        store
            .messages()
            .iter()
            .all(|m| m.status == MessageStatus::Sent && m.attempts == 1),
        "each charged only for its successful attempt"
    );
}

#[tokio::test(start_paused = true)]
async fn a_publish_longer_than_the_publish_timeout_is_an_outage() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new().with_publish_timeout(Some(Duration::from_secs(1)));
    publisher.set_delay(Duration::from_secs(5));
    let id = committed(&store, [message("1", "OrderPlaced")]).await[0];
    let d = dispatcher(&store, &publisher, DispatcherConfig::new());
    let started = Instant::now();
    let report = d.run_batch().await.expect("batch");
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(1),
        "cut at the timeout"
    );
    assert!(report.outage);
    assert_eq!(report.released, 1);
    assert!(d.circuit_open());
    let r = row(&store, id).await;
    assert_eq!((r.status, r.attempts), (MessageStatus::New, 0));
}

#[tokio::test(start_paused = true)]
async fn shutdown_behind_a_hung_broker_releases_everything_at_the_drain_timeout() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    publisher.set_delay(Duration::from_secs(3600));
    committed(
        &store,
        (0..10).map(|i| message(&i.to_string(), "OrderPlaced")),
    )
    .await;
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new()
            .with_batch_size(2)
            .with_concurrency(2)
            .with_drain_timeout(Duration::from_secs(2)),
    );
    let (token, run) = spawn(&d);
    wait_until("two publishes hang", || publisher.calls() == 2).await;
    wait_until("more batches claimed and waiting", || {
        d.stats().claimed >= 6
    })
    .await;
    let cancelled = Instant::now();
    token.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!(
        cancelled.elapsed(),
        Duration::from_secs(2),
        "run returns at the drain timeout, not after the hung publish"
    );
    assert_eq!(publisher.published_count(), 0);
    assert_eq!(
        stats.released, stats.claimed,
        "all that was claimed is released"
    );
    let rows = store.messages();
    assert!(
        rows.iter()
            .all(|m| m.status == MessageStatus::New && m.attempts == 0 && m.claim_token.is_none()),
        "handed back without charge: {rows:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_lets_a_slow_publish_finish_within_the_drain_timeout() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    publisher.set_delay(Duration::from_secs(1));
    let id = committed(&store, [message("1", "OrderPlaced")]).await[0];
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new().with_drain_timeout(Duration::from_secs(5)),
    );
    let (token, run) = spawn(&d);
    wait_until("the publish starts", || publisher.calls() == 1).await;
    token.cancel();
    let stats = run.await.expect("task").expect("run");
    assert_eq!((stats.published, stats.released), (1, 0));
    assert_eq!(row(&store, id).await.status, MessageStatus::Sent);
}

#[tokio::test(start_paused = true)]
async fn per_key_order_holds_across_a_retry() {
    let store = MemoryOutbox::new();
    // a-0 fails once: a-1.. must wait for it, b and c flow.
    let failed_once = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&failed_once);
    let publisher = MemoryPublisher::new().with_rule(move |m| {
        (m.aggregate_id == "a-0" && !flag.swap(true, SeqCst)).then_some(Scripted::Nack)
    });
    committed(&store, keyed(&["a", "b", "c"], 4)).await;
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new()
            .with_ordering(Ordering::per_key())
            .with_retry(RetryPolicies::new(exact_policy(3.0, 5))),
    );
    let (token, run) = spawn(&d);
    assert!(publisher.wait_published(12, Duration::from_secs(120)).await);
    token.cancel();
    run.await.expect("task").expect("run");
    assert!(failed_once.load(SeqCst));
    let order = confirmed(&publisher);
    for key in ["a", "b", "c"] {
        let of_key: Vec<&str> = order
            .iter()
            .map(String::as_str)
            .filter(|id| id.starts_with(&format!("{key}-")))
            .collect();
        let want: Vec<String> = (0..4).map(|n| format!("{key}-{n}")).collect();
        assert_eq!(of_key, want, "key {key} confirmed in order");
    }
    assert_eq!(by_aggregate(&store, "a-0").attempts, 2);
    assert!(
        order.iter().position(|id| id == "b-3") < order.iter().position(|id| id == "a-1"),
        "other keys do not wait for a's backoff: {order:?}"
    );
}

/// A key `k` whose head `k-0` is unroutable until `fixed` is set, beside a healthy key.
async fn dead_head_setup(
    on_dead: OnDead,
) -> (
    MemoryOutbox,
    MemoryPublisher,
    Arc<AtomicBool>,
    Dispatcher<MemoryOutbox, MemoryPublisher>,
) {
    let store = MemoryOutbox::new();
    let fixed = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&fixed);
    let publisher = MemoryPublisher::new().with_rule(move |m| {
        (m.aggregate_id == "k-0" && !flag.load(SeqCst)).then_some(Scripted::Unroutable)
    });
    committed(&store, keyed(&["k", "j"], 3)).await;
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new().with_ordering(Ordering::PerKey { on_dead }),
    );
    (store, publisher, fixed, d)
}

#[tokio::test(start_paused = true)]
async fn a_dead_head_blocks_its_key_under_block_until_replayed() {
    let (store, publisher, fixed, d) = dead_head_setup(OnDead::Block).await;
    let (token, run) = spawn(&d);
    assert!(publisher.wait_published(3, Duration::from_secs(60)).await);
    // Give the relay many more polls (virtual time) to publish what it must not.
    let polls = d.stats().batches;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(d.stats().batches, polls, "nothing more to claim");
    assert_eq!(confirmed(&publisher), ["j-0", "j-1", "j-2"]);
    assert_eq!(by_aggregate(&store, "k-0").status, MessageStatus::Dead);
    for waiting in ["k-1", "k-2"] {
        let m = by_aggregate(&store, waiting);
        assert_eq!((m.status, m.attempts), (MessageStatus::New, 0), "{waiting}");
    }
    let blocked = store.blocked_keys(10).await.expect("blocked keys");
    assert_eq!(blocked.len(), 1);
    assert_eq!(
        (
            blocked[0].key.as_str(),
            blocked[0].status,
            blocked[0].waiting
        ),
        ("p:k", MessageStatus::Dead, 2)
    );

    fixed.store(true, SeqCst);
    let head = by_aggregate(&store, "k-0").id;
    let replayed = store
        .replay(&MessageFilter::new().with_ids([head]), false)
        .await
        .expect("replay");
    assert_eq!(replayed.replayed, 1);
    d.wake_handle().wake();
    assert!(publisher.wait_published(6, Duration::from_secs(60)).await);
    token.cancel();
    run.await.expect("task").expect("run");
    let k: Vec<String> = confirmed(&publisher)
        .into_iter()
        .filter(|id| id.starts_with("k-"))
        .collect();
    assert_eq!(k, ["k-0", "k-1", "k-2"], "the replayed head goes first");
}

#[tokio::test(start_paused = true)]
async fn a_dead_head_is_passed_over_under_skip() {
    let (store, publisher, _fixed, d) = dead_head_setup(OnDead::Skip).await;
    let (token, run) = spawn(&d);
    assert!(publisher.wait_published(5, Duration::from_secs(60)).await);
    token.cancel();
    run.await.expect("task").expect("run");
    let order = confirmed(&publisher);
    let k: Vec<&String> = order.iter().filter(|id| id.starts_with("k-")).collect();
    assert_eq!(
        k,
        ["k-1", "k-2"],
        "the key goes on after its dead head, in order"
    );
    assert_eq!(by_aggregate(&store, "k-0").status, MessageStatus::Dead);
}

#[tokio::test(start_paused = true)]
async fn the_wake_handle_ends_the_poll_wait() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new()
            .with_poll_interval(Duration::from_secs(3600))
            .with_push_wake(false),
    );
    let (token, run) = spawn(&d);
    // Let the idle relay settle into its hour-long poll wait.
    tokio::time::sleep(Duration::from_secs(1)).await;
    committed(&store, [message("1", "OrderPlaced")]).await;
    assert!(
        !publisher.wait_published(1, Duration::from_secs(60)).await,
        "without a wake-up the message waits for the next poll"
    );
    d.wake_handle().wake();
    assert!(
        publisher
            .wait_published(1, Duration::from_millis(100))
            .await,
        "the wake-up claims it at once"
    );
    token.cancel();
    run.await.expect("task").expect("run");
}

/// The dispatcher starts the store's push wake-up by itself: with a 60 s poll (every
/// wait 60 s, even right after a claim that found messages), a message committed after
/// the relay went idle is published well within the poll interval. Turned off, the same
/// message waits for the poll.
#[tokio::test(start_paused = true)]
async fn the_store_wakes_the_dispatcher_on_commit_by_itself() {
    for push in [true, false] {
        let store = MemoryOutbox::new();
        let publisher = MemoryPublisher::new();
        let poll = Duration::from_secs(60);
        let d = dispatcher(
            &store,
            &publisher,
            DispatcherConfig::new()
                .with_poll_interval(poll)
                .with_min_poll_interval(poll)
                .with_push_wake(push),
        );
        committed(&store, [message("first", "OrderPlaced")]).await;
        let (token, run) = spawn(&d);
        // The first claim found a message: the claimer now waits its 60 s.
        wait_until("the first message is published", || {
            publisher.published_count() == 1
        })
        .await;
        let after_idle = Instant::now();
        committed(&store, [message("second", "OrderPlaced")]).await;
        let woken = publisher.wait_published(2, Duration::from_secs(5)).await;
        assert_eq!(
            woken, push,
            "push wake-up {push}: published within 5 s of the commit (poll interval 60 s)"
        );
        if !push {
            wait_until("the poll claims it", || publisher.published_count() == 2).await;
            assert!(
                after_idle.elapsed() >= Duration::from_secs(50),
                "by the poll"
            );
        }
        token.cancel();
        run.await.expect("task").expect("run");
    }
}

/// A half-open trial whose claim finds only poison rows records them dead and claims
/// again for a message to try: it does not close the circuit on nothing. Here the broker
/// answers probes but still cannot take messages: the trial fails and the circuit stays
/// open (never closed and opened again by a normal batch), until a later trial passes.
#[tokio::test(start_paused = true)]
async fn a_trial_that_finds_only_poison_keeps_the_circuit_open() {
    let store = MemoryOutbox::new();
    let publisher = MemoryPublisher::new();
    publisher.set_down(true);
    let poison = committed(
        &store,
        (0..3).map(|i| message(&format!("p{i}"), "OrderPlaced")),
    )
    .await;
    for &id in &poison {
        assert!(store.set_headers_json(id, "[1, 2]"), "poison row");
    }
    let good = committed(&store, [message("a", "OrderPlaced")]).await[0];
    let d = dispatcher(
        &store,
        &publisher,
        DispatcherConfig::new().with_probe_backoff(Duration::from_secs(1), Duration::from_secs(8)),
    );
    let (token, run) = spawn(&d);
    wait_until("the start's readiness check", || {
        publisher.ready_checks() >= 1
    })
    .await;
    // The broker answers probes again but its first two publishes fail.
    publisher.script_calls([Scripted::Unavailable, Scripted::Unavailable]);
    publisher.set_down(false);
    assert!(publisher.wait_published(1, Duration::from_secs(60)).await);
    token.cancel();
    let stats = run.await.expect("task").expect("run");
    for id in poison {
        assert_eq!(row(&store, id).await.status, MessageStatus::Dead);
    }
    assert_eq!(row(&store, good).await.status, MessageStatus::Sent);
    assert_eq!(
        stats.circuit_opened, 0,
        "the circuit never closed on a trial of poison alone, so never opened again: {stats:?}"
    );
    assert_eq!(
        publisher.call_sizes(),
        [1, 1, 1],
        "trials of the one message"
    );
}
