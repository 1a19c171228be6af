//! The message model: [`OutboxMessage`] (a stored row), [`NewMessage`] (what a producer
//! enqueues) and the [`MessageStatus`] state machine.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::error::{InvalidMessage, OutboxError};

/// Headers carried by a message: a sorted string map (name → value).
pub type Headers = BTreeMap<String, String>;

/// Headers from their stored JSON form, which must be an object whose values are all
/// strings (what [`NewMessage`] writes; a trigger, a migration or another language's
/// producer may write anything).
///
/// # Errors
/// A description of the first thing wrong, for a poison row's `last_error`.
pub fn headers_from_json(value: serde_json::Value) -> Result<Headers, String> {
    let serde_json::Value::Object(map) = value else {
        return Err(format!(
            "headers must be a JSON object of strings, not {}",
            json_kind(&value)
        ));
    };
    map.into_iter()
        .map(|(name, value)| match value {
            serde_json::Value::String(text) => Ok((name, text)),
            other => Err(format!(
                "headers must be a JSON object of strings: header {name:?} is {}",
                json_kind(&other)
            )),
        })
        .collect()
}

/// Headers from their stored JSON form, never failing: a value that is not a string
/// becomes its JSON text, and a form that is not an object becomes one header named
/// `(headers)` holding its JSON text. For showing rows to an operator (dead letters),
/// never for publishing.
pub fn headers_from_json_lossy(value: serde_json::Value) -> Headers {
    match value {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(name, value)| match value {
                serde_json::Value::String(text) => (name, text),
                other => (name, other.to_string()),
            })
            .collect(),
        other => Headers::from([("(headers)".to_owned(), other.to_string())]),
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The stored status of an outbox message. The numeric codes are what the stores persist
/// and MUST NOT change.
///
/// Legal transitions (stores enforce them in SQL with `WHERE status = ...`):
///
/// | from         | to           | when                                              |
/// |--------------|--------------|---------------------------------------------------|
/// | `New`        | `Processing` | claimed by a dispatcher                           |
/// | `Processing` | `Sent`       | the broker confirmed the publish                  |
/// | `Processing` | `New`        | transient failure (with backoff) or release       |
/// | `Processing` | `Dead`       | permanent failure or attempts exhausted           |
/// | `Processing` | `Processing` | the lease expired and another dispatcher reclaimed|
/// | `Dead`       | `New`        | replay                                            |
///
/// **Why 0, 1, 3 and 9.** The codes are stored in every row's `status` column and read
/// by operators' SQL, dashboards and producers in other languages, so they are part of
/// the product contract (`DESIGN.md`) and are never renumbered: they are names, not an
/// order (nothing compares them with `<`). The values that are not used (2, 4 to 8)
/// stay free, so a state added later gets a code of its own without rewriting stored
/// rows. Queries select by the `phase` column, not by ranges of codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[repr(i16)]
pub enum MessageStatus {
    /// Waiting to be claimed once `visible_at` has passed. Code 0.
    New = 0,
    /// Published and confirmed by the broker. Code 1.
    Sent = 1,
    /// Failed permanently or ran out of attempts; kept with `last_error` until replayed.
    /// Code 3.
    Dead = 3,
    /// Claimed by a dispatcher that holds a lease until `lease_until`. Code 9.
    Processing = 9,
}

impl MessageStatus {
    /// The code stored in the `status` column.
    pub const fn code(self) -> i16 {
        self as i16
    }

    /// Parses a stored code.
    ///
    /// # Errors
    /// [`OutboxError::UnknownStatus`] for a code that is not one of 0, 1, 3, 9.
    pub fn from_code(code: i16) -> Result<Self, OutboxError> {
        match code {
            0 => Ok(Self::New),
            1 => Ok(Self::Sent),
            3 => Ok(Self::Dead),
            9 => Ok(Self::Processing),
            other => Err(OutboxError::UnknownStatus(other)),
        }
    }

    /// Whether the state machine allows `self → to` (see the type's table).
    pub const fn can_transition_to(self, to: MessageStatus) -> bool {
        use MessageStatus::{Dead, New, Processing, Sent};
        matches!(
            (self, to),
            (New, Processing)
                | (Processing, Sent)
                | (Processing, New)
                | (Processing, Dead)
                | (Processing, Processing)
                | (Dead, New)
        )
    }
}

impl fmt::Display for MessageStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::New => "new",
            Self::Sent => "sent",
            Self::Dead => "dead",
            Self::Processing => "processing",
        })
    }
}

/// A message as stored in the outbox and handed to publishers.
///
/// `id` is a UUIDv7: it is also the broker message id (AMQP `message-id`, `Nats-Msg-Id`)
/// and the consumer-side inbox key.
///
/// Not `#[non_exhaustive]`: backends construct it from rows, and a new column is a
/// deliberate breaking change for every backend.
#[derive(Debug, Clone)]
pub struct OutboxMessage {
    /// Unique id (UUIDv7), the broker message id and the inbox key.
    pub id: Uuid,
    /// Insertion order assigned by the database (monotonic per table, gaps allowed).
    pub seq: i64,
    /// Kind of aggregate that raised the event, e.g. `"order"`.
    pub aggregate_type: String,
    /// Id of the aggregate instance, as text.
    pub aggregate_id: String,
    /// Version of the aggregate after the event (0 when the producer does not version).
    pub aggregate_version: i64,
    /// Event type, e.g. `"OrderPlaced"`; never empty. Default routing key.
    pub event_type: String,
    /// The JSON payload, exactly as enqueued (already validated).
    pub payload: Box<RawValue>,
    /// Extra headers (string map), including the captured trace context.
    pub headers: Headers,
    /// Tenant, when the producer is multi-tenant.
    pub tenant_id: Option<String>,
    /// Routing key (AMQP) or subject suffix (NATS); `None` means use `event_type`.
    pub routing_key: Option<String>,
    /// Ordering key; `None` means the aggregate (`aggregate_type` + `aggregate_id`).
    pub partition_key: Option<String>,
    /// When the event happened (producer's statement).
    pub occurred_at: DateTime<Utc>,
    /// When the row was written (database clock, transaction time).
    pub created_at: DateTime<Utc>,
    /// Not claimable before this instant (database clock).
    pub visible_at: DateTime<Utc>,
    /// Claims so far, including the current one.
    pub attempts: i32,
    /// Current status.
    pub status: MessageStatus,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// Fencing token of the current claim; completions must present it.
    pub claim_token: Option<Uuid>,
    /// End of the current lease (database clock).
    pub lease_until: Option<DateTime<Utc>>,
    /// When the broker confirmed the publish (database clock).
    pub sent_at: Option<DateTime<Utc>>,
}

impl OutboxMessage {
    /// The row a store would hand a publisher right after first claiming `msg` at
    /// `now`: `seq` 0, `attempts` 1, status `Processing`, `occurred_at` as given or
    /// `now`, a fresh claim token. For exercising a publisher without a store
    /// (benchmarks, transport tests).
    #[doc(hidden)] // reason: a test and bench helper (transport suites, bench), not API
    pub fn claimed_from(msg: NewMessage, now: DateTime<Utc>) -> Self {
        Self {
            id: msg.id,
            seq: 0,
            aggregate_type: msg.aggregate_type,
            aggregate_id: msg.aggregate_id,
            aggregate_version: msg.aggregate_version,
            event_type: msg.event_type,
            payload: msg.payload,
            headers: msg.headers,
            tenant_id: msg.tenant_id,
            routing_key: msg.routing_key,
            partition_key: msg.partition_key,
            occurred_at: msg.occurred_at.unwrap_or(now),
            created_at: now,
            visible_at: now,
            attempts: 1,
            status: MessageStatus::Processing,
            last_error: None,
            claim_token: Some(Uuid::new_v4()),
            lease_until: None,
            sent_at: None,
        }
    }

    /// The routing key to publish with: `routing_key`, or else `event_type`.
    pub fn effective_routing_key(&self) -> &str {
        self.routing_key.as_deref().unwrap_or(&self.event_type)
    }

    /// The ordering key: `partition_key`, or else `"{aggregate_type}:{aggregate_id}"`.
    pub fn effective_partition_key(&self) -> String {
        match &self.partition_key {
            Some(key) => key.clone(),
            None => format!("{}:{}", self.aggregate_type, self.aggregate_id),
        }
    }
}

/// Maximum length, in bytes, of `event_type`, `aggregate_type`, keys and header names.
pub const MAX_NAME_LEN: usize = 255;

/// Maximum length, in bytes, of `aggregate_id`: 1,024. Consumers key their version
/// records on the aggregate id and an index entry has a size limit (PostgreSQL's btree:
/// about 2,700 bytes for the whole key, consumer name and aggregate type included), so
/// [`IncomingMessage::decode`](crate::wire::IncomingMessage::decode) refuses a longer
/// CloudEvents `subject` and the builder refuses to make one.
pub const MAX_AGGREGATE_ID_LEN: usize = 1024;

/// Default payload limit of the stores' `enqueue`: 1 MiB (1,048,576 bytes) of the
/// payload's JSON text (see [`NewMessage::check_payload_size`]).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// A message to enqueue: built with [`NewMessage::builder`], validated by
/// [`NewMessageBuilder::build`], written by a store's `enqueue` inside the caller's
/// transaction.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NewMessage {
    /// UUIDv7 generated at build time (or supplied with [`NewMessageBuilder::id`]).
    pub id: Uuid,
    /// See [`OutboxMessage::aggregate_type`].
    pub aggregate_type: String,
    /// See [`OutboxMessage::aggregate_id`].
    pub aggregate_id: String,
    /// See [`OutboxMessage::aggregate_version`].
    pub aggregate_version: i64,
    /// See [`OutboxMessage::event_type`].
    pub event_type: String,
    /// Validated JSON payload.
    pub payload: Box<RawValue>,
    /// See [`OutboxMessage::headers`].
    pub headers: Headers,
    /// See [`OutboxMessage::tenant_id`].
    pub tenant_id: Option<String>,
    /// See [`OutboxMessage::routing_key`].
    pub routing_key: Option<String>,
    /// See [`OutboxMessage::partition_key`].
    pub partition_key: Option<String>,
    /// See [`OutboxMessage::occurred_at`]; `None` means the database's `now()`.
    pub occurred_at: Option<DateTime<Utc>>,
    /// Delay before the message becomes claimable, applied as `now() + delay` in SQL.
    pub deliver_after: Option<Duration>,
}

impl NewMessage {
    /// Checks that the payload's JSON text is at most `max` bytes long. Stores call it
    /// for every message of a batch before they write any: a payload far beyond what a
    /// broker takes would otherwise be stored, claimed and dead-lettered at publish.
    ///
    /// # Errors
    /// [`InvalidMessage::PayloadTooLarge`] with the payload's length and `max`.
    pub fn check_payload_size(&self, max: usize) -> Result<(), InvalidMessage> {
        let size = self.payload.get().len();
        if size > max {
            return Err(InvalidMessage::PayloadTooLarge { size, max });
        }
        Ok(())
    }

    /// Starts a builder for an event of `event_type` raised by aggregate
    /// `aggregate_type`/`aggregate_id`.
    pub fn builder(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
    ) -> NewMessageBuilder {
        NewMessageBuilder {
            id: None,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version: 0,
            event_type: event_type.into(),
            payload: PayloadSource::Missing,
            headers: Headers::new(),
            tenant_id: None,
            routing_key: None,
            partition_key: None,
            occurred_at: None,
            deliver_after: None,
        }
    }
}

#[derive(Debug)]
enum PayloadSource {
    Missing,
    Json(Result<Box<RawValue>, String>),
}

/// Builder for [`NewMessage`]; every setter consumes and returns the builder.
#[derive(Debug)]
#[must_use]
pub struct NewMessageBuilder {
    id: Option<Uuid>,
    aggregate_type: String,
    aggregate_id: String,
    aggregate_version: i64,
    event_type: String,
    payload: PayloadSource,
    headers: Headers,
    tenant_id: Option<String>,
    routing_key: Option<String>,
    partition_key: Option<String>,
    occurred_at: Option<DateTime<Utc>>,
    deliver_after: Option<Duration>,
}

impl NewMessageBuilder {
    /// Uses this id instead of a fresh UUIDv7 (e.g. a deterministic idempotency key).
    pub fn id(mut self, id: Uuid) -> Self {
        self.id = Some(id);
        self
    }

    /// Payload from any serializable value (serialized with `serde_json`).
    pub fn payload<T: Serialize + ?Sized>(mut self, value: &T) -> Self {
        self.payload =
            PayloadSource::Json(serde_json::value::to_raw_value(value).map_err(|e| e.to_string()));
        self
    }

    /// Payload from JSON text; it is validated by [`build`](Self::build).
    pub fn payload_json(mut self, json: impl Into<String>) -> Self {
        self.payload =
            PayloadSource::Json(RawValue::from_string(json.into()).map_err(|e| e.to_string()));
        self
    }

    /// Aggregate version after this event (default 0).
    pub fn aggregate_version(mut self, version: i64) -> Self {
        self.aggregate_version = version;
        self
    }

    /// Adds one header. Names must be non-empty, at most [`MAX_NAME_LEN`] bytes, and free
    /// of control characters; values free of control characters.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Tenant id (default none).
    pub fn tenant_id(mut self, tenant: impl Into<String>) -> Self {
        self.tenant_id = Some(tenant.into());
        self
    }

    /// Routing key (default: the event type).
    pub fn routing_key(mut self, key: impl Into<String>) -> Self {
        self.routing_key = Some(key.into());
        self
    }

    /// Partition (ordering) key (default: the aggregate).
    pub fn partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Correlation id, carried as the `correlationid` header.
    pub fn correlation_id(self, id: impl Into<String>) -> Self {
        self.header(crate::wire::CORRELATION_ID, id)
    }

    /// Causation id, carried as the `causationid` header.
    pub fn causation_id(self, id: impl Into<String>) -> Self {
        self.header(crate::wire::CAUSATION_ID, id)
    }

    /// W3C Trace Context (<https://www.w3.org/TR/trace-context/>) of the producing span:
    /// `traceparent` (validated) and optional `tracestate`, carried in the row and
    /// injected into broker headers by the transports.
    pub fn trace_context(
        mut self,
        traceparent: impl Into<String>,
        tracestate: Option<String>,
    ) -> Self {
        self.headers
            .insert(crate::wire::TRACEPARENT.to_owned(), traceparent.into());
        if let Some(state) = tracestate {
            self.headers
                .insert(crate::wire::TRACESTATE.to_owned(), state);
        }
        self
    }

    /// When the event happened (default: the database's `now()` at enqueue).
    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = Some(at);
        self
    }

    /// Makes the message claimable only after `delay` (computed as `now() + delay` by
    /// the database). Default: at once.
    pub fn deliver_after(mut self, delay: Duration) -> Self {
        self.deliver_after = Some(delay);
        self
    }

    /// Validates and builds the message. With the `opentelemetry` feature (default) and
    /// no explicit [`trace_context`](Self::trace_context), the current span's
    /// OpenTelemetry context is captured as `traceparent`/`tracestate`.
    ///
    /// # Errors
    /// [`OutboxError::InvalidMessage`] when the event type or aggregate type is empty or
    /// longer than [`MAX_NAME_LEN`], the aggregate id is empty or longer than
    /// [`MAX_AGGREGATE_ID_LEN`], the payload is missing or not valid JSON, a header name
    /// is empty or a header contains control characters, or a key is empty.
    // `mut` is needed only for the trace-context capture.
    #[cfg_attr(not(feature = "opentelemetry"), allow(unused_mut))]
    pub fn build(mut self) -> Result<NewMessage, OutboxError> {
        validate_name("event_type", &self.event_type)?;
        validate_name("aggregate_type", &self.aggregate_type)?;
        if self.aggregate_id.is_empty() {
            return Err(InvalidMessage::Empty {
                field: "aggregate_id",
            }
            .into());
        }
        if self.aggregate_id.len() > MAX_AGGREGATE_ID_LEN {
            return Err(InvalidMessage::TooLong {
                field: "aggregate_id",
                len: self.aggregate_id.len(),
                max: MAX_AGGREGATE_ID_LEN,
            }
            .into());
        }
        for (field, value) in [
            ("routing_key", &self.routing_key),
            ("partition_key", &self.partition_key),
            ("tenant_id", &self.tenant_id),
        ] {
            if let Some(v) = value {
                validate_name(field, v)?;
            }
        }
        for (name, value) in &self.headers {
            validate_name("header name", name)?;
            if value.chars().any(char::is_control) {
                return Err(InvalidMessage::ControlCharacter {
                    field: "header value",
                    value: name.clone(),
                }
                .into());
            }
        }
        #[cfg(feature = "opentelemetry")]
        if !self.headers.contains_key(crate::wire::TRACEPARENT)
            && let Some((traceparent, tracestate)) = crate::otel::current_trace_context()
        {
            self.headers
                .insert(crate::wire::TRACEPARENT.to_owned(), traceparent);
            if let Some(state) = tracestate {
                self.headers
                    .insert(crate::wire::TRACESTATE.to_owned(), state);
            }
        }
        if let Some(tp) = self.headers.get(crate::wire::TRACEPARENT)
            && crate::wire::TraceParent::parse(tp).is_none()
        {
            return Err(InvalidMessage::TraceParent(tp.clone()).into());
        }
        let payload = match self.payload {
            PayloadSource::Missing => return Err(InvalidMessage::MissingPayload.into()),
            PayloadSource::Json(Err(reason)) => {
                return Err(InvalidMessage::InvalidJson(reason).into());
            }
            PayloadSource::Json(Ok(raw)) => raw,
        };
        Ok(NewMessage {
            id: self.id.unwrap_or_else(Uuid::now_v7),
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            aggregate_version: self.aggregate_version,
            event_type: self.event_type,
            payload,
            headers: self.headers,
            tenant_id: self.tenant_id,
            routing_key: self.routing_key,
            partition_key: self.partition_key,
            occurred_at: self.occurred_at,
            deliver_after: self.deliver_after,
        })
    }
}

fn validate_name(field: &'static str, value: &str) -> Result<(), InvalidMessage> {
    if value.is_empty() {
        return Err(InvalidMessage::Empty { field });
    }
    if value.len() > MAX_NAME_LEN {
        return Err(InvalidMessage::TooLong {
            field,
            len: value.len(),
            max: MAX_NAME_LEN,
        });
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidMessage::ControlCharacter {
            field,
            value: value.escape_debug().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_are_stable() {
        for (status, code) in [
            (MessageStatus::New, 0),
            (MessageStatus::Sent, 1),
            (MessageStatus::Dead, 3),
            (MessageStatus::Processing, 9),
        ] {
            assert_eq!(status.code(), code);
            assert_eq!(MessageStatus::from_code(code).ok(), Some(status));
        }
        assert!(matches!(
            MessageStatus::from_code(2),
            Err(OutboxError::UnknownStatus(2))
        ));
    }

    #[test]
    fn payload_size_is_checked_on_the_json_text() {
        let message = NewMessage::builder("order", "1", "OrderPlaced")
            .payload_json(r#"{"a": "\u00e9"}"#)
            .build()
            .expect("valid");
        let size = message.payload.get().len();
        assert_eq!(size, 15, "the text as written, escapes included");
        assert_eq!(message.check_payload_size(size), Ok(()));
        assert_eq!(
            message.check_payload_size(size - 1),
            Err(InvalidMessage::PayloadTooLarge {
                size,
                max: size - 1
            })
        );
        assert_eq!(DEFAULT_MAX_PAYLOAD_BYTES, 1_048_576);
    }

    #[test]
    fn transitions_follow_the_design() {
        use MessageStatus::*;
        assert!(New.can_transition_to(Processing));
        assert!(Processing.can_transition_to(Processing));
        assert!(Dead.can_transition_to(New));
        assert!(!New.can_transition_to(Sent));
        assert!(!Sent.can_transition_to(New));
        assert!(!Dead.can_transition_to(Sent));
    }

    /// The builder makes nothing a consumer would refuse to decode.
    #[test]
    fn aggregate_ids_are_limited_like_the_consumers_limit_them() {
        let at_limit = NewMessage::builder("order", "x".repeat(MAX_AGGREGATE_ID_LEN), "T")
            .payload(&1)
            .build();
        assert!(at_limit.is_ok());
        let over = NewMessage::builder("order", "x".repeat(MAX_AGGREGATE_ID_LEN + 1), "T")
            .payload(&1)
            .build();
        assert!(matches!(
            over,
            Err(OutboxError::InvalidMessage(InvalidMessage::TooLong {
                field: "aggregate_id",
                len: 1025,
                max: 1024
            }))
        ));
    }

    #[test]
    fn builder_rejects_bad_input() {
        let empty_type = NewMessage::builder("order", "1", "").payload(&1).build();
        assert!(matches!(
            empty_type,
            Err(OutboxError::InvalidMessage(InvalidMessage::Empty {
                field: "event_type"
            }))
        ));
        let bad_json = NewMessage::builder("order", "1", "OrderPlaced")
            .payload_json("{not json")
            .build();
        assert!(matches!(
            bad_json,
            Err(OutboxError::InvalidMessage(InvalidMessage::InvalidJson(_)))
        ));
        let no_payload = NewMessage::builder("order", "1", "OrderPlaced").build();
        assert!(matches!(
            no_payload,
            Err(OutboxError::InvalidMessage(InvalidMessage::MissingPayload))
        ));
        let bad_header = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&1)
            .header("x", "a\nb")
            .build();
        assert!(bad_header.is_err());
        let bad_trace = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&1)
            .trace_context("nonsense", None)
            .build();
        assert!(matches!(
            bad_trace,
            Err(OutboxError::InvalidMessage(InvalidMessage::TraceParent(_)))
        ));
    }

    #[cfg(feature = "opentelemetry")]
    #[test]
    fn build_captures_the_current_opentelemetry_span() {
        use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
        use tracing_opentelemetry::OpenTelemetrySpanExt as _;
        use tracing_subscriber::layer::SubscriberExt as _;

        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let _guard = tracing::subscriber::set_default(subscriber);
        let span = tracing::info_span!("place_order");
        let _entered = span.enter();
        let trace_id = span.context().span().span_context().trace_id();

        let msg = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&1)
            .build()
            .expect("valid");
        let tp = msg.headers.get(crate::wire::TRACEPARENT).expect("captured");
        assert!(tp.starts_with(&format!("00-{trace_id:032x}-")), "{tp}");

        let explicit = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&1)
            .trace_context(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            )
            .build()
            .expect("valid");
        assert_eq!(
            explicit
                .headers
                .get(crate::wire::TRACEPARENT)
                .map(String::as_str),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            "an explicit context wins"
        );
    }

    #[test]
    fn builder_keeps_payload_text_and_makes_v7_ids() {
        let msg = NewMessage::builder("order", "42", "OrderPlaced")
            .payload_json(r#"{"b":1,"a":2}"#)
            .build()
            .expect("valid");
        assert_eq!(msg.payload.get(), r#"{"b":1,"a":2}"#);
        assert_eq!(msg.id.get_version_num(), 7);
    }
}

/// Property tests: no panic is reachable from the stored JSON form of a row's headers.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::proptest_support::{config, text};
    use proptest::prelude::*;
    use serde_json::Value;

    /// Any JSON value, nested up to 4 levels, numbers of every kind (NaN and the
    /// infinities become `null`, as `serde_json` does).
    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text(40).prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                prop::collection::btree_map(text(20), inner, 0..8)
                    .prop_map(|map| Value::Object(map.into_iter().collect())),
            ]
        })
    }

    /// What a stored `headers` column may hold: anything, often an object of strings
    /// (the well-formed case), sometimes an object with one value of another kind.
    fn stored_headers() -> impl Strategy<Value = Value> {
        let strings = || prop::collection::btree_map(text(30), text(60), 0..12);
        prop_oneof![
            json(),
            strings().prop_map(|map| Value::Object(
                map.into_iter()
                    .map(|(k, v)| (k, Value::String(v)))
                    .collect()
            )),
            (strings(), text(30), json()).prop_map(|(map, name, odd)| {
                let mut object: serde_json::Map<String, Value> = map
                    .into_iter()
                    .map(|(k, v)| (k, Value::String(v)))
                    .collect();
                object.insert(name, odd);
                Value::Object(object)
            }),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        /// Guards against `headers_from_json` panicking on, or accepting, a column that
        /// is not an object of strings (a trigger, migration or foreign producer may
        /// have written anything): `Ok` exactly for an object of strings, and then the
        /// same map; otherwise a description, never a panic.
        #[test]
        fn strict_headers_accept_exactly_objects_of_strings(value in stored_headers()) {
            let expected: Option<Headers> = match &value {
                Value::Object(map) => map
                    .iter()
                    .map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                    .collect(),
                _ => None,
            };
            match (headers_from_json(value.clone()), expected) {
                (Ok(headers), Some(expected)) => prop_assert_eq!(headers, expected),
                (Err(reason), None) => prop_assert!(!reason.is_empty()),
                (got, expected) => prop_assert!(
                    false,
                    "{value} gave {got:?}, expected {expected:?}"
                ),
            }
        }

        /// Guards against `headers_from_json_lossy` (used to show dead letters) panicking
        /// or dropping a header: every key of an object is kept (strings as they are,
        /// other values as their JSON text), anything else becomes the one `(headers)`
        /// header.
        #[test]
        fn lossy_headers_keep_every_key(value in stored_headers()) {
            let headers = headers_from_json_lossy(value.clone());
            match &value {
                Value::Object(map) => {
                    prop_assert_eq!(headers.len(), map.len());
                    for (name, v) in map {
                        let shown = headers.get(name);
                        prop_assert!(shown.is_some(), "header {:?} dropped", name);
                        match v {
                            Value::String(s) => prop_assert_eq!(shown, Some(s)),
                            other => prop_assert_eq!(shown, Some(&other.to_string())),
                        }
                    }
                }
                other => {
                    prop_assert_eq!(headers.len(), 1);
                    prop_assert_eq!(headers.get("(headers)"), Some(&other.to_string()));
                }
            }
        }
    }
}
