//! Configuration: [`RabbitConfig`], plain settings with defaults shared by the
//! publisher and the consumer, checked by [`RabbitConfig::validate`] (which
//! [`RabbitPublisher::connect`](crate::RabbitPublisher::connect) and
//! [`RabbitConsumer::new`](crate::RabbitConsumer::new) call before anything else).
//!
//! ```
//! use std::time::Duration;
//! use outboxkit_rabbit::RabbitConfig;
//!
//! let config = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .with_exchange("orders.events")
//!     .with_confirm_timeout(Duration::from_secs(10))
//!     .with_connection_name("orders-relay");
//! config.validate()?;
//! assert_eq!(config.exchange(), "orders.events");
//! // The password never shows up in logs or errors.
//! assert_eq!(config.url_redacted(), "amqp://guest:***@127.0.0.1:5672/%2f");
//! # Ok::<(), outboxkit_rabbit::RabbitError>(())
//! ```

use std::borrow::Cow;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::types::MAX_SHORT_STRING_LENGTH;
use lapin::uri::AMQPUri;

use outboxkit_core::env::{
    Env, EnvError, OUTBOX_BROKER_URL, OUTBOX_CONFIRM_TIMEOUT, OUTBOX_CONNECT_TIMEOUT,
    OUTBOX_DESTINATION_RULES, OUTBOX_EXCHANGE,
};

use crate::destinations::DestinationRule;
use crate::error::{RabbitError, redact_url};

/// The reason of a configuration error, without the URL or setting it is about.
fn reason_of(e: RabbitError) -> String {
    match e {
        RabbitError::InvalidUrl { reason, .. } | RabbitError::InvalidConfig { reason, .. } => {
            reason
        }
        other => other.to_string(),
    }
}

/// The broker URL used by [`RabbitConfig::from_env`] (and the `outbox` binary)
/// when `OUTBOX_BROKER_URL` is not set: the local broker.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Default exchange name.
pub const DEFAULT_EXCHANGE: &str = "outbox.events";
/// Default time to wait for the publisher confirms of one batch.
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time to wait for a connection (TCP, TLS, AMQP handshake, channel setup).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default largest payload published: 16 MiB, RabbitMQ 4's default `max_message_size`.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;
/// Default connection name shown by the broker (`connection_name` client property).
pub const DEFAULT_CONNECTION_NAME: &str = "outbox-transport-rabbit";
/// Default number of publisher channels per connection.
pub const DEFAULT_CHANNELS: usize = 2;
/// AMQP heartbeat timeout proposed when the URL sets none (`?heartbeat=`), in seconds:
/// a connection whose peer went silent (a host lost, a network partition: no reset
/// arrives) is given up after about twice this, instead of the server's 60 s default.
/// RabbitMQ's guide finds 5 to 20 s optimal for most environments
/// (<https://www.rabbitmq.com/docs/heartbeats>).
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;
/// Largest accepted number of publisher channels per connection.
pub const MAX_CHANNELS: usize = 256;

/// Settings of the RabbitMQ transport, shared by the publisher and the consumer: plain
/// data. [`new`](Self::new) takes the URL, every `with_*` setter consumes and returns the
/// configuration, getters are named after the settings, and [`validate`](Self::validate)
/// checks them all (the publisher's `connect` and the consumer's `new` call it first).
/// `Debug` shows the URLs redacted.
#[derive(Clone)]
#[must_use]
pub struct RabbitConfig {
    url: String,
    exchange: String,
    declare_exchange: bool,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    max_payload_bytes: usize,
    source: Option<String>,
    connection_name: String,
    channels: usize,
    destination_rules: Vec<DestinationRule>,
}

impl fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &self.url_redacted())
            .field("exchange", &self.exchange)
            .field("declare_exchange", &self.declare_exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("source", &self.source)
            .field("connection_name", &self.connection_name)
            .field("channels", &self.channels)
            .field("destination_rules", &self.destination_rules)
            .finish()
    }
}

impl RabbitConfig {
    /// Settings for the broker at `url` (`amqp://user:pass@host:port/vhost` or
    /// `amqps://...`; the default virtual host `/` is written `%2f`), with every other
    /// setting at its default.
    ///
    /// A cluster's nodes are given as several URLs separated by commas
    /// (`amqp://u:p@node1:5672/%2f,amqp://u:p@node2:5672/%2f`; a comma inside a password
    /// is written `%2C`): the publisher and the consumer connect to one of them, and on
    /// every (re)connection try them in turn, starting after the node used or tried
    /// last. Connecting stays bounded by the connect timeout in all: each of `n` nodes
    /// gets `connect_timeout / (n + 1)` (at least 1 s, at most the connect timeout), so a
    /// lost, stopped, frozen or cut-off node costs that share before the next is tried,
    /// and one share is left for the setup on the node reached.
    ///
    /// A URL without `?heartbeat=` proposes [`DEFAULT_HEARTBEAT_SECS`] (10 s).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            exchange: DEFAULT_EXCHANGE.to_owned(),
            declare_exchange: true,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            source: None,
            connection_name: DEFAULT_CONNECTION_NAME.to_owned(),
            channels: DEFAULT_CHANNELS,
            destination_rules: Vec::new(),
        }
    }

    /// Settings from the environment, under the names the `outbox` binary reads (the
    /// table: [`outboxkit_core::env`]); every other setting at its default:
    ///
    /// | Variable | Setting | Default |
    /// |---|---|---|
    /// | `OUTBOX_BROKER_URL` | the URL(s), as [`new`](Self::new) takes them | [`DEFAULT_URL`] (`amqp://guest:guest@127.0.0.1:5672/%2f`) |
    /// | `OUTBOX_EXCHANGE` | [`with_exchange`](Self::with_exchange) | `outbox.events` |
    /// | `OUTBOX_CONNECT_TIMEOUT` | [`with_connect_timeout`](Self::with_connect_timeout), a duration (`5s`, `1m`) | 5 s |
    /// | `OUTBOX_CONFIRM_TIMEOUT` | [`with_confirm_timeout`](Self::with_confirm_timeout), a duration | 10 s |
    /// | `OUTBOX_DESTINATION_RULES` | [`with_destination_rules`](Self::with_destination_rules), `PATTERN=NAME` comma-separated | none |
    ///
    /// Unset or blank variables take the default. The values are checked here as
    /// [`validate`](Self::validate) checks them, so that an error names its variable.
    ///
    /// # Errors
    /// [`RabbitError::Env`] naming the variable and its value (the URL's password
    /// hidden): a URL that is not `amqp://` or `amqps://` (e.g. a `nats://` one), an
    /// invalid exchange name, a duration that does not parse or is zero, a malformed
    /// destination rule.
    pub fn from_env() -> Result<Self, RabbitError> {
        Self::from_lookup(&Env::process())
    }

    /// [`from_env`](Self::from_env) over any environment (a map in tests).
    pub(crate) fn from_lookup(
        env: &Env<impl Fn(&str) -> Option<String>>,
    ) -> Result<Self, RabbitError> {
        let mut builder = Self::new(
            env.get(OUTBOX_BROKER_URL)
                .unwrap_or_else(|| DEFAULT_URL.to_owned()),
        );
        if let Some(exchange) = env.get(OUTBOX_EXCHANGE) {
            builder = builder.with_exchange(exchange);
        }
        if let Some(timeout) = env.duration(OUTBOX_CONNECT_TIMEOUT)? {
            builder = builder.with_connect_timeout(timeout);
        }
        if let Some(timeout) = env.duration(OUTBOX_CONFIRM_TIMEOUT)? {
            builder = builder.with_confirm_timeout(timeout);
        }
        let rules = env
            .list(OUTBOX_DESTINATION_RULES)
            .into_iter()
            .map(|rule| {
                rule.parse::<DestinationRule>().map_err(|e| {
                    EnvError::invalid(OUTBOX_DESTINATION_RULES, rule.clone(), reason_of(e))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !rules.is_empty() {
            builder = builder.with_destination_rules(rules);
        }
        if let Err(e) = builder.validate() {
            let var = match &e {
                RabbitError::InvalidUrl { .. } => OUTBOX_BROKER_URL,
                RabbitError::InvalidConfig { field, .. } => match *field {
                    "exchange" => OUTBOX_EXCHANGE,
                    "connect_timeout" => OUTBOX_CONNECT_TIMEOUT,
                    "confirm_timeout" => OUTBOX_CONFIRM_TIMEOUT,
                    "destination_rules" => OUTBOX_DESTINATION_RULES,
                    _ => return Err(e),
                },
                _ => return Err(e),
            };
            let value = if var == OUTBOX_BROKER_URL {
                redact_url(&builder.url)
            } else {
                env.get(var).unwrap_or_default()
            };
            return Err(EnvError::invalid(var, value, reason_of(e)).into());
        }
        Ok(builder)
    }

    /// The exchange messages are published to and queues are bound to. Default
    /// [`DEFAULT_EXCHANGE`] (`"outbox.events"`).
    ///
    /// The name must be 1 to 255 bytes. The AMQP default exchange `""` is rejected by
    /// [`validate`](Self::validate): it routes by queue name, so event types would have to be
    /// queue names, consumers could not bind by pattern, and it cannot be declared.
    pub fn with_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }

    /// Whether to declare the exchange (durable, type `topic`) when connecting. Default
    /// `true`. When `false` the exchange must exist: connecting checks it with a passive
    /// declare. Exchanges named `amq.*` are reserved by the broker and can only be used
    /// with `false`.
    pub fn with_declare_exchange(mut self, declare: bool) -> Self {
        self.declare_exchange = declare;
        self
    }

    /// How long a batch waits for its publisher confirms: a batch ends at most the
    /// connect timeout plus this after it started; messages still unconfirmed then are
    /// reported as [`PublishError::Timeout`](outboxkit_core::PublishError::Timeout), an
    /// outage that charges no attempt. Default 10 s. The dispatcher's lease must be at
    /// least twice the sum of the two.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// How long connecting may take (TCP, TLS, AMQP handshake, channel setup and
    /// declarations) before giving up with [`RabbitError::ConnectTimeout`], so a broker
    /// that is down never hangs the relay. Default 5 s.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The largest payload, in bytes, the publisher sends. A larger message is not sent
    /// and gets [`PublishError::PayloadTooLarge`](outboxkit_core::PublishError::PayloadTooLarge)
    /// (permanent). Default 16 MiB; keep it at or below the broker's
    /// `max_message_size`.
    pub fn with_max_payload_bytes(mut self, max: usize) -> Self {
        self.max_payload_bytes = max;
        self
    }

    /// The CloudEvents `source` attribute of every published message. Default `None`:
    /// `/{aggregate_type}` of each message.
    pub fn with_source(mut self, source: Option<String>) -> Self {
        self.source = source;
        self
    }

    /// The connection name shown by the broker (the `connection_name` client property,
    /// visible in `rabbitmqctl list_connections client_properties` and the management
    /// UI). Default [`DEFAULT_CONNECTION_NAME`] (`"outbox-transport-rabbit"`).
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// How many confirm-mode channels the publisher opens on its connection, 1 to
    /// [`MAX_CHANNELS`]. Concurrent `publish_batch` calls use different channels; calls
    /// beyond this number wait for a free channel. Default 2.
    pub fn with_channels(mut self, channels: usize) -> Self {
        self.channels = channels;
        self
    }

    /// Which routing keys are one destination of the relay (one circuit while a queue
    /// refuses messages), tried in order: see [`DestinationRule`]. Default none: each
    /// routing key is its own destination (RabbitMQ's `basic.nack` names no queue, so
    /// the transport cannot tell which routing keys share a full queue).
    pub fn with_destination_rules(
        mut self,
        rules: impl IntoIterator<Item = DestinationRule>,
    ) -> Self {
        self.destination_rules = rules.into_iter().collect();
        self
    }

    /// Validates the settings.
    ///
    /// # Errors
    /// - [`RabbitError::InvalidUrl`] when a URL does not parse as `amqp://` or
    ///   `amqps://` (the error shows the URL with its password redacted);
    /// - [`RabbitError::InvalidConfig`] when the exchange name is empty or longer than
    ///   255 bytes, an `amq.*` exchange is to be declared, a timeout or the payload limit
    ///   is zero, the channel count is outside `1..=256`, or the source or connection
    ///   name is empty.
    pub fn validate(&self) -> Result<(), RabbitError> {
        self.parse_nodes()?;
        if self.exchange.is_empty() {
            return Err(invalid(
                "exchange",
                "must not be empty (the AMQP default exchange is not supported)",
            ));
        }
        if self.exchange.len() > MAX_SHORT_STRING_LENGTH {
            return Err(invalid(
                "exchange",
                format!(
                    "is {} bytes long, the maximum is {MAX_SHORT_STRING_LENGTH}",
                    self.exchange.len()
                ),
            ));
        }
        if self.exchange.chars().any(char::is_control) {
            return Err(invalid("exchange", "contains a control character"));
        }
        if self.declare_exchange && self.exchange.starts_with("amq.") {
            return Err(invalid(
                "exchange",
                format!(
                    "{:?} is reserved by the broker and cannot be declared; use with_declare_exchange(false)",
                    self.exchange
                ),
            ));
        }
        if self.confirm_timeout.is_zero() {
            return Err(invalid("confirm_timeout", "must be greater than zero"));
        }
        if self.connect_timeout.is_zero() {
            return Err(invalid("connect_timeout", "must be greater than zero"));
        }
        if self.max_payload_bytes == 0 {
            return Err(invalid("max_payload_bytes", "must be greater than zero"));
        }
        if !(1..=MAX_CHANNELS).contains(&self.channels) {
            return Err(invalid(
                "channels",
                format!(
                    "must be between 1 and {MAX_CHANNELS}, got {}",
                    self.channels
                ),
            ));
        }
        if self.source.as_deref().is_some_and(str::is_empty) {
            return Err(invalid("source", "must not be empty when set"));
        }
        if self.connection_name.is_empty() {
            return Err(invalid("connection_name", "must not be empty"));
        }
        Ok(())
    }

    /// The nodes of the URL list, parsed (with their passwords).
    fn parse_nodes(&self) -> Result<Vec<Node>, RabbitError> {
        self.url
            .split(',')
            .map(|url| {
                let url_redacted = redact_url(url.trim());
                parse_uri(url, &url_redacted).map(|uri| Node { uri, url_redacted })
            })
            .collect()
    }

    /// Validates the settings and parses the URLs, for a publisher or consumer to
    /// hold: the parsed nodes and the position of the node to try next.
    pub(crate) fn resolve(self) -> Result<Resolved, RabbitError> {
        self.validate()?;
        let nodes = self.parse_nodes()?;
        let url_redacted = self.url_redacted();
        Ok(Resolved {
            config: self,
            nodes: Arc::new(nodes),
            next_node: Arc::new(AtomicUsize::new(0)),
            url_redacted,
        })
    }

    /// The broker URL (or comma-separated URLs) as given, passwords included: do not
    /// log it; [`url_redacted`](Self::url_redacted) hides them.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The broker URL, or the cluster's URLs separated by commas, with every password
    /// replaced by `***`.
    pub fn url_redacted(&self) -> String {
        self.url
            .split(',')
            .map(|url| redact_url(url.trim()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How many nodes the configuration lists (1 for a single broker): the URLs
    /// separated by commas.
    pub fn node_count(&self) -> usize {
        self.url.split(',').count()
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> RabbitError {
    RabbitError::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

/// Parses an AMQP URI without ever panicking or leaking the password.
fn parse_uri(url: &str, url_redacted: &str) -> Result<AMQPUri, RabbitError> {
    let invalid_url = |reason: String| RabbitError::InvalidUrl {
        url_redacted: url_redacted.to_owned(),
        // Parser messages may quote the input; never let the password through.
        reason: reason.replace(url, url_redacted),
    };
    let trimmed = url.trim();
    if trimmed.is_empty() {
        return Err(invalid_url("the URL is empty".to_owned()));
    }
    if !(trimmed.starts_with("amqp://") || trimmed.starts_with("amqps://")) {
        return Err(invalid_url(
            "the scheme must be amqp:// or amqps://".to_owned(),
        ));
    }
    let mut uri = AMQPUri::from_str(trimmed).map_err(invalid_url)?;
    // amq-protocol-uri 10.6 takes the host from `Url::domain()`, which is `None` for IPv6
    // literals (`[::1]`), and then silently falls back to "localhost": restore the IP.
    if let Some(ip) = ip_host(trimmed) {
        uri.authority.host = ip.to_string();
    }
    if uri.authority.host.is_empty() {
        return Err(invalid_url("the URL has no host".to_owned()));
    }
    Ok(uri)
}

/// The host of an `amqp(s)://` URL when it is an IP literal (`127.0.0.1`, `[::1]`).
fn ip_host(url: &str) -> Option<IpAddr> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host_port = authority
        .rfind('@')
        .map_or(authority, |at| &authority[at + 1..]);
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        &v6[..v6.find(']')?]
    } else {
        host_port.split(':').next()?
    };
    host.parse().ok()
}

/// One node of the broker: its parsed URI (with the password) and its URL redacted.
#[derive(Clone)]
pub(crate) struct Node {
    pub(crate) uri: AMQPUri,
    pub(crate) url_redacted: String,
}

/// A validated [`RabbitConfig`] with its URLs parsed, held by a publisher or a
/// consumer: cheap to clone; clones share the position of the node to try next. Derefs
/// to the configuration.
#[derive(Clone)]
pub(crate) struct Resolved {
    config: RabbitConfig,
    nodes: Arc<Vec<Node>>,
    next_node: Arc<AtomicUsize>,
    url_redacted: String,
}

impl fmt::Debug for Resolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}

impl std::ops::Deref for Resolved {
    type Target = RabbitConfig;

    fn deref(&self) -> &RabbitConfig {
        &self.config
    }
}

impl Resolved {
    /// The parsed URI of the first node (it contains the password: do not log it).
    #[cfg(test)]
    pub(crate) fn uri(&self) -> &AMQPUri {
        &self.nodes[0].uri
    }

    /// The nodes in the order to try them now: starting after the node a connection
    /// was last made to, round the list.
    pub(crate) fn nodes_in_turn(&self) -> impl Iterator<Item = (usize, &Node)> {
        let n = self.nodes.len();
        let start = self.next_node.load(Ordering::Relaxed) % n;
        (0..n).map(move |k| {
            let i = (start + k) % n;
            (i, &self.nodes[i])
        })
    }

    /// Records that a connection was made to, or failed on, node `index`: the next
    /// attempt starts with the node after it, so reconnecting after that node is lost
    /// does not wait on it first, an attempt cut short by the connect timeout goes on
    /// where it stopped, and several connections spread over the cluster.
    pub(crate) fn tried(&self, index: usize) {
        self.next_node.store(index + 1, Ordering::Relaxed);
    }

    /// How long connecting to one node may take: the connect timeout alone for a single
    /// node; for `n` nodes `connect_timeout / (n + 1)`, at least 1 s and at most the
    /// connect timeout.
    pub(crate) fn node_connect_timeout(&self) -> Duration {
        let n = self.nodes.len();
        if n <= 1 {
            return self.connect_timeout;
        }
        (self.connect_timeout / u32::try_from(n + 1).unwrap_or(u32::MAX))
            .max(Duration::from_secs(1))
            .min(self.connect_timeout)
    }

    /// How many nodes the configuration lists (1 for a single broker).
    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The URLs with every password replaced by `***` (computed once).
    pub(crate) fn url_redacted(&self) -> &str {
        &self.url_redacted
    }
}

impl RabbitConfig {
    /// The exchange messages are published to.
    pub fn exchange(&self) -> &str {
        &self.exchange
    }

    /// Whether the exchange is declared (durable topic) when connecting.
    pub fn declare_exchange(&self) -> bool {
        self.declare_exchange
    }

    /// How long a batch waits for its publisher confirms.
    pub fn confirm_timeout(&self) -> Duration {
        self.confirm_timeout
    }

    /// How long connecting may take in all, the setup on the node reached (exchange,
    /// channels) included, over however many nodes are listed.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The largest payload published, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// The CloudEvents `source` override, if any.
    pub fn source(&self) -> Option<&str> {
        self.source.as_deref()
    }

    /// The connection name shown by the broker.
    pub fn connection_name(&self) -> &str {
        &self.connection_name
    }

    /// The number of publisher channels.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The destination rules, in the order they are tried.
    pub fn destination_rules(&self) -> &[DestinationRule] {
        &self.destination_rules
    }

    /// The destination of messages with `routing_key`: the name of the first
    /// [`DestinationRule`] that matches it, else the routing key itself.
    pub fn destination<'a>(&'a self, routing_key: &'a str) -> Cow<'a, str> {
        Cow::Borrowed(
            self.destination_rules
                .iter()
                .find_map(|r| r.destination_of(routing_key))
                .unwrap_or(routing_key),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let config = RabbitConfig::new(DEFAULT_URL).resolve().expect("valid");
        assert_eq!(config.exchange(), DEFAULT_EXCHANGE);
        assert!(config.declare_exchange());
        assert_eq!(config.confirm_timeout(), Duration::from_secs(10));
        assert_eq!(config.connect_timeout(), Duration::from_secs(5));
        assert_eq!(config.max_payload_bytes(), 16 * 1024 * 1024);
        assert_eq!(config.channels(), 2);
        assert_eq!(config.source(), None);
        assert_eq!(config.uri().authority.host, "127.0.0.1");
        assert_eq!(config.uri().authority.port, 5672);
        assert_eq!(config.uri().vhost, "/");
    }

    #[test]
    fn ip_hosts_are_kept() {
        for (url, host) in [
            ("amqp://u:p@10.1.2.3:5673/%2f", "10.1.2.3"),
            ("amqp://[::1]:5672/%2f", "::1"),
            ("amqps://u:p@[fe80::1]/vh", "fe80::1"),
            ("amqp://broker.internal/%2f", "broker.internal"),
        ] {
            let config = RabbitConfig::new(url).resolve().expect("valid");
            assert_eq!(config.uri().authority.host, host, "{url}");
        }
    }

    /// A cluster's nodes, comma-separated: each parsed and redacted, tried in turn
    /// starting after the node connected to last.
    #[test]
    fn several_nodes_are_tried_in_turn() {
        let config = RabbitConfig::new(
            "amqp://u:s3cret@n1:5672/%2f, amqp://u:s3cret@n2:5673/%2f,amqp://u:s3cret@n3/%2f",
        )
        .resolve()
        .expect("valid");
        assert_eq!(config.node_count(), 3);
        assert_eq!(
            config.url_redacted(),
            "amqp://u:***@n1:5672/%2f,amqp://u:***@n2:5673/%2f,amqp://u:***@n3/%2f"
        );
        assert!(!format!("{config:?}").contains("s3cret"));
        let order = |c: &Resolved| -> Vec<String> {
            c.nodes_in_turn()
                .map(|(_, node)| node.uri.authority.host.clone())
                .collect()
        };
        assert_eq!(order(&config), ["n1", "n2", "n3"]);
        config.tried(1);
        let clone = config.clone();
        assert_eq!(order(&clone), ["n3", "n1", "n2"], "clones share the turn");
        config.tried(2);
        assert_eq!(order(&config), ["n1", "n2", "n3"]);
        // 5 s over 3 nodes and the setup: 1.25 s each; never below 1 s.
        assert_eq!(config.connect_timeout(), DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(config.node_connect_timeout(), Duration::from_millis(1_250));
        let short = RabbitConfig::new("amqp://n1/%2f,amqp://n2/%2f")
            .with_connect_timeout(Duration::from_secs(2))
            .resolve()
            .expect("valid");
        assert_eq!(short.node_connect_timeout(), Duration::from_secs(1));
        let single = RabbitConfig::new("amqp://n1/%2f").resolve().expect("valid");
        assert_eq!(single.node_connect_timeout(), DEFAULT_CONNECT_TIMEOUT);

        // One bad node fails the whole list, without its password.
        match RabbitConfig::new("amqp://u:s3cret@n1/%2f,http://u:hunter2@n2/").resolve() {
            Err(e @ RabbitError::InvalidUrl { .. }) => {
                assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
            }
            other => panic!("expected InvalidUrl, got {other:?}"),
        }
    }

    #[test]
    fn malformed_urls_are_typed_errors_without_password() {
        for url in [
            "",
            "   ",
            "http://guest:hunter2@host/",
            "amqp://guest:hunter2@host:notaport/%2f",
            "amqp://guest:hunter2@host/%2f?heartbeat=abc",
            "amqp//guest:hunter2@host",
            "guest:hunter2@host",
            "amqp://guest:hunter2@host/%ff",
        ] {
            match RabbitConfig::new(url).resolve() {
                Err(e @ RabbitError::InvalidUrl { .. }) => {
                    let text = format!("{e} {e:?}");
                    assert!(!text.contains("hunter2"), "password leaked: {text}");
                }
                other => panic!("{url:?}: expected InvalidUrl, got {other:?}"),
            }
        }
    }

    #[test]
    fn invalid_settings() {
        let base = || RabbitConfig::new(DEFAULT_URL);
        let field = |b: RabbitConfig| match b.validate() {
            Err(RabbitError::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        };
        assert_eq!(field(base().with_exchange("")), "exchange");
        assert_eq!(field(base().with_exchange("x".repeat(256))), "exchange");
        assert_eq!(field(base().with_exchange("amq.topic")), "exchange");
        assert!(
            base()
                .with_exchange("amq.topic")
                .with_declare_exchange(false)
                .validate()
                .is_ok()
        );
        assert_eq!(field(base().with_channels(0)), "channels");
        assert_eq!(field(base().with_channels(MAX_CHANNELS + 1)), "channels");
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
        assert_eq!(field(base().with_connection_name("")), "connection_name");
    }

    #[test]
    fn debug_never_shows_the_password() {
        let builder = RabbitConfig::new("amqp://guest:hunter2@host/%2f");
        assert!(!format!("{builder:?}").contains("hunter2"));
        let config = builder.resolve().expect("valid");
        assert!(!format!("{config:?}").contains("hunter2"));
        // Passwords with unencoded delimiters, digits-only ones included (which read as
        // a port and a path).
        for url in [
            "amqp://guest:s3cret@host/%2f",
            "amqp://guest:1234/s3cret@host:5672/%2f",
            "amqps://guest:s3?cret#x@host/%2f",
            "amqp://guest:s3cret@host/%2f?heartbeat=10",
        ] {
            let builder = RabbitConfig::new(url);
            let shown = format!("{builder:?}");
            assert!(
                !shown.contains("s3cret") && !shown.contains("cret#x"),
                "{shown}"
            );
            if let Ok(config) = builder.resolve() {
                let shown = format!("{config:?}");
                assert!(!shown.contains("s3cret"), "{shown}");
            }
        }
    }

    #[test]
    fn from_env_reads_the_binarys_variables() -> Result<(), RabbitError> {
        let config = RabbitConfig::from_lookup(&Env::from_pairs(&[
            ("OUTBOX_BROKER_URL", "amqp://app:s3cret@mq:5672/%2f"),
            ("OUTBOX_EXCHANGE", "orders.events"),
            ("OUTBOX_CONNECT_TIMEOUT", "2s"),
            ("OUTBOX_CONFIRM_TIMEOUT", "1m 30s"),
            (
                "OUTBOX_DESTINATION_RULES",
                "orders.#=orders, billing.*=billing",
            ),
        ]))?
        .resolve()?;
        assert_eq!(config.url_redacted(), "amqp://app:***@mq:5672/%2f");
        assert_eq!(config.exchange(), "orders.events");
        assert_eq!(config.connect_timeout(), Duration::from_secs(2));
        assert_eq!(config.confirm_timeout(), Duration::from_secs(90));
        assert_eq!(config.destination_rules().len(), 2);
        let defaults = RabbitConfig::from_lookup(&Env::from_pairs(&[("OUTBOX_BROKER_URL", " ")]))?
            .resolve()?;
        assert_eq!(defaults.url_redacted(), redact_url(DEFAULT_URL));
        assert_eq!(defaults.exchange(), DEFAULT_EXCHANGE);
        assert_eq!(defaults.connect_timeout(), DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(defaults.confirm_timeout(), DEFAULT_CONFIRM_TIMEOUT);
        assert!(defaults.destination_rules().is_empty());
        Ok(())
    }

    #[test]
    fn from_env_names_the_bad_variable() {
        for (pairs, var) in [
            (
                vec![("OUTBOX_BROKER_URL", "nats://app:s3cret@mq:4222")],
                "OUTBOX_BROKER_URL",
            ),
            (
                vec![("OUTBOX_BROKER_URL", "amqp://app:s3cret@mq:port/%2f")],
                "OUTBOX_BROKER_URL",
            ),
            (vec![("OUTBOX_EXCHANGE", "a\u{7}b")], "OUTBOX_EXCHANGE"),
            (
                vec![("OUTBOX_CONNECT_TIMEOUT", "5")],
                "OUTBOX_CONNECT_TIMEOUT",
            ),
            (
                vec![("OUTBOX_CONFIRM_TIMEOUT", "0s")],
                "OUTBOX_CONFIRM_TIMEOUT",
            ),
            (
                vec![("OUTBOX_DESTINATION_RULES", "orders.#")],
                "OUTBOX_DESTINATION_RULES",
            ),
        ] {
            match RabbitConfig::from_lookup(&Env::from_pairs(&pairs)) {
                Err(RabbitError::Env(e)) => {
                    assert_eq!(e.var(), var, "{e}");
                    assert!(!e.to_string().contains("s3cret"), "{e}");
                }
                other => panic!("{var}: {other:?}"),
            }
        }
    }
}
