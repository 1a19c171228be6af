//! The MariaDB / MySQL server is stopped in the middle of a relay run and of a consumer
//! run, while a producer keeps writing, and started again: the relay (MySQL → RabbitMQ)
//! sends every committed message, none dead and none lost (duplicates at the broker
//! allowed), and the idempotent consumer on the MySQL inbox rides out the outage: every
//! message's effect committed exactly once, no consumer dead letter.
//!
//! This binary stops the shared server (under the machine-wide fault lock of
//! `outboxkit_testkit::faults`, with `outboxkit_testkit::faults::MariaDbStopped`: the process
//! listening on port 3306, started again with its own command line when the guard is
//! dropped, a panic included, with a clean environment), so it holds a single test
//! (cargo runs test binaries one after another). The outage length is
//! `MYSQL_OUTAGE_SECS` (default 5). Run it with `TMPDIR` set to a directory the
//! `mysql` user cannot write (as CI systems set it): the server still comes back.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use lapin::types::FieldTable;
use outboxkit_core::Consumer as _;
use outboxkit_core::consumer::{DeliveryHandler, HandlerDecision};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer, OutboxStore};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_mysql::{MySqlInbox, MySqlOutbox};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};
use outboxkit_testkit::faults::{MYSQL_PORT, MariaDbStopped, pid_listening_on};
use outboxkit_testkit::rabbit::{eventually, relay_fixture};
use sqlx::{AssertSqlSafe, MySqlConnection};
use tokio_util::sync::CancellationToken;

use common::fresh_outbox;

const CONSUMER: &str = "restart-survivor";

/// The consumer's effect: one row per message, `times_applied` counting applications.
struct Effect {
    schema: String,
}

#[async_trait]
impl Handler<MySqlInbox> for Effect {
    async fn handle(
        &self,
        conn: &mut MySqlConnection,
        msg: &IncomingMessage,
        _ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}`.effects (message_id, times_applied) VALUES (?, 1)
             ON DUPLICATE KEY UPDATE times_applied = times_applied + 1",
            self.schema
        )))
        .bind(msg.id)
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The idempotent consumer, counting deliveries and how they were answered.
struct Counting {
    inner: IdempotentConsumer<MySqlInbox>,
    deliveries: Arc<AtomicU64>,
    acked: Arc<AtomicU64>,
}

#[async_trait]
impl DeliveryHandler for Counting {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        self.deliveries.fetch_add(1, Ordering::Relaxed);
        let decision = self.inner.process(msg).await;
        if decision == HandlerDecision::Ack {
            self.acked.fetch_add(1, Ordering::Relaxed);
        }
        decision
    }
}

fn messages(n: usize, tag: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{tag}-{i}"), "OrderPlaced")
                .payload(&i)
                .build()
                .expect("valid")
        })
        .collect()
}

/// Writes 10 messages every 10 ms until `stop`, each batch in a transaction of its own;
/// a batch that fails (the server is down) is skipped. Returns the failed batches. (A
/// batch whose `COMMIT` fails may have been committed anyway: the test counts what the
/// table holds, not what was attempted.)
async fn produce(outbox: Arc<MySqlOutbox>, stop: CancellationToken) -> u64 {
    let mut failed = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for batch in 0.. {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let written = async {
            let mut tx = outbox.begin().await?;
            outbox
                .enqueue_batch(&mut tx, &messages(10, &format!("during-{batch}")))
                .await?;
            tx.commit().await?;
            Ok::<_, Box<dyn std::error::Error>>(())
        };
        if written.await.is_err() {
            failed += 1;
        }
    }
    failed
}

async fn server_is_down() -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", MYSQL_PORT))
        .await
        .is_err()
}

async fn count(outbox: &MySqlOutbox, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(
        sql.replace("{s}", &format!("`{}`", outbox.schema())),
    ))
    .fetch_one(outbox.pool())
    .await
    .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_ride_out_a_server_restart_with_nothing_lost_or_applied_twice() {
    // No other test may freeze or stop a shared server meanwhile.
    let _lock = outboxkit_testkit::faults::lock().await;
    let outage_secs: u64 = std::env::var("MYSQL_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let (outbox, _drop) = fresh_outbox().await;
    let outbox = Arc::new(outbox);
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE `{}`.effects (message_id BINARY(16) PRIMARY KEY, times_applied INT NOT NULL)",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    common::enqueue_committed(&outbox, &messages(2000, "before")).await;

    let fx = relay_fixture(FieldTable::default()).await;
    let rabbit = RabbitConfig::new(outboxkit_testkit::rabbit::amqp_url())
        .with_exchange(&fx.exchange)
        .with_declare_exchange(false);
    let publisher = Arc::new(
        RabbitPublisher::connect(rabbit.clone())
            .await
            .expect("publisher"),
    );
    let dispatcher = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::clone(&publisher),
        DispatcherConfig::new()
            .with_batch_size(50)
            .with_poll_interval(Duration::from_millis(100)),
    )
    .expect("valid dispatcher config");
    let token = CancellationToken::new();
    let relay = {
        let d = dispatcher.clone();
        let t = token.clone();
        tokio::spawn(async move { d.run(t).await })
    };

    let deliveries = Arc::new(AtomicU64::new(0));
    let acked = Arc::new(AtomicU64::new(0));
    let handler = Counting {
        inner: IdempotentConsumer::new(
            Arc::new(outbox.inbox()),
            Pipeline::new().on(
                "OrderPlaced",
                CONSUMER,
                Effect {
                    schema: outbox.schema().to_owned(),
                },
            ),
            ConsumerConfig::new(),
        )
        .expect("valid consumer config"),
        deliveries: Arc::clone(&deliveries),
        acked: Arc::clone(&acked),
    };
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit, &fx.queue)
            .with_declare_queue(false)
            .with_prefetch(20)
            .with_requeue_delay(Duration::from_millis(200)),
    )
    .expect("consumer");
    let consumer_task = {
        let t = token.clone();
        tokio::spawn(async move { consumer.run(handler, t).await })
    };

    let producing = CancellationToken::new();
    let producer = tokio::spawn(produce(Arc::clone(&outbox), producing.clone()));
    assert!(
        eventually(Duration::from_secs(60), || async {
            dispatcher.stats().published >= 500 && acked.load(Ordering::Relaxed) >= 200
        })
        .await,
        "the relay and the consumer are under way: {:?}, {} acked",
        dispatcher.stats(),
        acked.load(Ordering::Relaxed)
    );

    let outage = MariaDbStopped::try_stop().expect("stop the MariaDB / MySQL server");
    assert!(server_is_down().await, "the server is down");
    let (published_down, acked_down) =
        (dispatcher.stats().published, acked.load(Ordering::Relaxed));
    eprintln!(
        "MariaDB stopped after {published_down} messages were published and {acked_down} acked"
    );
    // The outage itself (not an assertion: the server stays down this long).
    tokio::time::sleep(Duration::from_secs(outage_secs)).await;
    let stats_down = dispatcher.stats();
    drop(outage); // starts the server again and waits until it answers
    // With none of this process's environment (a CI's TMPDIR the `mysql` user cannot
    // write kept MariaDB from coming back): PATH and HOME only.
    let server = pid_listening_on(MYSQL_PORT).expect("the server listens again");
    let environ = std::fs::read(format!("/proc/{server}/environ")).expect("its environment");
    let inherited: Vec<String> = environ
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let key = kv.split_once('=')?.0.to_owned();
            (key != "PATH" && key != "HOME" && std::env::var_os(&key).is_some()).then_some(key)
        })
        .collect();
    assert!(
        inherited.is_empty(),
        "the restarted server has the test's environment: {inherited:?}"
    );
    eprintln!(
        "MariaDB started again; relay during the outage: {stats_down:?}; {} deliveries, {} acked",
        deliveries.load(Ordering::Relaxed),
        acked.load(Ordering::Relaxed)
    );
    // The producer writes again once the server is back; then it stops.
    let published_up = dispatcher.stats().published;
    tokio::time::sleep(Duration::from_secs(2)).await;
    producing.cancel();
    let failed_batches = producer.await.expect("producer task");
    let total = count(&outbox, "SELECT count(*) FROM {s}.outbox_messages").await;
    eprintln!("{total} messages committed, {failed_batches} producer batches failed");

    assert!(
        eventually(Duration::from_secs(180), || async {
            let stats = outbox.stats().await;
            stats.is_ok_and(|s| s.new == 0 && s.processing == 0)
        })
        .await,
        "every message is sent: {:?}",
        outbox.stats().await
    );
    let stats = outbox.stats().await.expect("stats");
    assert_eq!(
        stats.dead, 0,
        "an outage must not dead-letter anything: {stats:?}"
    );
    assert_eq!(stats.sent, total as u64, "{stats:?}");
    assert!(
        dispatcher.stats().published > published_up,
        "the relay published again after the restart"
    );

    assert!(
        eventually(Duration::from_secs(120), || async {
            count(&outbox, "SELECT count(*) FROM {s}.effects").await == total
        })
        .await,
        "every message's effect is committed: {} of {total}",
        count(&outbox, "SELECT count(*) FROM {s}.effects").await
    );
    token.cancel();
    let relay_stats = relay
        .await
        .expect("relay task")
        .expect("the relay rides out the outage and ends cleanly");
    consumer_task
        .await
        .expect("consumer task")
        .expect("the consumer rides out the outage and ends cleanly");

    let applied_twice = count(
        &outbox,
        "SELECT count(*) FROM {s}.effects WHERE times_applied <> 1",
    )
    .await;
    let records = count(
        &outbox,
        &format!("SELECT count(*) FROM {{s}}.inbox_records WHERE consumer = '{CONSUMER}'"),
    )
    .await;
    let failures = count(&outbox, "SELECT count(*) FROM {s}.inbox_failures").await;
    eprintln!(
        "relay {relay_stats:?}; consumer: {} deliveries, {} acked, {records} inbox records, {failures} failure records",
        deliveries.load(Ordering::Relaxed),
        acked.load(Ordering::Relaxed)
    );
    assert_eq!(applied_twice, 0, "no effect applied twice");
    assert_eq!(records, total, "one inbox record per message");
    assert_eq!(
        count(
            &outbox,
            "SELECT count(*) FROM {s}.inbox_failures WHERE dead_at IS NOT NULL"
        )
        .await,
        0,
        "no consumer dead letter"
    );
    assert!(
        deliveries.load(Ordering::Relaxed) >= total as u64,
        "every message was delivered at least once"
    );
    fx.delete_exchange().await;
}
