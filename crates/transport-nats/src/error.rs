//! [`NatsError`]: what can go wrong while configuring, connecting, setting up streams and
//! consumers, or consuming. Per-message publish failures are
//! [`outboxkit_core::PublishError`]s instead.
//!
//! Driver errors are boxed to keep `Result<_, NatsError>` small.
//!
//! Callers branch on [`NatsError::kind`], never on the message text. No variant ever
//! contains the password or token of the server URL: URLs are stored redacted
//! (`nats://user:***@host:4222`).

use std::time::Duration;

use outboxkit_core::{BoxError, ErrorKind};

/// Errors of the NATS transport outside the per-message publish path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The server URL is not a valid `nats://` or `tls://` URL (or comma-separated list of
    /// them).
    #[error("invalid NATS URL {url_redacted:?}: {reason}")]
    InvalidUrl {
        /// The URL with its password or token replaced by `***`.
        url_redacted: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value other than the URL is invalid.
    #[error("invalid configuration: {field}: {reason}")]
    InvalidConfig {
        /// The setting, e.g. `"subject_prefix"`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An environment variable read by
    /// [`NatsConfig::from_env`](crate::NatsConfig::from_env) is invalid (the
    /// variable and its value are named, a URL's password or token hidden).
    #[error("invalid configuration: {0}")]
    Env(#[from] outboxkit_core::EnvError),
    /// The connection to the server could not be established (refused, unreachable,
    /// authorization violation, TLS failure).
    #[error("could not connect to {url_redacted}: {source}")]
    Connect {
        /// The URL with its password or token replaced by `***`.
        url_redacted: String,
        /// The driver's error.
        #[source]
        source: Box<async_nats::ConnectError>,
    },
    /// Connecting, or a JetStream API request, took longer than the configured timeout.
    #[error("timed out after {timeout:?}: {operation} on {url_redacted}")]
    Timeout {
        /// What was being done, e.g. `"connect"` or `"stream.create_or_update"`.
        operation: &'static str,
        /// The URL with its password or token replaced by `***`.
        url_redacted: String,
        /// The timeout that ran out.
        timeout: Duration,
    },
    /// A JetStream API request about a stream failed (create, update, info, delete), e.g.
    /// JetStream is not enabled, the subjects overlap another stream's (`10065`), or a
    /// setting that cannot be changed on an existing stream (retention, storage) differs.
    #[error("{operation} of stream {stream:?} failed: {source}")]
    Stream {
        /// The operation, e.g. `"stream.create_or_update"`.
        operation: &'static str,
        /// The stream name.
        stream: String,
        /// Classification of the failure.
        kind: ErrorKind,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// Creating, updating or reading a JetStream consumer failed.
    #[error("{operation} of consumer {consumer:?} on stream {stream:?} failed: {source}")]
    Consumer {
        /// The operation, e.g. `"consumer.create_or_update"`.
        operation: &'static str,
        /// The stream name.
        stream: String,
        /// The durable consumer name.
        consumer: String,
        /// Classification of the failure.
        kind: ErrorKind,
        /// The driver's error.
        #[source]
        source: BoxError,
    },
    /// Consuming failed (the pull subscription could not be started, or the server
    /// deleted the consumer while it was in use).
    #[error("consuming with {consumer:?} from stream {stream:?} failed: {reason}")]
    Consume {
        /// The stream name.
        stream: String,
        /// The durable consumer name.
        consumer: String,
        /// What happened.
        reason: String,
        /// The driver's error, if any.
        #[source]
        source: Option<BoxError>,
    },
}

impl NatsError {
    /// What the caller can do about it:
    ///
    /// - [`ErrorKind::Permanent`]: invalid URL or configuration, an authorization
    ///   violation or failed authentication at connect time, a stream or consumer
    ///   configuration the server refuses (overlapping subjects, settings that cannot be
    ///   updated);
    /// - [`ErrorKind::Unavailable`]: the server cannot be reached, JetStream does not
    ///   answer, timeouts;
    /// - [`ErrorKind::Transient`]: anything else that may pass.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidUrl { .. } | Self::InvalidConfig { .. } | Self::Env(_) => {
                ErrorKind::Permanent
            }
            Self::Timeout { .. } => ErrorKind::Unavailable,
            Self::Connect { source, .. } => match source.kind() {
                async_nats::ConnectErrorKind::ServerParse
                | async_nats::ConnectErrorKind::Authentication
                | async_nats::ConnectErrorKind::AuthorizationViolation
                | async_nats::ConnectErrorKind::Tls => ErrorKind::Permanent,
                _ => ErrorKind::Unavailable,
            },
            Self::Stream { kind, .. } | Self::Consumer { kind, .. } => *kind,
            Self::Consume { .. } => ErrorKind::Unavailable,
        }
    }
}

/// The JetStream API error (`{"error": {"code", "err_code", "description"}}`) somewhere in
/// the source chain of `error`, if any.
pub(crate) fn jetstream_error<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a async_nats::jetstream::Error> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = current {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return Some(js);
        }
        current = e.source();
    }
    None
}

/// Classifies a JetStream API error answer (stream or consumer management): `503` and
/// "JetStream not enabled" are outages, other 4xx answers the configuration's fault,
/// anything else may pass.
pub(crate) fn classify_api(js: &async_nats::jetstream::Error) -> ErrorKind {
    use async_nats::jetstream::ErrorCode;
    let code = js.error_code();
    if code == ErrorCode::JETSTREAM_NOT_ENABLED
        || code == ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
        || code == ErrorCode::CLUSTER_NOT_AVAILABLE
        || js.code() == 503
    {
        ErrorKind::Unavailable
    } else if (400..500).contains(&js.code()) {
        ErrorKind::Permanent
    } else {
        ErrorKind::Transient
    }
}

/// Classifies a failed stream create or update request.
pub(crate) fn classify_create_stream(
    error: &async_nats::jetstream::context::CreateStreamError,
) -> ErrorKind {
    use async_nats::jetstream::context::CreateStreamErrorKind as K;
    match error.kind() {
        K::JetStream(js) => classify_api(&js),
        K::EmptyStreamName | K::InvalidStreamName | K::DomainAndExternalSet => ErrorKind::Permanent,
        K::JetStreamUnavailable | K::TimedOut => ErrorKind::Unavailable,
        _ => ErrorKind::Transient,
    }
}

/// `url` with the password (or token) of its user info replaced by `***`. Works on
/// malformed URLs and comma-separated server lists too (best effort): whatever sits
/// between the first `:` of a user info and its `@` is hidden; a user info without `:`
/// (a token, `nats://s3cr3t@host`) is hidden whole.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            outboxkit_core::error::redact_url(one, outboxkit_core::error::LoneUserInfo::Token)
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_and_tokens() {
        assert_eq!(
            redact_url("nats://app:s3cret@127.0.0.1:4222"),
            "nats://app:***@127.0.0.1:4222"
        );
        assert_eq!(
            redact_url("nats://t0ken@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        assert_eq!(
            redact_url("nats://a:x@h1:4222,nats://b:y@h2:4222"),
            "nats://a:***@h1:4222,nats://b:***@h2:4222"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact_url("user:secret@host"), "user:***@host");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn config_errors_are_permanent_timeouts_unavailable() {
        let e = NatsError::InvalidUrl {
            url_redacted: "x".into(),
            reason: "y".into(),
        };
        assert_eq!(e.kind(), ErrorKind::Permanent);
        let e = NatsError::Timeout {
            operation: "connect",
            url_redacted: "x".into(),
            timeout: Duration::from_secs(1),
        };
        assert_eq!(e.kind(), ErrorKind::Unavailable);
    }
}
