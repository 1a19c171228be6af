//! `outbox relay` on the 3-node clusters of `cargo xtask services --cluster`, through
//! node loss, against the real PostgreSQL:
//!
//! - RabbitMQ, a quorum queue: the node holding the queue's leader killed (`SIGKILL`)
//!   during a 20,000-message run and started again, then the node the relay is
//!   connected to killed during a second 20,000-message run: every row `Sent`, none
//!   `Dead`, the relay reconnected to another node of its list, and the queue holds
//!   every id (duplicates allowed).
//! - NATS JetStream, an R3 stream: the node holding the stream's leader killed during
//!   a 20,000-message run and started again: every row `Sent`, none `Dead`, the stream
//!   holds every id exactly once (`Nats-Msg-Id` deduplication).
//!
//! They need the clusters (`cargo xtask itest` starts them; otherwise they fail saying
//! how to start them), and take the machine-wide fault lock.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{RelayProcess, enqueue, fresh_outbox, message, scalar, wait_until};
use futures::StreamExt as _;
use outbox_postgres::PgOutbox;
use outbox_testkit::cluster::{self, Broker, NodeKilled};
use outbox_testkit::faults;
use transport_nats::async_nats;
use transport_rabbit::lapin;
use uuid::Uuid;

const MESSAGES: usize = 20_000;

async fn count(db: &PgOutbox, status: i16) -> usize {
    let n = scalar(
        db,
        &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE status = {status}"),
    )
    .await;
    usize::try_from(n).expect("a count")
}

async fn ids(db: &PgOutbox) -> HashSet<Uuid> {
    let sql = format!("SELECT id FROM {}.outbox_messages", db.schema());
    sqlx::query_scalar::<_, Uuid>(sqlx::AssertSqlSafe(sql))
        .fetch_all(db.pool())
        .await
        .expect("ids")
        .into_iter()
        .collect()
}

async fn enqueue_many(db: &PgOutbox, n: usize, tag: &str) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(2_000) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|i| message(tag, "t", &i.to_string()))
            .collect();
        enqueue(db, &batch).await;
    }
}

/// Relay arguments for the cluster: every node's URL, short timeouts.
fn relay_args(transport: &str, urls: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--transport",
        transport,
        "--broker-url",
        urls,
        "--connect-timeout",
        "2s",
        "--confirm-timeout",
        "5s",
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args
}

async fn sent_reaches(db: &PgOutbox, relay: &RelayProcess, n: usize, what: &str) {
    wait_until(relay, Duration::from_secs(180), what, || async {
        count(db, 1).await >= n
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_quorum_leader_and_relay_node_lost_nothing_dead_every_id_queued() {
    let _lock = faults::lock().await;
    cluster::require();
    let db = fresh_outbox().await;
    let tag = Uuid::new_v4().simple().to_string();
    let exchange = format!("t.{tag}");
    let queue = format!("t.{tag}.q");

    // The topology, declared on node 2: a quorum queue's leader goes to the node its
    // declaring client is connected to, so the relay (node 1 first) and the leader start
    // on different nodes.
    let conn = lapin::Connection::connect(
        &cluster::rabbit_url(2),
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("connect to RabbitMQ node 2");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("exchange");
    let mut arguments = lapin::types::FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        lapin::types::AMQPValue::LongString("quorum".into()),
    );
    channel
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            arguments,
        )
        .await
        .expect("quorum queue");
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("bind");
    conn.close(200, "OK".into()).await.expect("close");
    let leader = cluster::quorum_leader(&queue).expect("the quorum queue has a leader");

    enqueue_many(&db, MESSAGES, "Clustered").await;
    let args = relay_args(
        "rabbit",
        &cluster::rabbit_urls(),
        &["--exchange", &exchange],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = RelayProcess::start(&db, &args);

    sent_reaches(&db, &relay, 2_000, "the relay is under way").await;
    let killed = NodeKilled::kill(Broker::Rabbit, leader);
    let at_kill = count(&db, 1).await;
    sent_reaches(
        &db,
        &relay,
        (at_kill + 2_000).min(MESSAGES),
        "progress after the leader was killed",
    )
    .await;
    eprintln!(
        "leader node {leader} killed after {at_kill} sent; new leader {:?}",
        cluster::quorum_leader(&queue)
    );
    killed.restart();

    let pid = relay.pid();
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the relay is connected",
        || async move { cluster::connected_node(pid, Broker::Rabbit).is_some() },
    )
    .await;
    let relay_node = cluster::connected_node(pid, Broker::Rabbit).expect("connected");
    // A second run, so that the relay's node goes while the relay publishes to it.
    enqueue_many(&db, MESSAGES, "Clustered").await;
    sent_reaches(&db, &relay, MESSAGES + 2_000, "the second run is under way").await;
    let at_kill = count(&db, 1).await;
    let killed = NodeKilled::kill(Broker::Rabbit, relay_node);
    sent_reaches(
        &db,
        &relay,
        2 * MESSAGES,
        "every message is sent after the relay's node was killed",
    )
    .await;
    let moved_to = cluster::connected_node(relay.pid(), Broker::Rabbit);
    eprintln!("relay's node {relay_node} killed after {at_kill} sent; reconnected to {moved_to:?}");
    assert_ne!(
        moved_to,
        Some(relay_node),
        "the relay moved to another node"
    );
    killed.restart();

    assert_eq!(count(&db, 1).await, 2 * MESSAGES, "every row Sent");
    assert_eq!(count(&db, 3).await, 0, "none Dead");

    // Every id in the queue, read from node 3 (duplicates allowed: a publish whose
    // confirm was lost with a node is sent again).
    let expected = ids(&db).await;
    let conn = lapin::Connection::connect(
        &cluster::rabbit_url(3),
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("connect to RabbitMQ node 3");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .basic_qos(2_000, lapin::options::BasicQosOptions::default())
        .await
        .expect("qos");
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "reader".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("consume");
    let mut seen = HashSet::new();
    let mut total = 0usize;
    while seen.len() < expected.len() {
        let delivery = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "only {} of {} ids in the queue ({} messages)",
                    seen.len(),
                    expected.len(),
                    total
                )
            })
            .expect("open")
            .expect("delivery");
        total += 1;
        if let Some(id) = delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|id| Uuid::parse_str(id.as_str()).ok())
        {
            seen.insert(id);
        }
    }
    assert_eq!(seen, expected, "the queue holds every id");
    eprintln!("queue: {} messages for {} ids", total, seen.len());
    channel
        .queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .expect("delete queue");
    channel
        .exchange_delete(
            exchange.as_str().into(),
            lapin::options::ExchangeDeleteOptions::default(),
        )
        .await
        .expect("delete exchange");
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_r3_stream_leader_lost_nothing_dead_every_id_stored_once() {
    let _lock = faults::lock().await;
    cluster::require();
    let db = fresh_outbox().await;
    let tag = Uuid::new_v4().simple().to_string();
    let stream = format!("TEST_{tag}");
    let prefix = format!("test.{tag}");
    let config = transport_nats::NatsConfig::builder(cluster::nats_urls())
        .with_subject_prefix(&prefix)
        .build()
        .expect("valid");
    transport_nats::StreamSetup::for_config(&stream, &config)
        .with_replicas(3)
        .apply(&config)
        .await
        .expect("an R3 stream");
    let mut leader = None;
    for _ in 0..100 {
        leader = cluster::stream_leader(&stream);
        if leader.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let leader = leader.expect("the stream has a leader");

    enqueue_many(&db, MESSAGES, "Clustered").await;
    let args = relay_args(
        "nats",
        &cluster::nats_urls(),
        &["--subject-prefix", &prefix],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let relay = RelayProcess::start(&db, &args);

    sent_reaches(&db, &relay, 2_000, "the relay is under way").await;
    let killed = NodeKilled::kill(Broker::Nats, leader);
    let at_kill = count(&db, 1).await;
    sent_reaches(
        &db,
        &relay,
        MESSAGES,
        "every message is sent after the leader was killed",
    )
    .await;
    eprintln!(
        "stream leader node {leader} killed after {at_kill} sent; new leader {:?}",
        cluster::stream_leader(&stream)
    );
    killed.restart();
    assert_eq!(count(&db, 1).await, MESSAGES, "every row Sent");
    assert_eq!(count(&db, 3).await, 0, "none Dead");

    // Every id exactly once in the stream.
    let expected = ids(&db).await;
    let client = async_nats::connect(cluster::nats_urls().split(',').collect::<Vec<_>>())
        .await
        .expect("connect");
    let js = async_nats::jetstream::new(client);
    let mut info_stream = js.get_stream(&stream).await.expect("stream");
    let stored = info_stream.info().await.expect("info").state.messages;
    assert_eq!(stored, MESSAGES as u64, "each id stored once");
    let consumer = info_stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .expect("reader");
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(1_000)
        .messages()
        .await
        .expect("pull");
    let mut seen = HashSet::new();
    while seen.len() < expected.len() {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("every stored message arrives")
            .expect("open")
            .expect("message");
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .and_then(|id| Uuid::parse_str(id.as_str()).ok())
            .expect("a message id");
        seen.insert(id);
    }
    assert_eq!(seen, expected, "the stream holds every id");
    js.delete_stream(&stream).await.expect("delete the stream");
    relay.terminate();
}
