//! [`RabbitError`]: what can go wrong while configuring, connecting, declaring topology or
//! consuming. Per-message publish failures are [`outboxkit_core::PublishError`]s instead.
//!
//! Driver errors are boxed to keep `Result<_, RabbitError>` small.
//!
//! Callers branch on [`RabbitError::kind`], never on the message text. No variant ever
//! contains the password of the broker URL: URLs are stored redacted
//! (`amqp://user:***@host:5672/%2f`).

use std::time::Duration;

use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use outboxkit_core::ErrorKind;

/// Errors of the RabbitMQ transport outside the per-message publish path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitError {
    /// The broker URL is not a valid `amqp://` or `amqps://` URL.
    #[error("invalid AMQP URL {url_redacted:?}: {reason}")]
    InvalidUrl {
        /// The URL with its password replaced by `***`.
        url_redacted: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value other than the URL is invalid.
    #[error("invalid configuration: {field}: {reason}")]
    InvalidConfig {
        /// The setting, e.g. `"exchange"`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An environment variable read by
    /// [`RabbitConfig::from_env`](crate::RabbitConfig::from_env) is invalid
    /// (the variable and its value are named, a URL's password hidden).
    #[error("invalid configuration: {0}")]
    Env(#[from] outboxkit_core::EnvError),
    /// The connection to the broker could not be established (refused, unreachable,
    /// bad credentials, unknown virtual host, TLS failure).
    #[error("could not connect to {url_redacted}: {source}")]
    Connect {
        /// The URL with its password replaced by `***`.
        url_redacted: String,
        /// The driver's error.
        #[source]
        source: Box<lapin::Error>,
    },
    /// Connecting (TCP, TLS, AMQP handshake and channel setup) took longer than the
    /// configured connect timeout.
    #[error("timed out after {timeout:?} connecting to {url_redacted}")]
    ConnectTimeout {
        /// The URL with its password replaced by `***`.
        url_redacted: String,
        /// The configured connect timeout.
        timeout: Duration,
    },
    /// Opening or configuring a channel failed (`channel.open`, `confirm.select`,
    /// `basic.qos`).
    #[error("channel operation {operation} failed: {source}")]
    Channel {
        /// The AMQP method, e.g. `"confirm.select"`.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: Box<lapin::Error>,
    },
    /// Declaring or binding topology failed (`exchange.declare`, `queue.declare`,
    /// `queue.bind`), e.g. an existing exchange of another type (`406
    /// PRECONDITION_FAILED`) or a missing exchange on a passive declare (`404
    /// NOT_FOUND`).
    #[error("{operation} {name:?} failed: {source}")]
    Declare {
        /// The AMQP method, e.g. `"exchange.declare"`.
        operation: &'static str,
        /// The exchange or queue name.
        name: String,
        /// The driver's error.
        #[source]
        source: Box<lapin::Error>,
    },
    /// Starting or running a consumer failed (`basic.consume`, a delivery error, or the
    /// broker cancelled the consumer).
    #[error("consuming from queue {queue:?} failed: {reason}")]
    Consume {
        /// The queue.
        queue: String,
        /// What happened.
        reason: String,
        /// The driver's error, if any.
        #[source]
        source: Option<Box<lapin::Error>>,
    },
}

impl RabbitError {
    /// What the caller can do about it:
    ///
    /// - [`ErrorKind::Permanent`]: invalid URL or configuration, bad credentials or
    ///   missing permissions (`403 ACCESS_REFUSED`), an unknown virtual host,
    ///   inequivalent topology (`406 PRECONDITION_FAILED` on a declare; a 406 that closes
    ///   a consuming channel is transient: the consumer reconnects);
    /// - [`ErrorKind::Unavailable`]: the broker cannot be reached or the connection was
    ///   lost (I/O errors, timeouts, `320 CONNECTION_FORCED`, missed heartbeats);
    /// - [`ErrorKind::Transient`]: anything else that may pass (e.g. `404 NOT_FOUND` for
    ///   an exchange another service has yet to declare).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidUrl { .. } | Self::InvalidConfig { .. } | Self::Env(_) => {
                ErrorKind::Permanent
            }
            Self::ConnectTimeout { .. } => ErrorKind::Unavailable,
            Self::Connect { source, .. } => match classify(source) {
                // A refused handshake at connect time is the credentials' or vhost's
                // fault, not an outage.
                ErrorKind::Permanent => ErrorKind::Permanent,
                _ => ErrorKind::Unavailable,
            },
            Self::Channel { source, .. } | Self::Declare { source, .. } => classify(source),
            // A channel closed with 406 while consuming is not the topology's fault (that
            // fails `queue.declare`): an answer the broker did not know, or its
            // `consumer_timeout` for a delivery held too long. A new channel gets the
            // unacknowledged deliveries again.
            Self::Consume { source, .. } => source.as_deref().map_or(ErrorKind::Unavailable, |e| {
                if is_precondition_failed(e) {
                    ErrorKind::Transient
                } else {
                    classify(e)
                }
            }),
        }
    }
}

/// Classifies a driver error.
pub(crate) fn classify(error: &lapin::Error) -> ErrorKind {
    use lapin::ErrorKind as L;
    match error.kind() {
        L::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(
                AMQPSoftError::ACCESSREFUSED | AMQPSoftError::PRECONDITIONFAILED,
            ) => ErrorKind::Permanent,
            AMQPErrorKind::Soft(_) => ErrorKind::Transient,
            AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => ErrorKind::Permanent,
            AMQPErrorKind::Hard(_) => ErrorKind::Unavailable,
        },
        L::InvalidProtocolVersion(_) | L::AuthProviderError(_) => ErrorKind::Permanent,
        L::ChannelsLimitReached => ErrorKind::Transient,
        // I/O errors, closed channels and connections, missed heartbeats, a runtime
        // shutting down, frames we could not parse or write: the connection is gone.
        _ => ErrorKind::Unavailable,
    }
}

/// Whether the error says the channel was closed by the broker with `406
/// PRECONDITION_FAILED` (during a publish: a message over the broker's
/// `max_message_size`).
pub(crate) fn is_precondition_failed(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
    )
}

/// `url` with the password of its user info replaced by `***`, node by node for a
/// cluster's URLs separated by commas (a comma inside a password is written `%2C`).
/// Works on malformed URLs too (best effort): whatever sits between the first `:` of
/// the user info and the last `@` of the authority is hidden.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            outboxkit_core::error::redact_url(one, outboxkit_core::error::LoneUserInfo::UserName)
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("amqps://u:p@ss@w0rd@host/vhost?heartbeat=10"),
            "amqps://u:***@host/vhost?heartbeat=10"
        );
        assert_eq!(redact_url("amqp://host:5672/%2f"), "amqp://host:5672/%2f");
        assert_eq!(redact_url("amqp://user@host"), "amqp://user@host");
        assert_eq!(redact_url("user:secret@host"), "user:***@host");
        assert_eq!(
            redact_url("amqp://a:s1@n1:5672/%2f,amqp://a:s2@n2:5672/%2f"),
            "amqp://a:***@n1:5672/%2f,amqp://a:***@n2:5672/%2f"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn a_406_that_closes_a_consuming_channel_is_transient_not_permanent() {
        let soft = |e: AMQPSoftError| {
            Box::new(lapin::Error::from(lapin::ErrorKind::ProtocolError(
                lapin::protocol::AMQPError::new(
                    AMQPErrorKind::Soft(e),
                    "PRECONDITION_FAILED - unknown delivery tag 961".into(),
                ),
            )))
        };
        let consume = |e| RabbitError::Consume {
            queue: "q".to_owned(),
            reason: "the delivery stream failed".to_owned(),
            source: Some(soft(e)),
        };
        assert_eq!(
            consume(AMQPSoftError::PRECONDITIONFAILED).kind(),
            ErrorKind::Transient
        );
        assert_eq!(
            consume(AMQPSoftError::ACCESSREFUSED).kind(),
            ErrorKind::Permanent
        );
        // On a declare, a 406 is inequivalent topology: permanent.
        let declare = RabbitError::Declare {
            operation: "queue.declare",
            name: "q".to_owned(),
            source: soft(AMQPSoftError::PRECONDITIONFAILED),
        };
        assert_eq!(declare.kind(), ErrorKind::Permanent);
    }

    #[test]
    fn config_errors_are_permanent() {
        let e = RabbitError::InvalidUrl {
            url_redacted: "x".into(),
            reason: "y".into(),
        };
        assert_eq!(e.kind(), ErrorKind::Permanent);
        let e = RabbitError::ConnectTimeout {
            url_redacted: "x".into(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(e.kind(), ErrorKind::Unavailable);
    }
}
