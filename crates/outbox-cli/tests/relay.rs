//! `outbox relay` as a library: publishes to the real RabbitMQ, exports the documented
//! metrics, reports health, and a replayed message stays single through the inbox.

mod common;

use outboxkit_core::Consumer as _;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use clap::Parser as _;
use common::{amqp_url, enqueue, eventually, exec, fresh_outbox, http_get, message, scalar};
use outboxkit_cli::Cli;
use outboxkit_cli::testing::internals::{DbSettings, Relay, RelaySettings, SentRetentionMode};
use outboxkit_core::TransportKind;
use outboxkit_core::consumer::{DeliveryHandler, HandlerDecision};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgInbox, PgOutbox};
use outboxkit_rabbit::lapin::types::{AMQPValue, FieldTable};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig};
use outboxkit_testkit::rabbit::DropExchange;
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn settings(db: &PgOutbox, broker_url: &str, exchange: &str) -> RelaySettings {
    let mut s = RelaySettings::new(
        DbSettings {
            url: common::database_url(),
            schema: db.schema().to_owned(),
        },
        TransportKind::Rabbit,
        broker_url,
    );
    s.exchange = exchange.to_owned();
    s.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    s.poll_interval = Some(Duration::from_millis(50));
    s.health_interval = Duration::from_millis(200);
    s.batch_size = 50;
    s
}

struct Projector(String);

#[async_trait]
impl Handler<PgInbox> for Projector {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.0
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// Counts deliveries per message id (and keeps their trace ids), then hands them to
/// the idempotent consumer.
struct Counting {
    inner: IdempotentConsumer<PgInbox>,
    seen: Arc<Mutex<HashMap<Uuid, usize>>>,
    traces: Arc<Mutex<HashMap<Uuid, u128>>>,
}

#[async_trait]
impl DeliveryHandler for Counting {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        // Counted after processing, so a count the test sees is fully handled.
        let decision = self.inner.process(msg).await;
        if let Some(tp) = msg.traceparent {
            self.traces
                .lock()
                .expect("lock")
                .insert(msg.id, tp.trace_id);
        }
        *self.seen.lock().expect("lock").entry(msg.id).or_insert(0) += 1;
        decision
    }
}

fn expires_when_unused() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    args
}

/// A fresh exchange name and a declared consumer of its `OrderPlaced` messages only: a
/// message of another event type is unroutable and dies at once (mandatory). The guard
/// deletes the exchange when the test ends (the queue expires by itself).
async fn order_placed_consumer() -> (String, RabbitConsumer, DropExchange) {
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let guard = DropExchange::new(&amqp_url(), &exchange);
    let rabbit = RabbitConfig::new(amqp_url()).with_exchange(&exchange);
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit, format!("{exchange}.q"))
            .with_binding_key("OrderPlaced")
            .with_queue_arguments(expires_when_unused()),
    )
    .expect("consumer");
    consumer.declare().await.expect("declare");
    (exchange, consumer, guard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_exports_metrics_and_a_replayed_message_stays_single() {
    let db = fresh_outbox().await;
    exec(&db, "CREATE TABLE {s}.effects (message_id uuid NOT NULL)").await;
    let (exchange, consumer, _exchange) = order_placed_consumer().await;
    let store = Arc::new(db.inbox());
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let traces = Arc::new(Mutex::new(HashMap::new()));
    let handler = Counting {
        inner: IdempotentConsumer::new(
            Arc::clone(&store),
            Pipeline::new().on(
                "OrderPlaced",
                "projector",
                Projector(db.schema().to_owned()),
            ),
            ConsumerConfig::new(),
        )
        .expect("valid consumer config"),
        seen: Arc::clone(&seen),
        traces: Arc::clone(&traces),
    };
    let consumer_stop = CancellationToken::new();
    let consuming = {
        let t = consumer_stop.clone();
        tokio::spawn(async move { consumer.run(handler, t).await })
    };

    let mut placed: Vec<_> = (0..4)
        .map(|i| message("OrderPlaced", "acme", &i.to_string()))
        .collect();
    // The producer's W3C trace context travels through the relay to the consumer.
    let traced = outboxkit_core::NewMessage::builder("order", "4", "OrderPlaced")
        .aggregate_version(1)
        .tenant_id("acme")
        .payload_json("{}")
        .trace_context(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("vendor=1".into()),
        )
        .build()
        .expect("valid");
    placed.push(traced.clone());
    let unroutable = message("Unroutable", "acme", "9");
    enqueue(&db, &placed).await;
    enqueue(&db, std::slice::from_ref(&unroutable)).await;

    let stop = CancellationToken::new();
    let relay = Relay::start(&settings(&db, &amqp_url(), &exchange), stop.clone())
        .await
        .expect("relay starts");
    let addr = relay.local_addr();
    let effects =
        |db: PgOutbox| async move { scalar(&db, "SELECT count(*) FROM {s}.effects").await };
    assert!(
        eventually(Duration::from_secs(30), || {
            let db = db.clone();
            async move {
                effects(db.clone()).await == 5
                    && scalar(
                        &db,
                        "SELECT count(*) FROM {s}.outbox_messages WHERE status = 3",
                    )
                    .await
                        == 1
            }
        })
        .await,
        "published, consumed and the unroutable one dead"
    );

    // /healthz turns ok once a check has run (nothing pending, broker reachable).
    assert!(
        eventually(Duration::from_secs(10), || async move {
            http_get(addr, "/healthz").await.0 == 200
        })
        .await,
        "healthy: {:?}",
        http_get(addr, "/healthz").await
    );

    // Replay: the first message is marked dead as if its confirm had been lost, then
    // replayed through the CLI: published again, absorbed by the inbox.
    let again = placed[0].id;
    exec(
        &db,
        &format!(
            "UPDATE {{s}}.outbox_messages SET status = 3, last_error = 'no broker confirmation within 30s' WHERE id = '{again}'"
        ),
    )
    .await;
    let url = common::database_url();
    let id = again.to_string();
    let mut out = Vec::new();
    outboxkit_cli::run(
        Cli::parse_from([
            "outbox",
            "--database-url",
            &url,
            "--schema",
            db.schema(),
            "dead",
            "replay",
            "--id",
            &id,
        ]),
        &mut out,
    )
    .await
    .expect("replay");
    let out = String::from_utf8(out).expect("utf-8");
    assert!(out.contains("matched 1, replayed 1, failed 0"), "{out}");
    assert!(
        eventually(Duration::from_secs(30), || {
            let seen = Arc::clone(&seen);
            async move { seen.lock().expect("lock").get(&again) == Some(&2) }
        })
        .await,
        "the replayed message was delivered again"
    );
    assert!(
        eventually(Duration::from_secs(10), || {
            let db = db.clone();
            async move {
                scalar(&db, &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE id = '{again}' AND status = 1")).await == 1
            }
        })
        .await
    );
    assert_eq!(effects(db.clone()).await, 5, "its effect stays single");
    assert_eq!(
        traces.lock().expect("lock").get(&traced.id),
        Some(&0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736),
        "the consumer sees the producer's trace id"
    );

    // Every documented series is exported.
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200);
    for name in [
        outboxkit_core::metrics::PUBLISHED_TOTAL,
        outboxkit_core::metrics::PUBLISH_FAILURES_TOTAL,
        outboxkit_core::metrics::DEAD_TOTAL,
        outboxkit_core::metrics::CLAIM_BATCH_SIZE,
        outboxkit_core::metrics::PUBLISH_DURATION_SECONDS,
        outboxkit_core::metrics::CLAIM_WAIT_SECONDS,
        outboxkit_core::metrics::COMMIT_TO_PUBLISH_SECONDS,
        outboxkit_core::metrics::CIRCUIT_OPEN,
        outboxkit_core::metrics::PENDING_MESSAGES,
        outboxkit_core::metrics::OLDEST_PENDING_AGE_SECONDS,
        outboxkit_core::metrics::DEAD_MESSAGES,
        outboxkit_inbox::metrics::PROCESSED_TOTAL,
        outboxkit_inbox::metrics::DUPLICATES_TOTAL,
        outboxkit_inbox::metrics::HANDLER_DURATION_SECONDS,
        outboxkit_inbox::metrics::END_TO_END_SECONDS,
    ] {
        assert!(
            body.contains(&format!("\n{name}")),
            "{name} missing in:\n{body}"
        );
    }
    assert!(
        body.lines()
            .any(|l| l.starts_with("outbox_publish_failures_total{")
                && l.contains("kind=\"permanent\"")
                && l.contains("event_type=\"Unroutable\"")),
        "{body}"
    );
    assert!(
        body.contains("outbox_claim_batch_size_bucket"),
        "histograms have buckets"
    );

    stop.cancel();
    let stats = relay.wait().await.expect("graceful stop");
    assert!(stats.published >= 6, "{stats:?}");
    assert_eq!(stats.dead, 1);
    consumer_stop.cancel();
    consuming.await.expect("join").expect("consumer");
}

/// Records each delivered message id, and acks.
struct Seen(Arc<Mutex<HashMap<Uuid, usize>>>);

#[async_trait]
impl DeliveryHandler for Seen {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        *self.0.lock().expect("lock").entry(msg.id).or_insert(0) += 1;
        HandlerDecision::Ack
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_retention_delete_removes_delivered_rows_and_keeps_dead_ones() {
    let db = fresh_outbox().await;
    let (exchange, consumer, _exchange) = order_placed_consumer().await;
    let seen = Arc::new(Mutex::new(HashMap::new()));
    let consumer_stop = CancellationToken::new();
    let consuming = {
        let t = consumer_stop.clone();
        let handler = Seen(Arc::clone(&seen));
        tokio::spawn(async move { consumer.run(handler, t).await })
    };

    let placed: Vec<_> = (0..200)
        .map(|i| message("OrderPlaced", "acme", &i.to_string()))
        .collect();
    enqueue(&db, &placed).await;
    enqueue(&db, &[message("Unroutable", "acme", "x")]).await;

    let mut s = settings(&db, &amqp_url(), &exchange);
    s.sent_retention = SentRetentionMode::Delete;
    let stop = CancellationToken::new();
    let relay = Relay::start(&s, stop.clone()).await.expect("relay starts");
    assert!(
        eventually(Duration::from_secs(30), || {
            let (db, seen) = (db.clone(), Arc::clone(&seen));
            async move {
                seen.lock().expect("lock").len() == 200
                    && scalar(&db, "SELECT count(*) FROM {s}.outbox_messages").await == 1
            }
        })
        .await,
        "every message delivered, and only the dead one left in the table: {} rows, {} delivered",
        scalar(&db, "SELECT count(*) FROM {s}.outbox_messages").await,
        seen.lock().expect("lock").len()
    );
    assert_eq!(
        scalar(
            &db,
            "SELECT count(*) FROM {s}.outbox_messages WHERE status = 3 AND event_type = 'Unroutable' AND last_error IS NOT NULL"
        )
        .await,
        1,
        "the dead letter is kept, with its error"
    );
    stop.cancel();
    let stats = relay.wait().await.expect("graceful stop");
    assert_eq!((stats.published, stats.dead, stats.fenced), (200, 1, 0));
    let seen = seen.lock().expect("lock").clone();
    assert!(
        placed.iter().all(|m| seen.get(&m.id) == Some(&1)),
        "each message delivered exactly once"
    );
    consumer_stop.cancel();
    consuming.await.expect("join").expect("consumer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_when_the_broker_is_unreachable() {
    let db = fresh_outbox().await;
    enqueue(&db, &[message("OrderPlaced", "acme", "1")]).await;
    // Nothing listens on port 1: the broker is unreachable.
    let stop = CancellationToken::new();
    let relay = Relay::start(
        &settings(&db, "amqp://guest:guest@127.0.0.1:1/%2f", "t.unreachable"),
        stop.clone(),
    )
    .await
    .expect("starts although the broker is down");
    let addr = relay.local_addr();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let last = loop {
        let got = http_get(addr, "/healthz").await;
        let unhealthy = got.0 == 503
            && got.1.contains("broker unreachable")
            && got.1.contains("\"circuit_open\":true");
        if unhealthy {
            break got;
        }
        assert!(tokio::time::Instant::now() < deadline, "still {got:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let report: serde_json::Value = serde_json::from_str(&last.1).expect("json");
    assert_eq!(report["status"], "unhealthy");
    assert_eq!(report["broker_reachable"], false);
    stop.cancel();
    relay.wait().await.expect("graceful stop");
    // The outage charged nothing and killed nothing.
    let (status, attempts): (i16, i32) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT status, attempts FROM {}.outbox_messages",
        db.schema()
    )))
    .fetch_one(db.pool())
    .await
    .expect("row");
    assert_eq!((status, attempts), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_over_nats_jetstream() {
    let db = fresh_outbox().await;
    let id = Uuid::new_v4().simple().to_string();
    let (stream, prefix) = (format!("TEST_{id}"), format!("test.{id}"));
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let config = outboxkit_nats::NatsConfig::new(&nats_url).with_subject_prefix(&prefix);
    outboxkit_nats::StreamSetup::for_config(&stream, &config)
        .with_storage(outboxkit_nats::Storage::Memory)
        .apply(&config)
        .await
        .expect("stream");
    let msgs: Vec<_> = (0..3)
        .map(|i| message("OrderPlaced", "acme", &i.to_string()))
        .collect();
    enqueue(&db, &msgs).await;
    let mut s = settings(&db, &nats_url, "unused");
    s.transport = TransportKind::Nats;
    s.subject_prefix = prefix;
    let stop = CancellationToken::new();
    let relay = Relay::start(&s, stop.clone()).await.expect("relay starts");
    let sent = eventually(Duration::from_secs(30), || {
        let db = db.clone();
        async move {
            scalar(
                &db,
                "SELECT count(*) FROM {s}.outbox_messages WHERE status = 1",
            )
            .await
                == 3
        }
    })
    .await;
    let health = http_get(relay.local_addr(), "/healthz").await;
    stop.cancel();
    let stats = relay.wait().await.expect("graceful stop");
    let client = outboxkit_nats::async_nats::connect(&nats_url)
        .await
        .expect("connect");
    let _ = outboxkit_nats::async_nats::jetstream::new(client)
        .delete_stream(&stream)
        .await;
    assert!(sent, "published with PubAck: {stats:?}");
    assert_eq!(stats.published, 3);
    assert!(health.1.contains("\"broker_reachable\""), "{health:?}");
}
