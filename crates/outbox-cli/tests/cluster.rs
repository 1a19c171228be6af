//! `outbox relay` on the 3-node clusters of `cargo xtask services --cluster`, through
//! node loss and network partitions, against the real PostgreSQL:
//!
//! - RabbitMQ, a quorum queue: the node holding the queue's leader killed (`SIGKILL`)
//!   during a 20,000-message run and started again, then the node the relay is
//!   connected to killed during a second 20,000-message run; and, in another test, the
//!   relay's node cut off from the network (its namespace's link down: connections hang
//!   without a reset) during a run.
//! - NATS JetStream, an R3 stream: the node holding the stream's leader killed during a
//!   20,000-message run and started again; and the relay's node cut off during a run.
//!
//! Each ends with every row `Sent`, none `Dead`, the relay on another node where its own
//! was lost, and every id in the queue (duplicates allowed: a publish whose confirm was
//! lost with a node is sent again) or in the stream exactly once (`Nats-Msg-Id`
//! deduplication).
//!
//! They need the clusters (`cargo xtask itest` starts them; otherwise they fail saying
//! how to start them), and take the machine-wide fault lock.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{RelayProcess, enqueue, fresh_outbox, message, scalar, wait_until};
use futures::StreamExt as _;
use outboxkit_nats::async_nats;
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::lapin;
use outboxkit_testkit::cluster::{self, Broker, NodeKilled, NodePartitioned};
use outboxkit_testkit::faults;
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

async fn sent(db: &PgOutbox) -> usize {
    count(db, 1).await
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

async fn enqueue_many(db: &PgOutbox, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(2_000) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|i| message("Clustered", "t", &i.to_string()))
            .collect();
        enqueue(db, &batch).await;
    }
}

/// `outbox relay` over every node of `broker`'s cluster, with short timeouts.
fn start_relay(db: &PgOutbox, broker: Broker, destination: &[&str]) -> RelayProcess {
    let (transport, urls) = match broker {
        Broker::Rabbit => ("rabbit", cluster::rabbit_urls()),
        Broker::Nats => ("nats", cluster::nats_urls()),
    };
    let mut args = vec![
        "--transport",
        transport,
        "--broker-url",
        &urls,
        "--connect-timeout",
        "2s",
        "--confirm-timeout",
        "5s",
    ];
    args.extend_from_slice(destination);
    RelayProcess::start(db, &args)
}

async fn sent_reaches(db: &PgOutbox, relay: &RelayProcess, n: usize, what: &str) {
    wait_until(relay, Duration::from_secs(180), what, || async {
        sent(db).await >= n
    })
    .await;
}

/// The node the relay is connected to, once it is.
async fn relay_node(relay: &RelayProcess, broker: Broker) -> usize {
    let pid = relay.pid();
    wait_until(
        relay,
        Duration::from_secs(30),
        "the relay is connected",
        || async move { cluster::connected_node(pid, broker).is_some() },
    )
    .await;
    cluster::connected_node(pid, broker).expect("connected")
}

/// Every row `Sent` and none `Dead`.
async fn all_sent_none_dead(db: &PgOutbox, total: usize) {
    assert_eq!(sent(db).await, total, "every row Sent");
    assert_eq!(count(db, 3).await, 0, "none Dead");
}

/// An exchange and a quorum queue bound to it with `#`, declared on node `node`: a
/// quorum queue's leader goes to the node its declaring client is connected to.
struct QuorumQueue {
    exchange: String,
    queue: String,
}

impl QuorumQueue {
    async fn declare(node: usize) -> Self {
        let tag = Uuid::new_v4().simple().to_string();
        let this = Self {
            exchange: format!("t.{tag}"),
            queue: format!("t.{tag}.q"),
        };
        let conn = lapin::Connection::connect(
            &cluster::rabbit_url(node),
            lapin::ConnectionProperties::default(),
        )
        .await
        .expect("connect to a RabbitMQ node");
        let channel = conn.create_channel().await.expect("channel");
        channel
            .exchange_declare(
                this.exchange.as_str().into(),
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
                this.queue.as_str().into(),
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
                this.queue.as_str().into(),
                this.exchange.as_str().into(),
                "#".into(),
                lapin::options::QueueBindOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .expect("bind");
        conn.close(200, "OK".into()).await.expect("close");
        this
    }

    async fn leader(&self) -> usize {
        let queue = self.queue.clone();
        cluster::wait_for_leader(Duration::from_secs(30), move || {
            cluster::quorum_leader(&queue)
        })
        .await
        .expect("the quorum queue has a leader")
    }

    /// Reads the queue from node `node` until it has seen every id of `expected`, then
    /// deletes the queue and the exchange.
    async fn holds_every_id(self, node: usize, expected: &HashSet<Uuid>) {
        let conn = lapin::Connection::connect(
            &cluster::rabbit_url(node),
            lapin::ConnectionProperties::default(),
        )
        .await
        .expect("connect to a RabbitMQ node");
        let channel = conn.create_channel().await.expect("channel");
        channel
            .basic_qos(2_000, lapin::options::BasicQosOptions::default())
            .await
            .expect("qos");
        let mut deliveries = channel
            .basic_consume(
                self.queue.as_str().into(),
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
                        "only {} of {} ids in the queue ({total} messages)",
                        seen.len(),
                        expected.len(),
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
        assert_eq!(&seen, expected, "the queue holds every id");
        eprintln!("queue: {total} messages for {} ids", seen.len());
        channel
            .queue_delete(
                self.queue.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await
            .expect("delete queue");
        channel
            .exchange_delete(
                self.exchange.as_str().into(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await
            .expect("delete exchange");
    }
}

/// An R3 stream capturing `test.TAG.>`.
struct R3Stream {
    name: String,
    prefix: String,
}

fn nats_servers() -> Vec<String> {
    cluster::nats_urls().split(',').map(str::to_owned).collect()
}

impl R3Stream {
    async fn create() -> Self {
        let tag = Uuid::new_v4().simple().to_string();
        let this = Self {
            name: format!("TEST_{tag}"),
            prefix: format!("test.{tag}"),
        };
        let config =
            outboxkit_nats::NatsConfig::new(cluster::nats_urls()).with_subject_prefix(&this.prefix);
        outboxkit_nats::StreamSetup::for_config(&this.name, &config)
            .with_replicas(3)
            .apply(&config)
            .await
            .expect("an R3 stream");
        this
    }

    async fn leader(&self) -> usize {
        let name = self.name.clone();
        cluster::wait_for_leader(Duration::from_secs(30), move || {
            cluster::stream_leader(&name)
        })
        .await
        .expect("the stream has a leader")
    }

    /// Checks that the stream stored each id of `expected` exactly once, then deletes it.
    async fn holds_every_id_once(self, expected: &HashSet<Uuid>) {
        let client = async_nats::connect(nats_servers()).await.expect("connect");
        let js = async_nats::jetstream::new(client);
        let mut stream = js.get_stream(&self.name).await.expect("stream");
        // The stream's leader answers; one elected after the kill may answer before it
        // caught up with the replicas that hold every message (seen once in CI: 819 of
        // 20,000 right after the restart). A lost message never comes back, so the
        // count must reach every id within the wait.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let mut stored = 0;
        loop {
            match stream.info().await {
                Ok(info) => {
                    stored = info.state.messages;
                    if stored == expected.len() as u64 {
                        break;
                    }
                    eprintln!(
                        "stream {}: {stored} messages stored, {} expected; waiting for its replicas",
                        self.name,
                        expected.len()
                    );
                }
                Err(e) => eprintln!("stream info: {e}; again"),
            }
            if std::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(stored, expected.len() as u64, "each id stored once");
        // JetStream may answer 503 for a moment after a node rejoined.
        let mut attempts = 0;
        let consumer = loop {
            match stream
                .create_consumer(async_nats::jetstream::consumer::pull::Config {
                    ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
                    ..Default::default()
                })
                .await
            {
                Ok(consumer) => break consumer,
                Err(e) if attempts < 60 => {
                    attempts += 1;
                    eprintln!("creating the reader: {e}; again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("reader: {e}"),
            }
        };
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
        assert_eq!(&seen, expected, "the stream holds every id");
        // A delete whose answer was lost (a timeout while the meta leader moves after
        // the partition healed) may have deleted the stream: every later attempt then
        // answers "stream not found" (seen here for a whole minute). Gone is done, when
        // the stream cannot be looked up either.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while let Err(e) = js.delete_stream(&self.name).await {
            let not_found = matches!(
                e.kind(),
                async_nats::jetstream::context::DeleteStreamErrorKind::JetStream(ref api)
                    if api.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
            );
            if not_found && js.get_stream(&self.name).await.is_err() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "delete the stream: {e}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Enqueues a 20,000-message run for `relay` and cuts the node it is connected to off
/// once 2,000 are sent; waits until every message is sent, checks that the relay moved
/// to another node, heals the partition and checks that every row is `Sent` and none
/// `Dead`. Returns the node that was cut off.
async fn relay_rides_out_its_node_cut_off(
    db: &PgOutbox,
    relay: &RelayProcess,
    broker: Broker,
) -> usize {
    let relay_node = relay_node(relay, broker).await;
    enqueue_many(db, MESSAGES).await;
    sent_reaches(db, relay, 2_000, "the relay is under way").await;
    let at_cut = sent(db).await;
    let cut = NodePartitioned::isolate(broker, relay_node);
    let cut_at = std::time::Instant::now();
    sent_reaches(
        db,
        relay,
        MESSAGES,
        "every message is sent after the relay's node was cut off",
    )
    .await;
    let moved_to = cluster::connected_nodes(relay.pid(), broker);
    eprintln!(
        "{broker:?}: the relay's node {relay_node} cut off after {at_cut} sent; all sent {:.1} s later; relay now on {moved_to:?}",
        cut_at.elapsed().as_secs_f64(),
    );
    assert!(
        moved_to.iter().any(|node| *node != relay_node),
        "the relay moved to another node: {moved_to:?}"
    );
    cut.heal();
    all_sent_none_dead(db, MESSAGES).await;
    relay_node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the broker clusters"]
async fn on_cluster_rabbit_quorum_leader_and_relay_node_lost_nothing_dead_every_id_queued() {
    let _lock = faults::lock().await;
    cluster::require();
    let db = fresh_outbox().await;
    // Declared on node 2, so the relay (node 1 first) and the leader start apart.
    let queue = QuorumQueue::declare(2).await;
    let leader = queue.leader().await;

    enqueue_many(&db, MESSAGES).await;
    let relay = start_relay(&db, Broker::Rabbit, &["--exchange", &queue.exchange]);
    sent_reaches(&db, &relay, 500, "the relay is under way").await;
    let killed = NodeKilled::kill(Broker::Rabbit, leader);
    let at_kill = sent(&db).await;
    sent_reaches(
        &db,
        &relay,
        (at_kill + 2_000).min(MESSAGES),
        "progress after the leader was killed",
    )
    .await;
    eprintln!(
        "leader node {leader} killed after {at_kill} sent; new leader {:?}",
        cluster::quorum_leader(&queue.queue)
    );
    killed.restart();

    let relay_node = relay_node(&relay, Broker::Rabbit).await;
    // A second run, so that the relay's node goes while the relay publishes to it.
    enqueue_many(&db, MESSAGES).await;
    sent_reaches(&db, &relay, MESSAGES + 2_000, "the second run is under way").await;
    let at_kill = sent(&db).await;
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

    all_sent_none_dead(&db, 2 * MESSAGES).await;
    let other = if relay_node == 3 { 1 } else { 3 };
    queue.holds_every_id(other, &ids(&db).await).await;
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the broker clusters"]
async fn on_cluster_rabbit_relay_node_partitioned_relay_moves_on_nothing_dead_every_id_queued() {
    let _lock = faults::lock().await;
    cluster::require();
    let db = fresh_outbox().await;
    let queue = QuorumQueue::declare(1).await;
    let relay = start_relay(&db, Broker::Rabbit, &["--exchange", &queue.exchange]);
    let relay_node = relay_rides_out_its_node_cut_off(&db, &relay, Broker::Rabbit).await;
    queue.holds_every_id(relay_node, &ids(&db).await).await;
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the broker clusters"]
async fn on_cluster_nats_r3_stream_leader_lost_nothing_dead_every_id_stored_once() {
    let _lock = faults::lock().await;
    cluster::require();
    let db = fresh_outbox().await;
    let stream = R3Stream::create().await;
    let leader = stream.leader().await;

    enqueue_many(&db, MESSAGES).await;
    let relay = start_relay(&db, Broker::Nats, &["--subject-prefix", &stream.prefix]);
    sent_reaches(&db, &relay, 500, "the relay is under way").await;
    let killed = NodeKilled::kill(Broker::Nats, leader);
    let at_kill = sent(&db).await;
    sent_reaches(
        &db,
        &relay,
        MESSAGES,
        "every message is sent after the leader was killed",
    )
    .await;
    eprintln!(
        "stream leader node {leader} killed after {at_kill} sent; new leader {:?}",
        cluster::stream_leader(&stream.name)
    );
    killed.restart();

    all_sent_none_dead(&db, MESSAGES).await;
    stream.holds_every_id_once(&ids(&db).await).await;
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the broker clusters"]
async fn on_cluster_nats_relay_node_partitioned_relay_moves_on_nothing_dead_every_id_stored_once() {
    let _lock = faults::lock().await;
    cluster::require();
    let db = fresh_outbox().await;
    let stream = R3Stream::create().await;
    let relay = start_relay(&db, Broker::Nats, &["--subject-prefix", &stream.prefix]);
    relay_rides_out_its_node_cut_off(&db, &relay, Broker::Nats).await;
    stream.holds_every_id_once(&ids(&db).await).await;
    relay.terminate();
}
