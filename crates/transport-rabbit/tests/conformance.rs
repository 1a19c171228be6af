//! The transport conformance suite of `outboxkit-core` (`transport_conformance_tests!`)
//! run against the real RabbitMQ: every property on an exchange and a queue of its own
//! (with a dead-letter exchange and queue), read back with raw lapin.

mod common;

use outboxkit_core::Consumer as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt as _;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use outboxkit_core::transport_conformance::{
    ConsumerRun, ConsumerSettings, DEADLINE, RawMessage, SOURCE, TransportHarness,
};
use outboxkit_core::wire::Binding;
use outboxkit_core::{
    BatchDeliveryHandler, BoxError, DeliveryHandler, ErrorKind, Headers, OutboxMessage,
};
use outboxkit_rabbit::{
    RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitError, RabbitPublisher,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// An exchange and a queue bound to `#` of their own (the queue dead-letters to a
/// fanout exchange with a queue of its own), and a second exchange with no queue until
/// [`TransportHarness::route`] binds one.
struct Rabbit {
    exchange: String,
    queue: String,
    dlx: String,
    dlq: String,
    unrouted: String,
    unrouted_queues: Mutex<Vec<String>>,
    channel: Channel,
    /// In confirm mode, for the raw publishes.
    confirms: Channel,
    connection: Connection,
}

async fn harness() -> Rabbit {
    let connection = raw_connection().await;
    let channel = raw_channel(&connection).await;
    let confirms = raw_channel(&connection).await;
    confirms
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    let h = Rabbit {
        exchange: unique("conformance"),
        queue: unique("conformance.q"),
        dlx: unique("conformance.dlx"),
        dlq: unique("conformance.dlq"),
        unrouted: unique("conformance.unrouted"),
        unrouted_queues: Mutex::new(Vec::new()),
        channel,
        confirms,
        connection,
    };
    declare_exchange(&h.channel, &h.dlx, ExchangeKind::Fanout).await;
    bind_queue(&h.channel, &h.dlx, &h.dlq, "").await;
    h.consumer(&ConsumerSettings::default())
        .declare()
        .await
        .expect("exchange and queue");
    h
}

impl Rabbit {
    fn config(&self, exchange: &str) -> RabbitConfig {
        config(exchange).with_source(Some(SOURCE.to_owned()))
    }

    async fn connect(&self, config: RabbitConfig) -> RabbitPublisher {
        RabbitPublisher::connect(build(config))
            .await
            .expect("publisher connects")
    }

    fn unreachable(&self) -> RabbitConfig {
        RabbitConfig::new("amqp://guest:hunter2@127.0.0.1:1/%2f")
            .with_connect_timeout(Duration::from_secs(2))
    }

    fn consumer(&self, settings: &ConsumerSettings) -> RabbitConsumer {
        RabbitConsumer::new(
            RabbitConsumerConfig::new(build(config(&self.exchange)), self.queue.clone())
                .with_binding_key("#")
                .with_dead_letter_exchange(self.dlx.clone())
                .with_queue_arguments(expiring(FieldTable::default()))
                .with_prefetch(u16::try_from(settings.concurrency).expect("a prefetch"))
                .with_requeue_delay(settings.requeue_delay)
                .with_batch(settings.batch)
                .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1)),
        )
        .expect("valid consumer")
    }

    async fn publish_raw(&self, routing_key: &str, body: &[u8], properties: BasicProperties) {
        let confirm = self
            .confirms
            .basic_publish(
                self.exchange.as_str().into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .expect("basic.publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "{confirm:?}");
    }
}

/// Application headers as text; every header our publisher writes is a long string.
fn header_strings(properties: &BasicProperties) -> Headers {
    let mut headers = Headers::new();
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            match value {
                AMQPValue::LongString(s) => {
                    let text = std::str::from_utf8(s.as_bytes()).expect("UTF-8 header");
                    headers.insert(name.to_string(), text.to_owned());
                }
                other => panic!("header {name} is not a long string: {other:?}"),
            }
        }
    }
    headers
}

#[async_trait]
impl TransportHarness for Rabbit {
    type Publisher = RabbitPublisher;

    const BINDING: Binding = Binding::Amqp;
    // Classic queues report only the `redelivered` flag.
    const DELIVERY_COUNT: bool = false;
    const UNROUTABLE_REPLY: (u16, &'static str) = (312, "NO_ROUTE");

    async fn publisher(&self) -> RabbitPublisher {
        self.connect(self.config(&self.exchange)).await
    }

    async fn publisher_with_max_payload(&self, max: usize) -> RabbitPublisher {
        self.connect(self.config(&self.exchange).with_max_payload_bytes(max))
            .await
    }

    async fn publisher_with_confirm_timeout(&self, timeout: Duration) -> RabbitPublisher {
        self.connect(self.config(&self.exchange).with_confirm_timeout(timeout))
            .await
    }

    async fn narrow_publisher(&self) -> RabbitPublisher {
        self.connect(self.config(&self.exchange).with_channels(2))
            .await
    }

    fn default_max_payload(&self, publisher: &RabbitPublisher) -> usize {
        publisher.config().max_payload_bytes()
    }

    fn destination(&self, key: &str) -> String {
        key.to_owned()
    }

    fn invalid_messages(
        &self,
        valid: &dyn Fn() -> OutboxMessage,
    ) -> Vec<(&'static str, OutboxMessage)> {
        let mut long_key = valid();
        long_key.routing_key = Some("k".repeat(256));
        let mut long_header_name = valid();
        long_header_name.headers.insert("h".repeat(300), "v".into());
        // Larger than an AMQP frame: the headers must fit the content header frame.
        let mut huge_headers = valid();
        huge_headers
            .headers
            .insert("big".into(), "v".repeat(200_000));
        vec![
            ("routing key over 255 bytes", long_key),
            ("header name over 255 bytes", long_header_name),
            ("headers larger than a frame", huge_headers),
        ]
    }

    async fn unrouted_publisher(&self) -> RabbitPublisher {
        self.connect(self.config(&self.unrouted)).await
    }

    async fn route(&self, key: &str) {
        let queue = unique("conformance.routed.q");
        bind_queue(&self.channel, &self.unrouted, &queue, key).await;
        self.unrouted_queues.lock().expect("lock").push(queue);
    }

    async fn connect_unreachable(&self) -> Result<RabbitPublisher, (ErrorKind, String)> {
        RabbitPublisher::connect(build(self.unreachable()))
            .await
            .map_err(|e| {
                assert!(
                    matches!(
                        e,
                        RabbitError::Connect { .. } | RabbitError::ConnectTimeout { .. }
                    ),
                    "a typed connect error: {e:?}"
                );
                (e.kind(), format!("{e} {e:?}"))
            })
    }

    async fn unreachable_publisher(&self) -> RabbitPublisher {
        RabbitPublisher::connect_lazy(self.unreachable())
            .await
            .expect("valid config")
    }

    async fn stored(&self) -> u64 {
        queue_len(&self.channel, &self.queue).await.into()
    }

    async fn read_raw(&self, n: usize) -> Vec<RawMessage> {
        let channel = raw_channel(&self.connection).await;
        let mut consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("basic.consume");
        let deadline = tokio::time::Instant::now() + DEADLINE;
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let delivery = tokio::time::timeout_at(deadline, consumer.next())
                .await
                .expect("every message arrives before the deadline")
                .expect("consumer stream open")
                .expect("delivery");
            assert_eq!(delivery.exchange.as_str(), self.exchange);
            let p = &delivery.properties;
            let mut raw = RawMessage::new(delivery.routing_key.as_str(), delivery.data.clone());
            raw.message_id = p.message_id().as_ref().map(ToString::to_string);
            raw.content_type = p.content_type().as_ref().map(ToString::to_string);
            raw.headers = header_strings(p);
            out.push(raw);
        }
        let _ = channel.close(200, "read".into()).await;
        out
    }

    async fn publish_undecodable(&self) -> u64 {
        // No message id, no CloudEvents headers.
        self.publish_raw("Garbage", b"not even json", BasicProperties::default())
            .await;
        // A message id that is not a UUID.
        self.publish_raw(
            "Garbage",
            b"{}",
            BasicProperties::default().with_message_id("not-a-uuid".into()),
        )
        .await;
        2
    }

    async fn publish_malformed(&self, id: Uuid) {
        let mut headers = FieldTable::default();
        headers.insert(
            "cloudEvents:type".into(),
            AMQPValue::LongString("RawEvent".into()),
        );
        headers.insert(
            "cloudEvents:aggregateversion".into(),
            AMQPValue::LongString("1.0".into()),
        );
        self.publish_raw(
            "RawEvent",
            outboxkit_core::transport_conformance::MALFORMED_BODY,
            BasicProperties::default()
                .with_message_id(id.to_string().into())
                .with_headers(headers),
        )
        .await;
    }

    async fn publish_foreign(&self, id: Uuid, event_type: &str, version: i64) {
        // The id only in the property, the version as an integer header. (No short-string
        // header: RabbitMQ reads field type `s` as a 16-bit integer and fails the
        // connection.)
        let mut headers = FieldTable::default();
        headers.insert(
            "cloudEvents:type".into(),
            AMQPValue::LongString(event_type.into()),
        );
        headers.insert(
            "cloudEvents:aggregateversion".into(),
            AMQPValue::LongInt(i32::try_from(version).expect("a small version")),
        );
        self.publish_raw(
            event_type,
            b"{}",
            BasicProperties::default()
                .with_message_id(id.to_string().into())
                .with_headers(headers),
        )
        .await;
    }

    async fn unacknowledged(&self) -> u64 {
        // Unacknowledged deliveries are back in the queue once the consumer's channel is
        // closed.
        queue_len(&self.channel, &self.queue).await.into()
    }

    async fn dead_lettered(&self) -> Option<u64> {
        Some(queue_len(&self.channel, &self.dlq).await.into())
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
        let mut queues = vec![self.queue.clone(), self.dlq.clone()];
        queues.extend(self.unrouted_queues.lock().expect("lock").drain(..));
        let queues: Vec<&str> = queues.iter().map(String::as_str).collect();
        cleanup(
            &self.channel,
            &[&self.exchange, &self.dlx, &self.unrouted],
            &queues,
        )
        .await;
    }
}

outboxkit_core::transport_conformance_tests!(harness);
