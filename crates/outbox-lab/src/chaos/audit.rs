//! The broker's side of the verdict, read without the outbox tables: how many times
//! each message id reached the broker. RabbitMQ: the audit queue bound to the run's
//! exchange with `#` (every routed publish lands there too), drained at the end.
//! NATS: the streams themselves (the consumers' and the side events'), each read from
//! the first message to the last.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use outboxkit_nats::async_nats::jetstream;
use uuid::Uuid;

use super::injector::SENTINEL_ID_PREFIX;
use super::topology::{Names, TransportKind};
use crate::common;

/// Copies of each message id the broker holds.
pub(crate) type Copies = HashMap<Uuid, u32>;

/// What the broker holds, by message id, and how many copies had no usable id.
pub(crate) async fn broker_copies(
    transport: TransportKind,
    names: &Names,
) -> anyhow::Result<(Copies, u64)> {
    match transport {
        TransportKind::Rabbit => rabbit(names).await,
        TransportKind::Nats => nats(names).await,
    }
}

async fn rabbit(names: &Names) -> anyhow::Result<(Copies, u64)> {
    let conn = common::amqp_connect()
        .await
        .context("connect to RabbitMQ for the audit")?;
    let ch = conn.create_channel().await?;
    let queue = ch
        .queue_declare(
            names.audit_queue.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .context("the audit queue")?;
    let total = u64::from(queue.message_count());
    let mut consumer = ch
        .basic_consume(
            names.audit_queue.as_str().into(),
            "chaos-audit".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let mut copies = Copies::new();
    let mut without_id = 0;
    let mut read = 0_u64;
    while read < total {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .with_context(|| format!("the audit queue stopped after {read} of {total} messages"))?
            .context("the audit consumer ended")??;
        read += 1;
        match delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|id| id.as_str().parse::<Uuid>().ok())
        {
            Some(id) => *copies.entry(id).or_default() += 1,
            None => without_id += 1,
        }
    }
    let _ = conn.close(200, "audited".into()).await;
    Ok((copies, without_id))
}

async fn nats(names: &Names) -> anyhow::Result<(Copies, u64)> {
    let client = common::nats_connect()
        .await
        .context("connect to NATS for the audit")?;
    let js = jetstream::new(client);
    let mut copies = Copies::new();
    let mut without_id = 0;
    for stream in [&names.stream, &names.side_stream] {
        without_id += read_stream(&js, stream, &mut copies)
            .await
            .with_context(|| format!("stream {stream}"))?;
    }
    Ok((copies, without_id))
}

/// Adds the copies of each message id in stream `name` to `copies`; returns how many
/// of its messages had no usable id. The fault's sentinel messages
/// (`injector::add_sentinels`) are skipped.
pub(super) async fn read_stream(
    js: &jetstream::Context,
    name: &str,
    copies: &mut Copies,
) -> anyhow::Result<u64> {
    let mut stream = js.get_stream(name).await.context("the stream")?;
    let total = stream.info().await?.state.messages;
    if total == 0 {
        return Ok(0);
    }
    // An ordered consumer (no acks, one replica): when its pulls stall (idle heartbeats
    // missed twice, a sequence gap, the consumer gone) the client recreates it from the
    // last stream sequence it handed out, so each message is read once. A plain pull
    // consumer stalled here after a 15-minute run (12,800 of 43,146 messages read, then
    // only missed heartbeats) while the stream itself read back whole in 7 s. Pulls
    // expire after 5 s, so a stall is noticed within about 5 s.
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            max_expires: Duration::from_secs(5),
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut without_id = 0;
    let mut read = 0;
    while read < total {
        let message = tokio::time::timeout(Duration::from_secs(60), messages.next())
            .await
            .with_context(|| format!("the stream stopped after {read} of {total} messages (60 s)"))?
            .context("the stream reader ended")?
            .with_context(|| format!("reading the stream after {read} of {total} messages"))?;
        read += 1;
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str());
        if id.is_some_and(|id| id.starts_with(SENTINEL_ID_PREFIX)) {
            continue;
        }
        match id.and_then(|id| id.parse::<Uuid>().ok()) {
            Some(id) => *copies.entry(id).or_default() += 1,
            None => without_id += 1,
        }
    }
    Ok(without_id)
}
