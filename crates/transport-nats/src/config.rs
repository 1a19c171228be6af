//! Configuration: [`NatsConfig`], plain settings with defaults shared by the publisher,
//! the stream helper and the consumer, checked by [`NatsConfig::validate`] (which
//! [`NatsPublisher::connect`](crate::NatsPublisher::connect) and
//! [`NatsConsumer::new`](crate::NatsConsumer::new) call before anything else).
//!
//! ```
//! use std::time::Duration;
//! use outboxkit_nats::NatsConfig;
//!
//! let config = NatsConfig::new("nats://app:s3cret@127.0.0.1:4222")
//!     .with_subject_prefix("orders.events")
//!     .with_confirm_timeout(Duration::from_secs(10))
//!     .with_connection_name("orders-relay");
//! config.validate()?;
//! assert_eq!(config.subject_prefix(), "orders.events");
//! assert_eq!(config.subject_for("OrderPlaced"), "orders.events.OrderPlaced");
//! // The password never shows up in logs or errors.
//! assert_eq!(config.url_redacted(), "nats://app:***@127.0.0.1:4222");
//! # Ok::<(), outboxkit_nats::NatsError>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_nats::ServerAddr;

use outboxkit_core::env::{
    Env, EnvError, OUTBOX_BROKER_URL, OUTBOX_CONFIRM_TIMEOUT, OUTBOX_CONNECT_TIMEOUT,
    OUTBOX_STREAM, OUTBOX_SUBJECT_PREFIX,
};

use crate::error::{NatsError, redact_url};
use crate::topology::StreamSetup;

/// The server URL used by [`NatsConfig::from_env`] (and the `outbox` binary)
/// when `OUTBOX_BROKER_URL` is not set: the local server.
pub const DEFAULT_URL: &str = "nats://127.0.0.1:4222";
/// Default subject prefix: messages go to `outbox.events.<routing key or event type>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "outbox.events";
/// Default time a batch waits for its PubAcks, counted from the batch's first publish.
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// Default payload limit of the publisher: none of its own (`usize::MAX`), the server's
/// `max_payload` (from its `INFO`, 1 MiB unless configured) is the limit.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = usize::MAX;
/// Default time to wait for a connection (TCP, TLS, NATS handshake) or a JetStream API
/// answer.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default number of publishes awaiting their PubAck at once, per publisher.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
/// Largest accepted in-flight window.
pub const MAX_IN_FLIGHT: usize = 65_536;
/// Default connection name shown by the server (`CONNECT {"name": ...}`, visible in
/// `/connz` of the monitoring port).
pub const DEFAULT_CONNECTION_NAME: &str = "outbox-transport-nats";
/// Longest publish subject accepted, in bytes. The server's default `max_control_line`
/// is 4,096 bytes and the `HPUB` line also carries the reply inbox and two sizes; a
/// longer line makes the server close the connection, which would look like an outage.
pub const MAX_SUBJECT_BYTES: usize = 3_072;

/// Settings of the NATS transport, shared by the publisher, the stream helper and the
/// consumer: plain data. [`new`](Self::new) takes the URL, every `with_*` setter
/// consumes and returns the configuration, getters are named after the settings, and
/// [`validate`](Self::validate) checks them all (the publisher's `connect` and
/// `connect_lazy`, [`StreamSetup::apply`] and the consumer's `new` call it first).
/// Cheap to clone. `Debug` shows the URL redacted.
#[derive(Clone)]
#[must_use]
pub struct NatsConfig {
    url: String,
    subject_prefix: String,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    max_in_flight: usize,
    max_payload_bytes: usize,
    source: Option<String>,
    connection_name: String,
    /// Boxed: most configurations have none, and the config is inside every consumer.
    stream: Option<Box<StreamSetup>>,
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact_url(&self.url))
            .field("subject_prefix", &self.subject_prefix)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("source", &self.source)
            .field("connection_name", &self.connection_name)
            .field("stream", &self.stream)
            .finish()
    }
}

impl NatsConfig {
    /// Settings for the server(s) at `url`: `nats://[user:password@]host[:port]` or
    /// `tls://…`, several separated by commas; the port defaults to 4222.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            source: None,
            connection_name: DEFAULT_CONNECTION_NAME.to_owned(),
            stream: None,
        }
    }

    /// Settings from the environment, under the names the `outbox` binary reads (the
    /// table: [`outboxkit_core::env`]); every other setting at its default:
    ///
    /// | Variable | Setting | Default |
    /// |---|---|---|
    /// | `OUTBOX_BROKER_URL` | the URL(s), as [`new`](Self::new) takes them | [`DEFAULT_URL`] (`nats://127.0.0.1:4222`) |
    /// | `OUTBOX_SUBJECT_PREFIX` | [`with_subject_prefix`](Self::with_subject_prefix) | `outbox.events` |
    /// | `OUTBOX_CONNECT_TIMEOUT` | [`with_connect_timeout`](Self::with_connect_timeout), a duration (`5s`, `1m`) | 5 s |
    /// | `OUTBOX_CONFIRM_TIMEOUT` | [`with_confirm_timeout`](Self::with_confirm_timeout) (the PubAck wait), a duration | 10 s |
    /// | `OUTBOX_STREAM` | [`with_stream`](Self::with_stream)`(StreamSetup::new(NAME))`, the stream declared | none |
    ///
    /// Unset or blank variables take the default (so an empty subject prefix cannot be
    /// set from the environment). The values are checked here as
    /// [`validate`](Self::validate) checks them, so that an error names its variable.
    ///
    /// # Errors
    /// [`NatsError::Env`] naming the variable and its value (the URL's password or token
    /// hidden): a URL that is not `nats://` or `tls://` (e.g. an `amqp://` one), an
    /// invalid subject prefix or stream name, a duration that does not parse or is zero.
    pub fn from_env() -> Result<Self, NatsError> {
        Self::from_lookup(&Env::process())
    }

    /// [`from_env`](Self::from_env) over any environment (a map in tests).
    pub(crate) fn from_lookup(
        env: &Env<impl Fn(&str) -> Option<String>>,
    ) -> Result<Self, NatsError> {
        let mut builder = Self::new(
            env.get(OUTBOX_BROKER_URL)
                .unwrap_or_else(|| DEFAULT_URL.to_owned()),
        );
        if let Some(prefix) = env.get(OUTBOX_SUBJECT_PREFIX) {
            builder = builder.with_subject_prefix(prefix);
        }
        if let Some(timeout) = env.duration(OUTBOX_CONNECT_TIMEOUT)? {
            builder = builder.with_connect_timeout(timeout);
        }
        if let Some(timeout) = env.duration(OUTBOX_CONFIRM_TIMEOUT)? {
            builder = builder.with_confirm_timeout(timeout);
        }
        if let Some(stream) = env.get(OUTBOX_STREAM) {
            builder = builder.with_stream(StreamSetup::new(stream));
        }
        if let Err(e) = builder.validate() {
            let var = match &e {
                NatsError::InvalidUrl { .. } => OUTBOX_BROKER_URL,
                NatsError::InvalidConfig { field, .. } => match *field {
                    "subject_prefix" => OUTBOX_SUBJECT_PREFIX,
                    "connect_timeout" => OUTBOX_CONNECT_TIMEOUT,
                    "confirm_timeout" => OUTBOX_CONFIRM_TIMEOUT,
                    "stream name" | "stream subjects" => OUTBOX_STREAM,
                    _ => return Err(e),
                },
                _ => return Err(e),
            };
            let value = if var == OUTBOX_BROKER_URL {
                redact_url(&builder.url)
            } else {
                env.get(var).unwrap_or_default()
            };
            let reason = match e {
                NatsError::InvalidUrl { reason, .. } | NatsError::InvalidConfig { reason, .. } => {
                    reason
                }
                other => other.to_string(),
            };
            return Err(EnvError::invalid(var, value, reason).into());
        }
        Ok(builder)
    }

    /// The subject prefix: a message is published to `{prefix}.{routing key}` (or
    /// `{prefix}.{event type}` when it has no routing key). Default
    /// [`DEFAULT_SUBJECT_PREFIX`] (`"outbox.events"`). An empty prefix publishes to the
    /// routing key alone. The prefix must be a valid publish subject itself: non-empty
    /// tokens separated by `.`, no whitespace or control characters, no `*` or `>`, not
    /// starting with `$` (reserved for the system and JetStream APIs).
    pub fn with_subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// How long a batch waits for its PubAcks, measured from the start of the batch;
    /// messages still unacknowledged then are reported as
    /// [`PublishError::Timeout`](outboxkit_core::PublishError::Timeout) (transient), or as
    /// `Unavailable` when the connection was lost meanwhile. Also bounds each JetStream
    /// API request of the publisher. Default 10 s.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long connecting may take (TCP, TLS, NATS handshake), and how long
    /// [`check_ready`](outboxkit_core::EventPublisher::check_ready), the stream helper and
    /// the consumer wait for a JetStream API answer. Default 5 s.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How many publishes may await their PubAck at once, across every batch of one
    /// publisher, 1 to [`MAX_IN_FLIGHT`]. A batch larger than this sends the next
    /// message as soon as an earlier one is acknowledged. Default 1,024.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// The largest payload, in bytes, the publisher sends; the server's `max_payload`
    /// (from its `INFO`, 1 MiB unless configured) applies too, whichever is lower.
    /// Default [`DEFAULT_MAX_PAYLOAD_BYTES`] (`usize::MAX`: the server's limit only). A
    /// message whose payload plus headers exceed the limit is not sent and gets
    /// [`PublishError::PayloadTooLarge`](outboxkit_core::PublishError::PayloadTooLarge)
    /// (permanent).
    pub fn with_max_payload_bytes(mut self, max: usize) -> Self {
        self.max_payload_bytes = max;
        self
    }

    /// The CloudEvents `source` attribute (`ce-source` header) of every published
    /// message. Default `None`: `/{aggregate_type}` of each message.
    pub fn with_source(mut self, source: Option<String>) -> Self {
        self.source = source;
        self
    }

    /// The connection name shown by the server. Default [`DEFAULT_CONNECTION_NAME`]
    /// (`"outbox-transport-nats"`).
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// The JetStream stream the publisher declares, as the RabbitMQ publisher declares
    /// its exchange (default: none; the stream is then the operator's, and must exist).
    /// [`NatsPublisher::connect`](crate::NatsPublisher::connect) creates the stream with
    /// `setup`'s settings (storage, replicas, duplicate window, retention, age limit)
    /// when it does not exist, and every readiness check the relay makes (at start, and
    /// while its circuit is open) creates it again if it was deleted; an existing
    /// stream's settings are left as they are (an operator's replicas or limits are
    /// never changed; [`NatsPublisher::ensure_stream`](crate::NatsPublisher::ensure_stream)
    /// updates them). A `setup` without
    /// subjects captures every subject this configuration publishes to
    /// ([`subject_wildcard`](Self::subject_wildcard), e.g. `outbox.events.>`).
    ///
    /// A stream's subjects must not overlap another stream's: the server refuses such a
    /// stream (a permanent [`NatsError::Stream`] from `connect`).
    pub fn with_stream(mut self, setup: StreamSetup) -> Self {
        self.stream = Some(Box::new(setup));
        self
    }

    /// Validates the settings.
    ///
    /// # Errors
    /// - [`NatsError::InvalidUrl`] when a URL does not parse or its scheme is not
    ///   `nats://` or `tls://` (the error shows the URL with its password redacted);
    /// - [`NatsError::InvalidConfig`] when the subject prefix is not a valid publish
    ///   subject, a timeout, the in-flight window or the payload limit is zero (or the
    ///   window is over [`MAX_IN_FLIGHT`]), the source or connection name is empty or
    ///   contains a line break, or the [stream](Self::with_stream)'s name or subjects
    ///   are invalid (fields `stream name`, `stream subjects`).
    pub fn validate(&self) -> Result<(), NatsError> {
        self.servers()?;
        if !self.subject_prefix.is_empty()
            && let Some(problem) = subject_problem(&self.subject_prefix)
        {
            return Err(invalid("subject_prefix", problem));
        }
        if self.confirm_timeout.is_zero() {
            return Err(invalid("confirm_timeout", "must be greater than zero"));
        }
        if self.connect_timeout.is_zero() {
            return Err(invalid("connect_timeout", "must be greater than zero"));
        }
        if !(1..=MAX_IN_FLIGHT).contains(&self.max_in_flight) {
            return Err(invalid(
                "max_in_flight",
                format!(
                    "must be between 1 and {MAX_IN_FLIGHT}, got {}",
                    self.max_in_flight
                ),
            ));
        }
        if self.max_payload_bytes == 0 {
            return Err(invalid("max_payload_bytes", "must be greater than zero"));
        }
        if let Some(source) = &self.source {
            if source.is_empty() {
                return Err(invalid("source", "must not be empty when set"));
            }
            if source.contains(['\r', '\n']) {
                return Err(invalid("source", "must not contain a line break"));
            }
        }
        if self.connection_name.is_empty() {
            return Err(invalid("connection_name", "must not be empty"));
        }
        if self.connection_name.chars().any(char::is_control) {
            return Err(invalid("connection_name", "contains a control character"));
        }
        if let Some(setup) = self.stream() {
            setup.check()?;
        }
        Ok(())
    }
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> NatsError {
    NatsError::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

/// Parses a comma-separated server list without leaking the password.
fn parse_servers(url: &str, url_redacted: &str) -> Result<Vec<ServerAddr>, NatsError> {
    let invalid_url = |reason: String| NatsError::InvalidUrl {
        url_redacted: url_redacted.to_owned(),
        // Parser messages may quote the input; never let the password through.
        reason: reason.replace(url, url_redacted),
    };
    let trimmed = url.trim();
    if trimmed.is_empty() {
        return Err(invalid_url("the URL is empty".to_owned()));
    }
    let mut servers = Vec::new();
    for part in trimmed.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(invalid_url("an empty entry in the server list".to_owned()));
        }
        if let Some(scheme_end) = part.find("://") {
            let scheme = &part[..scheme_end];
            if scheme != "nats" && scheme != "tls" {
                return Err(invalid_url(format!(
                    "the scheme must be nats:// or tls://, got {scheme}://"
                )));
            }
        }
        let server = ServerAddr::from_str(part)
            .map_err(|e| invalid_url(e.to_string().replace(part, &redact_url(part))))?;
        if server.host().is_empty() {
            return Err(invalid_url("the URL has no host".to_owned()));
        }
        servers.push(server);
    }
    Ok(servers)
}

/// Why `subject` is not a valid NATS publish subject, or `None` when it is.
///
/// NATS subjects ([docs](https://docs.nats.io/nats-concepts/subjects)) are tokens
/// separated by `.`; a token is non-empty and contains no whitespace; `*` and `>` are
/// wildcards, which a publish subject must not contain; names starting with `$` are
/// reserved for the system (`$SYS`) and the JetStream API (`$JS`).
pub(crate) fn subject_problem(subject: &str) -> Option<String> {
    let shown = || {
        let head: String = subject.chars().take(60).collect();
        if head.len() < subject.len() {
            format!("{head:?}...")
        } else {
            format!("{head:?}")
        }
    };
    if subject.is_empty() {
        return Some("the subject is empty".to_owned());
    }
    if subject.len() > MAX_SUBJECT_BYTES {
        return Some(format!(
            "subject {} is {} bytes long, at most {MAX_SUBJECT_BYTES} are accepted (the server's control line limit)",
            shown(),
            subject.len()
        ));
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some(format!(
            "subject {} contains whitespace or a control character",
            shown()
        ));
    }
    if subject.contains(['*', '>']) {
        return Some(format!(
            "subject {} contains a wildcard ('*' or '>'), which a publish subject must not",
            shown()
        ));
    }
    if subject.split('.').any(str::is_empty) {
        return Some(format!(
            "subject {} has an empty token (leading, trailing or doubled '.')",
            shown()
        ));
    }
    if subject.starts_with('$') {
        return Some(format!(
            "subject {} starts with '$', reserved for the system and JetStream APIs",
            shown()
        ));
    }
    None
}

impl NatsConfig {
    /// The parsed server addresses (they contain the credentials: do not log them).
    pub(crate) fn servers(&self) -> Result<Vec<ServerAddr>, NatsError> {
        parse_servers(&self.url, &self.url_redacted())
    }

    /// The server URL (or comma-separated URLs) as given, credentials included: do not
    /// log it; [`url_redacted`](Self::url_redacted) hides them.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server URL with its password or token replaced by `***`.
    pub fn url_redacted(&self) -> String {
        redact_url(&self.url)
    }

    /// The subject prefix (may be empty).
    pub fn subject_prefix(&self) -> &str {
        &self.subject_prefix
    }

    /// The subject a message with this routing key (or event type) is published to:
    /// `{prefix}.{key}`, or `key` when the prefix is empty. Not validated; the publisher
    /// checks it per message.
    pub fn subject_for(&self, key: &str) -> String {
        if self.subject_prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.subject_prefix)
        }
    }

    /// The subject filter that matches every subject of this configuration:
    /// `{prefix}.>`, or `>` when the prefix is empty. Give it to a stream
    /// ([`StreamSetup::with_subjects`](crate::StreamSetup::with_subjects)).
    pub fn subject_wildcard(&self) -> String {
        self.subject_for(">")
    }

    /// The stream the publisher declares, if the configuration names one
    /// ([`with_stream`](Self::with_stream)), its subjects filled in (the
    /// [`subject_wildcard`](Self::subject_wildcard) when it was given none).
    pub fn stream(&self) -> Option<StreamSetup> {
        self.stream.as_deref().map(|setup| {
            if setup.subjects().is_empty() {
                setup.clone().with_subject(self.subject_wildcard())
            } else {
                setup.clone()
            }
        })
    }

    /// How long a batch waits for its PubAcks.
    pub fn confirm_timeout(&self) -> Duration {
        self.confirm_timeout
    }

    /// How long connecting to one server or a JetStream API request may take.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long the first connection may take in all: the connect timeout once per
    /// server listed (each may be down or cut off), plus one.
    pub fn connect_budget(&self) -> Duration {
        self.connect_timeout
            .saturating_mul(u32::try_from(self.url.split(',').count() + 1).unwrap_or(u32::MAX))
    }

    /// Publishes awaiting their PubAck at once, per publisher.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// The largest payload published, in bytes (the server's limit applies too).
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// The CloudEvents `source` override, if any.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// The connection name shown by the server.
    pub fn connection_name(&self) -> &str {
        &self.connection_name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = NatsConfig::new(DEFAULT_URL);
        assert_eq!(config.subject_prefix(), DEFAULT_SUBJECT_PREFIX);
        assert_eq!(config.confirm_timeout(), Duration::from_secs(10));
        assert_eq!(config.connect_timeout(), Duration::from_secs(5));
        assert_eq!(config.max_in_flight(), 1024);
        assert_eq!(config.max_payload_bytes(), usize::MAX);
        assert_eq!(config.source(), None);
        let servers = config.servers().expect("valid");
        assert_eq!(servers.len(), 1);
        assert_eq!(servers[0].host(), "127.0.0.1");
        assert_eq!(servers[0].port(), 4222);
        assert_eq!(
            config.subject_for("OrderPlaced"),
            "outbox.events.OrderPlaced"
        );
        assert_eq!(config.subject_wildcard(), "outbox.events.>");
        let bare = NatsConfig::new(DEFAULT_URL).with_subject_prefix("");
        bare.validate().expect("valid");
        assert_eq!(bare.subject_for("a.b"), "a.b");
        assert_eq!(bare.subject_wildcard(), ">");
    }

    #[test]
    fn server_lists_and_bare_hosts() {
        let config = NatsConfig::new("nats://a:1,tls://u:p@b:2, c");
        config.validate().expect("valid");
        let hosts: Vec<(String, u16)> = config
            .servers()
            .expect("valid")
            .iter()
            .map(|s| (s.host().to_owned(), s.port()))
            .collect();
        assert_eq!(
            hosts,
            [("a".into(), 1), ("b".into(), 2), ("c".into(), 4222)]
        );
    }

    #[test]
    fn malformed_urls_are_typed_errors_without_password() {
        for url in [
            "",
            "   ",
            "http://app:hunter2@host/",
            "amqp://app:hunter2@host:5672",
            "nats://app:hunter2@host:notaport",
            "nats://app:hunter2@host:1,",
        ] {
            match NatsConfig::new(url).validate() {
                Err(e @ NatsError::InvalidUrl { .. }) => {
                    let text = format!("{e} {e:?}");
                    assert!(!text.contains("hunter2"), "password leaked: {text}");
                }
                other => panic!("{url:?}: expected InvalidUrl, got {other:?}"),
            }
        }
    }

    #[test]
    fn invalid_settings() {
        let base = || NatsConfig::new(DEFAULT_URL);
        let field = |b: NatsConfig| match b.validate() {
            Err(NatsError::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        };
        for prefix in ["a..b", ".a", "a.", "a b", "a.*", "a.>", "$JS.API", "a\tb"] {
            assert_eq!(
                field(base().with_subject_prefix(prefix)),
                "subject_prefix",
                "{prefix:?}"
            );
        }
        assert_eq!(field(base().with_max_in_flight(0)), "max_in_flight");
        assert_eq!(
            field(base().with_max_in_flight(MAX_IN_FLIGHT + 1)),
            "max_in_flight"
        );
        assert_eq!(
            field(base().with_confirm_timeout(Duration::ZERO)),
            "confirm_timeout"
        );
        assert_eq!(
            field(base().with_connect_timeout(Duration::ZERO)),
            "connect_timeout"
        );
        assert_eq!(field(base().with_max_payload_bytes(0)), "max_payload_bytes");
        assert_eq!(field(base().with_source(Some(String::new()))), "source");
        assert_eq!(field(base().with_source(Some("a\nb".into()))), "source");
        assert_eq!(field(base().with_connection_name("")), "connection_name");
    }

    #[test]
    fn subject_rules() {
        for ok in ["a", "orders.events.OrderPlaced", "a-b_c.D9", "ünïcode.ok"] {
            assert_eq!(subject_problem(ok), None, "{ok:?}");
        }
        for bad in [
            "", "a..b", ".a", "a.", "a b", "a\nb", "a.*.c", "a.>", "x*y", "$SYS.x",
        ] {
            assert!(subject_problem(bad).is_some(), "{bad:?} should be invalid");
        }
        let long = format!("a.{}", "b".repeat(MAX_SUBJECT_BYTES));
        assert!(subject_problem(&long).is_some_and(|p| p.contains("bytes long")));
    }

    #[test]
    fn debug_never_shows_the_password() {
        let builder = NatsConfig::new("nats://app:hunter2@host:4222");
        assert!(!format!("{builder:?}").contains("hunter2"));
        builder.validate().expect("valid");
        for url in [
            "nats://app:s3cret@host:4222",
            "nats://s3cret@host:4222",
            "nats://app:12/s3cret@host:4222",
            "nats://a:x@h1:4222,nats://app:s3?cret@h2:4222",
        ] {
            let builder = NatsConfig::new(url);
            let shown = format!("{builder:?}");
            assert!(
                !shown.contains("s3cret") && !shown.contains("s3?cret"),
                "{shown}"
            );
            if let Err(e) = builder.validate() {
                let shown = format!("{e} {e:?}");
                assert!(!shown.contains("s3cret"), "{shown}");
            }
        }
    }

    #[test]
    fn from_env_reads_the_binarys_variables() -> Result<(), NatsError> {
        let config = NatsConfig::from_lookup(&Env::from_pairs(&[
            ("OUTBOX_BROKER_URL", "nats://app:s3cret@mq:4222"),
            ("OUTBOX_SUBJECT_PREFIX", "orders.events"),
            ("OUTBOX_CONNECT_TIMEOUT", "2s"),
            ("OUTBOX_CONFIRM_TIMEOUT", "1m 30s"),
            ("OUTBOX_STREAM", "ORDERS"),
        ]))?;
        assert_eq!(
            config
                .stream()
                .map(|s| (s.name().to_owned(), s.subjects().to_vec())),
            Some(("ORDERS".to_owned(), vec!["orders.events.>".to_owned()]))
        );
        assert_eq!(config.url_redacted(), "nats://app:***@mq:4222");
        assert_eq!(config.subject_prefix(), "orders.events");
        assert_eq!(config.connect_timeout(), Duration::from_secs(2));
        assert_eq!(config.confirm_timeout(), Duration::from_secs(90));
        let defaults = NatsConfig::from_lookup(&Env::from_pairs(&[]))?;
        assert_eq!(defaults.url_redacted(), DEFAULT_URL);
        assert_eq!(defaults.subject_prefix(), DEFAULT_SUBJECT_PREFIX);
        assert_eq!(defaults.connect_timeout(), DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(defaults.confirm_timeout(), DEFAULT_CONFIRM_TIMEOUT);
        assert!(defaults.stream().is_none());
        Ok(())
    }

    #[test]
    fn from_env_names_the_bad_variable() {
        for (pairs, var) in [
            (
                vec![("OUTBOX_BROKER_URL", "amqp://app:s3cret@mq:5672/%2f")],
                "OUTBOX_BROKER_URL",
            ),
            (
                vec![("OUTBOX_SUBJECT_PREFIX", "orders.*")],
                "OUTBOX_SUBJECT_PREFIX",
            ),
            (
                vec![("OUTBOX_CONNECT_TIMEOUT", "soon")],
                "OUTBOX_CONNECT_TIMEOUT",
            ),
            (
                vec![("OUTBOX_CONFIRM_TIMEOUT", "0ms")],
                "OUTBOX_CONFIRM_TIMEOUT",
            ),
            (vec![("OUTBOX_STREAM", "bad.name")], "OUTBOX_STREAM"),
        ] {
            match NatsConfig::from_lookup(&Env::from_pairs(&pairs)) {
                Err(NatsError::Env(e)) => {
                    assert_eq!(e.var(), var, "{e}");
                    assert!(!e.to_string().contains("s3cret"), "{e}");
                }
                other => panic!("{var}: {other:?}"),
            }
        }
    }
}
