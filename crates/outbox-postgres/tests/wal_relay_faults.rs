//! The WAL relay (`outbox_postgres::wal::WalRelay`, feature `wal`) under broker faults
//! injected for real on the shared RabbitMQ, at a precise point of a batch.
//!
//! - One destination's queue full (`x-max-length` with `reject-publish`) refuses a
//!   message, and a memory alarm raised right after makes the rest of the same batch
//!   meet an outage, among them a later message of the refused message's key and one
//!   for the full destination. Once the alarm is cleared and the full queue is gone, every
//!   message is published: no key is left registered as "in the stream" (where the
//!   sweeper of parked rows never touches it, nor tries the refusing destination). Found by `cargo xtask chaos -- --source wal` in CI (seed
//!   13427967000872470842: 40 rows parked for good, 20 side events never published).
//!
//! The test takes the machine-wide fault lock (a memory alarm blocks every publisher
//! on the broker) and clears the alarm on drop, also when it panics. Its own test
//! binary: the relay tests in `wal_relay.rs` would meet the alarm too.
#![cfg(feature = "wal")]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::database_url;
use common::wal::WalOutbox;
use lapin::BasicProperties;
use lapin::options::{
    BasicPublishOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use outbox_core::{
    EventPublisher, MessageStatus, NewMessage, OutboxMessage, OutboxStore as _, PublishError,
    PublishOutcome,
};
use outbox_postgres::wal::WalRelayConfig;
use outbox_testkit::faults::{self, RabbitMemoryAlarm};
use outbox_testkit::rabbit::{DropExchange, amqp_url, eventually, reject_when_full, relay_fixture};
use tokio_util::sync::CancellationToken;
use transport_rabbit::{RabbitConfig, RabbitPublisher};
use uuid::Uuid;

/// Publishes through RabbitMQ. In the first batch holding `trigger`, the messages up
/// to `trigger` are published and confirmed (or refused) first, then a real memory
/// alarm is raised and the rest of the batch is published into it: an outage that
/// begins inside one batch, as a broker alarmed, frozen or restarted mid-publish does.
struct AlarmAfter {
    inner: Arc<RabbitPublisher>,
    trigger: Uuid,
    fired: AtomicBool,
    alarm: Arc<Mutex<Option<RabbitMemoryAlarm>>>,
}

#[async_trait::async_trait]
impl EventPublisher for AlarmAfter {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let at = messages.iter().position(|m| m.id == self.trigger);
        let Some(at) = at.filter(|_| !self.fired.swap(true, Ordering::SeqCst)) else {
            return self.inner.publish_batch(messages).await;
        };
        let mut outcomes = self.inner.publish_batch(&messages[..=at]).await;
        let alarm = tokio::task::spawn_blocking(RabbitMemoryAlarm::raise)
            .await
            .expect("raise the memory alarm");
        *self.alarm.lock().expect("lock") = Some(alarm);
        outcomes.extend(self.inner.publish_batch(&messages[at + 1..]).await);
        outcomes
    }

    fn publish_timeout(&self) -> Option<Duration> {
        // Raising the alarm (`rabbitmqctl`, a few seconds) happens inside one call.
        self.inner.publish_timeout().map(|t| t + Duration::from_secs(30))
    }

    async fn check_ready(&self) -> Result<(), PublishError> {
        self.inner.check_ready().await
    }
}

fn message(key: &str, event_type: &str) -> NewMessage {
    NewMessage::builder("t", key, event_type)
        .payload(&serde_json::json!({ "key": key }))
        .build()
        .expect("message")
}

async fn status(w: &WalOutbox, id: Uuid) -> MessageStatus {
    w.outbox
        .get(id)
        .await
        .expect("get")
        .expect("row")
        .status
}

/// Key `k1` has a message for the full `side` queue, then, after the alarm, one for
/// `main`; `k3` one for `side` after the alarm. After it: every message published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_inside_a_batch_after_a_refusal_strands_no_key() {
    let _lock = faults::lock().await;
    let w = WalOutbox::new().await;
    // The exchange and a queue taking everything (`#`), and `side`'s full queue.
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let full = format!("{}.full", fx.queue);
    let mut args = reject_when_full(1);
    args.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    fx.channel
        .queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .expect("declare the full queue");
    fx.channel
        .queue_bind(
            full.as_str().into(),
            fx.exchange.as_str().into(),
            "side".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the full queue");
    fx.channel
        .basic_publish(
            fx.exchange.as_str().into(),
            "side".into(),
            BasicPublishOptions::default(),
            b"filler",
            BasicProperties::default(),
        )
        .await
        .expect("publish the filler")
        .await
        .expect("filler confirmed");

    let publisher = RabbitPublisher::connect(
        RabbitConfig::builder(amqp_url())
            .with_exchange(&fx.exchange)
            .with_declare_exchange(false)
            .with_confirm_timeout(Duration::from_secs(3))
            .build()
            .expect("config"),
    )
    .await
    .expect("publisher");
    // The outage meets `k2` first: the messages after it are not looked at in that
    // round and go again in the next, where `k1`'s waits behind its parked message and
    // `k3`'s behind its destination's open circuit.
    let batch = [
        message("k1", "side"),
        message("k2", "main"),
        message("k1", "main"),
        message("k3", "side"),
        message("k4", "main"),
    ];
    let alarm = Arc::new(Mutex::new(None));
    let publisher = Arc::new(AlarmAfter {
        inner: Arc::new(publisher),
        trigger: batch[0].id,
        fired: AtomicBool::new(false),
        alarm: Arc::clone(&alarm),
    });
    let config = WalRelayConfig::new(database_url())
        .with_standby_interval(Duration::from_millis(100))
        .with_batch_size(10);
    let token = CancellationToken::new();
    let relay = w.spawn(publisher, config, &token);

    // Past a new session's careful first rounds (as many messages as a batch).
    let warm_up: Vec<NewMessage> = (0..20).map(|i| message(&format!("w{i}"), "main")).collect();
    w.enqueue(&warm_up).await;
    let warmed = eventually(Duration::from_secs(30), || async {
        w.outbox.stats().await.expect("stats").sent == 20
    })
    .await;
    assert!(warmed, "the warm-up is sent");

    // One transaction: one batch of the stream.
    w.enqueue(&batch).await;
    let refused_then_alarmed = eventually(Duration::from_secs(60), || async {
        alarm.lock().expect("lock").is_some()
            && status(&w, batch[0].id).await == MessageStatus::Processing
    })
    .await;
    assert!(
        refused_then_alarmed,
        "k1's side message refused and parked, then the alarm raised"
    );
    let cleared = alarm.lock().expect("lock").take();
    tokio::task::spawn_blocking(move || drop(cleared))
        .await
        .expect("clear the alarm");
    // Room for both side messages: the full queue goes (it held one message at most).
    fx.channel
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete the full queue");

    let all_sent = eventually(Duration::from_secs(30), || async {
        w.outbox.stats().await.expect("stats").sent == 25
    })
    .await;
    let mut statuses = Vec::new();
    for m in &batch {
        statuses.push((m.aggregate_id.clone(), m.event_type.clone(), status(&w, m.id).await));
    }
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        all_sent,
        "every message sent once the alarm is cleared and the full queue is gone: {statuses:?}, {stats:?}"
    );
    assert_eq!(stats.dead, 0, "{stats:?}");
}
