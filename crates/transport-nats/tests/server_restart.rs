//! The NATS server is stopped in the middle of a relay run and started again: nothing
//! goes dead, nothing is lost or stored twice, and both the relay (PostgreSQL →
//! JetStream) and the consumer resume by themselves.
//!
//! This binary stops the shared NATS server (under the machine-wide fault lock of
//! `outboxkit_testkit::faults`), so it holds a single test (cargo runs test
//! binaries one after another). The outage length is `NATS_OUTAGE_SECS` (default 5).
//! The server is stopped with `outboxkit_testkit::faults::NatsStopped`: the process
//! listening on port 4222 and no other `nats-server` (a cluster's nodes keep running),
//! started again with its own command line; with Docker, the compose service `nats`.

mod common;

use outboxkit_core::Consumer as _;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer, OutboxStore};
use outboxkit_nats::{
    DeliveryHandler, HandlerDecision, NatsConfig, NatsConsumer, NatsConsumerConfig, NatsPublisher,
};
use outboxkit_postgres::PgOutbox;
use outboxkit_testkit::faults::NatsStopped;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// Records the distinct ids it receives and acks everything.
#[derive(Clone, Default)]
struct Collector {
    ids: Arc<Mutex<HashSet<Uuid>>>,
    deliveries: Arc<Mutex<u64>>,
}

#[async_trait]
impl DeliveryHandler for Collector {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        *self.deliveries.lock().expect("lock") += 1;
        self.ids.lock().expect("lock").insert(msg.id);
        HandlerDecision::Ack
    }
}

async fn enqueue(outbox: &PgOutbox, n: usize, tag: &str) {
    let messages: Vec<NewMessage> = (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{tag}-{i}"), "OrderPlaced")
                .payload(&i)
                .build()
                .expect("valid")
        })
        .collect();
    let mut tx = outbox.begin().await.expect("begin");
    outbox
        .enqueue_batch(&mut tx, &messages)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
}

async fn server_is_down() -> bool {
    tokio::net::TcpStream::connect("127.0.0.1:4222")
        .await
        .is_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_resume_after_a_server_restart_and_nothing_is_lost() {
    // No other test may freeze or stop a shared server meanwhile.
    let _lock = outboxkit_testkit::faults::lock().await;
    let outage_secs: u64 = std::env::var("NATS_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    // File storage: the stream (and the durable consumer) survive the restart.
    let fx = Fixture::new().await;
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    enqueue(&outbox, 3000, "before").await;

    let config = fx
        .config()
        .with_confirm_timeout(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_secs(2));
    let publisher = Arc::new(
        NatsPublisher::connect(config.clone())
            .await
            .expect("connect"),
    );
    let dispatcher = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::clone(&publisher),
        DispatcherConfig::new()
            .with_batch_size(50)
            .with_poll_interval(Duration::from_millis(100))
            .with_probe_backoff(Duration::from_millis(200), Duration::from_secs(2)),
    )
    .expect("valid dispatcher config");
    let token = CancellationToken::new();
    let relay = {
        let d = dispatcher.clone();
        let t = token.clone();
        tokio::spawn(async move { d.run(t).await })
    };
    let collector = Collector::default();
    let consumer = NatsConsumer::new(
        NatsConsumerConfig::new(
            NatsConfig::new(url())
                .with_subject_prefix(&fx.prefix)
                .with_connect_timeout(Duration::from_secs(2)),
            &fx.stream,
            "restart-survivor",
        )
        .with_ack_wait(Duration::from_secs(5))
        .with_reconnect_backoff(Duration::from_millis(200), Duration::from_secs(2)),
    )
    .expect("valid");
    let consumer_task = {
        let (c, t, h) = (consumer, token.clone(), collector.clone());
        tokio::spawn(async move { c.run(h, t).await })
    };

    eventually("the relay is under way", || async {
        dispatcher.stats().published >= 300
    })
    .await;

    let outage = NatsStopped::try_stop().expect("stop the NATS server");
    eventually("the server is down", server_is_down).await;
    eprintln!(
        "NATS stopped after {} messages were published",
        dispatcher.stats().published
    );
    // Written while the server is down: the relay must pick these up afterwards too.
    enqueue(&outbox, 1000, "during").await;
    eventually_within(
        Duration::from_secs(outage_secs.max(1) + 20),
        "the dispatcher opens its circuit",
        || async { dispatcher.circuit_open() },
    )
    .await;
    // The outage itself (not an assertion: the server stays down this long).
    tokio::time::sleep(Duration::from_secs(outage_secs)).await;
    let stats_down = dispatcher.stats();
    drop(outage); // starts the server again and waits until it answers
    eventually("the server is up", || async { !server_is_down().await }).await;
    eprintln!("NATS started again; relay during the outage: {stats_down:?}");

    eventually_within(
        Duration::from_secs(120),
        "every message is sent",
        || async {
            let stats = outbox.stats().await.expect("stats");
            stats.new == 0 && stats.processing == 0
        },
    )
    .await;
    let stats = outbox.stats().await.expect("stats");
    assert_eq!(
        stats.dead, 0,
        "an outage must not dead-letter anything: {stats:?}"
    );
    assert_eq!(stats.sent, 4000, "{stats:?}");
    assert!(
        dispatcher.stats().circuit_opened >= 1,
        "{:?}",
        dispatcher.stats()
    );
    // Exactly once in the stream: republished messages were dropped by the duplicate
    // window (JetStream rebuilds it from the stored messages after a restart).
    assert_eq!(fx.stored().await, 4000);
    eventually_within(
        Duration::from_secs(60),
        "the consumer received every message",
        || async { collector.ids.lock().expect("lock").len() == 4000 },
    )
    .await;

    token.cancel();
    let final_stats = relay
        .await
        .expect("relay task")
        .expect("relay ends cleanly");
    consumer_task
        .await
        .expect("consumer task")
        .expect("consumer ends cleanly");
    eprintln!(
        "relay {final_stats:?}; consumer deliveries {}",
        *collector.deliveries.lock().expect("lock")
    );
    fx.cleanup().await;
}
