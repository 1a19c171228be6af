//! `NatsConsumer::run_batched`'s settings, and what only JetStream has: every message
//! the consumer holds during a long outage of the handler's database keeps its
//! `ack_wait` alive. Its other behaviour on the server (per-message `+ACK`, `-NAK` with
//! delay and `+TERM`, deferred messages kept with `+WPI` past `ack_wait`, panics,
//! undecodable messages, shutdown) is checked by the transport conformance suite
//! (`tests/conformance.rs`).

mod common;

use outboxkit_core::Consumer as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt as _;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{BatchSettings, EventPublisher, OutboxMessage};
use outboxkit_nats::{
    BatchDeliveryHandler, HandlerDecision, NatsConsumer, NatsConsumerConfig, NatsError,
    NatsPublisher,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// Batch settings are checked against the concurrency.
#[test]
fn batch_settings_are_validated() {
    let config = outboxkit_nats::NatsConfig::new(url());
    let builder = || NatsConsumerConfig::new(config.clone(), "S", "d").with_concurrency(10);
    let field = |b: NatsConsumerConfig| match NatsConsumer::new(b) {
        Err(NatsError::InvalidConfig { field, .. }) => field,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    // The limits are BatchSettings::check's (outboxkit-core's unit tests); the window here
    // is the concurrency.
    assert_eq!(
        field(builder().with_batch(BatchSettings::new().with_size(11))),
        "batch_size"
    );
    assert_eq!(
        NatsConsumer::new(builder()).expect("valid").batch_size(),
        10,
        "default: the concurrency"
    );
}

/// A batch handler whose database goes down at its first call and stays down for
/// `outage`: until then it answers `Defer` for every message (how the inbox reports an
/// outage of its store), afterwards `Ack`. Records the delivery count of every message
/// it is handed and how often it acked each.
struct DownDatabase {
    outage: Duration,
    down_since: Mutex<Option<Instant>>,
    handed: Mutex<Vec<(Uuid, Option<u64>)>>,
    acked: Mutex<HashMap<Uuid, u32>>,
}

impl DownDatabase {
    fn new(outage: Duration) -> Self {
        Self {
            outage,
            down_since: Mutex::new(None),
            handed: Mutex::new(Vec::new()),
            acked: Mutex::new(HashMap::new()),
        }
    }
}

#[async_trait]
impl BatchDeliveryHandler for DownDatabase {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        let down_since = *self
            .down_since
            .lock()
            .expect("lock")
            .get_or_insert_with(Instant::now);
        self.handed
            .lock()
            .expect("lock")
            .extend(msgs.iter().map(|m| (m.id, m.delivery_count)));
        if down_since.elapsed() < self.outage {
            return vec![HandlerDecision::Defer; msgs.len()];
        }
        let mut acked = self.acked.lock().expect("lock");
        for msg in msgs {
            *acked.entry(msg.id).or_default() += 1;
        }
        vec![HandlerDecision::Ack; msgs.len()]
    }
}

/// A database outage four times longer than `ack_wait` spends no delivery: with 2
/// batches of 3 in flight, 12 messages are held (the other 6 pulled and waiting for a
/// batch), and every one of them is kept past `ack_wait` while the handler defers, the
/// waiting ones as well as the deferred ones, whose handler retries are up to 8 s
/// apart. Afterwards each message was handed to the handler only as its first
/// delivery and acked once, the consumer delivered exactly 12 times (no `ack_wait`
/// expiry, so none came near `max_deliver` = 3), and nothing is pending.
#[tokio::test]
async fn an_outage_longer_than_ack_wait_spends_no_delivery() {
    const ACK_WAIT: Duration = Duration::from_secs(2);
    const OUTAGE: Duration = Duration::from_secs(8);
    const DURABLE: &str = "outage";
    let fx = Fixture::new().await;
    let shutdown = CancellationToken::new();
    let task = Mutex::new(None);
    let property = async {
        let messages: Vec<OutboxMessage> = (0..12)
            .map(|i| message("OrderPlaced", &i.to_string(), &format!(r#"{{"n":{i}}}"#)))
            .collect();
        let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
        for outcome in publisher.publish_batch(&messages).await {
            assert!(outcome.is_published(), "{outcome:?}");
        }
        publisher.close().await;

        let handler = Arc::new(DownDatabase::new(OUTAGE));
        let consumer = NatsConsumer::new(
            NatsConsumerConfig::new(fx.build(), &fx.stream, DURABLE)
                .with_ack_wait(ACK_WAIT)
                .with_max_deliver(Some(3))
                .with_concurrency(12)
                .with_batch(BatchSettings::new().with_size(3).with_in_flight(2))
                .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1)),
        )
        .expect("valid consumer");
        let running = {
            let handler = Arc::clone(&handler);
            let shutdown = shutdown.clone();
            tokio::spawn(async move { consumer.run_batched(handler, shutdown).await })
        };
        *task.lock().expect("lock") = Some(running);

        // Deferred batches are handed again after 1 s, 2 s, 4 s, 8 s: the first acks come
        // about 15 s after the outage began, the waiting batches right after.
        let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
        let deadline = Instant::now() + OUTAGE + DEADLINE;
        loop {
            let all_acked = {
                let acked = handler.acked.lock().expect("lock");
                ids.iter().all(|id| acked.contains_key(id))
            };
            if all_acked || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let handed = handler.handed.lock().expect("lock").clone();
        let acked = handler.acked.lock().expect("lock").clone();
        let missing: Vec<usize> = (0..ids.len())
            .filter(|&i| !acked.contains_key(&ids[i]))
            .collect();
        let redeliveries: Vec<(usize, Option<u64>)> = handed
            .iter()
            .filter(|(_, count)| *count != Some(1))
            .map(|(id, count)| {
                (
                    ids.iter().position(|i| i == id).unwrap_or(usize::MAX),
                    *count,
                )
            })
            .collect();
        assert!(
            missing.is_empty() && redeliveries.is_empty(),
            "messages never acked (by index): {missing:?}; handed as a redelivery \
             (index, delivery count): {redeliveries:?}"
        );
        for id in &ids {
            assert_eq!(acked.get(id), Some(&1), "acked once: {acked:?}");
        }
        fx.nothing_pending(DURABLE).await;
        let info = fx.consumer_info(DURABLE).await;
        assert_eq!(
            (info.num_redelivered, info.delivered.consumer_sequence),
            (0, 12),
            "no delivery beyond the first of each message: {info:?}"
        );
    };
    let result = std::panic::AssertUnwindSafe(property).catch_unwind().await;
    shutdown.cancel();
    let running = task.lock().expect("lock").take();
    if let Some(running) = running {
        let stopped = tokio::time::timeout(DEADLINE, running).await;
        if result.is_ok() {
            stopped
                .expect("consumer stops before the deadline")
                .expect("consumer task did not panic")
                .expect("consumer ends without error");
        }
    }
    fx.cleanup().await;
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}
