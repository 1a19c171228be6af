//! The foreign producer: another service publishing straight to the broker, bypassing
//! the outbox and its message builder, as a producer in another language or an
//! operator's script would. At each planned time it publishes one message of every
//! [kind](kinds) to the consumers' routing key or subject (RabbitMQ: to the run's
//! exchange with the AMQP `message-id` property and `cloudEvents:*` headers; NATS: to
//! the run's subject with `Nats-Msg-Id` and `ce-*` headers), each retried until the
//! broker confirms it (up to a minute: a broker fault may be in force).
//!
//! What each kind must become is recorded in the run's `foreign_messages` table (the
//! message's id, kind, expected outcome, what its dead letter must say, and whether
//! the broker confirmed it), for the drain and the verdict: a message with a usable id
//! is applied exactly once (the one with NUL characters, otherwise valid) or exactly one
//! consumer dead letter under `undecodable` (the others), never both, never neither.
//! The message without any id is dropped by the consumers: nothing can record it, so
//! only their `inbox_undecodable_total{outcome="dropped"}` metric counts it; the verdict
//! checks that it reached the broker (the copies without an id) and that nothing is
//! left on the broker after the drain.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use outboxkit_nats::async_nats;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::db::{Arg, Db};
use super::schedule::{FaultKind, Planned};
use super::timeline::Timeline;
use super::topology::{self, EVENT_TYPE, Names, TransportKind};
use crate::common;

/// What must become of a foreign message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Decodable: applied exactly once by the consumers' handler.
    Applied,
    /// Undecodable, with a usable id: exactly one consumer dead letter under
    /// `outboxkit_inbox::UNDECODABLE_CONSUMER`.
    DeadLetter,
    /// Undecodable, without any usable id: dropped (counted in a metric only).
    Dropped,
}

impl Expect {
    /// The value stored in `foreign_messages.expect`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::DeadLetter => "dead letter",
            Self::Dropped => "dropped",
        }
    }
}

/// How a foreign message differs from one of ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spoil {
    /// An aggregate id (`subject`) of 8,000 characters, over the 1,024-byte limit.
    LongAggregateId,
    /// `aggregateversion` "1.0", not an integer.
    MalformedVersion,
    /// NUL characters in the aggregate id and in a header value; otherwise valid.
    Nul,
    /// A valid id and no `type`.
    NoType,
    /// A CloudEvents `id` that is not a UUID, beside a broker message id that is.
    IdNotUuid,
    /// Neither a CloudEvents id nor a broker message id.
    NoId,
}

/// A kind of foreign message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ForeignKind {
    pub(crate) name: &'static str,
    spoil: Spoil,
    pub(crate) expect: Expect,
    /// Text its dead letter's `last_error` must contain.
    pub(crate) reason: &'static str,
}

/// Every kind, one of each per batch.
pub(crate) fn kinds() -> Vec<ForeignKind> {
    let kind = |name, spoil, expect, reason| ForeignKind {
        name,
        spoil,
        expect,
        reason,
    };
    vec![
        kind(
            "aggregate id of 8,000 characters",
            Spoil::LongAggregateId,
            Expect::DeadLetter,
            "subject is 8000 bytes long",
        ),
        kind(
            "aggregateversion \"1.0\"",
            Spoil::MalformedVersion,
            Expect::DeadLetter,
            "attribute aggregateversion has a malformed value",
        ),
        kind(
            "NUL characters in the aggregate id and a header",
            Spoil::Nul,
            Expect::Applied,
            "",
        ),
        kind(
            "no event type",
            Spoil::NoType,
            Expect::DeadLetter,
            "missing required attribute type",
        ),
        kind(
            "CloudEvents id not a UUID (the broker's is)",
            Spoil::IdNotUuid,
            Expect::DeadLetter,
            "attribute id has a malformed value",
        ),
        kind("no id at all", Spoil::NoId, Expect::Dropped, ""),
    ]
}

/// A message as the foreign producer sends it.
struct Wire {
    /// The broker's message id (AMQP `message-id`, `Nats-Msg-Id`).
    message_id: Option<String>,
    /// CloudEvents attributes, without the binding's prefix.
    attributes: Vec<(&'static str, String)>,
    /// Other headers, under their own names.
    headers: Vec<(&'static str, String)>,
    payload: Vec<u8>,
}

/// The message of `kind` with id `id`. Its payload is a valid `OrderPlaced` of an order
/// no producer wrote (so an applied one is an effect of an unknown order, which the
/// verdict expects of these ids only).
fn wire(kind: &ForeignKind, id: Uuid) -> Wire {
    let id_text = id.to_string();
    let payload = serde_json::json!({
        "order_id": Uuid::now_v7(),
        "from": "a foreign producer",
        "kind": kind.name,
    })
    .to_string()
    .into_bytes();
    let base = |subject: String, version: &str| {
        vec![
            ("specversion", "1.0".to_owned()),
            ("id", id_text.clone()),
            ("source", "/foreign".to_owned()),
            ("type", EVENT_TYPE.to_owned()),
            ("aggregatetype", "order".to_owned()),
            ("subject", subject),
            ("aggregateversion", version.to_owned()),
        ]
    };
    let mut w = Wire {
        message_id: Some(id_text.clone()),
        attributes: base(format!("foreign-{id}"), "1"),
        headers: Vec::new(),
        payload,
    };
    match kind.spoil {
        Spoil::Nul => {
            w.attributes = base(format!("foreign-{id}\0x"), "1");
            w.headers.push(("note", "before\0after".to_owned()));
        }
        Spoil::LongAggregateId => {
            // Letters, not one repeated: no compression or prefix trick hides its length.
            let long: String = (0..8_000_u32)
                .map(|i| char::from(b'a' + u8::try_from((i * 7_919 + i / 13) % 26).unwrap_or(0)))
                .collect();
            w.attributes = base(long, "1");
        }
        Spoil::MalformedVersion => {
            w.attributes = base(format!("foreign-{id}"), "1.0");
        }
        Spoil::NoType => {
            w.attributes.retain(|(name, _)| *name != "type");
        }
        Spoil::IdNotUuid => {
            for attribute in &mut w.attributes {
                if attribute.0 == "id" {
                    attribute.1 = format!("order-{}", id.simple());
                }
            }
        }
        Spoil::NoId => {
            w.message_id = None;
            w.attributes.retain(|(name, _)| *name != "id");
        }
    }
    w
}

/// A foreign message published (or given up on): the id it can be recorded under (none
/// for [`Expect::Dropped`]), its kind, and whether the broker confirmed it.
#[derive(Debug, Clone)]
pub(crate) struct Sent {
    pub(crate) id: Option<Uuid>,
    pub(crate) kind: ForeignKind,
    pub(crate) confirmed: bool,
    /// Publish attempts (each may have reached the broker).
    pub(crate) attempts: u32,
}

/// Publishes straight to the broker, reconnecting after a failure.
enum Publisher {
    Rabbit {
        exchange: String,
        channel: Option<(Connection, Channel)>,
    },
    Nats {
        subject: String,
        context: Option<async_nats::jetstream::Context>,
    },
}

/// How long one publish may take before it is tried again.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a message is retried before it is given up (a broker fault lasts at most
/// about 30 s).
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);

impl Publisher {
    fn new(transport: TransportKind, names: &Names) -> anyhow::Result<Self> {
        Ok(match transport {
            TransportKind::Rabbit => Self::Rabbit {
                exchange: names.exchange.clone(),
                channel: None,
            },
            TransportKind::Nats => Self::Nats {
                subject: topology::nats_config(names, "chaos-foreign")?.subject_for(EVENT_TYPE),
                context: None,
            },
        })
    }

    /// Publishes `w` and waits for the broker's confirmation.
    async fn publish(&mut self, w: &Wire) -> anyhow::Result<()> {
        let result = tokio::time::timeout(PUBLISH_TIMEOUT, self.try_publish(w))
            .await
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "no confirmation within {PUBLISH_TIMEOUT:?}"
                ))
            });
        if result.is_err() {
            // Start over on a fresh connection.
            match self {
                Self::Rabbit { channel, .. } => {
                    if let Some((conn, _)) = channel.take() {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            conn.close(200, "retrying".into()),
                        )
                        .await;
                    }
                }
                Self::Nats { context, .. } => *context = None,
            }
        }
        result
    }

    async fn try_publish(&mut self, w: &Wire) -> anyhow::Result<()> {
        match self {
            Self::Rabbit { exchange, channel } => {
                if channel.is_none() {
                    let conn = common::amqp_connect().await?;
                    let ch = conn.create_channel().await?;
                    ch.confirm_select(ConfirmSelectOptions::default()).await?;
                    *channel = Some((conn, ch));
                }
                let Some((_, ch)) = channel.as_ref() else {
                    anyhow::bail!("no channel");
                };
                let mut table = FieldTable::default();
                for (name, value) in &w.attributes {
                    table.insert(
                        format!("cloudEvents:{name}").into(),
                        AMQPValue::LongString(value.as_str().into()),
                    );
                }
                for (name, value) in &w.headers {
                    table.insert((*name).into(), AMQPValue::LongString(value.as_str().into()));
                }
                let mut properties = BasicProperties::default()
                    .with_headers(table)
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2);
                if let Some(id) = &w.message_id {
                    properties = properties.with_message_id(id.as_str().into());
                }
                let confirmation = ch
                    .basic_publish(
                        exchange.as_str().into(),
                        EVENT_TYPE.into(),
                        BasicPublishOptions::default(),
                        &w.payload,
                        properties,
                    )
                    .await?
                    .await?;
                anyhow::ensure!(
                    confirmation.is_ack(),
                    "the broker refused it: {confirmation:?}"
                );
                Ok(())
            }
            Self::Nats { subject, context } => {
                if context.is_none() {
                    let client = common::nats_connect().await?;
                    *context = Some(async_nats::jetstream::new(client));
                }
                let Some(js) = context.as_ref() else {
                    anyhow::bail!("no connection");
                };
                let mut headers = async_nats::HeaderMap::new();
                if let Some(id) = &w.message_id {
                    headers.insert("Nats-Msg-Id", id.as_str());
                }
                for (name, value) in &w.attributes {
                    headers.insert(format!("ce-{name}"), value.as_str());
                }
                for (name, value) in &w.headers {
                    headers.insert(*name, value.as_str());
                }
                js.publish_with_headers(subject.clone(), headers, w.payload.clone().into())
                    .await?
                    .await?;
                Ok(())
            }
        }
    }
}

/// The foreign lane: at each planned time, one message of every kind, each retried
/// until the broker confirms it or [`GIVE_UP_AFTER`]; returns every message sent when
/// the plan is done or `stop` is cancelled. It owns what it uses, so that it runs as a
/// task of its own: the other lanes' blocking fault commands (`rabbitmqctl` can take
/// seconds) do not hold it up.
pub(crate) async fn lane(
    transport: TransportKind,
    names: Names,
    plan: Vec<Planned>,
    phase_start: Instant,
    timeline: Timeline,
    stop: CancellationToken,
) -> Vec<Sent> {
    let mut sent = Vec::new();
    let mut publisher = match Publisher::new(transport, &names) {
        Ok(p) => p,
        Err(e) => {
            for _ in &plan {
                timeline.not_injected(FaultKind::Foreign, format!("no publisher: {e:#}"));
            }
            return sent;
        }
    };
    let kinds = kinds();
    for batch in &plan {
        let at = tokio::time::Instant::from_std(phase_start + batch.at);
        tokio::select! {
            () = stop.cancelled() => return sent,
            () = tokio::time::sleep_until(at) => {}
        }
        let mut confirmed = 0;
        for kind in &kinds {
            let id = Uuid::now_v7();
            let w = wire(kind, id);
            let mut attempts = 0;
            let deadline = Instant::now() + GIVE_UP_AFTER;
            let outcome = loop {
                attempts += 1;
                let published = tokio::select! {
                    () = stop.cancelled() => Err(anyhow::anyhow!("the run stopped")),
                    published = publisher.publish(&w) => published,
                };
                match published {
                    Ok(()) => break Ok(()),
                    Err(e) if Instant::now() < deadline && !stop.is_cancelled() => {
                        tracing::debug!(error = %e, kind = kind.name, "foreign message not confirmed yet");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => break Err(e),
                }
            };
            match &outcome {
                Ok(()) => {
                    confirmed += 1;
                    let record = timeline.injected(FaultKind::Foreign, kind.name);
                    timeline.ended(record);
                }
                Err(e) => timeline.not_injected(
                    FaultKind::Foreign,
                    format!(
                        "{}: not confirmed after {attempts} attempts: {e:#}",
                        kind.name
                    ),
                ),
            }
            sent.push(Sent {
                id: (kind.expect != Expect::Dropped).then_some(id),
                kind: *kind,
                confirmed: outcome.is_ok(),
                attempts,
            });
        }
        timeline.say(format!(
            "foreign messages: {confirmed} of {} published straight to the broker",
            kinds.len()
        ));
    }
    sent
}

/// Writes what the lane sent into `foreign_messages` (those with a usable id).
pub(crate) async fn record(admin: &Db, names: &Names, sent: &[Sent]) -> anyhow::Result<()> {
    let recorded: Vec<&Sent> = sent.iter().filter(|s| s.id.is_some()).collect();
    if recorded.is_empty() {
        return Ok(());
    }
    let args = recorded
        .iter()
        .flat_map(|s| {
            [
                Arg::Uuid(s.id.unwrap_or_default()),
                Arg::Text(s.kind.name.to_owned()),
                Arg::Text(s.kind.expect.as_str().to_owned()),
                Arg::Text(s.kind.reason.to_owned()),
                Arg::Bool(s.confirmed),
            ]
        })
        .collect();
    admin
        .execute(
            format!(
                "INSERT INTO {} (id, kind, expect, reason, confirmed) VALUES {}",
                names.table("foreign_messages"),
                admin.database().rows(recorded.len(), 5)
            ),
            args,
        )
        .await
        .context("record the foreign messages")?;
    Ok(())
}
