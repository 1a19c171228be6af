//! Exactly-once consumers on the 3-node clusters of `cargo xtask services --cluster`,
//! through node loss and a network partition, against the real PostgreSQL: 6,000
//! messages in a quorum queue (RabbitMQ) or an R3 stream (NATS JetStream) consumed by
//! an `IdempotentConsumer` whose handler adds 1 to a row per message; the node the
//! consumer is connected to is killed (`SIGKILL`) and started again; then 6,000 more,
//! and the node the consumer is on is cut off from the network (connections hang
//! without a reset) and joined again. Every message must have had its effect exactly
//! once: one row each, none counted twice.
//!
//! They need the clusters (`cargo xtask itest` starts them; otherwise they fail saying
//! how to start them), and take the machine-wide fault lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{Consumer, EventPublisher, OutboxMessage, PublishOutcome};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit_testkit::cluster::{self, Broker, NodeKilled, NodePartitioned};
use outboxkit_testkit::faults;
use sqlx::{AssertSqlSafe, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const MESSAGES: usize = 6_000;

/// Adds 1 to the message's row: a second effect of one message shows as 2.
struct Count(String);

#[async_trait]
impl Handler<PgInbox> for Count {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {0}.effects (message_id, n) VALUES ($1, 1) \
             ON CONFLICT (message_id) DO UPDATE SET n = {0}.effects.n + 1",
            self.0
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// A fresh schema with its inbox and an `effects` table.
struct Effects {
    schema: String,
    outbox: PgOutbox,
    inbox: Arc<PgInbox>,
}

impl Effects {
    async fn new() -> Self {
        let schema = format!("t_{}", Uuid::new_v4().simple());
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let config = PgConfig::new(url).with_schema(&schema);
        let outbox = PgOutbox::connect(&config).await.expect("PostgreSQL");
        outbox.migrate().await.expect("migrate");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {schema}.effects (message_id uuid PRIMARY KEY, n int NOT NULL)"
        )))
        .execute(outbox.pool())
        .await
        .expect("table");
        let inbox = Arc::new(
            PgOutbox::new(outbox.pool().clone(), &config)
                .expect("outbox")
                .inbox(),
        );
        Self {
            schema,
            outbox,
            inbox,
        }
    }

    fn handler(&self) -> IdempotentConsumer<PgInbox> {
        IdempotentConsumer::new(
            Arc::clone(&self.inbox),
            Pipeline::new().on("Counted", "counter", Count(self.schema.clone())),
            ConsumerConfig::new(),
        )
        .expect("valid consumer config")
    }

    /// Messages with an effect, and those with more than one.
    async fn tally(&self) -> (usize, usize) {
        let (rows, doubled): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(*) FILTER (WHERE n > 1) FROM {}.effects",
            self.schema
        )))
        .fetch_one(self.outbox.pool())
        .await
        .expect("tally");
        (
            usize::try_from(rows).expect("count"),
            usize::try_from(doubled).expect("count"),
        )
    }

    async fn reach(&self, n: usize, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let (rows, _) = self.tally().await;
            if rows >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}: {rows} of {n} messages had their effect"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn drop_schema(self) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(self.outbox.pool())
        .await
        .expect("drop schema");
    }
}

fn messages() -> Vec<OutboxMessage> {
    (0..MESSAGES)
        .map(|_| {
            let id = Uuid::now_v7();
            let msg = outboxkit_core::NewMessage::builder("counter", id.to_string(), "Counted")
                .id(id)
                .aggregate_version(1)
                .payload_json("{}")
                .build()
                .expect("valid");
            OutboxMessage::claimed_from(msg, chrono::Utc::now())
        })
        .collect()
}

/// Publishes every message, each batch again until all of it is confirmed.
async fn publish_all(publisher: &impl EventPublisher, messages: &[OutboxMessage]) {
    for chunk in messages.chunks(500) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !publisher
            .publish_batch(chunk)
            .await
            .iter()
            .all(|outcome| matches!(outcome, PublishOutcome::Published))
        {
            assert!(Instant::now() < deadline, "the cluster takes no messages");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The node this test process is connected to: its consumer's (each batch's publisher
/// is closed once the batch is confirmed).
async fn consumer_node(broker: Broker) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(node) = cluster::connected_node(std::process::id(), broker) {
            return node;
        }
        assert!(Instant::now() < deadline, "the consumer is not connected");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Publishes a batch of messages on a connection of its own, closed when done.
type Publish =
    Box<dyn Fn(Vec<OutboxMessage>) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// Publishes 6,000 messages and runs `consumer`, killing the node it is connected to
/// after a sixth of them have had their effect; once all have, publishes 6,000 more and
/// cuts off the node the consumer is on then, after another sixth. Then checks that each
/// message had its effect exactly once.
async fn ride_out_faults<C: Consumer + Send + Sync + 'static>(
    consumer: C,
    publish: Publish,
    effects: &Effects,
    broker: Broker,
) {
    publish(messages()).await;
    let token = CancellationToken::new();
    let handler = effects.handler();
    let running = tokio::spawn({
        let token = token.clone();
        async move { consumer.run(handler, token).await }
    });

    effects
        .reach(MESSAGES / 6, "the consumer is under way")
        .await;
    let node = consumer_node(broker).await;
    let killed = NodeKilled::kill(broker, node);
    effects
        .reach(
            MESSAGES,
            "every message had its effect after the consumer's node was killed",
        )
        .await;
    killed.restart();
    let moved_to = consumer_node(broker).await;
    eprintln!("consumer's node {node} killed; consumer moved to node {moved_to}");
    assert_ne!(moved_to, node, "the consumer moved to another node");

    publish(messages()).await;
    effects
        .reach(MESSAGES + MESSAGES / 6, "the second run is under way")
        .await;
    let on = consumer_node(broker).await;
    let cut = NodePartitioned::isolate(broker, on);
    let cut_at = Instant::now();
    let (before, _) = effects.tally().await;
    effects
        .reach(
            2 * MESSAGES,
            "every message had its effect after the partition",
        )
        .await;
    eprintln!(
        "consumer's node {on} cut off with {} messages to go; all had their effect {:.1} s later, on {:?}",
        2 * MESSAGES - before,
        cut_at.elapsed().as_secs_f64(),
        cluster::connected_nodes(std::process::id(), broker)
    );
    cut.heal();

    token.cancel();
    running.await.expect("join").expect("consumer");
    let (rows, doubled) = effects.tally().await;
    assert_eq!(rows, 2 * MESSAGES, "every message had its effect");
    assert_eq!(doubled, 0, "no message had its effect twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the broker clusters"]
async fn on_cluster_rabbit_consumer_rides_out_node_loss_and_partition_exactly_once() {
    use outboxkit_rabbit::{
        RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher, lapin,
    };

    let _lock = faults::lock().await;
    cluster::require();
    let effects = Effects::new().await;
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let queue = format!("{exchange}.q");
    let config = RabbitConfig::new(cluster::rabbit_urls()).with_exchange(&exchange);
    // A quorum queue: the consumer's default.
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(config.clone(), &queue).with_binding_key("#"),
    )
    .expect("consumer");
    consumer.declare().await.expect("declare");
    let publish: Publish = Box::new(move |messages| {
        let config = config.clone();
        Box::pin(async move {
            let publisher = RabbitPublisher::connect(config).await.expect("publisher");
            publish_all(&publisher, &messages).await;
            publisher.close().await;
        })
    });

    ride_out_faults(consumer, publish, &effects, Broker::Rabbit).await;

    let conn = lapin::Connection::connect(
        &cluster::rabbit_url(1),
        lapin::ConnectionProperties::default(),
    )
    .await
    .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
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
    effects.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the broker clusters"]
async fn on_cluster_nats_consumer_rides_out_node_loss_and_partition_exactly_once() {
    use outboxkit_nats::{
        NatsConfig, NatsConsumer, NatsConsumerConfig, NatsPublisher, StreamSetup, async_nats,
    };

    let _lock = faults::lock().await;
    cluster::require();
    let effects = Effects::new().await;
    let tag = Uuid::new_v4().simple().to_string();
    let stream = format!("TEST_{tag}");
    let config = NatsConfig::new(cluster::nats_urls()).with_subject_prefix(format!("test.{tag}"));
    StreamSetup::for_config(&stream, &config)
        .with_replicas(3)
        .apply(&config)
        .await
        .expect("an R3 stream");
    let consumer = NatsConsumer::new(NatsConsumerConfig::new(config.clone(), &stream, "counter"))
        .expect("consumer");
    consumer.declare().await.expect("declare");
    let publish: Publish = Box::new(move |messages| {
        let config = config.clone();
        Box::pin(async move {
            let publisher = NatsPublisher::connect(config).await.expect("publisher");
            publish_all(&publisher, &messages).await;
            publisher.close().await;
        })
    });

    ride_out_faults(consumer, publish, &effects, Broker::Nats).await;

    let servers: Vec<String> = cluster::nats_urls().split(',').map(str::to_owned).collect();
    let client = async_nats::connect(servers).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    // The JetStream API may time out for a moment after the cluster healed.
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = js.delete_stream(&stream).await {
        assert!(Instant::now() < deadline, "delete the stream: {e}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    effects.drop_schema().await;
}
