//! `NatsConsumer::run_batched` against the real NATS server: batches, per-message
//! answers (`+ACK`, `-NAK` with delay, `+TERM`), deferred messages kept with `+WPI`
//! longer than `ack_wait` and handed again alone, panics, undecodable messages.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::wire::IncomingMessage;
use outbox_core::{EventPublisher, OutboxMessage};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use transport_nats::{
    BatchDeliveryHandler, HandlerDecision, NatsConsumer, NatsConsumerBuilder, NatsError,
    NatsPublisher,
};
use uuid::Uuid;

use common::*;

/// One call of the handler: the ids and delivery counts it was given.
type Call = Vec<(Uuid, Option<u64>)>;

/// Answers `Defer`/`Requeue`/`Reject` on a message's first `n` calls, panics on the
/// first call holding a `panic` id, acks the rest; records its calls.
#[derive(Clone, Default)]
struct Scripted {
    calls: Arc<Mutex<Vec<Call>>>,
    script: Arc<Mutex<HashMap<Uuid, (u32, HandlerDecision)>>>,
    panic: Arc<Mutex<Option<Uuid>>>,
    seen: Arc<Mutex<HashMap<Uuid, u32>>>,
}

impl Scripted {
    fn with(self, id: Uuid, times: u32, decision: HandlerDecision) -> Self {
        self.script
            .lock()
            .expect("lock")
            .insert(id, (times, decision));
        self
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    fn times(&self, id: Uuid) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.iter().any(|(m, _)| *m == id))
            .count()
    }
}

#[async_trait]
impl BatchDeliveryHandler for Scripted {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        self.calls
            .lock()
            .expect("lock")
            .push(msgs.iter().map(|m| (m.id, m.delivery_count)).collect());
        let panics = {
            let mut panic = self.panic.lock().expect("lock");
            let hit = msgs.iter().any(|m| Some(m.id) == *panic);
            if hit {
                *panic = None;
            }
            hit
        };
        assert!(!panics, "batch handler bug (expected by the test)");
        msgs.iter()
            .map(|m| {
                let n = {
                    let mut seen = self.seen.lock().expect("lock");
                    let n = seen.entry(m.id).or_default();
                    *n += 1;
                    *n
                };
                match self.script.lock().expect("lock").get(&m.id) {
                    Some((times, decision)) if n <= *times => *decision,
                    _ => HandlerDecision::Ack,
                }
            })
            .collect()
    }
}

struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), NatsError>>,
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

fn start(consumer: NatsConsumer, handler: Scripted) -> Running {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let task = tokio::spawn(async move { consumer.run_batched(handler, token).await });
    Running { shutdown, task }
}

fn consumer(fx: &Fixture, durable: &str) -> NatsConsumerBuilder {
    NatsConsumer::builder(fx.build(), &fx.stream, durable)
        .with_nak_delays(vec![Duration::from_millis(50)])
        .with_batch_linger(Duration::from_millis(200))
        .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1))
}

async fn publish(fx: &Fixture, messages: &[OutboxMessage]) {
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    for outcome in publisher.publish_batch(messages).await {
        assert!(outcome.is_published(), "{outcome:?}");
    }
    publisher.close().await;
}

fn messages(n: usize) -> Vec<OutboxMessage> {
    (0..n)
        .map(|i| message("Batched", &i.to_string(), "{}"))
        .collect()
}

/// One batch of 8 answered per message: a requeued message comes back (delivery 2) and
/// is acked, a rejected one is terminated (never delivered again), the rest are acked
/// once; nothing is left pending.
#[tokio::test]
async fn a_batch_is_answered_per_message() {
    let fx = Fixture::new().await;
    let msgs = messages(8);
    publish(&fx, &msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Scripted::default()
        .with(ids[2], 1, HandlerDecision::Requeue)
        .with(ids[5], 1, HandlerDecision::Reject);
    let running = start(
        consumer(&fx, "answers").build().expect("valid"),
        handler.clone(),
    );
    eventually("the requeued message is handled again", || async {
        handler.times(ids[2]) == 2
    })
    .await;
    fx.nothing_pending("answers").await;
    running.stop().await;
    let calls = handler.calls();
    assert_eq!(calls[0].iter().map(|(id, _)| *id).collect::<Vec<_>>(), ids);
    let again = calls.iter().skip(1).flatten().find(|(id, _)| *id == ids[2]);
    assert_eq!(again, Some(&(ids[2], Some(2))), "{calls:?}");
    for (i, id) in ids.iter().enumerate() {
        if i != 2 {
            assert_eq!(handler.times(*id), 1, "message {i}");
        }
    }
    let info = fx.consumer_info("answers").await;
    assert_eq!(info.num_redelivered, 0, "nothing waiting for a redelivery");
    fx.cleanup().await;
}

/// Two messages of a batch are deferred three times (1 s, 2 s, 4 s: 7 s in all) with
/// an `ack_wait` of 5 s: the `+WPI` sent before each wait keeps them, so they are never
/// redelivered (delivery count stays 1) and only they are handed again; the rest of the
/// batch was acked at once.
#[tokio::test]
async fn deferred_messages_are_kept_past_ack_wait_and_handed_again_alone() {
    let fx = Fixture::new().await;
    let msgs = messages(5);
    publish(&fx, &msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Scripted::default()
        .with(ids[0], 3, HandlerDecision::Defer)
        .with(ids[3], 3, HandlerDecision::Defer);
    let running = start(
        consumer(&fx, "defer")
            .with_ack_wait(Duration::from_secs(5))
            .build()
            .expect("valid"),
        handler.clone(),
    );
    eventually("the other messages are acked at once", || async {
        handler.times(ids[0]) >= 1 && fx.consumer_info("defer").await.num_ack_pending == 2
    })
    .await;
    eventually_within(
        Duration::from_secs(20),
        "the deferred messages are handled",
        || async { handler.times(ids[0]) == 4 && handler.times(ids[3]) == 4 },
    )
    .await;
    fx.nothing_pending("defer").await;
    running.stop().await;
    let calls = handler.calls();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert_eq!(calls[0].len(), 5);
    for call in &calls[1..] {
        assert_eq!(
            *call,
            [(ids[0], Some(1)), (ids[3], Some(1))],
            "only the deferred ones, never redelivered"
        );
    }
    assert_eq!(fx.consumer_info("defer").await.num_redelivered, 0);
    fx.cleanup().await;
}

/// A batch handler that panics: every message of the batch is nak'ed and handled on
/// its redelivery (never terminated); an undecodable message is terminated alone.
#[tokio::test]
async fn a_panicking_batch_is_redelivered_and_an_undecodable_message_terminated() {
    let fx = Fixture::new().await;
    let msgs = messages(3);
    publish(&fx, &msgs[..1]).await;
    fx.js
        .publish(format!("{}.Raw", fx.prefix), "not even json".into())
        .await
        .expect("send")
        .await
        .expect("PubAck");
    publish(&fx, &msgs[1..]).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Scripted::default();
    *handler.panic.lock().expect("lock") = Some(ids[1]);
    let running = start(
        consumer(&fx, "panics").build().expect("valid"),
        handler.clone(),
    );
    eventually("every message is handled after the panic", || async {
        ids.iter().all(|id| handler.times(*id) == 2)
    })
    .await;
    fx.nothing_pending("panics").await;
    assert!(
        !running.task.is_finished(),
        "the consumer survived the panic"
    );
    running.stop().await;
    let calls = handler.calls();
    assert_eq!(
        calls[0].iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        ids,
        "one batch, the undecodable message left out"
    );
    for id in &ids {
        let last = calls.iter().flatten().rev().find(|(m, _)| m == id);
        assert_eq!(last, Some(&(*id, Some(2))), "redelivered after the panic");
    }
    fx.cleanup().await;
}

/// Batch settings are validated.
#[test]
fn batch_settings_are_validated() {
    let config = transport_nats::NatsConfigBuilder::new(url())
        .build()
        .expect("valid");
    let builder = || NatsConsumer::builder(config.clone(), "S", "d").with_concurrency(10);
    let field = |b: NatsConsumerBuilder| match b.build() {
        Err(NatsError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(field(builder().with_batch_size(0)), "batch_size");
    assert_eq!(field(builder().with_batch_size(11)), "batch_size");
    assert_eq!(
        field(builder().with_batch_linger(Duration::from_secs(2))),
        "batch_linger"
    );
    assert_eq!(
        field(builder().with_batches_in_flight(65)),
        "batches_in_flight"
    );
    assert_eq!(
        builder().build().expect("valid").batch_size(),
        10,
        "default: the concurrency"
    );
}
