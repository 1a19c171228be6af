//! The broker is stopped for a minute in the middle of a run: nothing goes dead, nothing
//! is lost, and the relay resumes by itself when the broker returns.
//!
//! The test stops the shared RabbitMQ under the machine-wide fault lock of
//! `outboxkit_testkit::faults`, whose guard starts it again even if the test fails. The
//! outage length is `OUTBOX_OUTAGE_SECS` (default 60).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fresh_outbox;
use common::rabbit::{eventually, fixture};
use lapin::types::FieldTable;
use outboxkit_core::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer, OutboxStore};
use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};
use outboxkit_testkit::faults::{self, RabbitStopped};
use tokio_util::sync::CancellationToken;

async fn enqueue(outbox: &outboxkit_postgres::PgOutbox, n: usize, tag: &str) {
    let msgs: Vec<NewMessage> = (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{tag}-{i}"), "OrderPlaced")
                .payload(&i)
                .build()
                .expect("valid")
        })
        .collect();
    let mut tx = outbox.begin().await.expect("begin");
    outbox.enqueue_batch(&mut tx, &msgs).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_for_a_minute_dead_letters_nothing_and_recovers() {
    let _lock = faults::lock().await;
    let outage_secs: u64 = std::env::var("OUTBOX_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    // A durable exchange and queue: they must survive the broker restart.
    let fx = fixture(true, FieldTable::default()).await;
    let durable = format!("{}.durable", fx.exchange);
    let durable_q = format!("{}.q", durable);
    {
        use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
        let ch = &fx.channel;
        ch.exchange_declare(
            durable.as_str().into(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("exchange");
        ch.queue_declare(
            durable_q.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue");
        ch.queue_bind(
            durable_q.as_str().into(),
            durable.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    }
    enqueue(&outbox, 3000, "before").await;

    let publisher = RabbitPublisher::connect(
        RabbitConfig::new(common::rabbit::amqp_url())
            .with_exchange(&durable)
            .with_declare_exchange(false)
            .with_confirm_timeout(Duration::from_secs(5)),
    )
    .await
    .expect("publisher");
    let dispatcher = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::new(publisher),
        DispatcherConfig::new()
            .with_batch_size(50)
            .with_poll_interval(Duration::from_millis(100))
            .with_probe_backoff(Duration::from_millis(200), Duration::from_secs(2)),
    )
    .expect("valid dispatcher config");
    let token = CancellationToken::new();
    let handle = {
        let d = dispatcher.clone();
        let t = token.clone();
        tokio::spawn(async move { d.run(t).await })
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            outbox.stats().await.expect("stats").sent >= 300
        })
        .await
    );

    let outage = RabbitStopped::stop();
    // Producers keep writing while the broker is down.
    enqueue(&outbox, 500, "during").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(outage_secs);
    while tokio::time::Instant::now() < deadline {
        let stats = outbox.stats().await.expect("stats");
        assert_eq!(stats.dead, 0, "an outage must not dead-letter anything");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        dispatcher.circuit_open(),
        "the circuit is open while the broker is down"
    );
    outage.end();

    let recovered = eventually(Duration::from_secs(180), || async {
        outbox.stats().await.expect("stats").sent == 3500
    })
    .await;
    token.cancel();
    let stats = handle.await.expect("join").expect("run");
    let table = outbox.stats().await.expect("stats");
    assert!(
        recovered,
        "all messages sent after the broker returned: {table:?} {stats:?}"
    );
    assert_eq!(table.dead, 0);
    assert!(stats.circuit_opened >= 1, "{stats:?}");
    let max_attempts: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT max(attempts) FROM {}.outbox_messages",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("attempts");
    assert!(
        max_attempts <= 2,
        "the outage was not charged to the messages (max attempts {max_attempts})"
    );
    // The durable exchange and queue outlive connections: delete them.
    let conn = lapin::Connection::connect(
        &common::rabbit::amqp_url(),
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("reconnect");
    let ch = conn.create_channel().await.expect("channel");
    ch.queue_delete(durable_q.as_str().into(), Default::default())
        .await
        .expect("delete queue");
    ch.exchange_delete(durable.as_str().into(), Default::default())
        .await
        .expect("delete exchange");
    let _ = conn.close(200, "done".into()).await;
}
