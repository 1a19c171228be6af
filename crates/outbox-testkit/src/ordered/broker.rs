//! The brokers the ordered-delivery suite runs over: [`Rabbit`] (an exchange and a bound
//! queue of its own, read by a lapin consumer) and [`Nats`] (a JetStream stream and
//! subject prefix of its own, read by an ordered JetStream consumer). Both record every
//! delivery in the order the broker hands them out, which is the order it accepted them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt as _;
use lapin::types::FieldTable;
use outboxkit_core::EventPublisher;
use outboxkit_nats::async_nats::{self, jetstream};
use outboxkit_nats::{NatsConfig, NatsPublisher, StreamSetup};
use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};
use tokio::task::JoinHandle;

use crate::rabbit::{Fixture, amqp_url, fixture};

/// One delivery as the suite's consumer saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// The outbox message id (AMQP `message_id`, NATS `Nats-Msg-Id`).
    pub id: String,
    /// The payload's `key` (see [`keyed`](outboxkit_core::conformance::keyed)).
    pub key: String,
    /// The payload's `n`, the message's position within its key (`u64::MAX` if absent).
    pub n: u64,
}

impl Arrival {
    fn decode(id: String, payload: &[u8]) -> Self {
        let body: serde_json::Value = serde_json::from_slice(payload).expect("JSON payload");
        Self {
            id,
            key: body["key"].as_str().unwrap_or_default().to_owned(),
            n: body["n"].as_u64().unwrap_or(u64::MAX),
        }
    }
}

/// Every delivery so far, in arrival order, appended by the consumer's task.
pub type Arrivals = Arc<Mutex<Vec<Arrival>>>;

/// A broker the ordered-delivery suite runs over: a destination isolated from every
/// other test, publishers of the relay's transport writing to it, and a consumer that
/// records each delivery in arrival order.
#[async_trait]
pub trait Broker: Sized + Send + Sync + 'static {
    /// The relay's publisher for this broker.
    type Publisher: EventPublisher + 'static;

    /// Whether the broker itself drops a message whose id it stored moments ago, so a
    /// republished message arrives once (JetStream's duplicate window); otherwise
    /// (RabbitMQ) the consumer receives it again.
    const DROPS_REPUBLISHED: bool;

    /// A fresh destination with its consumer already recording. The destination MUST
    /// receive nothing but what this test's publishers send, so tests run in parallel;
    /// the consumer MUST record every delivery in the order the broker hands them out
    /// (the order it accepted them) and MUST NOT reorder or drop any. Panics if the
    /// broker is unreachable.
    async fn setup() -> Self;

    /// What the consumer received so far, in arrival order.
    fn arrivals(&self) -> &Arrivals;

    /// A new publisher (its own connection) writing to this destination.
    async fn publisher(&self) -> Arc<Self::Publisher>;

    /// Stops the consumer and removes what [`setup`](Self::setup) created on the broker.
    async fn cleanup(self);
}

/// RabbitMQ at `AMQP_URL`: a topic exchange `t.<uuid>` (auto-deleted) and a queue bound
/// to `#` (expires a minute after its last use), consumed with acks by a lapin consumer.
pub struct Rabbit {
    fx: Fixture,
    arrivals: Arrivals,
}

#[async_trait]
impl Broker for Rabbit {
    type Publisher = RabbitPublisher;
    const DROPS_REPUBLISHED: bool = false;

    async fn setup() -> Self {
        let fx = fixture(true, FieldTable::default()).await;
        let arrivals = Arrivals::default();
        let sink = Arc::clone(&arrivals);
        fx.consume(move |id, body| sink.lock().expect("lock").push(Arrival::decode(id, body)))
            .await;
        Self { fx, arrivals }
    }

    fn arrivals(&self) -> &Arrivals {
        &self.arrivals
    }

    async fn publisher(&self) -> Arc<RabbitPublisher> {
        let config = RabbitConfig::new(amqp_url())
            .with_exchange(&self.fx.exchange)
            .with_declare_exchange(false);
        Arc::new(RabbitPublisher::connect(config).await.expect("publisher"))
    }

    async fn cleanup(self) {
        // The consumer's channel closes with the connection: the auto-delete queue goes,
        // and with it the auto-delete exchange.
        let _ = self.fx.conn.close(200, "test done".into()).await;
    }
}

/// Streams this suite creates are named `ORDERED_<uuid>`.
const STREAM_PREFIX: &str = "ORDERED_";

/// How long a stream keeps a message: bounds what a test process killed before its
/// cleanup leaves on the server (its stream itself is swept an hour later).
const STREAM_MAX_AGE: Duration = Duration::from_secs(15 * 60);

/// NATS JetStream at `NATS_URL` (default `nats://127.0.0.1:4222`): a stream
/// `ORDERED_<uuid>` (file storage, 2-minute duplicate window, 15-minute max age)
/// capturing `ordered.<uuid>.>`, read from the start by an ordered consumer (no acks,
/// stream order). [`cleanup`](Broker::cleanup) deletes the stream, and so does dropping
/// it while the test panics; streams of earlier runs older than an hour (a killed test
/// process) are deleted at the first setup of a test binary.
pub struct Nats {
    stream: String,
    config: NatsConfig,
    js: jetstream::Context,
    arrivals: Arrivals,
    consumer: JoinHandle<()>,
}

/// `NATS_URL` (the test environment's setting, not the library's `OUTBOX_BROKER_URL`),
/// or the local server.
fn nats_url() -> String {
    std::env::var("NATS_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| outboxkit_nats::config::DEFAULT_URL.to_owned())
}

#[async_trait]
impl Broker for Nats {
    type Publisher = NatsPublisher;
    const DROPS_REPUBLISHED: bool = true;

    async fn setup() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let stream = format!("{STREAM_PREFIX}{id}");
        let config = NatsConfig::new(nats_url())
            .with_subject_prefix(format!("ordered.{id}"))
            .with_connection_name(format!("ordered-{id}"));
        let client = async_nats::connect(nats_url())
            .await
            .expect("connect to NATS (is it running? `cargo xtask services`)");
        let js = jetstream::new(client);
        sweep_old_streams(&js).await;
        StreamSetup::for_config(&stream, &config)
            .with_max_age(STREAM_MAX_AGE)
            .apply_with(&js, Duration::from_secs(10))
            .await
            .expect("create the test stream");

        let messages = js
            .get_stream(&stream)
            .await
            .expect("get stream")
            .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
            .await
            .expect("ordered consumer")
            .messages()
            .await
            .expect("message stream");
        let arrivals = Arrivals::default();
        let sink = Arc::clone(&arrivals);
        let consumer = tokio::spawn(async move {
            let mut messages = messages;
            while let Some(next) = messages.next().await {
                // The ordered consumer recreates itself after a gap or a missed
                // heartbeat and reports it as an error; the next message follows.
                let Ok(message) = next else { continue };
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(outboxkit_nats::publisher::MSG_ID_HEADER))
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                sink.lock()
                    .expect("lock")
                    .push(Arrival::decode(id, &message.payload));
            }
        });
        Self {
            stream,
            config,
            js,
            arrivals,
            consumer,
        }
    }

    fn arrivals(&self) -> &Arrivals {
        &self.arrivals
    }

    async fn publisher(&self) -> Arc<NatsPublisher> {
        Arc::new(
            NatsPublisher::connect(self.config.clone())
                .await
                .expect("publisher"),
        )
    }

    async fn cleanup(self) {
        self.consumer.abort();
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

impl Drop for Nats {
    /// A test that failed before [`cleanup`](Broker::cleanup) deletes its stream here,
    /// from a thread of its own: the test's runtime is unwinding and may not run tasks.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        self.consumer.abort();
        let stream = self.stream.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let client = async_nats::connect(nats_url()).await.ok()?;
                jetstream::new(client).delete_stream(&stream).await.ok()
            })
        })
        .join();
    }
}

/// Deletes `ORDERED_*` streams created more than an hour ago (left by earlier runs that
/// failed before their cleanup; never by a test still running). Once per test binary.
async fn sweep_old_streams(js: &jetstream::Context) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            let mut names = js.stream_names();
            let mut old = Vec::new();
            while let Some(Ok(name)) = names.next().await {
                if !name.starts_with(STREAM_PREFIX) {
                    continue;
                }
                if let Ok(mut stream) = js.get_stream(&name).await
                    && let Ok(info) = stream.info().await
                    && now - info.created.unix_timestamp() > 3600
                {
                    old.push(name);
                }
            }
            for name in old {
                let _ = js.delete_stream(&name).await;
            }
        })
        .await;
}
