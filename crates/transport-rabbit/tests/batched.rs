//! `RabbitConsumer::run_batched` against the real RabbitMQ: batches, per-message
//! answers, `multiple` acks that never acknowledge another batch's deliveries, deferred
//! deliveries held and handed again alone, panics, undecodable deliveries, shutdown.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::BasicPublishOptions;
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};
use outbox_core::wire::IncomingMessage;
use outbox_core::{EventPublisher, OutboxMessage};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use transport_rabbit::{
    BatchDeliveryHandler, HandlerDecision, RabbitConsumer, RabbitConsumerBuilder, RabbitError,
    RabbitPublisher,
};
use uuid::Uuid;

use common::*;

/// One call of the handler: the ids and `redelivered` flags it was given.
type Call = Vec<(Uuid, bool)>;

/// What a scripted batch handler does with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Script {
    /// Answer this on the first `n` calls that hold the message, then `Ack`.
    First(u32, HandlerDecision),
    /// Sleep this long before answering the call that holds it.
    Slow(Duration),
    /// Panic on the first call that holds it.
    PanicOnce,
}

/// A batch handler that records its calls and follows a script per message id.
#[derive(Clone, Default)]
struct Scripted {
    calls: Arc<Mutex<Vec<Call>>>,
    script: Arc<Mutex<HashMap<Uuid, Script>>>,
    seen: Arc<Mutex<HashMap<Uuid, u32>>>,
}

impl Scripted {
    fn with(self, id: Uuid, script: Script) -> Self {
        self.script.lock().expect("lock").insert(id, script);
        self
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    /// How many calls held `id`.
    fn times(&self, id: Uuid) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.iter().any(|(m, _)| *m == id))
            .count()
    }

    /// Whether `id`'s last call answered `Ack` (it is past its script).
    fn acked(&self, id: Uuid) -> bool {
        let seen = self
            .seen
            .lock()
            .expect("lock")
            .get(&id)
            .copied()
            .unwrap_or(0);
        match self.script.lock().expect("lock").get(&id) {
            Some(Script::First(n, _)) => seen > *n,
            Some(Script::PanicOnce) => seen > 1,
            _ => seen > 0,
        }
    }
}

#[async_trait]
impl BatchDeliveryHandler for Scripted {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        self.calls
            .lock()
            .expect("lock")
            .push(msgs.iter().map(|m| (m.id, m.redelivered)).collect());
        let mut pause = Duration::ZERO;
        let mut panic = false;
        let decisions: Vec<HandlerDecision> = msgs
            .iter()
            .map(|m| {
                let n = {
                    let mut seen = self.seen.lock().expect("lock");
                    let n = seen.entry(m.id).or_default();
                    *n += 1;
                    *n
                };
                match self.script.lock().expect("lock").get(&m.id).copied() {
                    Some(Script::First(times, decision)) if n <= times => decision,
                    Some(Script::Slow(d)) => {
                        pause = pause.max(d);
                        HandlerDecision::Ack
                    }
                    Some(Script::PanicOnce) if n == 1 => {
                        panic = true;
                        HandlerDecision::Ack
                    }
                    _ => HandlerDecision::Ack,
                }
            })
            .collect();
        assert!(!panic, "batch handler bug (expected by the test)");
        tokio::time::sleep(pause).await;
        decisions
    }
}

struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), RabbitError>>,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("consumer stops before the deadline")
            .expect("consumer task did not panic")
            .expect("consumer ends without error");
    }
}

fn start(consumer: RabbitConsumer, handler: Scripted) -> Running {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let task = tokio::spawn(async move { consumer.run_batched(handler, token).await });
    Running { shutdown, task }
}

/// A fresh exchange, a queue with a dead-letter queue, and a consumer builder for it.
struct Topology {
    exchange: String,
    queue: String,
    dlx: String,
    dlq: String,
    channel: lapin::Channel,
    _raw: lapin::Connection,
}

impl Topology {
    async fn new(tag: &str) -> Self {
        let raw = raw_connection().await;
        let channel = raw_channel(&raw).await;
        let dlx = unique(&format!("{tag}.dlx"));
        let dlq = unique(&format!("{tag}.dlq"));
        declare_exchange(&channel, &dlx, ExchangeKind::Fanout).await;
        bind_queue(&channel, &dlx, &dlq, "").await;
        Self {
            exchange: unique(tag),
            queue: unique(&format!("{tag}.q")),
            dlx,
            dlq,
            channel,
            _raw: raw,
        }
    }

    fn consumer(&self) -> RabbitConsumerBuilder {
        RabbitConsumer::builder(build(config(&self.exchange)), self.queue.clone())
            .with_binding_key("#")
            .with_dead_letter_exchange(self.dlx.clone())
            .with_queue_arguments(expiring(FieldTable::default()))
            .with_requeue_delay(Duration::from_millis(50))
    }

    async fn publish(&self, messages: &[OutboxMessage]) {
        let publisher = RabbitPublisher::connect(build(config(&self.exchange)))
            .await
            .expect("publisher connects");
        for outcome in publisher.publish_batch(messages).await {
            assert!(outcome.is_published(), "{outcome:?}");
        }
        publisher.close().await;
    }

    async fn ready(&self) -> u32 {
        queue_len(&self.channel, &self.queue).await
    }

    async fn dead_lettered(&self) -> u32 {
        queue_len(&self.channel, &self.dlq).await
    }

    async fn cleanup(self) {
        cleanup(
            &self.channel,
            &[&self.exchange, &self.dlx],
            &[&self.queue, &self.dlq],
        )
        .await;
    }
}

fn messages(n: usize) -> Vec<OutboxMessage> {
    (0..n)
        .map(|i| message("Batched", &i.to_string(), "{}"))
        .collect()
}

/// Two batches in flight on one channel (prefetch 10, batches of 5): the first is slow
/// and answers `Requeue`, `Reject` and `Ack` for its messages; the second answers all
/// `Ack` at once. A `multiple` ack of the second batch would acknowledge the first's
/// deliveries too (and its later nacks would close the channel): instead the first
/// batch's requeued messages come back, flagged redelivered, and are handled; the
/// rejected one reaches the dead-letter queue; nothing else is lost or left.
#[tokio::test]
async fn a_batch_never_acknowledges_another_batchs_deliveries() {
    let t = Topology::new("batched.multiple").await;
    let consumer = t
        .consumer()
        .with_prefetch(10)
        .with_batch_size(5)
        .with_batches_in_flight(2)
        .with_batch_linger(Duration::from_millis(200))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let msgs = messages(10);
    t.publish(&msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Scripted::default()
        .with(ids[0], Script::Slow(Duration::from_millis(1500)))
        .with(ids[1], Script::First(1, HandlerDecision::Requeue))
        .with(ids[2], Script::First(1, HandlerDecision::Requeue))
        .with(ids[3], Script::First(1, HandlerDecision::Reject));
    let running = start(consumer, handler.clone());
    eventually("the requeued messages are handled again", || async {
        handler.acked(ids[1]) && handler.acked(ids[2])
    })
    .await;
    eventually("the queue is empty", || async { t.ready().await == 0 }).await;
    running.stop().await;

    let calls = handler.calls();
    let first: Vec<Uuid> = calls[0].iter().map(|(id, _)| *id).collect();
    assert_eq!(first, ids[..5], "batches of 5, in delivery order");
    assert!(
        calls
            .iter()
            .any(|c| c.iter().map(|(id, _)| *id).eq(ids[5..].iter().copied())),
        "the second batch: {calls:?}"
    );
    for id in [ids[1], ids[2]] {
        assert_eq!(handler.times(id), 2, "requeued once, then acked");
        let again = calls
            .iter()
            .skip(1)
            .flatten()
            .find(|(m, _)| *m == id)
            .expect("handled again");
        assert!(again.1, "flagged redelivered");
    }
    for id in [ids[0], ids[3], ids[4], ids[5], ids[9]] {
        assert_eq!(handler.times(id), 1, "handled once");
    }
    assert_eq!(t.dead_lettered().await, 1, "only the rejected one");
    t.cleanup().await;
}

/// Deferred deliveries stay unacknowledged and only they are handed again, without a
/// redelivery (after 1 s, then 2 s), while the rest of the batch was acknowledged at
/// once; nothing is requeued or dead-lettered.
#[tokio::test]
async fn deferred_deliveries_are_held_and_handed_again_alone() {
    let t = Topology::new("batched.defer").await;
    let consumer = t
        .consumer()
        .with_prefetch(10)
        .with_batch_linger(Duration::from_millis(200))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let msgs = messages(6);
    t.publish(&msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Scripted::default()
        .with(ids[1], Script::First(2, HandlerDecision::Defer))
        .with(ids[4], Script::First(2, HandlerDecision::Defer));
    let running = start(consumer, handler.clone());
    eventually("every message is acked", || async {
        ids.iter().all(|id| handler.acked(*id))
    })
    .await;
    eventually("the queue is empty", || async { t.ready().await == 0 }).await;
    running.stop().await;
    let calls = handler.calls();
    assert_eq!(calls.len(), 3, "{calls:?}");
    assert_eq!(calls[0].len(), 6);
    for call in &calls[1..] {
        assert_eq!(
            *call,
            [(ids[1], false), (ids[4], false)],
            "only the deferred ones, never redelivered"
        );
    }
    assert_eq!(t.dead_lettered().await, 0);
    t.cleanup().await;
}

/// A batch handler that panics: every delivery of its batch is requeued (redelivered
/// and handled next time), none rejected; an undecodable delivery among them is
/// rejected alone, to the dead-letter queue.
#[tokio::test]
async fn a_panicking_batch_is_requeued_and_an_undecodable_delivery_rejected_alone() {
    let t = Topology::new("batched.panic").await;
    let consumer = t
        .consumer()
        .with_prefetch(10)
        .with_batch_linger(Duration::from_millis(200))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let msgs = messages(4);
    t.publish(&msgs[..2]).await;
    t.channel
        .basic_publish(
            t.exchange.as_str().into(),
            "Garbage".into(),
            BasicPublishOptions::default(),
            b"not even json",
            BasicProperties::default(),
        )
        .await
        .expect("publish");
    t.publish(&msgs[2..]).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Scripted::default().with(ids[2], Script::PanicOnce);
    let running = start(consumer, handler.clone());
    eventually("every message is handled after the panic", || async {
        ids.iter().all(|id| handler.times(*id) == 2)
    })
    .await;
    eventually("the queue is empty", || async { t.ready().await == 0 }).await;
    eventually("the undecodable one is dead-lettered", || async {
        t.dead_lettered().await == 1
    })
    .await;
    assert!(
        !running.task.is_finished(),
        "the consumer survived the panic"
    );
    running.stop().await;
    let calls = handler.calls();
    let panicked: Vec<Uuid> = calls[0].iter().map(|(id, _)| *id).collect();
    assert_eq!(
        panicked, ids,
        "one batch, the undecodable delivery left out"
    );
    for id in &panicked {
        let last = calls
            .iter()
            .flatten()
            .rev()
            .find(|(m, _)| m == id)
            .expect("seen");
        assert!(last.1, "redelivered");
    }
    assert_eq!(t.dead_lettered().await, 1, "only the undecodable one");
    t.cleanup().await;
}

/// A graceful shutdown lets the batches in flight finish and acknowledges them;
/// what no batch started stays in the queue.
#[tokio::test]
async fn shutdown_finishes_the_batches_in_flight() {
    let t = Topology::new("batched.shutdown").await;
    let consumer = t
        .consumer()
        .with_prefetch(4)
        .with_batch_size(2)
        .with_batches_in_flight(2)
        .with_batch_linger(Duration::from_millis(100))
        .build()
        .expect("valid consumer");
    consumer.declare().await.expect("topology");
    let msgs = messages(10);
    t.publish(&msgs).await;
    let mut handler = Scripted::default();
    for m in &msgs {
        handler = handler.with(m.id, Script::Slow(Duration::from_millis(1500)));
    }
    let running = start(consumer, handler.clone());
    eventually("two batches run", || async { handler.calls().len() == 2 }).await;
    running.stop().await;
    let handled: usize = handler.calls().iter().map(Vec::len).sum();
    assert_eq!(handled, 4, "two batches of two");
    eventually("the rest is back in the queue", || async {
        t.ready().await == 6
    })
    .await;
    t.cleanup().await;
}

/// Batch settings are validated.
#[test]
fn batch_settings_are_validated() {
    let builder = || RabbitConsumer::builder(build(config("x")), "q").with_prefetch(10);
    let field = |b: RabbitConsumerBuilder| match b.build() {
        Err(RabbitError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(field(builder().with_batch_size(0)), "batch_size");
    assert_eq!(field(builder().with_batch_size(11)), "batch_size");
    assert_eq!(
        field(builder().with_batch_linger(Duration::from_secs(2))),
        "batch_linger"
    );
    assert_eq!(
        field(builder().with_batches_in_flight(0)),
        "batches_in_flight"
    );
    assert_eq!(
        builder().build().expect("valid").batch_size(),
        10,
        "default: the prefetch"
    );
}
