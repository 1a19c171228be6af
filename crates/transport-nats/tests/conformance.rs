//! The transport conformance suite of `outboxkit-core` (`transport_conformance_tests!`)
//! run against the real NATS server with JetStream: every property on a stream and a
//! subject prefix of its own, consumed by one durable consumer, read back with raw
//! async-nats.

mod common;

use outboxkit_core::Consumer as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::transport_conformance::{
    ConsumerRun, ConsumerSettings, RawMessage, SOURCE, TransportHarness,
};
use outboxkit_core::wire::Binding;
use outboxkit_core::{
    BatchDeliveryHandler, BoxError, DeliveryHandler, ErrorKind, Headers, OutboxMessage,
};
use outboxkit_nats::{
    NatsConfig, NatsConsumer, NatsConsumerConfig, NatsError, NatsPublisher, StreamSetup,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// The durable consumer every run of a harness uses.
const DURABLE: &str = "conformance";

/// A stream capturing a subject prefix of its own, and a second prefix no stream
/// captures until [`TransportHarness::route`] creates one for a subject.
struct Nats {
    fx: Fixture,
    /// `test.<uuid>`, captured by no stream at first.
    unrouted: String,
    /// Streams created by `route`.
    routed: Mutex<Vec<String>>,
}

async fn harness() -> Nats {
    Nats {
        fx: Fixture::new().await,
        unrouted: format!("test.{}", Uuid::new_v4().simple()),
        routed: Mutex::new(Vec::new()),
    }
}

impl Nats {
    fn config(&self) -> NatsConfig {
        self.fx.config().with_source(Some(SOURCE.to_owned()))
    }

    async fn connect(&self, config: NatsConfig) -> NatsPublisher {
        NatsPublisher::connect(config)
            .await
            .expect("publisher connects")
    }

    fn unreachable(&self) -> outboxkit_nats::NatsConfig {
        NatsConfig::new("nats://app:hunter2@127.0.0.1:1")
            .with_connect_timeout(Duration::from_secs(2))
    }

    fn consumer(&self, settings: &ConsumerSettings) -> NatsConsumer {
        let mut builder = NatsConsumerConfig::new(self.fx.build(), &self.fx.stream, DURABLE)
            .with_nak_delays(vec![settings.requeue_delay])
            .with_concurrency(settings.concurrency)
            .with_batch(settings.batch)
            .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1));
        if let Some(ack_wait) = settings.ack_wait {
            builder = builder.with_ack_wait(ack_wait);
        }
        NatsConsumer::new(builder).expect("valid consumer")
    }

    async fn publish_raw(&self, headers: Option<async_nats::HeaderMap>, payload: &'static str) {
        let subject = format!("{}.Raw", self.fx.prefix);
        let ack = match headers {
            Some(headers) => {
                self.fx
                    .js
                    .publish_with_headers(subject, headers, payload.into())
                    .await
            }
            None => self.fx.js.publish(subject, payload.into()).await,
        };
        ack.expect("send").await.expect("PubAck");
    }
}

#[async_trait]
impl TransportHarness for Nats {
    type Publisher = NatsPublisher;

    const BINDING: Binding = Binding::Nats;
    const DELIVERY_COUNT: bool = true;
    const UNROUTABLE_REPLY: (u16, &'static str) = (503, "no JetStream stream");

    async fn publisher(&self) -> NatsPublisher {
        self.connect(self.config()).await
    }

    async fn publisher_with_max_payload(&self, max: usize) -> NatsPublisher {
        self.connect(self.config().with_max_payload_bytes(max))
            .await
    }

    async fn publisher_with_confirm_timeout(&self, timeout: Duration) -> NatsPublisher {
        self.connect(self.config().with_confirm_timeout(timeout))
            .await
    }

    async fn narrow_publisher(&self) -> NatsPublisher {
        self.connect(self.config().with_max_in_flight(8)).await
    }

    fn default_max_payload(&self, publisher: &NatsPublisher) -> usize {
        // The server's `max_payload`, from its INFO.
        publisher.max_message_bytes()
    }

    fn destination(&self, key: &str) -> String {
        format!("{}.{key}", self.fx.prefix)
    }

    fn invalid_messages(
        &self,
        valid: &dyn Fn() -> OutboxMessage,
    ) -> Vec<(&'static str, OutboxMessage)> {
        let keyed = |what, key: &str| {
            let mut msg = valid();
            msg.routing_key = Some(key.to_owned());
            (what, msg)
        };
        let headed = |what, name: &str, value: &str| {
            let mut msg = valid();
            msg.headers.insert(name.to_owned(), value.to_owned());
            (what, msg)
        };
        vec![
            keyed("space in the subject", "bad key"),
            keyed("wildcard * in the subject", "orders.*"),
            keyed("wildcard > in the subject", "orders.>"),
            keyed("empty subject token", "a..b"),
            keyed("trailing dot", "trailing."),
            keyed("tab in the subject", "tab\there"),
            headed(
                "a Nats-* header steering JetStream",
                "Nats-Expected-Stream",
                "OTHER",
            ),
            headed("colon in a header name", "x:y", "v"),
            headed("line break in a header value", "x", "line\r\nbreak"),
        ]
    }

    async fn unrouted_publisher(&self) -> NatsPublisher {
        self.connect(self.config().with_subject_prefix(&self.unrouted))
            .await
    }

    async fn route(&self, key: &str) {
        let name = format!("TEST_{}", Uuid::new_v4().simple());
        let setup = StreamSetup::new(&name).with_subject(format!("{}.{key}", self.unrouted));
        self.unrouted_publisher()
            .await
            .ensure_stream(&setup)
            .await
            .expect("stream for the routed subject");
        self.routed.lock().expect("lock").push(name);
    }

    async fn connect_unreachable(&self) -> Result<NatsPublisher, (ErrorKind, String)> {
        NatsPublisher::connect(self.unreachable())
            .await
            .map_err(|e| {
                assert!(
                    matches!(e, NatsError::Connect { .. } | NatsError::Timeout { .. }),
                    "a typed connect error: {e:?}"
                );
                (e.kind(), format!("{e} {e:?}"))
            })
    }

    async fn unreachable_publisher(&self) -> NatsPublisher {
        NatsPublisher::connect_lazy(self.unreachable())
            .await
            .expect("valid config")
    }

    async fn stored(&self) -> u64 {
        self.fx.stored().await
    }

    async fn read_raw(&self, n: usize) -> Vec<RawMessage> {
        let messages = self.fx.read_all().await;
        assert_eq!(messages.len(), n, "the stream holds exactly {n} messages");
        messages
            .into_iter()
            .map(|m| {
                let mut raw = RawMessage::new(m.subject.as_str(), m.payload.to_vec());
                raw.message_id = header(&m, "Nats-Msg-Id").map(str::to_owned);
                raw.content_type = header(&m, "Content-Type").map(str::to_owned);
                let mut headers = Headers::new();
                for (name, values) in m.headers.iter().flat_map(|h| h.iter()) {
                    if let Some(value) = values.first() {
                        headers.insert(name.to_string(), value.as_str().to_owned());
                    }
                }
                raw.headers = headers;
                raw
            })
            .collect()
    }

    async fn publish_undecodable(&self) -> u64 {
        // No headers at all.
        self.publish_raw(None, "not even json").await;
        // An id that is not a UUID.
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", "not-a-uuid");
        headers.insert("ce-type", "Raw");
        self.publish_raw(Some(headers), "{}").await;
        2
    }

    async fn publish_malformed(&self, id: Uuid) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.to_string().as_str());
        headers.insert("ce-type", "RawEvent");
        headers.insert("ce-aggregateversion", "1.0");
        let body = std::str::from_utf8(outboxkit_core::transport_conformance::MALFORMED_BODY)
            .expect("UTF-8");
        self.publish_raw(Some(headers), body).await;
    }

    async fn publish_foreign(&self, id: Uuid, event_type: &str, version: i64) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.to_string().as_str());
        headers.insert("ce-type", event_type);
        headers.insert("ce-aggregateversion", version.to_string().as_str());
        self.publish_raw(Some(headers), "{}").await;
    }

    async fn unacknowledged(&self) -> u64 {
        let info = self.fx.consumer_info(DURABLE).await;
        info.num_pending + info.num_ack_pending as u64
    }

    async fn dead_lettered(&self) -> Option<u64> {
        // `+TERM` drops a message: JetStream has no dead-letter stream of its own.
        None
    }

    fn run(
        &self,
        settings: &ConsumerSettings,
        handler: Arc<dyn DeliveryHandler>,
        shutdown: CancellationToken,
    ) -> ConsumerRun {
        let consumer = self.consumer(settings);
        Box::pin(async move {
            consumer
                .run(handler, shutdown)
                .await
                .map_err(BoxError::from)
        })
    }

    fn run_batched(
        &self,
        settings: &ConsumerSettings,
        handler: Arc<dyn BatchDeliveryHandler>,
        shutdown: CancellationToken,
    ) -> ConsumerRun {
        let consumer = self.consumer(settings);
        Box::pin(async move {
            consumer
                .run_batched(handler, shutdown)
                .await
                .map_err(BoxError::from)
        })
    }

    async fn cleanup(&self) {
        let routed: Vec<String> = self.routed.lock().expect("lock").drain(..).collect();
        for name in routed {
            let _ = self.fx.js.delete_stream(&name).await;
        }
        let _ = self.fx.js.delete_stream(&self.fx.stream).await;
    }
}

outboxkit_core::transport_conformance_tests!(harness);
