//! Batched consumer properties: the transport's `run_batched` with a
//! [`BatchDeliveryHandler`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::{
    ConsumerSettings, Running, TransportHarness, eventually, eventually_within, outbox_messages,
    publish_all,
};
use crate::consumer::{BatchDeliveryHandler, BatchSettings, HandlerDecision};
use crate::wire::IncomingMessage;

/// One call of the handler: each message's id, `redelivered` flag and delivery count.
type Call = Vec<(Uuid, bool, Option<u64>)>;

/// What a [`Scripted`] batch handler does with a message.
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
#[derive(Default)]
struct Scripted {
    calls: Mutex<Vec<Call>>,
    script: Mutex<HashMap<Uuid, Script>>,
    seen: Mutex<HashMap<Uuid, u32>>,
}

impl Scripted {
    fn with(self, id: Uuid, script: Script) -> Self {
        self.script.lock().expect("lock").insert(id, script);
        self
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    fn ids(call: &Call) -> Vec<Uuid> {
        call.iter().map(|(id, ..)| *id).collect()
    }

    /// How many calls held `id`.
    fn times(&self, id: Uuid) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.iter().any(|(m, ..)| *m == id))
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
        self.calls.lock().expect("lock").push(
            msgs.iter()
                .map(|m| (m.id, m.redelivered, m.delivery_count))
                .collect(),
        );
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
        assert!(!panic, "batch handler bug (expected by the property)");
        tokio::time::sleep(pause).await;
        decisions
    }
}

fn start<H: TransportHarness>(
    h: &H,
    settings: &ConsumerSettings,
    handler: &Arc<Scripted>,
) -> Running {
    let handler: Arc<dyn BatchDeliveryHandler> = Arc::clone(handler) as _;
    Running::start(|shutdown| h.run_batched(settings, handler, shutdown))
}

/// Two batches in flight (batches of 5 of 10 messages): the first is slow and answers
/// `Requeue`, `Reject` and `Ack` for its messages, the second answers all `Ack` at
/// once. Each batch's answers apply to its own deliveries only (an AMQP `multiple` ack
/// of the second batch would acknowledge the first's too): the requeued messages come
/// back flagged as redeliveries and are handled, the rejected one is never delivered
/// again (dead-lettered where the broker can), every other message is handled once,
/// and nothing is left.
pub async fn batches_are_answered_per_message<H: TransportHarness>(h: &H) {
    let msgs = outbox_messages(10, "Batched");
    publish_all(&h.publisher().await, &msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Arc::new(
        Scripted::default()
            .with(ids[0], Script::Slow(Duration::from_millis(1500)))
            .with(ids[1], Script::First(1, HandlerDecision::Requeue))
            .with(ids[2], Script::First(1, HandlerDecision::Requeue))
            .with(ids[3], Script::First(1, HandlerDecision::Reject)),
    );
    let defaults = ConsumerSettings::default();
    let settings = ConsumerSettings {
        batch: defaults.batch.with_size(5),
        ..defaults
    };
    let running = start(h, &settings, &handler);
    eventually("the requeued messages are handled again", || async {
        handler.acked(ids[1]) && handler.acked(ids[2])
    })
    .await;
    eventually("the other messages are handled", || async {
        ids.iter().all(|id| handler.times(*id) >= 1)
    })
    .await;
    running.stop_settled(h).await;

    let calls = handler.calls();
    assert_eq!(
        Scripted::ids(&calls[0]),
        ids[..5],
        "batches of 5, in delivery order"
    );
    assert!(
        calls.iter().any(|c| Scripted::ids(c) == ids[5..]),
        "the second batch: {calls:?}"
    );
    for id in [ids[1], ids[2]] {
        assert_eq!(handler.times(id), 2, "requeued once, then acked");
        let again = calls
            .iter()
            .skip(1)
            .flatten()
            .find(|(m, ..)| *m == id)
            .expect("handled again");
        assert!(again.1, "flagged as a redelivery: {calls:?}");
        if H::DELIVERY_COUNT {
            assert_eq!(again.2, Some(2), "{calls:?}");
        }
    }
    for (i, id) in ids.iter().enumerate() {
        if i != 1 && i != 2 {
            assert_eq!(handler.times(*id), 1, "message {i} handled once");
        }
    }
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(dead, 1, "only the rejected one is dead-lettered");
    }
}

/// Deferred messages stay with the consumer unanswered, past the broker's redelivery
/// timeout (JetStream `ack_wait` of 5 s, kept with `+WPI`), and only they are handed
/// again (after 1 s, 2 s, 4 s), never as a redelivery; the rest of the batch was
/// acknowledged at once; nothing is requeued or dead-lettered.
pub async fn deferred_messages_are_held_and_handed_again_alone<H: TransportHarness>(h: &H) {
    let msgs = outbox_messages(5, "Deferred");
    publish_all(&h.publisher().await, &msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Arc::new(
        Scripted::default()
            .with(ids[0], Script::First(3, HandlerDecision::Defer))
            .with(ids[3], Script::First(3, HandlerDecision::Defer)),
    );
    let settings = ConsumerSettings {
        ack_wait: Some(Duration::from_secs(5)),
        ..ConsumerSettings::default()
    };
    let running = start(h, &settings, &handler);
    eventually_within(
        Duration::from_secs(40),
        "every message is acked",
        || async { ids.iter().all(|id| handler.acked(*id)) },
    )
    .await;
    running.stop_settled(h).await;
    let calls = handler.calls();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert_eq!(Scripted::ids(&calls[0]), ids, "one batch");
    for call in &calls[1..] {
        assert_eq!(
            Scripted::ids(call),
            [ids[0], ids[3]],
            "only the deferred ones: {calls:?}"
        );
        for (_, redelivered, count) in call {
            assert!(!redelivered, "never redelivered: {calls:?}");
            if H::DELIVERY_COUNT {
                assert_eq!(*count, Some(1), "never redelivered: {calls:?}");
            }
        }
    }
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(dead, 0, "nothing was dead-lettered");
    }
}

/// A batch handler that panics: every message of its batch is redelivered (flagged)
/// and handled next time, none rejected; undecodable deliveries among them are left out
/// of the batch and rejected alone (dead-lettered where the broker can).
pub async fn a_panicking_batch_is_redelivered_and_undecodable_deliveries_rejected<
    H: TransportHarness,
>(
    h: &H,
) {
    let msgs = outbox_messages(3, "Batched");
    let publisher = h.publisher().await;
    publish_all(&publisher, &msgs[..1]).await;
    let undecodable = h.publish_undecodable().await;
    publish_all(&publisher, &msgs[1..]).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let handler = Arc::new(Scripted::default().with(ids[1], Script::PanicOnce));
    let running = start(h, &ConsumerSettings::default(), &handler);
    eventually("every message is handled after the panic", || async {
        ids.iter().all(|id| handler.times(*id) == 2)
    })
    .await;
    assert!(running.is_running(), "the consumer survived the panic");
    running.stop_settled(h).await;
    let calls = handler.calls();
    assert_eq!(
        Scripted::ids(&calls[0]),
        ids,
        "one batch, the undecodable deliveries left out"
    );
    for id in &ids {
        let last = calls
            .iter()
            .flatten()
            .rev()
            .find(|(m, ..)| m == id)
            .expect("seen");
        assert!(last.1, "redelivered after the panic: {calls:?}");
        if H::DELIVERY_COUNT {
            assert_eq!(last.2, Some(2), "{calls:?}");
        }
    }
    if let Some(dead) = h.dead_lettered().await {
        assert_eq!(
            dead, undecodable,
            "only the undecodable ones are dead-lettered"
        );
    }
}

/// A graceful shutdown lets the batches in flight finish and acknowledges them; what no
/// batch started is still waiting on the broker.
pub async fn shutdown_finishes_the_batches_in_flight<H: TransportHarness>(h: &H) {
    let msgs = outbox_messages(10, "Batched");
    publish_all(&h.publisher().await, &msgs).await;
    let mut handler = Scripted::default();
    for m in &msgs {
        handler = handler.with(m.id, Script::Slow(Duration::from_millis(1500)));
    }
    let handler = Arc::new(handler);
    let settings = ConsumerSettings {
        concurrency: 4,
        batch: BatchSettings::new()
            .with_size(2)
            .with_linger(Duration::from_millis(100)),
        ..ConsumerSettings::default()
    };
    let running = start(h, &settings, &handler);
    eventually("two batches run", || async { handler.calls().len() == 2 }).await;
    running.stop().await;
    let handled: usize = handler.calls().iter().map(Vec::len).sum();
    assert_eq!(handled, 4, "two batches of two");
    eventually("the rest waits on the broker", || async {
        h.unacknowledged().await == 6
    })
    .await;
}

/// [`an_identifiable_undecodable_delivery_reaches_the_handler`](super::an_identifiable_undecodable_delivery_reaches_the_handler)
/// in batched mode: the malformed delivery goes to the batch handler's
/// [`handle_undecodable`](BatchDeliveryHandler::handle_undecodable), alone, never in a
/// batch; `Defer` keeps it, `Ack` removes it.
pub async fn an_identifiable_undecodable_delivery_reaches_the_batch_handler<H: TransportHarness>(
    h: &H,
) {
    super::undecodable_is_recorded_and_acked(h, |recorder, shutdown| {
        let handler: Arc<dyn BatchDeliveryHandler> = recorder;
        h.run_batched(&ConsumerSettings::default(), handler, shutdown)
    })
    .await;
}
