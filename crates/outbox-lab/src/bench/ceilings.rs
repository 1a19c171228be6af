//! The broker ceilings: the raw client publishing what the relay publishes, pipelined,
//! without a database (RabbitMQ: lapin with publisher confirms; NATS: async-nats
//! JetStream awaiting PubAcks). And the same loops fed from the outbox table: the
//! reference relay ([`reference_feeds`]), a hand-written relay with nothing but a
//! claim, a pipelined publish and one update marking the batch sent.

use std::future::IntoFuture;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use outboxkit_core::{NewMessage, OutboxMessage};
use outboxkit_nats::async_nats;
use outboxkit_nats::async_nats::jetstream;

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
        outboxkit_core::wire::encode_headers(&msg, outboxkit_core::wire::Binding::Amqp, None)
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

/// Where a publishing loop gets its windows of messages, and what it does once every
/// message of a window is confirmed.
#[async_trait]
pub(super) trait Feed: Send + 'static {
    /// The next window: up to `max` messages, each with the id to publish it under
    /// (`None`: a fresh one); empty when the feed is done.
    async fn next(&mut self, max: usize) -> anyhow::Result<Vec<(Option<Uuid>, Bytes)>>;
    /// Every message of the last window was confirmed.
    async fn confirmed(&mut self) -> anyhow::Result<()>;
}

/// `count` copies of `body`, for the ceilings.
struct Copies {
    count: usize,
    body: Bytes,
}

#[async_trait]
impl Feed for Copies {
    async fn next(&mut self, max: usize) -> anyhow::Result<Vec<(Option<Uuid>, Bytes)>> {
        let n = max.min(self.count);
        self.count -= n;
        Ok(vec![(None, self.body.clone()); n])
    }

    async fn confirmed(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}

/// The ceilings' feeds: `args.messages` copies of `body` split over
/// `args.concurrency` publishers, each publishing windows of `batch_size` and then
/// awaiting their confirms or PubAcks together.
pub(super) fn copies(args: &Args, body: &[u8]) -> Vec<Box<dyn Feed>> {
    let per_task = args.messages.div_ceil(args.concurrency);
    let body = Bytes::copy_from_slice(body);
    (0..args.concurrency)
        .map(|c| {
            Box::new(Copies {
                count: per_task.min(args.messages.saturating_sub(c * per_task)),
                body: body.clone(),
            }) as Box<dyn Feed>
        })
        .collect()
}

/// The reference relay's feed: claims up to a window of pending rows of the outbox
/// table in `schema` (one `UPDATE ... RETURNING` with `FOR UPDATE SKIP LOCKED`, in
/// claim order), and marks them sent by an id array once confirmed. No lease checks,
/// no retries, no circuit, no crash-loop guard: the least a relay can do.
struct Claims {
    pool: sqlx::PgPool,
    claim: String,
    mark_sent: String,
    window: Vec<Uuid>,
}

#[async_trait]
impl Feed for Claims {
    async fn next(&mut self, max: usize) -> anyhow::Result<Vec<(Option<Uuid>, Bytes)>> {
        let rows: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(self.claim.as_str()))
            .bind(i64::try_from(max)?)
            .fetch_all(&self.pool)
            .await?;
        self.window = rows.iter().map(|(id, _)| *id).collect();
        Ok(rows
            .into_iter()
            .map(|(id, payload)| (Some(id), Bytes::from(payload)))
            .collect())
    }

    async fn confirmed(&mut self) -> anyhow::Result<()> {
        sqlx::query(AssertSqlSafe(self.mark_sent.as_str()))
            .bind(&self.window)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// `concurrency` reference-relay feeds over the outbox table in `schema`.
pub(super) fn reference_feeds(
    concurrency: usize,
    pool: &sqlx::PgPool,
    schema: &str,
) -> Vec<Box<dyn Feed>> {
    let t = format!("{schema}.outbox_messages");
    (0..concurrency)
        .map(|_| {
            Box::new(Claims {
                pool: pool.clone(),
                claim: format!(
                    "UPDATE {t} SET status = 9, lease_until = now() + interval '1 minute'
                      WHERE id = ANY(ARRAY(
                            SELECT id FROM {t} WHERE phase = 0 AND status = 0
                             ORDER BY visible_at, seq LIMIT $1 FOR UPDATE SKIP LOCKED))
                     RETURNING id, payload::text"
                ),
                mark_sent: format!(
                    "UPDATE {t} SET status = 1, sent_at = now(), lease_until = NULL
                      WHERE id = ANY($1)"
                ),
                window: Vec::new(),
            }) as Box<dyn Feed>
        })
        .collect()
}

/// Raw lapin: a channel per feed, each publishing windows of `batch_size` messages
/// from its feed and then awaiting their confirms together. Returns when every feed is
/// done.
pub(super) async fn rabbit_publish(
    args: &Args,
    exchange: &str,
    feeds: Vec<Box<dyn Feed>>,
    bare: bool,
) -> anyhow::Result<Duration> {
    let conn = common::amqp_connect().await?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut feed in feeds {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let exchange = exchange.to_owned();
        let batch = args.batch_size;
        tasks.push(tokio::spawn(async move {
            loop {
                let window = feed.next(batch).await?;
                if window.is_empty() {
                    break;
                }
                // Each send is polled once as soon as it is built (queuing its frames
                // for lapin's I/O thread), then all are awaited together: the relay's
                // RabbitMQ publisher sends the same way.
                let mut sends = Vec::with_capacity(window.len());
                let mut confirms = Vec::with_capacity(window.len());
                for (id, body) in &window {
                    let props = if bare {
                        BasicProperties::default().with_delivery_mode(2)
                    } else {
                        let props = same_properties_as_the_relay(body);
                        match id {
                            Some(id) => props.with_message_id(id.to_string().into()),
                            None => props,
                        }
                    };
                    let mut send = Box::pin(channel.basic_publish(
                        exchange.as_str().into(),
                        "BenchEvent".into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        body,
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
                feed.confirmed().await?;
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
        outboxkit_core::wire::encode_headers(&msg, outboxkit_core::wire::Binding::Nats, None)
    {
        headers.insert(name.as_str(), value.as_str());
    }
    headers
}

/// Raw async-nats JetStream: a task per feed, each publishing windows of `batch_size`
/// messages from its feed and then awaiting their PubAcks together. Returns when every
/// feed is done.
pub(super) async fn nats_publish(
    args: &Args,
    js: &jetstream::Context,
    subject: &str,
    feeds: Vec<Box<dyn Feed>>,
    bare: bool,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut feed in feeds {
        let js = js.clone();
        let subject = subject.to_owned();
        let batch = args.batch_size;
        tasks.push(tokio::spawn(async move {
            loop {
                let window = feed.next(batch).await?;
                if window.is_empty() {
                    break;
                }
                let mut acks = Vec::with_capacity(window.len());
                for (id, body) in window {
                    let message = if bare {
                        jetstream::message::PublishMessage::build().payload(body)
                    } else {
                        let mut headers = same_headers_as_the_relay(&body);
                        if let Some(id) = id {
                            headers.insert("Nats-Msg-Id", id.to_string().as_str());
                        }
                        jetstream::message::PublishMessage::build()
                            .payload(body)
                            .headers(headers)
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
                feed.confirmed().await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(started.elapsed())
}
