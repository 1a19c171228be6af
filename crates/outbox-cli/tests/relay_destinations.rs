//! One destination full, the other healthy, with `outbox relay` as a process against the
//! real PostgreSQL and RabbitMQ or NATS: the full destination's trouble stays with it.
//!
//! Producers write 50 messages a second for each of two routing keys, `ToFull` and
//! `ToOther`, first for 10 s with room everywhere (the baseline), then for 20 s with
//! `ToFull`'s destination full (a RabbitMQ queue at `x-max-length` with
//! `reject-publish`; a JetStream stream at `max_msgs` with `discard: new`). During those
//! 20 s `ToOther`'s messages must go out as in the baseline (at least 0.8 times the
//! baseline's share sent by the end of the phase), and `ToFull`'s are held back, none
//! charged; once room returns (the queue or stream purged) `ToFull`'s are all sent,
//! none dead, each charged only its successful attempt.
//!
//! The RabbitMQ case runs with the polling relay and with the WAL relay (`--source
//! wal`, its own slot, dropped by a guard).
//!
//! They fill queues and streams of their own, no shared server's, so they run side by
//! side; each holds the machine-wide fault lock of `outboxkit_testkit::faults` shared, so
//! that no broker-wide fault of another process (the chaos harness) falls into a
//! measurement.

mod common;

use std::time::{Duration, Instant};

use common::{RelayProcess, WalCleanup, amqp_url, enqueue, fresh_outbox, scalar, wait_until};
use futures::StreamExt as _;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use outboxkit_core::NewMessage;
use outboxkit_nats::async_nats::{self, jetstream};
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::lapin;
use outboxkit_testkit::faults;
use uuid::Uuid;

const NATS_URL: &str = "nats://127.0.0.1:4222";
/// How many messages the full destination holds.
const ROOM: i64 = 5;
/// Messages per second for each destination.
const RATE: usize = 50;

fn messages(event_type: &str, n: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{event_type}-{i}"), event_type)
                .payload(&serde_json::json!({ "n": i }))
                .build()
                .expect("valid")
        })
        .collect()
}

/// Writes `RATE` messages a second for each destination for `for_`, in 10 batches a
/// second; returns when it started.
async fn produce(db: &PgOutbox, for_: Duration) -> chrono::DateTime<chrono::Utc> {
    let started = chrono::Utc::now();
    let per_tick = RATE / 10;
    let deadline = Instant::now() + for_;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while Instant::now() < deadline {
        tick.tick().await;
        let mut batch = messages("ToFull", per_tick);
        batch.extend(messages("ToOther", per_tick));
        enqueue(db, &batch).await;
    }
    started
}

/// Of the `ToOther` messages written since `since`, the share sent by now.
async fn other_sent_share(db: &PgOutbox, since: chrono::DateTime<chrono::Utc>) -> f64 {
    let (sent, all): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FILTER (WHERE status = 1), count(*) FROM {}.outbox_messages
          WHERE event_type = 'ToOther' AND created_at >= $1",
        db.schema()
    )))
    .bind(since)
    .fetch_one(db.pool())
    .await
    .expect("share");
    assert!(all > 0, "messages were written");
    sent as f64 / all as f64
}

/// `(status, count, max attempts)` of the rows of `event_type`.
async fn by_status(db: &PgOutbox, event_type: &str) -> Vec<(i16, i64, i32)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status, count(*), max(attempts) FROM {}.outbox_messages
          WHERE event_type = $1 GROUP BY status ORDER BY status",
        db.schema()
    )))
    .bind(event_type)
    .fetch_all(db.pool())
    .await
    .expect("statuses")
}

/// The broker side of a run: `ToFull`'s destination has room after `new`, is full after
/// [`fill`](Self::fill), and has room again after [`make_room`](Self::make_room).
trait Destinations {
    async fn fill(&self);
    async fn make_room(&self);
    async fn cleanup(self);
}

/// The whole scenario over `broker`, the relay started with `args`.
async fn one_full_destination_holds_back_only_its_own(
    db: &PgOutbox,
    broker: impl Destinations,
    args: &[&str],
) {
    let relay = RelayProcess::start(db, args);
    let t0 = Instant::now();

    // Baseline: room everywhere.
    let baseline_start = produce(db, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let baseline = other_sent_share(db, baseline_start).await;
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the baseline is sent",
        || async {
            scalar(
                db,
                "SELECT count(*) FROM {s}.outbox_messages WHERE status <> 1",
            )
            .await
                == 0
        },
    )
    .await;

    // 20 s with ToFull's destination full.
    eprintln!("baseline done at {:.1} s", t0.elapsed().as_secs_f64());
    broker.fill().await;
    let fault_start = produce(db, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = other_sent_share(db, fault_start).await;
    eprintln!(
        "share of ToOther sent by the end of the phase: {baseline:.3} with room, {during:.3} with ToFull full"
    );
    assert!(
        during >= 0.8 * baseline,
        "the other destination flowed at {during:.3} of its messages against {baseline:.3} without the full one; relay log:\n{}",
        relay.log()
    );
    let held = by_status(db, "ToFull").await;
    assert!(
        held.iter()
            .all(|&(status, _, attempts)| status != 3 && attempts <= 1),
        "ToFull's messages are held back, none dead or charged: {held:?}"
    );

    // Room returns: everything goes, none dead, each charged only its successful
    // attempt.
    broker.make_room().await;
    let room = Instant::now();
    wait_until(
        &relay,
        Duration::from_secs(120),
        "every row is sent",
        || async {
            scalar(
                db,
                "SELECT count(*) FROM {s}.outbox_messages WHERE status <> 1",
            )
            .await
                == 0
        },
    )
    .await;
    eprintln!(
        "all sent {:.1} s after room returned",
        room.elapsed().as_secs_f64()
    );
    for event_type in ["ToFull", "ToOther"] {
        let rows = by_status(db, event_type).await;
        assert_eq!(rows.len(), 1, "{event_type}: {rows:?}");
        assert_eq!(
            (rows[0].0, rows[0].2),
            (1, 1),
            "{event_type}: sent, one attempt each"
        );
    }
    assert!(
        relay.log().contains("a destination refuses messages"),
        "{}",
        relay.log()
    );
    relay.terminate();
    broker.cleanup().await;
}

/// A topic exchange with a queue per routing key; `ToFull`'s holds `ROOM` messages and
/// refuses more (`reject-publish`).
struct Rabbit {
    exchange: String,
    full: String,
    other: String,
    channel: lapin::Channel,
    _conn: Connection,
}

/// The consumer tag of the consumer that drains the full queue while it has room.
const DRAIN: &str = "drain";

impl Rabbit {
    async fn new() -> Self {
        let tag = Uuid::new_v4().simple().to_string();
        let exchange = format!("t.{tag}");
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("RabbitMQ");
        let channel = conn.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirms");
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("exchange");
        let (full, other) = (format!("{exchange}.full"), format!("{exchange}.other"));
        for (queue, key, limited) in [(&full, "ToFull", true), (&other, "ToOther", false)] {
            let mut args = FieldTable::default();
            args.insert("x-expires".into(), AMQPValue::LongInt(120_000));
            if limited {
                args.insert("x-max-length".into(), AMQPValue::LongLongInt(ROOM));
                args.insert(
                    "x-overflow".into(),
                    AMQPValue::LongString("reject-publish".into()),
                );
            }
            channel
                .queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), args)
                .await
                .expect("queue");
            channel
                .queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("bind");
        }
        let rabbit = Self {
            exchange,
            full,
            other,
            channel,
            _conn: conn,
        };
        rabbit.make_room().await;
        rabbit
    }
}

impl Destinations for Rabbit {
    async fn fill(&self) {
        self.channel
            .basic_cancel(DRAIN.into(), lapin::options::BasicCancelOptions::default())
            .await
            .expect("stop draining");
        self.channel
            .queue_purge(self.full.as_str().into(), QueuePurgeOptions::default())
            .await
            .expect("purge");
        for _ in 0..ROOM {
            self.channel
                .basic_publish(
                    self.exchange.as_str().into(),
                    "ToFull".into(),
                    BasicPublishOptions::default(),
                    b"filler",
                    BasicProperties::default(),
                )
                .await
                .expect("publish")
                .await
                .expect("confirm");
        }
    }

    async fn make_room(&self) {
        // A consumer that drains the queue as messages arrive (a purge alone would make
        // room for only `ROOM` more).
        let consumer = self
            .channel
            .basic_consume(
                self.full.as_str().into(),
                DRAIN.into(),
                lapin::options::BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("consume");
        tokio::spawn(consumer.for_each(|_| async {}));
    }

    async fn cleanup(self) {
        for queue in [&self.full, &self.other] {
            let _ = self
                .channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_holds_back_only_its_own_routing_key() {
    let _lock = faults::lock_shared().await;
    let db = fresh_outbox().await;
    let rabbit = Rabbit::new().await;
    let url = amqp_url();
    let exchange = rabbit.exchange.clone();
    let args = [
        "--transport",
        "rabbit",
        "--broker-url",
        &url,
        "--exchange",
        &exchange,
        "--confirm-timeout",
        "2s",
    ];
    one_full_destination_holds_back_only_its_own(&db, rabbit, &args).await;
}

/// The same with the WAL relay (`--source wal`): what the full queue refuses is parked
/// in the table, and the slot's stream goes on with the other routing key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_a_full_queue_holds_back_only_its_own_routing_key() {
    let _lock = faults::lock_shared().await;
    let db = fresh_outbox().await;
    let _wal = WalCleanup::setup(&db);
    let rabbit = Rabbit::new().await;
    let url = amqp_url();
    let exchange = rabbit.exchange.clone();
    let args = [
        "--source",
        "wal",
        "--transport",
        "rabbit",
        "--broker-url",
        &url,
        "--exchange",
        &exchange,
        "--confirm-timeout",
        "2s",
    ];
    one_full_destination_holds_back_only_its_own(&db, rabbit, &args).await;
}

/// Two streams, one per routing key; `ToFull`'s holds `ROOM` messages and refuses more
/// (`discard: new`).
struct Nats {
    prefix: String,
    full: String,
    other: String,
    js: jetstream::Context,
}

impl Nats {
    async fn new() -> Self {
        let tag = Uuid::new_v4().simple().to_string();
        let prefix = format!("test.{tag}");
        let client = async_nats::connect(NATS_URL).await.expect("NATS");
        let js = jetstream::new(client);
        let (full, other) = (format!("FULL_{tag}"), format!("OTHER_{tag}"));
        for (name, key, limited) in [(&full, "ToFull", true), (&other, "ToOther", false)] {
            js.create_stream(jetstream::stream::Config {
                name: name.clone(),
                subjects: vec![format!("{prefix}.{key}")],
                max_messages: -1,
                discard: if limited {
                    jetstream::stream::DiscardPolicy::New
                } else {
                    jetstream::stream::DiscardPolicy::Old
                },
                storage: jetstream::stream::StorageType::Memory,
                ..Default::default()
            })
            .await
            .expect("stream");
        }
        Self {
            prefix,
            full,
            other,
            js,
        }
    }
}

impl Nats {
    async fn set_max_messages(&self, max: i64) {
        let mut config = self
            .js
            .get_stream(&self.full)
            .await
            .expect("stream")
            .cached_info()
            .config
            .clone();
        config.max_messages = max;
        self.js.update_stream(config).await.expect("max_msgs");
    }
}

impl Destinations for Nats {
    async fn fill(&self) {
        self.set_max_messages(ROOM).await;
        let stream = self.js.get_stream(&self.full).await.expect("stream");
        stream.purge().await.expect("purge");
        for _ in 0..ROOM {
            self.js
                .publish(format!("{}.ToFull", self.prefix), "filler".into())
                .await
                .expect("publish")
                .await
                .expect("stored");
        }
    }

    async fn make_room(&self) {
        self.set_max_messages(-1).await;
    }

    async fn cleanup(self) {
        for name in [&self.full, &self.other] {
            let _ = self.js.delete_stream(name).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stream_holds_back_only_its_own_subject() {
    let _lock = faults::lock_shared().await;
    let db = fresh_outbox().await;
    let nats = Nats::new().await;
    let prefix = nats.prefix.clone();
    let args = [
        "--transport",
        "nats",
        "--broker-url",
        NATS_URL,
        "--subject-prefix",
        &prefix,
        "--confirm-timeout",
        "2s",
    ];
    one_full_destination_holds_back_only_its_own(&db, nats, &args).await;
}
