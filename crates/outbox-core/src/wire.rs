//! The wire format shared by every transport: CloudEvents attributes in binary content
//! mode, plus W3C Trace Context.
//!
//! The payload travels as the message body (`datacontenttype` = `application/json`); the
//! event's metadata travels as broker headers named after CloudEvents attributes
//! (<https://github.com/cloudevents/spec>, v1.0.2), with the prefix of the protocol
//! binding in use:
//!
//! | binding                          | prefix         | example header      |
//! |----------------------------------|----------------|---------------------|
//! | AMQP (RabbitMQ, AMQP 0-9-1 headers) | `cloudEvents:` | `cloudEvents:type` |
//! | NATS                             | `ce-`          | `ce-type`           |
//!
//! | attribute          | from                         | kind                        |
//! |--------------------|------------------------------|-----------------------------|
//! | `specversion`      | `1.0`                        | required                    |
//! | `id`               | outbox id (UUIDv7)           | required; also the broker message id |
//! | `source`           | `/{aggregate_type}`, or configured | required              |
//! | `type`             | `event_type`                 | required                    |
//! | `subject`          | `aggregate_id`               | optional                    |
//! | `time`             | `occurred_at` (RFC 3339)     | optional                    |
//! | `datacontenttype`  | `application/json`           | optional (AMQP: the `content-type` property) |
//! | `aggregatetype`    | `aggregate_type`             | extension                   |
//! | `aggregateversion` | `aggregate_version`          | extension                   |
//! | `tenantid`         | `tenant_id`                  | extension                   |
//! | `partitionkey`     | `partition_key`              | Partitioning extension      |
//! | `correlationid`, `causationid` | headers of the message | extensions             |
//!
//! `traceparent` and `tracestate` travel unprefixed, as W3C Trace Context
//! (<https://www.w3.org/TR/trace-context/>) and OpenTelemetry propagators expect. Any
//! other header of the message is passed through under its own name.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use uuid::Uuid;

use crate::error::InvalidMessage;
use crate::message::{Headers, MAX_AGGREGATE_ID_LEN, MAX_NAME_LEN, OutboxMessage};

/// CloudEvents `specversion` we emit.
pub const SPEC_VERSION: &str = "1.0";
/// Content type of every payload.
pub const CONTENT_TYPE_JSON: &str = "application/json";
/// W3C Trace Context `traceparent` header.
pub const TRACEPARENT: &str = "traceparent";
/// W3C Trace Context `tracestate` header.
pub const TRACESTATE: &str = "tracestate";
/// Message header (unprefixed in the row) carrying the correlation id.
pub const CORRELATION_ID: &str = "correlationid";
/// Message header (unprefixed in the row) carrying the causation id.
pub const CAUSATION_ID: &str = "causationid";

/// A CloudEvents protocol binding: decides the header prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Binding {
    /// AMQP binding: `cloudEvents:` prefix.
    Amqp,
    /// NATS binding: `ce-` prefix.
    Nats,
}

impl Binding {
    /// The header prefix of the binding.
    pub const fn prefix(self) -> &'static str {
        match self {
            Self::Amqp => "cloudEvents:",
            Self::Nats => "ce-",
        }
    }

    fn name(self, attribute: &str) -> String {
        format!("{}{attribute}", self.prefix())
    }
}

/// Formats a time as CloudEvents wants it (RFC 3339, microseconds, `Z`).
pub fn format_time(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The headers to publish for `msg` under `binding`, as (name, value) pairs. `source`
/// overrides the default CloudEvents `source` of `/{aggregate_type}`.
pub fn encode_headers(
    msg: &OutboxMessage,
    binding: Binding,
    source: Option<&str>,
) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(10 + msg.headers.len());
    out.push((binding.name("specversion"), SPEC_VERSION.to_owned()));
    out.push((binding.name("id"), msg.id.to_string()));
    out.push((
        binding.name("source"),
        source.map_or_else(|| format!("/{}", msg.aggregate_type), str::to_owned),
    ));
    out.push((binding.name("type"), msg.event_type.clone()));
    out.push((binding.name("subject"), msg.aggregate_id.clone()));
    out.push((binding.name("time"), format_time(msg.occurred_at)));
    out.push((binding.name("aggregatetype"), msg.aggregate_type.clone()));
    out.push((
        binding.name("aggregateversion"),
        msg.aggregate_version.to_string(),
    ));
    if let Some(tenant) = &msg.tenant_id {
        out.push((binding.name("tenantid"), tenant.clone()));
    }
    if let Some(key) = &msg.partition_key {
        out.push((binding.name("partitionkey"), key.clone()));
    }
    for (name, value) in &msg.headers {
        let wire_name = match name.as_str() {
            CORRELATION_ID | CAUSATION_ID => binding.name(name),
            _ => name.clone(),
        };
        out.push((wire_name, value.clone()));
    }
    out
}

/// Checks that `msg` is within the limits [`IncomingMessage::decode`] applies, so that
/// what a relay publishes can be decoded by every consumer: `event_type`,
/// `aggregate_type`, `tenant_id`, `partition_key` and every header name at most
/// [`MAX_NAME_LEN`] bytes, `aggregate_id` at most [`MAX_AGGREGATE_ID_LEN`] bytes.
/// [`NewMessageBuilder::build`](crate::NewMessageBuilder::build) enforces the same
/// limits; a row written around it (plain SQL, another producer) may not meet them,
/// and the transports' publishers refuse such a row as
/// [`PublishError::Invalid`](crate::PublishError::Invalid) (a dead letter at the
/// source) instead of publishing a message no consumer can decode.
///
/// # Errors
/// [`InvalidMessage::TooLong`] naming the first field over its limit (`event_type`,
/// `aggregate_type`, `aggregate_id`, `tenant_id`, `partition_key` or `header name`).
pub fn check_limits(msg: &OutboxMessage) -> Result<(), InvalidMessage> {
    let fields = [
        ("event_type", Some(&msg.event_type), MAX_NAME_LEN),
        ("aggregate_type", Some(&msg.aggregate_type), MAX_NAME_LEN),
        (
            "aggregate_id",
            Some(&msg.aggregate_id),
            MAX_AGGREGATE_ID_LEN,
        ),
        ("tenant_id", msg.tenant_id.as_ref(), MAX_NAME_LEN),
        ("partition_key", msg.partition_key.as_ref(), MAX_NAME_LEN),
    ];
    let names = msg
        .headers
        .keys()
        .map(|name| ("header name", Some(name), MAX_NAME_LEN));
    for (field, value, max) in fields.into_iter().chain(names) {
        if let Some(value) = value
            && value.len() > max
        {
            return Err(InvalidMessage::TooLong {
                field,
                len: value.len(),
                max,
            });
        }
    }
    Ok(())
}

/// A message as received by a consumer, decoded from the wire format.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct IncomingMessage {
    /// The outbox id (broker message id, CloudEvents `id`): the inbox key.
    pub id: Uuid,
    /// CloudEvents `type`.
    pub event_type: String,
    /// CloudEvents `source`.
    pub source: Option<String>,
    /// `aggregatetype` extension.
    pub aggregate_type: Option<String>,
    /// CloudEvents `subject` (the aggregate id).
    pub aggregate_id: Option<String>,
    /// `aggregateversion` extension.
    pub aggregate_version: Option<i64>,
    /// `tenantid` extension.
    pub tenant_id: Option<String>,
    /// `partitionkey` extension.
    pub partition_key: Option<String>,
    /// `correlationid` extension.
    pub correlation_id: Option<String>,
    /// `causationid` extension.
    pub causation_id: Option<String>,
    /// CloudEvents `time` (the event's `occurred_at`).
    pub occurred_at: Option<DateTime<Utc>>,
    /// W3C `traceparent`, if valid.
    pub traceparent: Option<TraceParent>,
    /// W3C `tracestate`.
    pub tracestate: Option<String>,
    /// Every header as received (names and values).
    pub headers: Headers,
    /// The body (JSON bytes).
    pub payload: Vec<u8>,
    /// Whether the broker flags this as a redelivery.
    pub redelivered: bool,
    /// The delivery attempt number reported by the broker, when it reports one.
    pub delivery_count: Option<u64>,
}

/// Why an incoming message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// A required attribute is absent.
    #[error("missing required attribute {0}")]
    Missing(&'static str),
    /// An attribute has a malformed value.
    #[error("attribute {attribute} has a malformed value {value:?}")]
    Malformed {
        /// The attribute.
        attribute: &'static str,
        /// The value received (at most [`MAX_QUOTED_BYTES`] of it, cut with `…`).
        value: String,
    },
    /// An attribute or a header name is longer than any producer of ours sends and than
    /// the inbox stores may key on (see [`IncomingMessage::decode`] for the limits).
    #[error("{field} is {len} bytes long, the maximum is {max}")]
    TooLong {
        /// The attribute (`type`, `subject`, ...) or `header name`.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The maximum in bytes.
        max: usize,
    },
}

/// How much of a malformed value a [`DecodeError::Malformed`] quotes, in bytes.
pub const MAX_QUOTED_BYTES: usize = 200;

/// A delivery that [`IncomingMessage::decode`] refused, as the transport received it:
/// what a handler needs to record it (a consumer dead letter with its raw headers and
/// body) instead of dropping it unrecorded. Handed to
/// [`DeliveryHandler::handle_undecodable`](crate::consumer::DeliveryHandler::handle_undecodable).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UndecodableMessage {
    /// An id the delivery can be recorded under: the CloudEvents `id` when it is a UUID,
    /// else the broker's message id (AMQP `message-id`, `Nats-Msg-Id`) when that is one.
    /// `None`: the delivery cannot be identified, so nothing can deduplicate a record of
    /// it; it may only be dropped.
    pub id: Option<Uuid>,
    /// Why it could not be decoded.
    pub error: DecodeError,
    /// The CloudEvents `type` as received, if any (any length).
    pub event_type: Option<String>,
    /// Every header as received (names and values).
    pub headers: Headers,
    /// The body.
    pub payload: Vec<u8>,
    /// Whether the broker flags this as a redelivery.
    pub redelivered: bool,
    /// The delivery attempt number reported by the broker, when it reports one.
    pub delivery_count: Option<u64>,
}

impl UndecodableMessage {
    /// The delivery as an [`IncomingMessage`] of its usable [`id`](Self::id) carrying
    /// only what can be trusted: the raw headers, the body, and the event type when it
    /// is at most [`MAX_NAME_LEN`] bytes (else empty). For recording the delivery (a
    /// consumer dead letter); `None` when it has no usable id.
    pub fn as_received(&self) -> Option<IncomingMessage> {
        let id = self.id?;
        let event_type = self
            .event_type
            .as_deref()
            .filter(|t| t.len() <= MAX_NAME_LEN)
            .unwrap_or("");
        let mut msg = IncomingMessage::new(id, event_type, self.payload.clone());
        msg.headers = self.headers.clone();
        msg.redelivered = self.redelivered;
        msg.delivery_count = self.delivery_count;
        Some(msg)
    }
}

impl std::fmt::Display for UndecodableMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "undecodable delivery: {}", self.error)
    }
}

impl std::error::Error for UndecodableMessage {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// `value` cut to at most [`MAX_QUOTED_BYTES`] on a character boundary, with `…` when cut.
fn quoted(value: &str) -> String {
    if value.len() <= MAX_QUOTED_BYTES {
        return value.to_owned();
    }
    let mut end = MAX_QUOTED_BYTES;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &value[..end])
}

impl IncomingMessage {
    /// A message with only an id, event type and payload; set the public fields for the
    /// rest (used by stores that rebuild stored messages).
    pub fn new(id: Uuid, event_type: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            id,
            event_type: event_type.into(),
            source: None,
            aggregate_type: None,
            aggregate_id: None,
            aggregate_version: None,
            tenant_id: None,
            partition_key: None,
            correlation_id: None,
            causation_id: None,
            occurred_at: None,
            traceparent: None,
            tracestate: None,
            headers: Headers::new(),
            payload,
            redelivered: false,
            delivery_count: None,
        }
    }

    /// Decodes the wire format. `message_id` is the broker's message-id property, used
    /// when the CloudEvents `id` header is absent.
    ///
    /// Limits, so that whatever decodes can be stored, keyed and dead-lettered by every
    /// inbox store (and whatever our [`NewMessageBuilder`](crate::NewMessageBuilder)
    /// accepts decodes): `type`, `aggregatetype`, `tenantid`, `partitionkey` and every
    /// header name at most [`MAX_NAME_LEN`] bytes, `subject` at most
    /// [`MAX_AGGREGATE_ID_LEN`].
    ///
    /// # Errors
    /// An [`UndecodableMessage`] holding the delivery as received and its
    /// [`DecodeError`]: no id, an id that is not a UUID, no event type, a malformed
    /// `aggregateversion` (not an integer), or a value over its limit.
    pub fn decode(
        binding: Binding,
        message_id: Option<&str>,
        headers: Headers,
        payload: Vec<u8>,
        redelivered: bool,
        delivery_count: Option<u64>,
    ) -> Result<Self, Box<UndecodableMessage>> {
        let get = |attr: &str| headers.get(&binding.name(attr)).cloned();
        let as_uuid = |text: &str| Uuid::parse_str(text).ok();
        let checked = Self::check(binding, message_id, &headers);
        let (id, aggregate_version) = match checked {
            Ok(decoded) => decoded,
            Err(error) => {
                let id = get("id")
                    .as_deref()
                    .and_then(as_uuid)
                    .or_else(|| message_id.and_then(as_uuid));
                return Err(Box::new(UndecodableMessage {
                    id,
                    error,
                    event_type: get("type"),
                    headers,
                    payload,
                    redelivered,
                    delivery_count,
                }));
            }
        };
        let occurred_at = get("time").and_then(|t| {
            DateTime::parse_from_rfc3339(&t)
                .ok()
                .map(|t| t.with_timezone(&Utc))
        });
        Ok(Self {
            id,
            event_type: get("type").unwrap_or_default(),
            source: get("source"),
            aggregate_type: get("aggregatetype"),
            aggregate_id: get("subject"),
            aggregate_version,
            tenant_id: get("tenantid"),
            partition_key: get("partitionkey"),
            correlation_id: get(CORRELATION_ID),
            causation_id: get(CAUSATION_ID),
            occurred_at,
            traceparent: headers.get(TRACEPARENT).and_then(|t| TraceParent::parse(t)),
            tracestate: headers.get(TRACESTATE).cloned(),
            headers,
            payload,
            redelivered,
            delivery_count,
        })
    }

    /// The checks of [`decode`](Self::decode): the id and the aggregate version, or why
    /// the delivery is undecodable.
    fn check(
        binding: Binding,
        message_id: Option<&str>,
        headers: &Headers,
    ) -> Result<(Uuid, Option<i64>), DecodeError> {
        let get = |attr: &str| headers.get(&binding.name(attr));
        let raw_id = get("id")
            .map(String::as_str)
            .or(message_id)
            .ok_or(DecodeError::Missing("id"))?;
        let id = Uuid::parse_str(raw_id).map_err(|_| DecodeError::Malformed {
            attribute: "id",
            value: quoted(raw_id),
        })?;
        if get("type").is_none() {
            return Err(DecodeError::Missing("type"));
        }
        for (field, max) in [
            ("type", MAX_NAME_LEN),
            ("aggregatetype", MAX_NAME_LEN),
            ("tenantid", MAX_NAME_LEN),
            ("partitionkey", MAX_NAME_LEN),
            ("subject", MAX_AGGREGATE_ID_LEN),
        ] {
            if let Some(value) = get(field)
                && value.len() > max
            {
                return Err(DecodeError::TooLong {
                    field,
                    len: value.len(),
                    max,
                });
            }
        }
        if let Some(name) = headers.keys().find(|name| name.len() > MAX_NAME_LEN) {
            return Err(DecodeError::TooLong {
                field: "header name",
                len: name.len(),
                max: MAX_NAME_LEN,
            });
        }
        let aggregate_version = match get("aggregateversion") {
            Some(v) => Some(v.parse::<i64>().map_err(|_| DecodeError::Malformed {
                attribute: "aggregateversion",
                value: quoted(v),
            })?),
            None => None,
        };
        Ok((id, aggregate_version))
    }

    /// The payload deserialized as `T`.
    ///
    /// # Errors
    /// The `serde_json` error when the body does not match `T`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}

/// A parsed W3C Trace Context `traceparent` (version 00):
/// `00-{trace-id: 32 hex}-{parent-id: 16 hex}-{flags: 2 hex}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// 16-byte trace id (not all zero).
    pub trace_id: u128,
    /// 8-byte parent span id (not all zero).
    pub parent_id: u64,
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// Parses a `traceparent` value; `None` when it is malformed or uses the all-zero
    /// ids the specification forbids.
    pub fn parse(value: &str) -> Option<Self> {
        let parts: Vec<&str> = value.trim().split('-').collect();
        let [version, trace, parent, flags] = parts.as_slice() else {
            return None;
        };
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        if !hex(version, 2)
            || *version == "ff"
            || !hex(trace, 32)
            || !hex(parent, 16)
            || !hex(flags, 2)
        {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let parent_id = u64::from_str_radix(parent, 16).ok()?;
        if trace_id == 0 || parent_id == 0 {
            return None;
        }
        Some(Self {
            trace_id,
            parent_id,
            flags: u8::from_str_radix(flags, 16).ok()?,
        })
    }
}

impl std::fmt::Display for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

/// Builds a [`Headers`] map from (name, value) pairs.
pub fn headers_from_pairs<I, K, V>(pairs: I) -> Headers
where
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    pairs
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect::<BTreeMap<_, _>>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::MessageStatus;
    use serde_json::value::RawValue;

    fn sample() -> OutboxMessage {
        OutboxMessage {
            id: Uuid::now_v7(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            aggregate_version: 3,
            event_type: "OrderPlaced".into(),
            payload: RawValue::from_string("{}".into()).expect("json"),
            headers: headers_from_pairs([
                (
                    TRACEPARENT,
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                ),
                (CORRELATION_ID, "c-1"),
            ]),
            tenant_id: Some("t1".into()),
            routing_key: None,
            partition_key: None,
            occurred_at: Utc::now(),
            created_at: Utc::now(),
            visible_at: Utc::now(),
            attempts: 1,
            status: MessageStatus::Processing,
            last_error: None,
            claim_token: None,
            lease_until: None,
            sent_at: None,
        }
    }

    #[test]
    fn round_trip_through_both_bindings() {
        let msg = sample();
        for binding in [Binding::Amqp, Binding::Nats] {
            let headers = headers_from_pairs(encode_headers(&msg, binding, None));
            assert!(headers.contains_key(&format!("{}type", binding.prefix())));
            let decoded =
                IncomingMessage::decode(binding, None, headers, b"{}".to_vec(), false, None)
                    .expect("decodes");
            assert_eq!(decoded.id, msg.id);
            assert_eq!(decoded.event_type, "OrderPlaced");
            assert_eq!(decoded.aggregate_id.as_deref(), Some("42"));
            assert_eq!(decoded.aggregate_version, Some(3));
            assert_eq!(decoded.tenant_id.as_deref(), Some("t1"));
            assert_eq!(decoded.correlation_id.as_deref(), Some("c-1"));
            assert_eq!(decoded.source.as_deref(), Some("/order"));
            assert_eq!(
                decoded.traceparent.map(|t| t.to_string()).as_deref(),
                Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            );
        }
    }

    #[test]
    fn decode_rejects_missing_or_bad_ids() {
        let missing =
            IncomingMessage::decode(Binding::Nats, None, Headers::new(), vec![], false, None)
                .expect_err("no id");
        assert_eq!(missing.error, DecodeError::Missing("id"));
        assert_eq!(missing.id, None);
        let bad = IncomingMessage::decode(
            Binding::Nats,
            Some("x"),
            Headers::new(),
            vec![],
            false,
            None,
        )
        .expect_err("not a UUID");
        assert!(matches!(
            bad.error,
            DecodeError::Malformed {
                attribute: "id",
                ..
            }
        ));
        assert_eq!(bad.id, None, "no usable id");
    }

    /// What an undecodable delivery keeps: a usable id (the CloudEvents id, else the
    /// broker's message id, whichever is a UUID), the raw type, headers and body.
    #[test]
    fn an_undecodable_delivery_keeps_what_it_can_be_recorded_by() {
        let id = Uuid::now_v7();
        let decode = |message_id: Option<&str>, pairs: &[(&str, &str)]| {
            let headers = headers_from_pairs(
                pairs
                    .iter()
                    .map(|(name, value)| (format!("ce-{name}"), (*value).to_owned())),
            );
            IncomingMessage::decode(
                Binding::Nats,
                message_id,
                headers,
                b"{}".to_vec(),
                true,
                Some(2),
            )
        };
        let text = id.to_string();
        let version = decode(
            None,
            &[("id", &text), ("type", "T"), ("aggregateversion", "1.0")],
        )
        .expect_err("malformed version");
        assert_eq!(version.id, Some(id));
        assert_eq!(version.event_type.as_deref(), Some("T"));
        assert_eq!(
            version.error,
            DecodeError::Malformed {
                attribute: "aggregateversion",
                value: "1.0".into()
            }
        );
        let received = version.as_received().expect("usable id");
        assert_eq!((received.id, received.event_type.as_str()), (id, "T"));
        assert_eq!(received.headers, version.headers);
        assert_eq!(
            (
                received.payload.as_slice(),
                received.redelivered,
                received.delivery_count
            ),
            (&b"{}"[..], true, Some(2))
        );
        assert_eq!(
            received.aggregate_version, None,
            "nothing untrusted is parsed"
        );

        let untyped = decode(None, &[("id", &text)]).expect_err("no type");
        assert_eq!(
            (untyped.id, untyped.error.clone()),
            (Some(id), DecodeError::Missing("type"))
        );
        assert_eq!(
            untyped.as_received().map(|m| m.event_type),
            Some(String::new())
        );

        let by_message_id = decode(Some(&text), &[("id", "order-17"), ("type", "T")])
            .expect_err("the CloudEvents id is not a UUID");
        assert_eq!(by_message_id.id, Some(id), "the broker's message id is");
        assert!(matches!(
            by_message_id.error,
            DecodeError::Malformed {
                attribute: "id",
                ..
            }
        ));

        let anonymous = decode(Some("x"), &[("type", "T"), ("aggregateversion", "v")])
            .expect_err("no usable id");
        assert_eq!(anonymous.id, None);
        assert!(anonymous.as_received().is_none());
    }

    #[test]
    fn values_over_their_limits_are_refused_and_quoted_short() {
        let id = Uuid::now_v7().to_string();
        let with = |name: &str, value: String| {
            let mut headers =
                headers_from_pairs([("ce-id", id.clone()), ("ce-type", "T".to_owned())]);
            headers.insert(name.to_owned(), value);
            IncomingMessage::decode(Binding::Nats, None, headers, vec![], false, None)
        };
        for (field, max) in [
            ("type", MAX_NAME_LEN),
            ("aggregatetype", MAX_NAME_LEN),
            ("tenantid", MAX_NAME_LEN),
            ("partitionkey", MAX_NAME_LEN),
            ("subject", MAX_AGGREGATE_ID_LEN),
        ] {
            assert!(
                with(&format!("ce-{field}"), "x".repeat(max)).is_ok(),
                "{field} at its limit"
            );
            let over = with(&format!("ce-{field}"), "x".repeat(max + 1)).expect_err(field);
            assert_eq!(
                over.error,
                DecodeError::TooLong {
                    field,
                    len: max + 1,
                    max
                }
            );
        }
        let long_name = with(&"h".repeat(MAX_NAME_LEN + 1), "v".into()).expect_err("header name");
        assert_eq!(
            long_name.error,
            DecodeError::TooLong {
                field: "header name",
                len: MAX_NAME_LEN + 1,
                max: MAX_NAME_LEN
            }
        );
        let long_version = with("ce-aggregateversion", "9".repeat(5_000)).expect_err("not an i64");
        let DecodeError::Malformed { value, .. } = long_version.error else {
            panic!("{:?}", long_version.error);
        };
        assert!(
            value.len() <= MAX_QUOTED_BYTES + '…'.len_utf8() && value.ends_with('…'),
            "{value}"
        );
    }

    /// A row over a limit is refused before publishing, and exactly the rows under the
    /// limits encode to headers that decode.
    #[test]
    fn check_limits_matches_what_decodes() {
        type Set = fn(&mut OutboxMessage, String);
        let cases: [(&str, usize, Set); 6] = [
            ("event_type", MAX_NAME_LEN, |m, v| m.event_type = v),
            ("aggregate_type", MAX_NAME_LEN, |m, v| m.aggregate_type = v),
            ("aggregate_id", MAX_AGGREGATE_ID_LEN, |m, v| {
                m.aggregate_id = v
            }),
            ("tenant_id", MAX_NAME_LEN, |m, v| m.tenant_id = Some(v)),
            ("partition_key", MAX_NAME_LEN, |m, v| {
                m.partition_key = Some(v)
            }),
            ("header name", MAX_NAME_LEN, |m, v| {
                m.headers.insert(v, "v".into());
            }),
        ];
        let decodes = |msg: &OutboxMessage| {
            let headers = encode_headers(msg, Binding::Nats, None)
                .into_iter()
                .collect();
            IncomingMessage::decode(Binding::Nats, None, headers, vec![], false, None).is_ok()
        };
        for (field, max, set) in cases {
            let mut at_limit = sample();
            set(&mut at_limit, "x".repeat(max));
            assert_eq!(check_limits(&at_limit), Ok(()), "{field} at its limit");
            assert!(decodes(&at_limit), "{field} at its limit");
            let mut over = sample();
            set(&mut over, "x".repeat(max + 1));
            assert_eq!(
                check_limits(&over),
                Err(InvalidMessage::TooLong {
                    field,
                    len: max + 1,
                    max
                })
            );
            assert!(!decodes(&over), "{field} over its limit");
        }
    }

    #[test]
    fn traceparent_validation() {
        assert!(
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_some()
        );
        assert!(
            TraceParent::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01").is_none()
        );
        assert!(
            TraceParent::parse("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01").is_none()
        );
        assert!(TraceParent::parse("garbage").is_none());
    }
}

/// Property tests: no panic is reachable from a row's content on the way to the wire,
/// nor from a broker's headers on the way back.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::message::MessageStatus;
    use crate::proptest_support::{any_time, config, text};
    use proptest::prelude::*;
    use serde_json::value::RawValue;

    /// Every attribute `decode` looks up, without the binding's prefix.
    const ATTRIBUTES: [&str; 12] = [
        "specversion",
        "id",
        "source",
        "type",
        "subject",
        "time",
        "aggregatetype",
        "aggregateversion",
        "tenantid",
        "partitionkey",
        CORRELATION_ID,
        CAUSATION_ID,
    ];

    /// Header names: arbitrary text, empty, very long (ASCII or multi-byte), the names
    /// of our attributes under either binding, `Nats-*` in any case, 1-4 byte names.
    fn header_name() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => text(40),
            1 => (0usize..400).prop_map(|n| "h".repeat(n)),
            1 => prop::collection::vec(any::<char>(), 60..200).prop_map(String::from_iter),
            2 => (
                prop::sample::select(vec!["ce-", "cloudEvents:", "Nats-", "NATS-", "nats-", "CE-"]),
                prop::sample::select(ATTRIBUTES.to_vec()),
            )
                .prop_map(|(prefix, attr)| format!("{prefix}{attr}")),
            2 => prop::sample::select(vec![
                "", TRACEPARENT, TRACESTATE, CORRELATION_ID, CAUSATION_ID, "Nats-Msg-Id",
                "Content-Type", "N", "Na", "Nat", "Nats", "é", "日本", "𝄞", "Nats-", "ce-",
                "a:b", "x\r\ny", " ",
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// Header values: arbitrary text, long text, and values some attribute parses
    /// (UUIDs, integers, RFC 3339 times, trace contexts), valid or nearly so.
    fn header_value() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => text(60),
            1 => (0usize..2000).prop_map(|n| "v".repeat(n)),
            2 => any::<u128>().prop_map(|n| Uuid::from_u128(n).to_string()),
            1 => any::<i64>().prop_map(|n| n.to_string()),
            1 => "[0-9]{1,30}",
            1 => any_time().prop_map(format_time),
            1 => concat!(
                "[0-9+-]{4,7}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}",
                "(\\.[0-9]{0,12})?(Z|[+-][0-9]{2}:[0-9]{2})",
            ),
            2 => traceparent_like(),
        ]
    }

    /// Strings shaped like a `traceparent`, valid or broken in one of many ways.
    fn traceparent_like() -> impl Strategy<Value = String> {
        "\\s{0,2}[0-9a-fA-F]{2}-[0-9a-fA-F]{31,33}-[0-9a-f]{15,17}-[0-9a-fA-F]{1,3}\\s{0,2}"
    }

    /// Instants of years 0 to 9999, which RFC 3339 can express.
    fn rfc3339_time() -> impl Strategy<Value = DateTime<Utc>> {
        (-62_167_219_200i64..=253_402_300_799, 0u32..1_000_000_000)
            .prop_filter_map("not an instant", |(secs, nanos)| {
                DateTime::from_timestamp(secs, nanos)
            })
    }

    /// A claimed row with arbitrary content in every field the wire format reads.
    fn message(
        names: impl Strategy<Value = String>,
        times: impl Strategy<Value = DateTime<Utc>>,
    ) -> impl Strategy<Value = OutboxMessage> {
        (
            (any::<u128>(), text(30), text(30), any::<i64>(), text(30)),
            (
                prop::collection::btree_map(names, header_value(), 0..10),
                prop::option::of(text(20)),
                prop::option::of(text(20)),
                prop::option::of(text(20)),
            ),
            times,
        )
            .prop_map(
                |(
                    (id, aggregate_type, aggregate_id, aggregate_version, event_type),
                    (headers, tenant_id, routing_key, partition_key),
                    occurred_at,
                )| OutboxMessage {
                    id: Uuid::from_u128(id),
                    seq: 1,
                    aggregate_type,
                    aggregate_id,
                    aggregate_version,
                    event_type,
                    payload: RawValue::from_string("{}".to_owned()).expect("valid JSON"),
                    headers,
                    tenant_id,
                    routing_key,
                    partition_key,
                    occurred_at,
                    created_at: occurred_at,
                    visible_at: occurred_at,
                    attempts: 1,
                    status: MessageStatus::Processing,
                    last_error: None,
                    claim_token: None,
                    lease_until: None,
                    sent_at: None,
                },
            )
    }

    /// The encoded headers as both transports collect them: the first of two headers
    /// of the same name wins (the CloudEvents attributes come first).
    fn first_wins(pairs: Vec<(String, String)>) -> Headers {
        let mut headers = Headers::new();
        for (name, value) in pairs {
            headers.entry(name).or_insert(value);
        }
        headers
    }

    fn binding() -> impl Strategy<Value = Binding> {
        prop_oneof![Just(Binding::Amqp), Just(Binding::Nats)]
    }

    proptest! {
        #![proptest_config(config())]

        /// Guards against `encode_headers` panicking on a row's content (arbitrary
        /// unicode, controls, empty or very long names, names of our own attributes,
        /// any `occurred_at` chrono can hold) and checks its shape: the eight
        /// CloudEvents attributes first, then tenant and partition key when set, then
        /// one pair per header of the row, correlation and causation ids prefixed.
        #[test]
        fn encode_headers_never_panics(
            msg in message(header_name(), any_time()),
            binding in binding(),
            source in prop::option::of(text(20)),
        ) {
            let pairs = encode_headers(&msg, binding, source.as_deref());
            let fixed = 8 + usize::from(msg.tenant_id.is_some())
                + usize::from(msg.partition_key.is_some());
            prop_assert_eq!(pairs.len(), fixed + msg.headers.len());
            let expected_source = source.unwrap_or_else(|| format!("/{}", msg.aggregate_type));
            prop_assert_eq!(&pairs[0], &(binding.name("specversion"), SPEC_VERSION.to_owned()));
            prop_assert_eq!(&pairs[1], &(binding.name("id"), msg.id.to_string()));
            prop_assert_eq!(&pairs[2], &(binding.name("source"), expected_source));
            prop_assert_eq!(&pairs[3], &(binding.name("type"), msg.event_type.clone()));
            let passed_through = msg.headers.iter().zip(&pairs[fixed..]);
            for ((name, value), (wire_name, wire_value)) in passed_through {
                prop_assert_eq!(value, wire_value);
                if name == CORRELATION_ID || name == CAUSATION_ID {
                    prop_assert_eq!(wire_name, &binding.name(name));
                } else {
                    prop_assert_eq!(wire_name, name);
                }
            }
        }

        /// Guards against `IncomingMessage::decode` panicking on whatever headers a
        /// broker delivers (anyone can publish to the exchange or stream): arbitrary
        /// names and values, attributes present or not, well-formed or not. The verdict
        /// is exactly: no id → `Missing("id")`, an id that is not a UUID → `Malformed`,
        /// no type → `Missing("type")`, an attribute or header name over its limit →
        /// `TooLong`, a version that is not an `i64` → `Malformed`, else `Ok` with every
        /// header kept; an error keeps the delivery as received and its usable id.
        #[test]
        fn decode_never_panics(
            binding in binding(),
            mut headers in prop::collection::btree_map(header_name(), header_value(), 0..12),
            attributes in prop::collection::vec(
                (prop::sample::select(ATTRIBUTES.to_vec()), header_value()),
                0..8,
            ),
            trace in prop::option::of((traceparent_like(), text(20))),
            message_id in prop::option::of(header_value()),
            payload in prop::collection::vec(any::<u8>(), 0..64),
            redelivered in any::<bool>(),
            delivery_count in prop::option::of(any::<u64>()),
        ) {
            for (attribute, value) in attributes {
                headers.insert(binding.name(attribute), value);
            }
            if let Some((traceparent, tracestate)) = trace {
                headers.insert(TRACEPARENT.to_owned(), traceparent);
                headers.insert(TRACESTATE.to_owned(), tracestate);
            }
            let get = |attribute: &str| headers.get(&binding.name(attribute)).cloned();
            let raw_id = get("id").or_else(|| message_id.clone());
            let too_long = [
                ("type", MAX_NAME_LEN),
                ("aggregatetype", MAX_NAME_LEN),
                ("tenantid", MAX_NAME_LEN),
                ("partitionkey", MAX_NAME_LEN),
                ("subject", MAX_AGGREGATE_ID_LEN),
            ]
            .into_iter()
            .find_map(|(field, max)| {
                get(field)
                    .filter(|v| v.len() > max)
                    .map(|v| DecodeError::TooLong { field, len: v.len(), max })
            })
            .or_else(|| {
                headers.keys().find(|n| n.len() > MAX_NAME_LEN).map(|n| DecodeError::TooLong {
                    field: "header name",
                    len: n.len(),
                    max: MAX_NAME_LEN,
                })
            });
            let expected = match raw_id.as_deref().map(Uuid::parse_str) {
                None => Err(DecodeError::Missing("id")),
                Some(Err(_)) => Err(DecodeError::Malformed {
                    attribute: "id",
                    value: quoted(raw_id.as_deref().unwrap_or_default()),
                }),
                Some(Ok(_)) if get("type").is_none() => Err(DecodeError::Missing("type")),
                Some(Ok(_)) if too_long.is_some() => Err(too_long.clone().expect("checked")),
                Some(Ok(id)) => match get("aggregateversion").map(|v| (v.parse::<i64>(), v)) {
                    Some((Err(_), value)) => Err(DecodeError::Malformed {
                        attribute: "aggregateversion",
                        value: quoted(&value),
                    }),
                    _ => Ok(id),
                },
            };
            let usable_id = get("id")
                .and_then(|v| Uuid::parse_str(&v).ok())
                .or_else(|| message_id.as_deref().and_then(|v| Uuid::parse_str(v).ok()));
            let decoded = IncomingMessage::decode(
                binding,
                message_id.as_deref(),
                headers.clone(),
                payload.clone(),
                redelivered,
                delivery_count,
            );
            match (decoded, expected) {
                (Ok(msg), Ok(id)) => {
                    prop_assert_eq!(msg.id, id);
                    prop_assert_eq!(Some(msg.event_type), get("type"));
                    prop_assert_eq!(
                        msg.traceparent,
                        headers.get(TRACEPARENT).and_then(|t| TraceParent::parse(t))
                    );
                    prop_assert_eq!(msg.headers, headers);
                    prop_assert_eq!(msg.payload, payload);
                    prop_assert_eq!(msg.redelivered, redelivered);
                    prop_assert_eq!(msg.delivery_count, delivery_count);
                }
                (Err(got), Err(expected)) => {
                    prop_assert_eq!(&got.error, &expected);
                    prop_assert_eq!(got.id, usable_id);
                    prop_assert_eq!(got.event_type, get("type"));
                    prop_assert_eq!(got.headers, headers);
                    prop_assert_eq!(got.payload, payload);
                }
                (got, expected) => prop_assert!(false, "got {got:?}, expected {expected:?}"),
            }
        }

        /// Guards the consumer's decode of what the publisher encodes: for any row
        /// (any content within the builder's length limits, any `occurred_at`), the
        /// encoded headers decode to the same id,
        /// type and attributes; the time survives for years 0-9999 and for others
        /// (which RFC 3339 cannot express) is dropped, never a panic or an error.
        #[test]
        fn encoded_rows_decode(
            msg in message(
                header_name().prop_filter(
                    "a pass-through header shadowing an attribute, or a name the builder refuses",
                    |n| {
                        !n.starts_with(Binding::Nats.prefix())
                            && !n.starts_with(Binding::Amqp.prefix())
                            && n.len() <= MAX_NAME_LEN
                    },
                ),
                prop_oneof![3 => rfc3339_time(), 1 => any_time()],
            ),
            binding in binding(),
        ) {
            let headers = first_wins(encode_headers(&msg, binding, None));
            let payload = b"{}".to_vec();
            let decoded = IncomingMessage::decode(binding, None, headers, payload, false, None)
                .map_err(|e| TestCaseError::fail(format!("an encoded row does not decode: {}", e.error)))?;
            prop_assert_eq!(decoded.id, msg.id);
            prop_assert_eq!(&decoded.event_type, &msg.event_type);
            prop_assert_eq!(decoded.source, Some(format!("/{}", msg.aggregate_type)));
            prop_assert_eq!(decoded.aggregate_type.as_ref(), Some(&msg.aggregate_type));
            prop_assert_eq!(decoded.aggregate_id.as_ref(), Some(&msg.aggregate_id));
            prop_assert_eq!(decoded.aggregate_version, Some(msg.aggregate_version));
            prop_assert_eq!(&decoded.tenant_id, &msg.tenant_id);
            prop_assert_eq!(&decoded.partition_key, &msg.partition_key);
            prop_assert_eq!(decoded.correlation_id.as_ref(), msg.headers.get(CORRELATION_ID));
            prop_assert_eq!(decoded.causation_id.as_ref(), msg.headers.get(CAUSATION_ID));
            prop_assert_eq!(
                decoded.traceparent,
                msg.headers.get(TRACEPARENT).and_then(|t| TraceParent::parse(t))
            );
            prop_assert_eq!(decoded.tracestate.as_ref(), msg.headers.get(TRACESTATE));
            let micros = msg.occurred_at.timestamp_micros();
            if (0..=9999).contains(&chrono::Datelike::year(&msg.occurred_at)) {
                prop_assert_eq!(
                    decoded.occurred_at.map(|t| t.timestamp_micros()),
                    Some(micros)
                );
            } else {
                prop_assert_eq!(decoded.occurred_at, None);
            }
            for (name, value) in &msg.headers {
                if name != CORRELATION_ID && name != CAUSATION_ID {
                    prop_assert_eq!(decoded.headers.get(name), Some(value));
                }
            }
        }

        /// Guards `TraceParent::parse` against panicking on any text (it slices and
        /// parses hex) and checks that what it accepts prints back as the same
        /// trace id, parent id and flags.
        #[test]
        fn traceparent_parse_never_panics(value in prop_oneof![traceparent_like(), text(60)]) {
            if let Some(parsed) = TraceParent::parse(&value) {
                let printed = parsed.to_string();
                prop_assert_eq!(&printed[2..], &value.trim()[2..]);
                prop_assert_eq!(TraceParent::parse(&printed), Some(parsed));
            }
        }
    }
}
