//! The ordered-delivery suite: the dispatcher in `Ordering::PerKey` mode over a real
//! broker, RabbitMQ or NATS JetStream, with a real consumer that reads the broker and
//! checks every key's order. Generic over a backend's conformance [`Harness`] and over
//! the [`Broker`] ([`Rabbit`], [`Nats`]), so every SQL backend runs the same tests
//! against itself over both transports: expand
//! [`ordered_delivery_tests!`](crate::ordered_delivery_tests).
//!
//! The properties are the same on both brokers. One count differs: a message published
//! again after a dispatcher died arrives twice on RabbitMQ and once on JetStream (its
//! duplicate window drops the second copy, see [`Broker::DROPS_REPUBLISHED`]); the order
//! is checked on first receipts, as an inbox would see them, on both.

mod broker;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outboxkit_core::conformance::{Harness, keyed};
use outboxkit_core::{
    Dispatcher, DispatcherConfig, EventPublisher, MessageFilter, MessageStatus, OnDead, Ordering,
    OutboxMessage, OutboxStore, PublishError, PublishOutcome, RetryPolicies, RetryPolicy,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use broker::{Arrival, Arrivals, Broker, Nats, Rabbit};

use crate::rabbit::eventually;

/// First receipts per key, in arrival order (a republished duplicate is ignored, as the
/// inbox would ignore it).
fn first_receipts(log: &[Arrival]) -> HashMap<String, Vec<u64>> {
    let mut seen = HashSet::new();
    let mut per_key: HashMap<String, Vec<u64>> = HashMap::new();
    for a in log {
        if seen.insert(a.id.clone()) {
            per_key.entry(a.key.clone()).or_default().push(a.n);
        }
    }
    per_key
}

/// Asserts every key's first receipts are exactly `0..per_key`, in order (the WAL
/// relay's suite in `outboxkit-postgres` uses it too).
pub fn assert_in_order(log: &[Arrival], keys: usize, per_key: u64) {
    let per = first_receipts(log);
    assert_eq!(per.len(), keys, "messages of every key arrived");
    for (key, ns) in &per {
        let expected: Vec<u64> = (0..per_key).collect();
        assert_eq!(
            ns, &expected,
            "key {key} arrived out of order or incomplete"
        );
    }
}

/// `key-0` ... `key-{n-1}`.
pub fn key_names(n: usize) -> Vec<String> {
    (0..n).map(|k| format!("key-{k}")).collect()
}

fn ordered(on_dead: OnDead) -> DispatcherConfig {
    DispatcherConfig::new()
        .with_ordering(Ordering::PerKey { on_dead })
        .with_poll_interval(Duration::from_millis(100))
}

fn spawn<S: OutboxStore, P: EventPublisher>(
    d: &Dispatcher<S, P>,
    token: &CancellationToken,
) -> tokio::task::JoinHandle<Result<outboxkit_core::DispatcherStats, outboxkit_core::OutboxError>> {
    let d = d.clone();
    let t = token.clone();
    tokio::spawn(async move { d.run(t).await })
}

/// 4 concurrent dispatchers, 100 keys, 20,000 messages: every key arrives in order,
/// each message published once.
pub async fn four_dispatchers_keep_100_keys_in_order_over_20000_messages<B: Broker, H: Harness>(
    h: &H,
) {
    let outbox = h.store();
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let names = key_names(100);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    h.enqueue(&keyed(&refs, 200, "Ordered")).await;

    let token = CancellationToken::new();
    let mut handles = Vec::new();
    for _ in 0..4 {
        let d = Dispatcher::new(
            Arc::clone(&outbox),
            broker.publisher().await,
            ordered(OnDead::Block),
        )
        .expect("valid dispatcher config");
        handles.push(spawn(&d, &token));
    }
    let received = eventually(Duration::from_secs(240), || async {
        log.lock().expect("lock").len() >= 20_000
    })
    .await;
    token.cancel();
    let mut published = 0;
    for h in handles {
        let stats = h.await.expect("join").expect("run");
        assert_eq!(stats.dead + stats.retried, 0, "{stats:?}");
        published += stats.published;
    }
    assert!(
        received,
        "20,000 received: {}",
        log.lock().expect("lock").len()
    );
    assert_eq!(published, 20_000, "each message published once");
    assert_in_order(&log.lock().expect("lock"), 100, 200);
    broker.cleanup().await;
}

/// Fails chosen messages: `faults[id] = (permanent, times)`; publishes the rest for real.
pub struct Faulty<P> {
    inner: Arc<P>,
    faults: Mutex<HashMap<Uuid, (bool, u32)>>,
}

impl<P> Faulty<P> {
    /// `inner` with `faults`: `(id, permanent, times)`.
    pub fn new(inner: Arc<P>, faults: &[(Uuid, bool, u32)]) -> Self {
        Self {
            inner,
            faults: Mutex::new(faults.iter().map(|&(id, p, n)| (id, (p, n))).collect()),
        }
    }
}

#[async_trait::async_trait]
impl<P: EventPublisher> EventPublisher for Faulty<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let mut fail = HashMap::new();
        {
            let mut faults = self.faults.lock().expect("lock");
            for m in messages {
                if let Some((permanent, left)) = faults.get_mut(&m.id)
                    && *left > 0
                {
                    *left -= 1;
                    fail.insert(m.id, *permanent);
                }
            }
        }
        let pass: Vec<OutboxMessage> = messages
            .iter()
            .filter(|m| !fail.contains_key(&m.id))
            .cloned()
            .collect();
        let mut passed = self.inner.publish_batch(&pass).await.into_iter();
        messages
            .iter()
            .map(|m| match fail.get(&m.id) {
                Some(true) => PublishOutcome::Permanent(PublishError::Invalid(
                    "injected permanent failure".into(),
                )),
                // A failure of this message alone (a broker's refusal would be an
                // outage, which stops every key instead).
                Some(false) => PublishOutcome::Transient(PublishError::Other {
                    kind: outboxkit_core::ErrorKind::Transient,
                    message: "injected transient failure".into(),
                    source: None,
                }),
                None => passed.next().expect("one outcome per message"),
            })
            .collect()
    }
}

/// Retries after exactly `delay` (no jitter), `max_attempts` in all.
pub fn retry_after(delay: Duration, max_attempts: u32) -> RetryPolicies {
    RetryPolicies::new(
        RetryPolicy::new()
            .with_base(delay.as_secs_f64())
            .with_cap(delay)
            .with_jitter(Duration::ZERO)
            .with_max_attempts(max_attempts),
    )
}

/// Where message `n` of `key` first arrived.
pub fn position(log: &[Arrival], key: &str, n: u64) -> Option<usize> {
    log.iter().position(|a| a.key == key && a.n == n)
}

/// A transient failure on one key's message delays that key only: other keys flow
/// during its backoff, and the key's order holds after the retry.
pub async fn transient_failure_delays_only_its_key_and_order_holds<B: Broker, H: Harness>(h: &H) {
    let outbox = h.store();
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let names = key_names(20);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let msgs = keyed(&refs, 50, "Ordered");
    // key-7's fourth message (n = 3) fails once.
    let victim = msgs
        .iter()
        .find(|m| m.partition_key.as_deref() == Some("key-7") && m.aggregate_id == "key-7-3")
        .expect("victim")
        .id;
    h.enqueue(&msgs).await;

    let token = CancellationToken::new();
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(Faulty::new(broker.publisher().await, &[(victim, false, 1)])),
        ordered(OnDead::Block).with_retry(retry_after(Duration::from_secs(2), 5)),
    )
    .expect("valid dispatcher config");
    let handle = spawn(&d, &token);
    let received = eventually(Duration::from_secs(60), || async {
        log.lock().expect("lock").len() >= 1000
    })
    .await;
    token.cancel();
    let stats = handle.await.expect("join").expect("run");
    assert!(
        received,
        "all 1,000 received: {}",
        log.lock().expect("lock").len()
    );
    assert_eq!(stats.retried, 1, "{stats:?}");
    let log = log.lock().expect("lock").clone();
    assert_in_order(&log, 20, 50);

    // While key-7 waited out its backoff, the other keys kept flowing.
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
    let victim_row = outbox.get(victim).await.expect("get").expect("row");
    assert_eq!(victim_row.attempts, 2, "failed once, then sent");
    broker.cleanup().await;
}

/// `OnDead::Block`: the key stops at its dead message until it is replayed, which
/// then goes first; other keys are not held up.
pub async fn on_dead_block_stops_the_key_until_replay<B: Broker, H: Harness>(h: &H) {
    let outbox = h.store();
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["blocked", "free"], 10, "Ordered");
    let poison = msgs
        .iter()
        .find(|m| m.aggregate_id == "blocked-4")
        .expect("poison")
        .id;
    h.enqueue(&msgs).await;

    let token = CancellationToken::new();
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(Faulty::new(broker.publisher().await, &[(poison, true, 1)])),
        ordered(OnDead::Block),
    )
    .expect("valid dispatcher config");
    let handle = spawn(&d, &token);
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock()
                .expect("lock")
                .iter()
                .filter(|a| a.key == "free")
                .count()
                == 10
        })
        .await,
        "the other key is not held up"
    );
    // Give the relay several poll cycles: nothing after the dead message may go.
    tokio::time::sleep(Duration::from_millis(800)).await;
    {
        let log = log.lock().expect("lock");
        let blocked: Vec<u64> = log
            .iter()
            .filter(|a| a.key == "blocked")
            .map(|a| a.n)
            .collect();
        assert_eq!(
            blocked,
            vec![0, 1, 2, 3],
            "the key stops at its dead message"
        );
    }
    assert_eq!(
        outbox.get(poison).await.expect("get").expect("row").status,
        MessageStatus::Dead
    );
    let blocked_keys = outbox.blocked_keys(10).await.expect("blocked keys");
    assert_eq!(blocked_keys.len(), 1);
    assert_eq!(blocked_keys[0].head_id, poison);
    assert_eq!(blocked_keys[0].waiting, 5);

    // Replayed (the fault was one-shot), the key resumes with the dead message first.
    let report = outbox
        .replay(&MessageFilter::new().with_ids([poison]), false)
        .await
        .expect("replay");
    assert_eq!(report.replayed, 1);
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 20
        })
        .await,
        "the rest of the key follows the replay"
    );
    token.cancel();
    handle.await.expect("join").expect("run");
    assert_in_order(&log.lock().expect("lock"), 2, 10);
    broker.cleanup().await;
}

/// `OnDead::Skip`: the key continues past its dead message.
pub async fn on_dead_skip_lets_the_key_continue<B: Broker, H: Harness>(h: &H) {
    let outbox = h.store();
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let msgs = keyed(&["k"], 10, "Ordered");
    let poison = msgs[4].id;
    h.enqueue(&msgs).await;

    let token = CancellationToken::new();
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(Faulty::new(broker.publisher().await, &[(poison, true, 1)])),
        ordered(OnDead::Skip),
    )
    .expect("valid dispatcher config");
    let handle = spawn(&d, &token);
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= 9
        })
        .await,
        "the key continues past its dead message"
    );
    token.cancel();
    let stats = handle.await.expect("join").expect("run");
    assert_eq!(stats.dead, 1);
    let ns: Vec<u64> = log.lock().expect("lock").iter().map(|a| a.n).collect();
    assert_eq!(
        ns,
        vec![0, 1, 2, 3, 5, 6, 7, 8, 9],
        "in order, without the dead one"
    );
    assert_eq!(
        outbox.get(poison).await.expect("get").expect("row").status,
        MessageStatus::Dead
    );
    broker.cleanup().await;
}

/// Publishes its first wave for real, then hangs: a dispatcher killed mid-batch.
struct DiesAfterFirstWave<P> {
    inner: Arc<P>,
    calls: Mutex<u32>,
}

#[async_trait::async_trait]
impl<P: EventPublisher> EventPublisher for DiesAfterFirstWave<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let first = {
            let mut calls = self.calls.lock().expect("lock");
            *calls += 1;
            *calls == 1
        };
        if first {
            self.inner.publish_batch(messages).await
        } else {
            std::future::pending().await
        }
    }
}

/// A dispatcher killed after its first wave: after the lease, the rescuers republish
/// and every key's first receipts stay in order.
pub async fn dispatcher_killed_mid_batch_does_not_break_any_keys_order<B: Broker, H: Harness>(
    h: &H,
) {
    let outbox = h.store();
    let broker = B::setup().await;
    let log = Arc::clone(broker.arrivals());
    let names = key_names(10);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    h.enqueue(&keyed(&refs, 20, "Ordered")).await;

    let real = broker.publisher().await;
    let doomed = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(DiesAfterFirstWave {
            inner: Arc::clone(&real),
            calls: Mutex::new(0),
        }),
        ordered(OnDead::Block)
            .with_batch_size(100)
            .with_lease(Duration::from_secs(2)),
    )
    .expect("valid dispatcher config");
    let killed = tokio::spawn(async move { doomed.run_batch().await });
    assert!(
        eventually(Duration::from_secs(20), || async {
            log.lock().expect("lock").len() >= 10
        })
        .await,
        "the doomed dispatcher published its first wave"
    );
    killed.abort();
    assert_eq!(outbox.stats().await.expect("stats").processing, 100);

    let token = CancellationToken::new();
    let rescuers: Vec<_> = (0..2)
        .map(|_| {
            let d = Dispatcher::new(
                Arc::clone(&outbox),
                Arc::clone(&real),
                ordered(OnDead::Block),
            )
            .expect("valid dispatcher config");
            spawn(&d, &token)
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(60), || async {
            outbox.stats().await.expect("stats").sent == 200
        })
        .await,
        "everything sent after the lease expired"
    );
    // The rescuers republish the first wave's 10 messages: RabbitMQ delivers them a
    // second time; JetStream stores them once (same `Nats-Msg-Id` within the stream's
    // duplicate window), so its consumer sees each message once. Either way the first
    // receipts are what the order is checked on.
    let expected = if B::DROPS_REPUBLISHED { 200 } else { 210 };
    assert!(
        eventually(Duration::from_secs(30), || async {
            log.lock().expect("lock").len() >= expected
        })
        .await,
        "200 messages, plus the 10 republished from the first wave unless the broker \
         dropped them: {expected} expected, {} received",
        log.lock().expect("lock").len()
    );
    token.cancel();
    for h in rescuers {
        h.await.expect("join").expect("run");
    }
    assert_in_order(&log.lock().expect("lock"), 10, 20);
    broker.cleanup().await;
}

/// Expands to one `#[tokio::test]` per ordered-delivery property and broker, in
/// `mod ordered_delivery { mod rabbit { .. } mod nats { .. } }` (so `cargo test nats`
/// picks one broker). `$harness` is the path of an `async fn() -> impl Harness`
/// returning a fresh, isolated store; the tests also need the RabbitMQ at `AMQP_URL`
/// and the NATS server (JetStream enabled) at `NATS_URL`. Attributes written before the
/// harness are put on every test, e.g. `ordered_delivery_tests!(#[ignore = "needs
/// MSSQL_URL"] harness)` (see `outboxkit_core::store_conformance_tests!`).
#[macro_export]
macro_rules! ordered_delivery_tests {
    (@broker $attrs:tt $harness:path; $module:ident, $broker:ident) => {
        mod $module {
            use super::*;
            $crate::ordered_delivery_tests!(@each $attrs $harness; $broker;
                four_dispatchers_keep_100_keys_in_order_over_20000_messages,
                transient_failure_delays_only_its_key_and_order_holds,
                on_dead_block_stops_the_key_until_replay,
                on_dead_skip_lets_the_key_continue,
                dispatcher_killed_mid_batch_does_not_break_any_keys_order,
            );
        }
    };
    (@each $attrs:tt $harness:path; $broker:ident; $($name:ident),* $(,)?) => {
        $( $crate::ordered_delivery_tests!(@one $attrs $harness; $broker; $name); )*
    };
    (@one [$(#[$attr:meta])*] $harness:path; $broker:ident; $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let h = $harness().await;
            $crate::ordered::$name::<$crate::ordered::$broker, _>(&h).await;
        }
    };
    ($(#[$attr:meta])* $harness:path) => {
        mod ordered_delivery {
            use super::*;
            $crate::ordered_delivery_tests!(@broker [$(#[$attr])*] $harness; rabbit, Rabbit);
            $crate::ordered_delivery_tests!(@broker [$(#[$attr])*] $harness; nats, Nats);
        }
    };
}
