//! The broker ceilings: the raw client publishing what the relay publishes, pipelined,
//! without a database (RabbitMQ: lapin with publisher confirms; NATS: async-nats
//! JetStream awaiting PubAcks).

use std::future::IntoFuture;
use std::time::{Duration, Instant};

use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use outbox_core::{NewMessage, OutboxMessage};
use transport_nats::async_nats;
use transport_nats::async_nats::jetstream;

use super::Args;
use crate::common;

/// The properties and headers the relay's publisher sends for a `BenchEvent` (CloudEvents
/// attributes as AMQP long-string headers), so the ceiling publishes identical messages.
pub(super) fn same_properties_as_the_relay(body: &[u8]) -> BasicProperties {
    let msg = OutboxMessage::claimed_from(
        NewMessage::builder("bench", "0", "BenchEvent")
            .payload_json(String::from_utf8_lossy(body).into_owned())
            .build()
            .expect("the bench payload is JSON"),
        chrono::Utc::now(),
    );
    let mut headers = std::collections::BTreeMap::new();
    for (name, value) in
        outbox_core::wire::encode_headers(&msg, outbox_core::wire::Binding::Amqp, None)
    {
        headers.insert(name.into(), AMQPValue::LongString(value.into()));
    }
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(msg.id.to_string().into())
        .with_timestamp(u64::try_from(msg.occurred_at.timestamp()).unwrap_or(0))
        .with_type("BenchEvent".into())
        .with_headers(FieldTable::from(headers))
}

/// Raw lapin: `concurrency` channels, each publishing windows of `batch_size` messages
/// and then awaiting their confirms together.
pub(super) async fn rabbit_ceiling(
    args: &Args,
    exchange: &str,
    body: &[u8],
    bare: bool,
) -> anyhow::Result<Duration> {
    let conn = common::amqp_connect().await?;
    let per_channel = args.messages.div_ceil(args.concurrency);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.concurrency {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let exchange = exchange.to_owned();
        let body = body.to_vec();
        let batch = args.batch_size;
        let count = per_channel.min(args.messages - c * per_channel);
        tasks.push(tokio::spawn(async move {
            let mut sent = 0;
            while sent < count {
                let window = batch.min(count - sent);
                // Each send is polled once as soon as it is built (queuing its frames
                // for lapin's I/O thread), then all are awaited together: the relay's
                // RabbitMQ publisher sends the same way.
                let mut sends = Vec::with_capacity(window);
                let mut confirms = Vec::with_capacity(window);
                for _ in 0..window {
                    let props = if bare {
                        BasicProperties::default().with_delivery_mode(2)
                    } else {
                        same_properties_as_the_relay(&body)
                    };
                    let mut send = Box::pin(channel.basic_publish(
                        exchange.as_str().into(),
                        "BenchEvent".into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        &body,
                        props,
                    ));
                    match futures::poll!(send.as_mut()) {
                        std::task::Poll::Ready(confirm) => confirms.push(confirm?),
                        std::task::Poll::Pending => sends.push(send),
                    }
                }
                for send in futures::future::join_all(sends).await {
                    confirms.push(send?);
                }
                for confirm in futures::future::join_all(confirms).await {
                    let confirmation = confirm?;
                    anyhow::ensure!(confirmation.is_ack(), "broker nacked a message");
                }
                sent += window;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    conn.close(200, "bench done".into()).await.ok();
    Ok(elapsed)
}

/// The headers the relay's NATS publisher sends for a `BenchEvent`: `Nats-Msg-Id` (a
/// fresh id, so the stream tracks every message in its duplicate window as it does for
/// the relay), `Content-Type` and the CloudEvents `ce-*` headers.
pub(super) fn same_headers_as_the_relay(body: &[u8]) -> async_nats::HeaderMap {
    let msg = OutboxMessage::claimed_from(
        NewMessage::builder("bench", "0", "BenchEvent")
            .payload_json(String::from_utf8_lossy(body).into_owned())
            .build()
            .expect("the bench payload is JSON"),
        chrono::Utc::now(),
    );
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg.id.to_string().as_str());
    headers.insert("Content-Type", "application/json");
    for (name, value) in
        outbox_core::wire::encode_headers(&msg, outbox_core::wire::Binding::Nats, None)
    {
        headers.insert(name.as_str(), value.as_str());
    }
    headers
}

/// Raw async-nats JetStream: `concurrency` tasks, each publishing windows of
/// `batch_size` messages and then awaiting their PubAcks together.
pub(super) async fn nats_ceiling(
    args: &Args,
    js: &jetstream::Context,
    subject: &str,
    body: &[u8],
    bare: bool,
) -> anyhow::Result<Duration> {
    let per_task = args.messages.div_ceil(args.concurrency);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..args.concurrency {
        let js = js.clone();
        let subject = subject.to_owned();
        let body = bytes::Bytes::copy_from_slice(body);
        let batch = args.batch_size;
        let count = per_task.min(args.messages - c * per_task);
        tasks.push(tokio::spawn(async move {
            let mut sent = 0;
            while sent < count {
                let window = batch.min(count - sent);
                let mut acks = Vec::with_capacity(window);
                for _ in 0..window {
                    let message = if bare {
                        jetstream::message::PublishMessage::build().payload(body.clone())
                    } else {
                        jetstream::message::PublishMessage::build()
                            .payload(body.clone())
                            .headers(same_headers_as_the_relay(&body))
                    };
                    acks.push(js.send_publish(subject.clone(), message).await?);
                }
                for ack in
                    futures::future::join_all(acks.into_iter().map(IntoFuture::into_future)).await
                {
                    let ack = ack?;
                    anyhow::ensure!(
                        !ack.duplicate,
                        "the stream dropped a message as a duplicate"
                    );
                }
                sent += window;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}
