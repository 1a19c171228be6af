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
    /// Retrying cannot help (bad input, unroutable message, payload too large, a
    /// misconfiguration: a missing table, a refused permission).
    Permanent,
    /// The database refused the data of this one operation: a value too long or out of
    /// range, a constraint violated, an index entry over the size limit (PostgreSQL
    /// SQLSTATE classes `22` data exception and `23` integrity constraint violation,
    /// `54000` program limit exceeded; SQL Server errors such as 2627, 2628, 547, 8152).
    /// The input's fault, not the database's: the same input fails again while other
    /// input goes through. Not retryable. The inbox counts it as a failure of the
    /// message that carried the data (retried, then a consumer dead letter), where an
    /// outage or a misconfiguration would only defer the message.
    InvalidData,
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
    /// The payload's JSON text is longer than the store accepts (see
    /// [`NewMessage::check_payload_size`](crate::NewMessage::check_payload_size)).
    #[error("payload is {size} bytes of JSON, the maximum is {max}")]
    PayloadTooLarge {
        /// Length of the payload's JSON text, in bytes.
        size: usize,
        /// The store's limit, in bytes.
        max: usize,
    },
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
    /// A setting of a configuration (`DispatcherConfig`, the inbox's
    /// `ProcessorConfig`, ...) is invalid: refused by its `validate`, which the
    /// component built from it (`Dispatcher::new`, `InboxProcessor::new`) calls before
    /// any I/O or task starts.
    #[error("invalid configuration: {field}: {reason}")]
    InvalidConfig {
        /// The setting, as its `with_*` setter names it (`batch_size`, `lease`, ...).
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// An environment variable read by a `from_env` is missing or invalid (the
    /// variable and its redacted value are named).
    #[error("invalid configuration: {0}")]
    Env(#[from] crate::env::EnvError),
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
    /// A statement, or the commit, ran on a transaction that an earlier failed statement
    /// had already aborted: PostgreSQL refuses every statement after a failed one
    /// (SQLSTATE `25P02`) and answers `COMMIT` with `ROLLBACK`; SQL Server dooms the
    /// transaction (`XACT_STATE() = -1`) or, under `XACT_ABORT ON`, rolls it back at
    /// once. Nothing of the transaction was or will be committed. In a consumer this
    /// means the handler caught a database error and went on as if nothing happened:
    /// the inbox treats it as that handler's failure, never as a commit.
    #[error(
        "the transaction was aborted by an earlier failed statement whose error was ignored; nothing of it was committed (during {operation})"
    )]
    TransactionAborted {
        /// What was being done when the abort showed, e.g. `"inbox_commit"`.
        operation: &'static str,
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
    /// An [`OutboxError::InvalidConfig`]: `field` as its `with_*` setter names it,
    /// `reason` what is wrong with its value. The configs' `validate` methods return
    /// these.
    pub fn invalid_config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidConfig {
            field,
            reason: reason.into(),
        }
    }

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
/// and error messages (a [`LoneUserInfo::Token`] user info without a password is hidden
/// whole), and the value of a `password`, `sslpassword` or `token` query parameter too
/// (`postgres://u@h/db?password=secret`, which libpq and sqlx accept).
///
/// The URL is parsed with the `url` crate, whose output may normalise it (percent-encode
/// characters a URL may not hold); a URL without a secret is returned unchanged.
/// Passwords that are not percent-encoded can make a URL ambiguous: in
/// `amqp://user:1234/ss@host` the password `1234/ss` reads as a port and a path. So
/// whenever the parse fails, or the text between the scheme and the last `@` holds a `:`
/// that the parse did not take for the start of a password, everything between the first
/// `:` after the scheme and the last `@` is hidden instead (over-redaction is preferred
/// to a leak). Text with no `scheme://` is treated the same way. One case cannot be
/// told apart from a URL without user info: a token containing `/`, `?` or `#`
/// (`nats://to/ken@host` reads as host `to`, path `/ken@host`) is shown.
pub fn redact_url(url: &str, lone: LoneUserInfo) -> String {
    redact_query_secrets(&redact_user_info(url, lone))
}

/// Query parameters whose value is a secret (libpq's `password` and `sslpassword`, the
/// `token` some brokers' URLs take), matched without regard to case.
const SECRET_PARAMETERS: [&str; 3] = ["password", "sslpassword", "token"];

/// `url` with the value of every [`SECRET_PARAMETERS`] query parameter replaced by
/// `***` (`postgres://u@h/db?password=…` is as valid as a password in the user info).
fn redact_query_secrets(url: &str) -> String {
    let Some(query_at) = url.find('?') else {
        return url.to_owned();
    };
    let (head, query) = url.split_at(query_at + 1);
    let (query, fragment) = match query.find('#') {
        Some(at) => query.split_at(at),
        None => (query, ""),
    };
    let mut changed = false;
    let parts: Vec<String> = query
        .split('&')
        .map(|part| match part.split_once('=') {
            Some((name, value))
                if !value.is_empty()
                    && SECRET_PARAMETERS
                        .iter()
                        .any(|s| name.eq_ignore_ascii_case(s)) =>
            {
                changed = true;
                format!("{name}=***")
            }
            _ => part.to_owned(),
        })
        .collect();
    if changed {
        format!("{head}{}{fragment}", parts.join("&"))
    } else {
        url.to_owned()
    }
}

/// [`redact_url`] for the user info alone.
fn redact_user_info(url: &str, lone: LoneUserInfo) -> String {
    let Some((scheme, rest)) = split_scheme(url) else {
        // No recognisable scheme (`amqp//user:pw@host`): the whole text may hide a user
        // info.
        return redact_textually("", url, lone);
    };
    let Some(last_at) = rest.rfind('@') else {
        return url.to_owned();
    };
    let before_at = &rest[..last_at];
    // The parser ends the authority at the first of these: when none comes before the
    // last `@`, its user info is exactly `before_at`.
    let in_authority = !before_at.contains(['/', '?', '#', '\\']);
    match url::Url::parse(url) {
        Ok(mut parsed) if in_authority || !before_at.contains(':') => {
            let hidden = if parsed.password().is_some() {
                parsed.set_password(Some("***"))
            } else if lone == LoneUserInfo::Token && !parsed.username().is_empty() {
                parsed.set_username("***")
            } else {
                return url.to_owned();
            };
            match hidden {
                Ok(()) => parsed.into(),
                // A URL that cannot hold a user info (no host) but was given one.
                Err(()) => redact_textually(&url[..scheme], rest, lone),
            }
        }
        // Unparsable, or a `:` before an `@` that the parser put in a path, query or
        // fragment: hide by position.
        _ => redact_textually(&url[..scheme], rest, lone),
    }
}

/// Splits `scheme://` off `url`: the byte length of `scheme://` and the rest, when the
/// text before `://` is a scheme (`[A-Za-z][A-Za-z0-9+.-]*`).
fn split_scheme(url: &str) -> Option<(usize, &str)> {
    let i = url.find("://")?;
    let mut chars = url[..i].chars();
    let scheme_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    scheme_ok.then(|| (i + 3, &url[i + 3..]))
}

/// `prefix` + `rest` with whatever lies between the first `:` of `rest` and its last `@`
/// hidden (or, without a `:`, everything before the last `@` for a token).
fn redact_textually(prefix: &str, rest: &str, lone: LoneUserInfo) -> String {
    let Some(at) = rest.rfind('@') else {
        return format!("{prefix}{rest}");
    };
    let userinfo = &rest[..at];
    let shown = match (userinfo.find(':'), lone) {
        (Some(colon), _) => format!("{}:***", &userinfo[..colon]),
        (None, LoneUserInfo::Token) => "***".to_owned(),
        (None, LoneUserInfo::UserName) => return format!("{prefix}{rest}"),
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

    /// Passwords as people type them, unencoded characters included.
    #[test]
    fn redaction_hides_passwords_with_url_delimiters() {
        use LoneUserInfo::{Token, UserName};
        for (url, secret) in [
            ("amqp://user:pa/ss@host:5672/vhost", "pa/ss"),
            ("amqp://user:pa?ss@host:5672/vhost", "pa?ss"),
            ("amqp://user:pa#ss@host:5672/vhost", "pa#ss"),
            ("amqp://user:pa@ss@host:5672/vhost", "pa@ss"),
            ("amqp://user:pa:ss@host:5672/vhost", "pa:ss"),
            // Digits then `/`: parses as host `user`, port 1234, path `/ss@host`.
            ("amqp://user:1234/ss@host:5672/vhost", "1234/ss"),
            ("amqp://user:1234/ss@host", "1234/ss"),
            ("postgres://app:12/34?56#78@db:5432/app", "12/34?56#78"),
            ("nats://app:s/3?c#r@et@127.0.0.1:4222", "s/3?c#r@et"),
            ("http://user:pa\\ss@host/x", "pa\\ss"),
        ] {
            for lone in [UserName, Token] {
                let shown = redact_url(url, lone);
                assert!(!shown.contains(secret), "{url} -> {shown}");
                assert!(shown.contains("***"), "{url} -> {shown}");
            }
        }
        assert_eq!(
            redact_url("amqp://user:1234/ss@host:5672/vhost", UserName),
            "amqp://user:***@host:5672/vhost"
        );
        assert_eq!(
            redact_url("amqp://user:pa/ss@host:5672/vhost", UserName),
            "amqp://user:***@host:5672/vhost"
        );
        // Percent-encoded passwords: hidden whole, encoded or not.
        for url in [
            "amqp://user:p%2Fss%40w%3Ard@host/%2f",
            "postgres://app:%E2%82%AC%20x@db/app",
        ] {
            let shown = redact_url(url, UserName);
            assert!(shown.starts_with(&url[..url.find(':').map_or(0, |i| i + 3)]));
            assert!(shown.contains(":***@"), "{url} -> {shown}");
            assert!(!shown.contains("%2F") && !shown.contains("%E2"), "{shown}");
        }
        // An `@` in the query behind a real password: hidden up to the last `@`.
        let shown = redact_url("amqp://u:pw@host/v?email=a@b", UserName);
        assert!(!shown.contains("pw"), "{shown}");
        // A text whose `://` comes after the user info is not a scheme.
        assert_eq!(
            redact_url("user:secret@host://x", UserName),
            "user:***@host://x"
        );
        // A token with a `:` in it is a password (`nats://user:pass@`).
        assert_eq!(
            redact_url("nats://t0k:en@h:4222", Token),
            "nats://t0k:***@h:4222"
        );
        // A token of a URL without a host.
        assert!(!redact_url("nats://s3cr3t@", Token).contains("s3cr3t"));
    }

    #[test]
    fn redaction_hides_secrets_in_the_query() {
        use LoneUserInfo::UserName;
        assert_eq!(
            redact_url(
                "postgres://app@db:5432/app?password=s3cret&sslmode=require",
                UserName
            ),
            "postgres://app@db:5432/app?password=***&sslmode=require"
        );
        assert_eq!(
            redact_url(
                "postgres://app:pw@db/app?sslmode=verify-full&SSLPASSWORD=k3y#x",
                UserName
            ),
            "postgres://app:***@db/app?sslmode=verify-full&SSLPASSWORD=***#x"
        );
        assert_eq!(
            redact_url("nats://host:4222?token=t0k", UserName),
            "nats://host:4222?token=***"
        );
        assert_eq!(
            redact_url("postgres://db/app?user=me&password=", UserName),
            "postgres://db/app?user=me&password=",
            "nothing to hide"
        );
    }

    #[test]
    fn redaction_leaves_urls_without_secrets_alone() {
        use LoneUserInfo::{Token, UserName};
        for url in [
            "amqp://127.0.0.1:5672/%2f",
            "amqps://host/vhost?heartbeat=10&connection_timeout=5000",
            "nats://127.0.0.1:4222",
            "postgres://postgres@127.0.0.1:5432/test",
            "postgres://127.0.0.1/test?user=x#frag",
            "nats://host/a@b",
            "amqp://Host.Example:5672/V%20host",
        ] {
            for lone in [UserName, Token] {
                if lone == Token && url.contains("postgres@") {
                    continue;
                }
                assert_eq!(redact_url(url, lone), url);
            }
        }
        assert_eq!(
            redact_url("postgres://postgres@127.0.0.1:5432/test", Token),
            "postgres://***@127.0.0.1:5432/test",
            "a lone user info is a token when the caller says so"
        );
    }

    mod properties {
        use proptest::prelude::*;

        use super::super::{LoneUserInfo, redact_url};
        use crate::proptest_support::config;

        proptest! {
            #![proptest_config(config())]

            /// Whatever the password (any unicode, URL delimiters included), it never
            /// shows in `scheme://user:PASSWORD@host:1234/vhost`, unless it is too short to
            /// mean anything or also spelled by the rest of the URL.
            #[test]
            fn no_password_survives(
                scheme in prop::sample::select(vec!["amqp", "amqps", "nats", "postgres", "http", "x-y.z+w"]),
                password in "(\\PC|[/?#@:%\\\\ ]){0,24}",
                lone in prop::sample::select(vec![LoneUserInfo::UserName, LoneUserInfo::Token]),
            ) {
                let url = format!("{scheme}://user:{password}@host:1234/vhost");
                let shown = redact_url(&url, lone);
                let rest = format!("{scheme}://user:@host:1234/vhost");
                prop_assume!(password.chars().count() >= 3 && !rest.contains(&password));
                prop_assert!(!shown.contains(&password), "{} -> {}", url, shown);
            }
        }
    }
}
