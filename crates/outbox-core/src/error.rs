//! Typed errors. Callers branch on [`ErrorKind`] (retryable or not), never on text.

use std::time::Duration;

/// A boxed error source from a driver (sqlx, lapin, ...).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a caller can do about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Retrying the same operation later may succeed (timeout, nack, lock conflict).
    Transient,
    /// The database or broker cannot take the work now: it cannot be reached, does not
    /// answer in time, or refuses everything for a while (a RabbitMQ resource alarm or a
    /// queue at its `x-max-length` with `reject-publish`, a JetStream stream that is
    /// full, being moved or has no leader). Retryable, and never the message's fault: the
    /// dispatcher opens its circuit and releases the messages instead of charging
    /// attempts.
    Unavailable,
    /// Retrying cannot help (bad input, unroutable message, payload too large).
    Permanent,
}

impl ErrorKind {
    /// `true` for [`Transient`](Self::Transient) and [`Unavailable`](Self::Unavailable).
    pub const fn is_retryable(self) -> bool {
        matches!(self, Self::Transient | Self::Unavailable)
    }
}

/// Why a [`NewMessage`](crate::NewMessage) was rejected. Nothing is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// A required text field is empty.
    #[error("{field} must not be empty")]
    Empty {
        /// The field.
        field: &'static str,
    },
    /// A text field is longer than allowed.
    #[error("{field} is {len} bytes long, the maximum is {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The maximum in bytes.
        max: usize,
    },
    /// A field contains a control character (newline, NUL, ...).
    #[error("{field} contains a control character: {value:?}")]
    ControlCharacter {
        /// The field.
        field: &'static str,
        /// The offending value (escaped) or header name.
        value: String,
    },
    /// No payload was given.
    #[error("payload is missing")]
    MissingPayload,
    /// The payload is not valid JSON.
    #[error("payload is not valid JSON: {0}")]
    InvalidJson(String),
    /// The `traceparent` header is not a W3C Trace Context `traceparent`.
    #[error("traceparent {0:?} is not a valid W3C Trace Context traceparent")]
    TraceParent(String),
}

/// Errors of stores and the dispatcher.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The message failed validation; nothing was written.
    #[error("invalid message: {0}")]
    InvalidMessage(#[from] InvalidMessage),
    /// A row carries a status code this version does not know.
    #[error("unknown message status code {0} in the table")]
    UnknownStatus(i16),
    /// A configuration value is invalid (URL, schema name, sizes, durations).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The database reported an error.
    #[error("database error ({kind:?}) during {operation}: {source}")]
    Database {
        /// Retryable or not.
        kind: ErrorKind,
        /// What was being done, e.g. `"claim"`.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// A stored row could not be decoded (e.g. a payload that is not JSON).
    #[error("row {id} could not be decoded: {reason}")]
    Decode {
        /// The row id, as text.
        id: String,
        /// What was wrong.
        reason: String,
    },
    /// Publishing failed at the batch level.
    #[error(transparent)]
    Publish(#[from] PublishError),
}

impl OutboxError {
    /// Whether retrying may help.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Database { kind, .. } => *kind,
            Self::Publish(e) => e.kind(),
            _ => ErrorKind::Permanent,
        }
    }
}

/// Why publishing one message (or reaching the broker) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// No connection to the broker, or it was lost before the confirm arrived.
    #[error("broker unavailable: {reason}")]
    Unavailable {
        /// What happened.
        reason: String,
        /// The driver's error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The broker refused to take responsibility for the message for a reason of its own
    /// (AMQP `basic.nack`: a full queue with `reject-publish`, a queue process failure;
    /// a JetStream error about the stream's state, such as storage full). Not the
    /// message's fault: [`ErrorKind::Unavailable`].
    #[error("broker rejected the message: {reason}")]
    Rejected {
        /// The broker's words.
        reason: String,
    },
    /// The broker could not route the message to any queue or stream (AMQP mandatory
    /// return, e.g. `312 NO_ROUTE`).
    #[error(
        "unroutable: exchange {exchange:?}, routing key {routing_key:?}: {reply_code} {reply_text}"
    )]
    Unroutable {
        /// Exchange or stream the message was sent to.
        exchange: String,
        /// Routing key or subject.
        routing_key: String,
        /// Broker reply code.
        reply_code: u16,
        /// Broker reply text.
        reply_text: String,
    },
    /// The payload exceeds the broker's limit.
    #[error("payload of {size} bytes exceeds the broker limit of {max} bytes")]
    PayloadTooLarge {
        /// Payload size in bytes.
        size: usize,
        /// Broker limit in bytes.
        max: usize,
    },
    /// The routing key, subject or a header cannot be expressed on the wire.
    #[error("invalid destination or header: {0}")]
    Invalid(String),
    /// No confirmation arrived in time: the broker is slow, frozen or blocked.
    /// [`ErrorKind::Unavailable`].
    #[error("no broker confirmation within {0:?}")]
    Timeout(Duration),
    /// A confirmation was not requested though it must be (AMQP `NotRequested`).
    #[error("publisher confirms are not enabled on the channel")]
    ConfirmsNotEnabled,
    /// Anything else, classified by the transport.
    #[error("{message}")]
    Other {
        /// Classification.
        kind: ErrorKind,
        /// Description.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
}

impl PublishError {
    /// The classification that drives retry, dead-lettering and the circuit breaker.
    /// Only a verdict about the message itself ([`Unroutable`](Self::Unroutable),
    /// [`PayloadTooLarge`](Self::PayloadTooLarge), [`Invalid`](Self::Invalid)) is
    /// permanent; what a degraded broker says ([`Rejected`](Self::Rejected),
    /// [`Timeout`](Self::Timeout)) is an outage, like no connection at all.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Unavailable { .. } | Self::Rejected { .. } | Self::Timeout(_) => {
                ErrorKind::Unavailable
            }
            Self::Unroutable { .. }
            | Self::PayloadTooLarge { .. }
            | Self::Invalid(_)
            | Self::ConfirmsNotEnabled => ErrorKind::Permanent,
            Self::Other { kind, .. } => *kind,
        }
    }

    /// Shorthand for [`PublishError::Unavailable`].
    pub fn unavailable(reason: impl Into<String>, source: Option<BoxError>) -> Self {
        Self::Unavailable {
            reason: reason.into(),
            source,
        }
    }
}

/// What a user info without a `:` (no password part) is, when redacting a URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoneUserInfo {
    /// A user name, shown as is (`amqp://guest@host`).
    UserName,
    /// A secret token, hidden whole (`nats://s3cr3t@host` → `nats://***@host`).
    Token,
}

/// `url` with the password of its user info replaced by `***`, so it can go into logs
/// and error messages. Best effort on malformed URLs too: whatever sits between the
/// first `:` of the user info and the last `@` of the authority is hidden.
pub fn redact_url(url: &str, lone: LoneUserInfo) -> String {
    let (prefix, rest, authority_len) = match url.find("://") {
        Some(i) => {
            let (prefix, rest) = url.split_at(i + 3);
            (
                prefix,
                rest,
                rest.find(['/', '?', '#']).unwrap_or(rest.len()),
            )
        }
        // No recognisable scheme (`amqp//user:pw@host`): the whole text may hide a
        // user info, so nothing is cut off before looking for the `@`.
        None => ("", url, url.len()),
    };
    let Some(at) = rest[..authority_len].rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &rest[..at];
    let shown = match (userinfo.find(':'), lone) {
        (Some(colon), _) => format!("{}:***", &userinfo[..colon]),
        (None, LoneUserInfo::Token) => "***".to_owned(),
        (None, LoneUserInfo::UserName) => return url.to_owned(),
    };
    format!("{prefix}{shown}{}", &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_passwords_and_tokens() {
        use LoneUserInfo::{Token, UserName};
        assert_eq!(
            redact_url("amqp://guest:s3cret@h:5672/%2f", UserName),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(
            redact_url("amqps://u:p@ss@w0rd@host/v?x=1", UserName),
            "amqps://u:***@host/v?x=1"
        );
        assert_eq!(redact_url("amqp://user@host", UserName), "amqp://user@host");
        assert_eq!(redact_url("nats://s3cr3t@host", Token), "nats://***@host");
        assert_eq!(
            redact_url("amqp//guest:hunter2@host", UserName),
            "amqp//guest:***@host"
        );
        assert_eq!(redact_url("user:secret@host", UserName), "user:***@host");
        assert_eq!(redact_url("not a url", Token), "not a url");
        assert_eq!(
            redact_url("nats://host/a@b", Token),
            "nats://host/a@b",
            "an @ after the authority is not user info"
        );
    }
}
