//! Settings: the TOML config file ([`FileConfig`]), the resolved relay settings
//! ([`RelaySettings`]) and the parsers for durations, time bounds and per-event-type
//! overrides.
//!
//! Precedence, per setting: command-line flag, then environment variable (clap reads
//! both), then the config file, then the default.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outboxkit_core::{DispatcherConfig, RetryPolicies, RetryPolicy};
use serde::Deserialize;

use crate::cli::{Cli, LogFormat, OrderingMode, RelayArgs, SentRetentionMode};
use crate::database::DatabaseKind;
use crate::error::CliError;
pub(crate) use outboxkit_core::TransportKind;

/// The default schema of both SQL backends.
const DEFAULT_SCHEMA: &str = "outbox";

/// Default address of `/metrics` and `/healthz`.
const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    9464,
));

/// The config file. Every key is optional; unknown keys are an error (a typo must not
/// be silently ignored).
///
/// ```toml
/// database_url = "postgres://postgres@127.0.0.1:5432/app"
/// schema = "outbox"
/// log_format = "json"
///
/// [relay]
/// transport = "rabbit"            # or "nats"
/// broker_url = "amqp://guest:guest@127.0.0.1:5672/%2f"
/// exchange = "outbox.events"      # rabbit
/// subject_prefix = "outbox.events" # nats
/// stream = "OUTBOX"              # nats: declared by the relay
/// destination_rules = ["orders.#=orders"] # rabbit: routing keys of one queue
/// batch_size = 500
/// poll_interval = "500ms"
/// lease = "30s"
/// connect_timeout = "5s"
/// confirm_timeout = "10s"
/// drain_timeout = "10s"
/// crash_loop_limit = 5
/// max_attempts = 8
/// concurrency = 2
/// ordering = "per-key"            # unordered | per-key | per-key-skip
/// sent_retention = "keep"         # keep | delete
/// listen = "0.0.0.0:9464"
/// dashboard = true                # serve the dashboard's pages on `listen` too
/// allow_replay = false            # replay from the dashboard (dry run + confirmation)
/// max_lag = "5m"
/// stuck_after = "2m"
/// health_interval = "5s"
///
/// [relay.event_types.PaymentCaptured]
/// max_attempts = 20
/// base = 2.0
/// cap = "10m"
/// jitter = "1s"
/// ```
///
/// `Debug` hides the URLs' passwords.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// PostgreSQL URL.
    pub database_url: Option<String>,
    /// Schema of the tables.
    pub schema: Option<String>,
    /// Log format.
    pub log_format: Option<LogFormat>,
    /// Relay settings.
    #[serde(default)]
    pub relay: FileRelay,
}

/// The `[relay]` table of the config file (see [`RelayArgs`] for the meaning of each).
/// `Debug` hides the broker URL's password.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // reason: documented on the matching `RelayArgs` flags
pub struct FileRelay {
    pub transport: Option<TransportKind>,
    pub broker_url: Option<String>,
    pub exchange: Option<String>,
    pub subject_prefix: Option<String>,
    pub stream: Option<String>,
    pub destination_rules: Option<Vec<String>>,
    pub batch_size: Option<usize>,
    pub poll_interval: Option<String>,
    pub lease: Option<String>,
    pub connect_timeout: Option<String>,
    pub confirm_timeout: Option<String>,
    pub drain_timeout: Option<String>,
    pub crash_loop_limit: Option<u32>,
    pub max_attempts: Option<u32>,
    pub concurrency: Option<usize>,
    pub ordering: Option<OrderingMode>,
    pub sent_retention: Option<SentRetentionMode>,
    pub listen: Option<String>,
    pub dashboard: Option<bool>,
    pub allow_replay: Option<bool>,
    pub max_lag: Option<String>,
    pub stuck_after: Option<String>,
    pub health_interval: Option<String>,
    pub source: Option<crate::cli::SourceKind>,
    pub wal_slot: Option<String>,
    pub wal_publication: Option<String>,
    pub max_wal_retained: Option<u64>,
    pub wal_linger: Option<String>,
    pub wal_part_size: Option<usize>,
    #[serde(default)]
    pub event_types: BTreeMap<String, FileOverride>,
}

/// A per-event-type retry override in the config file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileOverride {
    /// Attempts before Dead.
    pub max_attempts: Option<u32>,
    /// Growth factor (delay = base^attempt seconds).
    pub base: Option<f64>,
    /// Cap of the exponential part.
    pub cap: Option<String>,
    /// Maximum random jitter added.
    pub jitter: Option<String>,
}

impl FileConfig {
    /// Reads and parses `path`.
    ///
    /// # Errors
    /// [`CliError::ConfigRead`] or [`CliError::ConfigParse`] (with line and column).
    pub fn load(path: &Path) -> Result<Self, CliError> {
        let text = std::fs::read_to_string(path).map_err(|source| CliError::ConfigRead {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|message| CliError::ConfigParse {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses TOML text.
    ///
    /// # Errors
    /// The parser's message for invalid TOML or unknown/mistyped keys.
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())
    }
}

/// Database settings shared by every command. `Debug` hides the URL's password.
#[derive(Clone, PartialEq, Eq)]
pub struct DbSettings {
    /// Database URL or connection string (validated; it picks the backend).
    pub url: String,
    /// Schema (validated).
    pub schema: String,
}

impl DbSettings {
    /// From flags/environment, else the file.
    ///
    /// # Errors
    /// [`CliError::Missing`] without a URL, [`CliError::Invalid`] for a malformed URL
    /// or schema name.
    pub fn resolve(cli: &Cli, file: &FileConfig) -> Result<Self, CliError> {
        let url = cli
            .database_url
            .clone()
            .or_else(|| file.database_url.clone())
            .ok_or(CliError::Missing {
                field: "database_url",
                hint: "pass --database-url, set DATABASE_URL, or set database_url in the config file",
            })?;
        let schema = cli
            .schema
            .clone()
            .or_else(|| file.schema.clone())
            .unwrap_or_else(|| DEFAULT_SCHEMA.to_owned());
        let kind = DatabaseKind::of_url(&url)?.require()?;
        if let Err(e) = outboxkit_core::store::validate_schema(&schema) {
            return Err(CliError::Invalid {
                field: "schema",
                reason: strip_config_prefix(&e),
            });
        }
        let settings = Self { url, schema };
        match kind {
            DatabaseKind::Postgres =>
            {
                #[cfg(feature = "postgres")]
                if let Err(e) = outboxkit_postgres::parse_url(&settings.url) {
                    return Err(CliError::Invalid {
                        field: "database_url",
                        reason: strip_config_prefix(&e),
                    });
                }
            }
            DatabaseKind::SqlServer =>
            {
                #[cfg(feature = "sqlserver")]
                if let Err(e) = settings.mssql_config()?.validate() {
                    return Err(CliError::Invalid {
                        field: "database_url",
                        reason: strip_config_prefix(&e),
                    });
                }
            }
            DatabaseKind::MySql =>
            {
                #[cfg(feature = "mysql")]
                if let Err(e) = outboxkit_mysql::parse_url(&settings.url) {
                    return Err(CliError::Invalid {
                        field: "database_url",
                        reason: strip_config_prefix(&e),
                    });
                }
            }
        }
        Ok(settings)
    }

    /// The backend the URL names (checked to be compiled in by [`resolve`](Self::resolve)).
    ///
    /// # Errors
    /// [`CliError::Invalid`] for an unrecognised URL.
    pub fn kind(&self) -> Result<DatabaseKind, CliError> {
        DatabaseKind::of_url(&self.url)
    }

    /// The PostgreSQL configuration.
    #[cfg(feature = "postgres")]
    pub fn pg_config(&self) -> outboxkit_postgres::PgConfig {
        outboxkit_postgres::PgConfig::new(&self.url).with_schema(&self.schema)
    }

    /// The MySQL / MariaDB configuration.
    #[cfg(feature = "mysql")]
    pub fn mysql_config(&self) -> outboxkit_mysql::MySqlConfig {
        outboxkit_mysql::MySqlConfig::new(&self.url).with_schema(&self.schema)
    }

    /// The SQL Server configuration (the URL or connection string parsed by
    /// `MssqlConfig`'s `FromStr`, see [`crate::database`]).
    ///
    /// # Errors
    /// [`CliError::Invalid`] for a malformed `mssql://` URL or connection string.
    #[cfg(feature = "sqlserver")]
    pub fn mssql_config(&self) -> Result<outboxkit_sqlserver::MssqlConfig, CliError> {
        let config: outboxkit_sqlserver::MssqlConfig =
            self.url.parse().map_err(|e| CliError::Invalid {
                field: "database_url",
                reason: strip_config_prefix(&e),
            })?;
        Ok(config.with_schema(&self.schema))
    }
}

pub(crate) use crate::database::redact_database_url;

/// `url`, a broker URL of `transport`, with its password (and a NATS token) replaced by
/// `***`. When the transport is not known yet the NATS rules apply: a user info without
/// a password is hidden as a token too, and a comma-separated server list is redacted
/// server by server.
pub(crate) fn redact_broker_url(transport: Option<TransportKind>, url: &str) -> String {
    match transport {
        #[cfg(feature = "rabbit")]
        Some(TransportKind::Rabbit) => outboxkit_rabbit::redact_url(url),
        #[cfg(feature = "nats")]
        Some(TransportKind::Nats) | None => outboxkit_nats::redact_url(url),
        // A transport compiled out never connects; hide the whole user info.
        #[allow(unreachable_patterns)] // reason: unreachable with both transports
        _ => outboxkit_core::error::redact_url(url, outboxkit_core::error::LoneUserInfo::Token),
    }
}

/// What the binary knows of a [`TransportKind`] beyond the core: its product name,
/// its cargo feature and whether this build has it.
pub(crate) trait TransportExt: Sized {
    /// The broker's name in messages.
    fn product_name(self) -> &'static str;
    /// The cargo feature of `outboxkit-cli` that compiles the transport in.
    fn feature(self) -> &'static str;
    /// `Ok(self)` when this binary was built with the transport.
    ///
    /// # Errors
    /// [`CliError::FeatureMissing`] naming the feature otherwise.
    fn require(self) -> Result<Self, CliError>;
    /// The [`CliError::FeatureMissing`] that names this transport's feature.
    fn missing(self) -> CliError;
    /// The local broker's URL: the default without `--broker-url` / `OUTBOX_BROKER_URL`
    /// (the transport's `from_env` default too).
    fn default_url(self) -> &'static str;
    /// The transport's default connect timeout.
    fn connect_timeout(self) -> Duration;
}

impl TransportExt for TransportKind {
    /// The broker's name in messages.
    fn product_name(self) -> &'static str {
        match self {
            Self::Rabbit => "RabbitMQ",
            Self::Nats => "NATS JetStream",
        }
    }

    /// The cargo feature of `outboxkit-cli` that compiles the transport in.
    fn feature(self) -> &'static str {
        match self {
            Self::Rabbit => "rabbit",
            Self::Nats => "nats",
        }
    }

    /// `Ok(self)` when this binary was built with the transport.
    ///
    /// # Errors
    /// [`CliError::FeatureMissing`] naming the feature otherwise.
    fn require(self) -> Result<Self, CliError> {
        let compiled = match self {
            Self::Rabbit => cfg!(feature = "rabbit"),
            Self::Nats => cfg!(feature = "nats"),
        };
        if compiled {
            Ok(self)
        } else {
            Err(self.missing())
        }
    }

    /// The [`CliError::FeatureMissing`] that names this backend's feature.
    fn missing(self) -> CliError {
        CliError::FeatureMissing {
            backend: self.product_name(),
            feature: self.feature(),
        }
    }

    /// The local broker's URL.
    fn default_url(self) -> &'static str {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit => outboxkit_rabbit::config::DEFAULT_URL,
            #[cfg(feature = "nats")]
            Self::Nats => outboxkit_nats::config::DEFAULT_URL,
            // Compiled out: `require` fails before the URL is used.
            #[allow(unreachable_patterns)] // reason: unreachable with both transports
            _ => "",
        }
    }

    /// The transport's connect timeout.
    fn connect_timeout(self) -> Duration {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit => outboxkit_rabbit::config::DEFAULT_CONNECT_TIMEOUT,
            #[cfg(feature = "nats")]
            Self::Nats => outboxkit_nats::config::DEFAULT_CONNECT_TIMEOUT,
            #[allow(unreachable_patterns)] // reason: unreachable with both transports
            _ => DEFAULT_CONNECT_TIMEOUT,
        }
    }
}

/// The relay's longest wait between polls when none is configured: 2 seconds on
/// PostgreSQL, where polling is only the fallback of push wake-up (`LISTEN`; while the
/// listener is down it wakes the relay every 500 ms), 500 milliseconds on SQL Server
/// and MySQL (polling only) and for an unrecognised URL.
pub(crate) fn default_poll_interval(database: Option<DatabaseKind>) -> Duration {
    match database {
        Some(DatabaseKind::Postgres) => Duration::from_secs(2),
        Some(DatabaseKind::SqlServer | DatabaseKind::MySql) | None => Duration::from_millis(500),
    }
}

/// Default RabbitMQ exchange and NATS subject prefix (the transports' defaults).
const DEFAULT_DESTINATION: &str = "outbox.events";
/// Default confirm (RabbitMQ) / PubAck (NATS) timeout (the transports' defaults).
const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// Default broker connect timeout (the transports' defaults).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

impl fmt::Debug for FileConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured, so that a new field cannot be forgotten here.
        let Self {
            database_url,
            schema,
            log_format,
            relay,
        } = self;
        f.debug_struct("FileConfig")
            .field(
                "database_url",
                &database_url.as_deref().map(redact_database_url),
            )
            .field("schema", schema)
            .field("log_format", log_format)
            .field("relay", relay)
            .finish()
    }
}

impl fmt::Debug for FileRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            transport,
            broker_url,
            exchange,
            subject_prefix,
            stream,
            destination_rules,
            batch_size,
            poll_interval,
            lease,
            connect_timeout,
            confirm_timeout,
            drain_timeout,
            crash_loop_limit,
            max_attempts,
            concurrency,
            ordering,
            sent_retention,
            listen,
            dashboard,
            allow_replay,
            max_lag,
            stuck_after,
            health_interval,
            source,
            wal_slot,
            wal_publication,
            max_wal_retained,
            wal_linger,
            wal_part_size,
            event_types,
        } = self;
        f.debug_struct("FileRelay")
            .field("source", source)
            .field("wal_slot", wal_slot)
            .field("wal_publication", wal_publication)
            .field("max_wal_retained", max_wal_retained)
            .field("wal_linger", wal_linger)
            .field("wal_part_size", wal_part_size)
            .field("transport", transport)
            .field(
                "broker_url",
                &broker_url
                    .as_deref()
                    .map(|url| redact_broker_url(*transport, url)),
            )
            .field("exchange", exchange)
            .field("subject_prefix", subject_prefix)
            .field("stream", stream)
            .field("destination_rules", destination_rules)
            .field("batch_size", batch_size)
            .field("poll_interval", poll_interval)
            .field("lease", lease)
            .field("connect_timeout", connect_timeout)
            .field("confirm_timeout", confirm_timeout)
            .field("drain_timeout", drain_timeout)
            .field("crash_loop_limit", crash_loop_limit)
            .field("max_attempts", max_attempts)
            .field("concurrency", concurrency)
            .field("ordering", ordering)
            .field("sent_retention", sent_retention)
            .field("listen", listen)
            .field("dashboard", dashboard)
            .field("allow_replay", allow_replay)
            .field("max_lag", max_lag)
            .field("stuck_after", stuck_after)
            .field("health_interval", health_interval)
            .field("event_types", event_types)
            .finish()
    }
}

impl fmt::Debug for DbSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self { url, schema } = self;
        f.debug_struct("DbSettings")
            .field("url", &redact_database_url(url))
            .field("schema", schema)
            .finish()
    }
}

impl fmt::Debug for RelaySettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            db,
            transport,
            broker_url,
            exchange,
            subject_prefix,
            stream,
            destination_rules,
            batch_size,
            poll_interval,
            lease,
            connect_timeout,
            confirm_timeout,
            drain_timeout,
            crash_loop_limit,
            max_attempts,
            concurrency,
            overrides,
            ordering,
            sent_retention,
            listen,
            dashboard,
            max_lag,
            stuck_after,
            health_interval,
            source,
            wal_slot,
            wal_publication,
            max_wal_retained,
            wal_linger,
            wal_part_size,
        } = self;
        f.debug_struct("RelaySettings")
            .field("db", db)
            .field("transport", transport)
            .field(
                "broker_url",
                &redact_broker_url(Some(*transport), broker_url),
            )
            .field("exchange", exchange)
            .field("subject_prefix", subject_prefix)
            .field("stream", stream)
            .field("destination_rules", destination_rules)
            .field("batch_size", batch_size)
            .field("poll_interval", poll_interval)
            .field("lease", lease)
            .field("connect_timeout", connect_timeout)
            .field("confirm_timeout", confirm_timeout)
            .field("drain_timeout", drain_timeout)
            .field("crash_loop_limit", crash_loop_limit)
            .field("max_attempts", max_attempts)
            .field("concurrency", concurrency)
            .field("overrides", overrides)
            .field("ordering", ordering)
            .field("sent_retention", sent_retention)
            .field("listen", listen)
            .field("dashboard", dashboard)
            .field("max_lag", max_lag)
            .field("stuck_after", stuck_after)
            .field("health_interval", health_interval)
            .field("source", source)
            .field("wal_slot", wal_slot)
            .field("wal_publication", wal_publication)
            .field("max_wal_retained", max_wal_retained)
            .field("wal_linger", wal_linger)
            .field("wal_part_size", wal_part_size)
            .finish()
    }
}

fn strip_config_prefix(e: &outboxkit_core::OutboxError) -> String {
    match e {
        outboxkit_core::OutboxError::Config(reason) => reason.clone(),
        other => other.to_string(),
    }
}

/// Everything `outbox relay` needs, resolved and validated. `Debug` hides the URLs'
/// passwords.
#[derive(Clone)]
pub struct RelaySettings {
    /// Database.
    pub db: DbSettings,
    /// Broker kind.
    pub transport: TransportKind,
    /// Broker URL.
    pub broker_url: String,
    /// RabbitMQ exchange.
    pub exchange: String,
    /// NATS subject prefix.
    pub subject_prefix: String,
    /// NATS: the stream the relay declares (capturing `{subject_prefix}.>`), if any.
    pub stream: Option<String>,
    /// RabbitMQ destination rules, `PATTERN=NAME` each (see
    /// `outboxkit_rabbit::DestinationRule`), in the order they are tried.
    pub destination_rules: Vec<String>,
    /// Messages per claim.
    pub batch_size: usize,
    /// Longest wait between polls; `None`: the database's default (2 s on PostgreSQL,
    /// where push wake-up comes first; 500 ms on SQL Server).
    pub poll_interval: Option<Duration>,
    /// Claim lease.
    pub lease: Duration,
    /// How long connecting to the broker may take before it counts as unavailable.
    pub connect_timeout: Duration,
    /// How long a batch waits for broker confirmations.
    pub confirm_timeout: Duration,
    /// Shutdown drain limit.
    pub drain_timeout: Duration,
    /// Claims without an outcome before a row is a suspected crash loop.
    pub crash_loop_limit: u32,
    /// Default attempts before Dead.
    pub max_attempts: u32,
    /// Batches published at once (2; 4 with `--source wal`).
    pub concurrency: usize,
    /// Per-event-type retry policies (event type → policy).
    pub overrides: BTreeMap<String, RetryPolicy>,
    /// Publish order.
    pub ordering: OrderingMode,
    /// What completions do with sent messages.
    pub sent_retention: SentRetentionMode,
    /// Endpoint address (port 0: any free port).
    pub listen: SocketAddr,
    /// The dashboard's pages on the endpoint (`--dashboard`), `None` without them.
    pub dashboard: Option<crate::commands::dashboard::DashboardSettings>,
    /// Queue-lag threshold of /healthz.
    pub max_lag: Duration,
    /// Stuck threshold of /healthz.
    pub stuck_after: Duration,
    /// Health check and gauge refresh period.
    pub health_interval: Duration,
    /// Where committed messages are read from (`--source`).
    pub source: crate::cli::SourceKind,
    /// The slot of `--source wal` (`None`: `{schema}_outbox`).
    pub wal_slot: Option<String>,
    /// The publication of `--source wal` (`None`: `{schema}_outbox`).
    pub wal_publication: Option<String>,
    /// `--source wal`: the most WAL the slot may retain before /healthz fails, bytes.
    pub max_wal_retained: u64,
    /// `--source wal`: the linger of a batch read after a wait for the stream
    /// (`WalRelayConfig::with_linger`).
    pub wal_linger: Duration,
    /// `--source wal`: rows of a producer transaction held whole; a larger one is
    /// published in parts of this many rows (`WalRelayConfig::with_part_size`).
    pub wal_part_size: usize,
}

impl RelaySettings {
    /// Settings for a relay of `db` over `transport` at `broker_url`, other values at
    /// their defaults (handy for tests and embedding).
    pub fn new(db: DbSettings, transport: TransportKind, broker_url: impl Into<String>) -> Self {
        Self {
            db,
            transport,
            broker_url: broker_url.into(),
            exchange: DEFAULT_DESTINATION.to_owned(),
            subject_prefix: DEFAULT_DESTINATION.to_owned(),
            stream: None,
            destination_rules: Vec::new(),
            batch_size: 500,
            poll_interval: None,
            lease: Duration::from_secs(30),
            connect_timeout: transport.connect_timeout(),
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            drain_timeout: outboxkit_core::dispatcher::DEFAULT_DRAIN_TIMEOUT,
            crash_loop_limit: outboxkit_core::DEFAULT_CRASH_LOOP_LIMIT,
            max_attempts: 8,
            concurrency: 2,
            overrides: BTreeMap::new(),
            ordering: OrderingMode::Unordered,
            sent_retention: SentRetentionMode::Keep,
            listen: DEFAULT_LISTEN,
            dashboard: None,
            max_lag: Duration::from_secs(300),
            stuck_after: Duration::from_secs(120),
            health_interval: Duration::from_secs(5),
            source: crate::cli::SourceKind::Poll,
            wal_slot: None,
            wal_publication: None,
            max_wal_retained: 1 << 30,
            wal_linger: Duration::ZERO,
            // `outboxkit_postgres::wal::WalRelayConfig::DEFAULT_PART_SIZE` (that crate is
            // optional).
            wal_part_size: 5_000,
        }
    }

    /// Resolves flags/environment over the file over the defaults, and validates.
    ///
    /// # Errors
    /// [`CliError::Missing`], [`CliError::Invalid`] (durations, sizes, address, broker
    /// URL, exchange, subject prefix), [`CliError::EventTypeOverride`].
    pub fn resolve(cli: &Cli, args: &RelayArgs, file: &FileConfig) -> Result<Self, CliError> {
        let db = DbSettings::resolve(cli, file)?;
        let f = &file.relay;
        let given_url = args.broker_url.clone().or_else(|| f.broker_url.clone());
        // Without a transport, the URL's scheme names it (as `AnyPublisherConfig::from_url`
        // reads it): a `nats://` URL is never taken for RabbitMQ.
        let transport = args
            .transport
            .or(f.transport)
            .or_else(|| given_url.as_deref().and_then(TransportKind::of_url))
            .unwrap_or(TransportKind::Rabbit);
        let broker_url = given_url.unwrap_or_else(|| transport.default_url().to_owned());
        let mut s = Self::new(db, transport, broker_url);
        if let Some(x) = args.exchange.clone().or_else(|| f.exchange.clone()) {
            s.exchange = x;
        }
        if let Some(x) = args
            .subject_prefix
            .clone()
            .or_else(|| f.subject_prefix.clone())
        {
            s.subject_prefix = x;
        }
        s.stream = args.stream.clone().or_else(|| f.stream.clone());
        if !args.destination_rules.is_empty() {
            s.destination_rules.clone_from(&args.destination_rules);
        } else if let Some(rules) = &f.destination_rules {
            s.destination_rules.clone_from(rules);
        }
        s.destination_rules.retain(|r| !r.trim().is_empty());
        if let Some(n) = args.batch_size.or(f.batch_size) {
            s.batch_size = positive("batch_size", n)?;
        }
        if let Some(n) = args.concurrency.or(f.concurrency) {
            s.concurrency = positive("concurrency", n)?;
        }
        if let Some(n) = args.max_attempts.or(f.max_attempts) {
            s.max_attempts =
                u32::try_from(positive("max_attempts", n as usize)?).unwrap_or(u32::MAX);
        }
        let dur = |field: &'static str, flag: &Option<String>, file: &Option<String>| {
            flag.as_deref()
                .or(file.as_deref())
                .map(|v| parse_duration(field, v))
                .transpose()
        };
        if let Some(d) = dur("poll_interval", &args.poll_interval, &f.poll_interval)? {
            s.poll_interval = Some(d);
        }
        if let Some(d) = dur("lease", &args.lease, &f.lease)? {
            s.lease = nonzero("lease", d)?;
        }
        if let Some(d) = dur("connect_timeout", &args.connect_timeout, &f.connect_timeout)? {
            s.connect_timeout = nonzero("connect_timeout", d)?;
        }
        if let Some(d) = dur("confirm_timeout", &args.confirm_timeout, &f.confirm_timeout)? {
            s.confirm_timeout = nonzero("confirm_timeout", d)?;
        }
        if let Some(d) = dur("drain_timeout", &args.drain_timeout, &f.drain_timeout)? {
            s.drain_timeout = d;
        }
        if let Some(n) = args.crash_loop_limit.or(f.crash_loop_limit) {
            s.crash_loop_limit =
                u32::try_from(positive("crash_loop_limit", n as usize)?).unwrap_or(u32::MAX);
        }
        if let Some(d) = dur("max_lag", &args.max_lag, &f.max_lag)? {
            s.max_lag = nonzero("max_lag", d)?;
        }
        if let Some(d) = dur("stuck_after", &args.stuck_after, &f.stuck_after)? {
            s.stuck_after = nonzero("stuck_after", d)?;
        }
        if let Some(d) = dur("health_interval", &args.health_interval, &f.health_interval)? {
            s.health_interval = nonzero("health_interval", d)?;
        }
        if let Some(o) = args.ordering.or(f.ordering) {
            s.ordering = o;
        }
        if let Some(r) = args.sent_retention.or(f.sent_retention) {
            s.sent_retention = r;
        }
        if let Some(addr) = args.listen.as_deref().or(f.listen.as_deref()) {
            s.listen = addr.parse().map_err(|e| CliError::Invalid {
                field: "listen",
                reason: format!("{addr:?} is not a socket address (host:port): {e}"),
            })?;
        }
        let allow_replay = args.allow_replay || f.allow_replay == Some(true);
        if args.dashboard || f.dashboard == Some(true) {
            let mut d = crate::commands::dashboard::DashboardSettings::new();
            d.listen = s.listen;
            d.allow_replay = allow_replay;
            d.token = crate::commands::dashboard::DashboardSettings::token_from_env();
            d.check_address(s.listen)?;
            s.dashboard = Some(d);
        } else if allow_replay {
            return Err(CliError::Invalid {
                field: "allow_replay",
                reason: "replay is a dashboard setting: add --dashboard".into(),
            });
        }
        // File overrides first, flags replace them per event type.
        for (event_type, o) in &f.event_types {
            let policy = file_override(event_type, o, s.max_attempts)?;
            s.overrides.insert(event_type.clone(), policy);
        }
        for text in &args.event_types {
            if text.trim().is_empty() {
                continue;
            }
            let (event_type, policy) = parse_override(text, s.max_attempts)?;
            s.overrides.insert(event_type, policy);
        }
        s.source = args.source.or(f.source).unwrap_or_default();
        s.wal_slot = args.wal.slot.clone().or_else(|| f.wal_slot.clone());
        s.wal_publication = args
            .wal
            .publication
            .clone()
            .or_else(|| f.wal_publication.clone());
        if let Some(n) = args.max_wal_retained.or(f.max_wal_retained) {
            s.max_wal_retained = n;
        }
        if let Some(d) = dur("wal_linger", &args.wal_linger, &f.wal_linger)? {
            // `outboxkit_postgres::wal::WalRelayConfig::MAX_LINGER` (that crate is optional).
            if d > Duration::from_secs(1) {
                return Err(CliError::Invalid {
                    field: "wal_linger",
                    reason: format!("{d:?} is longer than the most accepted, 1s"),
                });
            }
            s.wal_linger = d;
        }
        if let Some(n) = args.wal_part_size.or(f.wal_part_size) {
            s.wal_part_size = positive("wal_part_size", n)?;
        }
        if s.source == crate::cli::SourceKind::Wal {
            s.wal_config()?;
            if args.concurrency.or(f.concurrency).is_none() {
                // `WalRelayConfig::DEFAULT_CONCURRENCY` (outboxkit-postgres is an optional
                // dependency here).
                s.concurrency = 4;
            }
            let ignored: Vec<&str> = [
                (
                    "poll_interval",
                    args.poll_interval.is_some() || f.poll_interval.is_some(),
                ),
                (
                    "drain_timeout",
                    args.drain_timeout.is_some() || f.drain_timeout.is_some(),
                ),
            ]
            .into_iter()
            .filter_map(|(name, given)| given.then_some(name))
            .collect();
            if !ignored.is_empty() {
                tracing::warn!(
                    settings = ?ignored,
                    "these settings do not apply to --source wal (commit order, no claims): ignored"
                );
            }
            if s.ordering == OrderingMode::PerKey {
                return Err(CliError::Invalid {
                    field: "ordering",
                    reason: "--source wal never stops a key at a dead message: use --ordering per-key-skip \
                             (per-key order, a dead message skipped) or unordered"
                        .into(),
                });
            }
        } else {
            if args.wal_linger.is_some() || f.wal_linger.is_some() {
                tracing::warn!("wal_linger applies to --source wal only: ignored");
            }
            if args.wal_part_size.is_some() || f.wal_part_size.is_some() {
                tracing::warn!("wal_part_size applies to --source wal only: ignored");
            }
        }
        s.validate_transport()?;
        s.dispatcher_config()
            .check_lease(Some(s.publish_timeout()))
            .map_err(|e| CliError::Invalid {
                field: "lease",
                reason: match e {
                    outboxkit_core::OutboxError::InvalidConfig { reason, .. } => reason,
                    other => other.to_string(),
                },
            })?;
        Ok(s)
    }

    /// The slot and publication of `--source wal`, checked.
    ///
    /// # Errors
    /// [`CliError::Invalid`] for a database other than PostgreSQL or a bad name.
    #[cfg(feature = "postgres")]
    pub(crate) fn wal_config(&self) -> Result<outboxkit_postgres::wal::WalConfig, CliError> {
        if self.db.kind()? != DatabaseKind::Postgres {
            return Err(CliError::Invalid {
                field: "source",
                reason: "--source wal reads a PostgreSQL replication slot: the database URL must be postgres://".into(),
            });
        }
        crate::commands::wal::wal_config(
            &self.db.schema,
            self.wal_slot.as_deref(),
            self.wal_publication.as_deref(),
        )
    }

    /// Without PostgreSQL compiled in there is no WAL source.
    #[cfg(not(feature = "postgres"))]
    pub(crate) fn wal_config(&self) -> Result<(), CliError> {
        Err(CliError::FeatureMissing {
            backend: "PostgreSQL",
            feature: "postgres",
        })
    }

    /// The longest publish of one batch: the connect timeout plus the confirm timeout
    /// (what the publisher reports as its publish timeout).
    pub fn publish_timeout(&self) -> Duration {
        self.connect_timeout + self.confirm_timeout
    }

    /// Builds the transport configuration once to validate the broker URL, exchange and
    /// subject prefix before anything connects.
    ///
    /// # Errors
    /// [`CliError::FeatureMissing`] for a transport compiled out, [`CliError::Rabbit`]
    /// / [`CliError::Nats`] with `InvalidUrl` / `InvalidConfig`.
    pub fn validate_transport(&self) -> Result<(), CliError> {
        match self.transport.require()? {
            #[cfg(feature = "rabbit")]
            TransportKind::Rabbit => {
                if let Some(stream) = &self.stream {
                    return Err(CliError::Invalid {
                        field: "stream",
                        reason: format!(
                            "{stream:?}: a stream is for NATS; RabbitMQ publishes to the exchange, which the relay declares"
                        ),
                    });
                }
                let _ = self.rabbit_config()?;
            }
            #[cfg(feature = "nats")]
            TransportKind::Nats => {
                if let Some(rule) = self.destination_rules.first() {
                    return Err(CliError::Invalid {
                        field: "destination_rules",
                        reason: format!(
                            "{rule:?}: destination rules are for RabbitMQ; NATS names the stream that refuses messages by itself"
                        ),
                    });
                }
                let _ = self.nats_config()?;
            }
            #[allow(unreachable_patterns)] // reason: unreachable with both transports
            _ => {}
        }
        Ok(())
    }

    /// The RabbitMQ configuration.
    ///
    /// # Errors
    /// [`CliError::Rabbit`] for an invalid URL or exchange.
    #[cfg(feature = "rabbit")]
    pub fn rabbit_config(&self) -> Result<outboxkit_rabbit::RabbitConfig, CliError> {
        let config = outboxkit_rabbit::RabbitConfig::new(&self.broker_url)
            .with_exchange(&self.exchange)
            .with_connection_name("outbox-relay")
            .with_connect_timeout(self.connect_timeout)
            .with_confirm_timeout(self.confirm_timeout)
            // A channel per batch published at once (concurrent batches on one
            // channel wait for it), at least the builder's default 2, at most its
            // limit of 256.
            .with_channels(self.concurrency.clamp(2, 256))
            .with_destination_rules(
                self.destination_rules
                    .iter()
                    .map(|r| r.parse())
                    .collect::<Result<Vec<outboxkit_rabbit::DestinationRule>, _>>()?,
            );
        config.validate()?;
        Ok(config)
    }

    /// The NATS configuration.
    ///
    /// # Errors
    /// [`CliError::Nats`] for an invalid URL, subject prefix or stream name.
    #[cfg(feature = "nats")]
    pub fn nats_config(&self) -> Result<outboxkit_nats::NatsConfig, CliError> {
        let mut config = outboxkit_nats::NatsConfig::new(&self.broker_url)
            .with_subject_prefix(&self.subject_prefix)
            .with_connection_name("outbox-relay")
            .with_connect_timeout(self.connect_timeout)
            .with_confirm_timeout(self.confirm_timeout);
        if let Some(stream) = &self.stream {
            config = config.with_stream(outboxkit_nats::StreamSetup::new(stream));
        }
        config.validate()?;
        Ok(config)
    }

    /// The retry policies: the default with `max_attempts`, plus the overrides.
    pub fn retry_policies(&self) -> RetryPolicies {
        let mut policies =
            RetryPolicies::new(RetryPolicy::new().with_max_attempts(self.max_attempts));
        for (event_type, policy) in &self.overrides {
            policies = policies.with_override(event_type.clone(), policy.clone());
        }
        policies
    }

    /// The dispatcher configuration.
    pub fn dispatcher_config(&self) -> DispatcherConfig {
        DispatcherConfig::new()
            .with_batch_size(self.batch_size)
            .with_poll_interval(
                self.poll_interval
                    .unwrap_or_else(|| default_poll_interval(self.db.kind().ok())),
            )
            .with_lease(self.lease)
            .with_concurrency(self.concurrency)
            .with_retry(self.retry_policies())
            .with_drain_timeout(self.drain_timeout)
    }
}

fn positive(field: &'static str, n: usize) -> Result<usize, CliError> {
    if n == 0 {
        Err(CliError::Invalid {
            field,
            reason: "must be at least 1".into(),
        })
    } else {
        Ok(n)
    }
}

fn nonzero(field: &'static str, d: Duration) -> Result<Duration, CliError> {
    if d.is_zero() {
        Err(CliError::Invalid {
            field,
            reason: "must be greater than zero".into(),
        })
    } else {
        Ok(d)
    }
}

/// Parses a duration such as `500ms`, `30s`, `5m`, `7d`, `1h 30m`: the syntax of every
/// `from_env` too ([`outboxkit_core::env::parse_duration`]).
///
/// # Errors
/// [`CliError::Invalid`] naming `field`.
pub(crate) fn parse_duration(field: &'static str, text: &str) -> Result<Duration, CliError> {
    outboxkit_core::env::parse_duration(text).map_err(|e| CliError::Invalid {
        field,
        reason: e.to_string(),
    })
}

/// Parses one time bound: an RFC 3339 time (`2026-11-22T06:00:00Z`) or a duration
/// meaning that long before `now` (`2h`, `7d`).
///
/// # Errors
/// [`CliError::TimeWindow`] naming the flag.
pub(crate) fn parse_time(
    flag: &str,
    text: &str,
    now: DateTime<Utc>,
) -> Result<DateTime<Utc>, CliError> {
    let text = text.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = outboxkit_core::env::parse_duration(text).map_err(|_| CliError::TimeWindow {
        reason: format!(
            "{flag} {text:?} is neither an RFC 3339 time (2026-11-22T06:00:00Z) nor a duration ago (2h, 7d)"
        ),
    })?;
    let ago = chrono::Duration::from_std(ago).map_err(|_| CliError::TimeWindow {
        reason: format!("{flag} {text:?} is too far back"),
    })?;
    now.checked_sub_signed(ago)
        .ok_or_else(|| CliError::TimeWindow {
            reason: format!("{flag} {text:?} is too far back"),
        })
}

/// A time window `[from, to)`; either bound may be open.
pub(crate) type Window = (Option<DateTime<Utc>>, Option<DateTime<Utc>>);

/// Parses `--since`/`--until` into a window; both optional.
///
/// # Errors
/// [`CliError::TimeWindow`] for an unparsable bound or `since >= until`.
pub(crate) fn parse_window(
    since: Option<&str>,
    until: Option<&str>,
    now: DateTime<Utc>,
) -> Result<Window, CliError> {
    let from = since.map(|s| parse_time("--since", s, now)).transpose()?;
    let to = until.map(|s| parse_time("--until", s, now)).transpose()?;
    if let (Some(f), Some(t)) = (from, to)
        && f >= t
    {
        return Err(CliError::TimeWindow {
            reason: format!("--since ({f}) must be before --until ({t})"),
        });
    }
    Ok((from, to))
}

/// Parses `EVENT_TYPE:key=value[,key=value...]` (keys `max_attempts`, `base`, `cap`,
/// `jitter`) into a policy based on the default policy with `default_max_attempts`.
///
/// # Errors
/// [`CliError::EventTypeOverride`] saying what is wrong.
pub(crate) fn parse_override(
    text: &str,
    default_max_attempts: u32,
) -> Result<(String, RetryPolicy), CliError> {
    let bad = |reason: String| CliError::EventTypeOverride {
        input: text.to_owned(),
        reason,
    };
    let (event_type, settings) = text
        .split_once(':')
        .ok_or_else(|| bad("expected EVENT_TYPE:key=value[,key=value...]".into()))?;
    let event_type = event_type.trim();
    if event_type.is_empty() {
        return Err(bad("the event type is empty".into()));
    }
    let mut o = FileOverride::default();
    let mut any = false;
    for pair in settings.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| bad(format!("{pair:?} is not key=value")))?;
        let (key, value) = (key.trim(), value.trim());
        match key {
            "max_attempts" => {
                o.max_attempts = Some(value.parse().map_err(|_| {
                    bad(format!("max_attempts {value:?} is not a positive integer"))
                })?);
            }
            "base" => {
                o.base = Some(
                    value
                        .parse()
                        .map_err(|_| bad(format!("base {value:?} is not a number")))?,
                );
            }
            "cap" => o.cap = Some(value.to_owned()),
            "jitter" => o.jitter = Some(value.to_owned()),
            other => {
                return Err(bad(format!(
                    "unknown key {other:?} (known: max_attempts, base, cap, jitter)"
                )));
            }
        }
        any = true;
    }
    if !any {
        return Err(bad("no settings after the event type".into()));
    }
    let policy = file_override(event_type, &o, default_max_attempts).map_err(|e| match e {
        CliError::EventTypeOverride { reason, .. } => bad(reason),
        other => other,
    })?;
    Ok((event_type.to_owned(), policy))
}

fn file_override(
    event_type: &str,
    o: &FileOverride,
    default_max_attempts: u32,
) -> Result<RetryPolicy, CliError> {
    let bad = |reason: String| CliError::EventTypeOverride {
        input: event_type.to_owned(),
        reason,
    };
    let mut policy = RetryPolicy::new().with_max_attempts(default_max_attempts);
    if let Some(n) = o.max_attempts {
        if n == 0 {
            return Err(bad("max_attempts must be at least 1".into()));
        }
        policy = policy.with_max_attempts(n);
    }
    if let Some(b) = o.base {
        if !b.is_finite() || b < 1.0 {
            return Err(bad(format!("base {b} must be a number >= 1")));
        }
        policy = policy.with_base(b);
    }
    let dur = |name: &str, v: &str| {
        outboxkit_core::env::parse_duration(v).map_err(|e| {
            bad(format!(
                "{name} {v:?} is not a duration like 30s or 5m: {}",
                e.reason()
            ))
        })
    };
    if let Some(c) = &o.cap {
        policy = policy.with_cap(dur("cap", c)?);
    }
    if let Some(j) = &o.jitter {
        policy = policy.with_jitter(dur("jitter", j)?);
    }
    Ok(policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_and_reject_bad_syntax() {
        let (t, p) =
            parse_override("OrderPlaced:max_attempts=3,cap=60s,jitter=0s", 8).expect("valid");
        assert_eq!(t, "OrderPlaced");
        assert_eq!(p.max_attempts(), 3);
        assert_eq!(p.base_delay(10), Duration::from_secs(60));
        for bad in [
            "OrderPlaced",
            ":max_attempts=3",
            "OrderPlaced:",
            "OrderPlaced:attempts=3",
            "OrderPlaced:max_attempts=x",
            "OrderPlaced:max_attempts=0",
            "OrderPlaced:cap=soon",
            "OrderPlaced:base=0.5",
            "OrderPlaced:max_attempts",
        ] {
            assert!(
                matches!(
                    parse_override(bad, 8),
                    Err(CliError::EventTypeOverride { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn time_bounds_accept_rfc3339_and_durations_ago() {
        let now = DateTime::parse_from_rfc3339("2026-11-22T12:00:00Z")
            .expect("valid")
            .with_timezone(&Utc);
        let t = parse_time("--since", "2h", now).expect("valid");
        assert_eq!(t, now - chrono::Duration::hours(2));
        let t = parse_time("--since", "2026-11-21T00:00:00+01:00", now).expect("valid");
        assert_eq!(t.to_rfc3339(), "2026-11-20T23:00:00+00:00");
        assert!(matches!(
            parse_time("--since", "yesterday", now),
            Err(CliError::TimeWindow { .. })
        ));
        assert!(matches!(
            parse_window(Some("1h"), Some("2h"), now),
            Err(CliError::TimeWindow { .. })
        ));
        assert!(parse_window(Some("2h"), Some("1h"), now).is_ok());
    }

    /// `outbox --database-url postgres://u@h/d relay --source wal <flags>`, resolved
    /// without a config file.
    fn resolve_wal_relay(flags: &[&str]) -> Result<RelaySettings, CliError> {
        let argv = ["outbox", "--database-url", "postgres://u@h/d", "relay"];
        let cli =
            <Cli as clap::Parser>::parse_from(argv.iter().chain(&["--source", "wal"]).chain(flags));
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        RelaySettings::resolve(&cli, args, &FileConfig::default())
    }

    #[test]
    fn the_wal_source_keeps_four_batches_in_flight_unless_told() {
        assert_eq!(resolve_wal_relay(&[]).expect("valid").concurrency, 4);
        let s = resolve_wal_relay(&["--concurrency", "1"]).expect("valid");
        assert_eq!(s.concurrency, 1);
        let e = resolve_wal_relay(&["--concurrency", "0"]).expect_err("at least one");
        assert!(
            e.is_bad_input() && e.to_string().contains("concurrency"),
            "{e}"
        );
        #[cfg(feature = "rabbit")]
        {
            // A RabbitMQ channel per batch in flight (at least the default 2).
            let s = resolve_wal_relay(&["--concurrency", "6"]).expect("valid");
            assert_eq!(s.rabbit_config().expect("config").channels(), 6);
            assert_eq!(
                resolve_wal_relay(&["--concurrency", "1"])
                    .expect("valid")
                    .rabbit_config()
                    .expect("config")
                    .channels(),
                2
            );
        }
    }

    #[cfg(feature = "rabbit")]
    #[test]
    fn destination_rules_come_from_flags_or_the_file_and_bad_ones_are_typed_errors() {
        let s = resolve_wal_relay(&[
            "--destination-rule",
            "orders.#=orders",
            "--destination-rule",
            "pay.*=payments,audit.#=audit",
        ])
        .expect("valid");
        assert_eq!(
            s.destination_rules,
            ["orders.#=orders", "pay.*=payments", "audit.#=audit"]
        );
        let config = s.rabbit_config().expect("config");
        assert_eq!(config.destination("orders.eu.created"), "orders");
        assert_eq!(config.destination("pay.x"), "payments");
        assert_eq!(config.destination("other"), "other", "its own by default");
        let file: FileConfig =
            toml::from_str("[relay]\ndestination_rules = [\"a.#=qa\"]").expect("toml");
        let argv = ["outbox", "--database-url", "postgres://u@h/d", "relay"];
        let cli = <Cli as clap::Parser>::parse_from(argv);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let s = RelaySettings::resolve(&cli, args, &file).expect("valid");
        assert_eq!(s.rabbit_config().expect("config").destination("a.b"), "qa");
        let e = resolve_wal_relay(&["--destination-rule", "orders.#"]).expect_err("no =NAME");
        assert!(
            e.is_bad_input() && e.to_string().contains("PATTERN=NAME"),
            "{e}"
        );
        #[cfg(feature = "nats")]
        {
            let e = resolve_wal_relay(&["--transport", "nats", "--destination-rule", "a.#=q"])
                .expect_err("rules are RabbitMQ's");
            assert!(e.is_bad_input() && e.to_string().contains("NATS"), "{e}");
        }
    }

    #[cfg(all(feature = "nats", feature = "rabbit"))]
    #[test]
    fn without_a_transport_the_broker_urls_scheme_names_it() {
        let s = resolve_wal_relay(&["--broker-url", "nats://127.0.0.1:4222"]).expect("valid");
        assert_eq!(s.transport, TransportKind::Nats);
        let s = resolve_wal_relay(&["--broker-url", "tls://a:4222,tls://b:4222"]).expect("valid");
        assert_eq!(s.transport, TransportKind::Nats);
        let s = resolve_wal_relay(&["--broker-url", "amqps://u:p@mq/%2f"]).expect("valid");
        assert_eq!(s.transport, TransportKind::Rabbit);
        // A given transport wins, and is checked against the URL as before.
        let e = resolve_wal_relay(&[
            "--transport",
            "rabbit",
            "--broker-url",
            "nats://127.0.0.1:4222",
        ])
        .expect_err("a NATS URL for RabbitMQ");
        assert!(e.is_bad_input(), "{e}");
        // No URL, no transport: RabbitMQ on the local broker.
        let s = resolve_wal_relay(&[]).expect("valid");
        assert_eq!(
            (s.transport, s.broker_url.as_str()),
            (TransportKind::Rabbit, TransportKind::Rabbit.default_url())
        );
        // From the file too.
        let file: FileConfig =
            toml::from_str("[relay]\nbroker_url = \"nats://127.0.0.1:4222\"\nstream = \"S\"")
                .expect("toml");
        let argv = ["outbox", "--database-url", "postgres://u@h/d", "relay"];
        let cli = <Cli as clap::Parser>::parse_from(argv);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let s = RelaySettings::resolve(&cli, args, &file).expect("a stream is fine on NATS");
        assert_eq!(s.transport, TransportKind::Nats);
    }

    #[cfg(feature = "nats")]
    #[test]
    fn the_nats_stream_comes_from_flags_or_the_file_and_is_refused_with_rabbit() {
        let s = resolve_wal_relay(&[
            "--transport",
            "nats",
            "--subject-prefix",
            "orders.events",
            "--stream",
            "ORDERS",
        ])
        .expect("valid");
        let config = s.nats_config().expect("config");
        let stream = config.stream().expect("declared");
        assert_eq!(
            (stream.name(), stream.subjects()),
            ("ORDERS", &["orders.events.>".to_owned()][..])
        );
        let file: FileConfig =
            toml::from_str("[relay]\ntransport = \"nats\"\nstream = \"OUTBOX\"").expect("toml");
        let argv = ["outbox", "--database-url", "postgres://u@h/d", "relay"];
        let cli = <Cli as clap::Parser>::parse_from(argv);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let s = RelaySettings::resolve(&cli, args, &file).expect("valid");
        assert_eq!(
            s.nats_config()
                .expect("config")
                .stream()
                .map(|s| s.name().to_owned()),
            Some("OUTBOX".to_owned())
        );
        let e = resolve_wal_relay(&["--transport", "nats", "--stream", "bad.name"])
            .expect_err("a dot in a stream name");
        assert!(e.is_bad_input(), "{e}");
        #[cfg(feature = "rabbit")]
        {
            let e = resolve_wal_relay(&["--stream", "ORDERS"]).expect_err("streams are NATS'");
            assert!(
                matches!(
                    &e,
                    CliError::Invalid {
                        field: "stream",
                        ..
                    }
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn the_wal_source_takes_per_key_skip_and_refuses_a_blocking_order() {
        let resolve = |ordering: &str| resolve_wal_relay(&["--ordering", ordering]);
        let s = resolve("per-key-skip").expect("valid");
        assert_eq!(s.ordering, OrderingMode::PerKeySkip);
        assert!(resolve("unordered").is_ok());
        let e = resolve("per-key").expect_err("a dead message cannot block a WAL key");
        assert!(
            matches!(&e, CliError::Invalid { field: "ordering", reason } if reason.contains("per-key-skip")),
            "{e}"
        );
    }

    #[test]
    fn the_wal_source_comes_from_flags_or_the_file_and_needs_postgres() {
        let file = FileConfig::parse(
            "[relay]\nsource = \"wal\"\nwal_slot = \"s1\"\nmax_wal_retained = 1000\n",
        )
        .expect("parses");
        let cli = <Cli as clap::Parser>::parse_from([
            "outbox",
            "--database-url",
            "postgres://u@h/d",
            "relay",
            "--publication",
            "p1",
        ]);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let s = RelaySettings::resolve(&cli, args, &file).expect("valid");
        assert_eq!(s.source, crate::cli::SourceKind::Wal);
        assert_eq!(
            (s.wal_slot.as_deref(), s.wal_publication.as_deref()),
            (Some("s1"), Some("p1"))
        );
        assert_eq!(s.max_wal_retained, 1000);
        assert_eq!(s.wal_linger, Duration::ZERO);

        let linger = |value: &str| resolve_wal_relay(&["--wal-linger", value]);
        assert_eq!(
            linger("5ms").expect("valid").wal_linger,
            Duration::from_millis(5)
        );
        let e = linger("2s").expect_err("over 1 s");
        assert!(
            e.is_bad_input() && e.to_string().contains("wal_linger"),
            "{e}"
        );
        assert_eq!(s.wal_part_size, 5_000);
        let part = |value: &str| resolve_wal_relay(&["--wal-part-size", value]);
        assert_eq!(part("200").expect("valid").wal_part_size, 200);
        let e = part("0").expect_err("zero");
        assert!(
            e.is_bad_input() && e.to_string().contains("wal_part_size"),
            "{e}"
        );

        let cli = <Cli as clap::Parser>::parse_from([
            "outbox",
            "--database-url",
            "postgres://u@h/d",
            "relay",
            "--source",
            "wal",
            "--slot",
            "Bad-Name",
        ]);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let e = RelaySettings::resolve(&cli, args, &FileConfig::default()).expect_err("bad slot");
        assert!(e.is_bad_input(), "{e}");

        let cli = <Cli as clap::Parser>::parse_from([
            "outbox",
            "--database-url",
            "mysql://u@h/d",
            "relay",
            "--source",
            "wal",
        ]);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let e =
            RelaySettings::resolve(&cli, args, &FileConfig::default()).expect_err("not postgres");
        assert!(e.to_string().contains("PostgreSQL"), "{e}");
    }

    #[test]
    fn the_example_config_file_is_valid() {
        let file = FileConfig::parse(include_str!("../outbox.example.toml")).expect("parses");
        let cli = <Cli as clap::Parser>::parse_from(["outbox", "relay"]);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let s = RelaySettings::resolve(&cli, args, &file).expect("valid");
        assert_eq!(s.ordering, OrderingMode::PerKey);
        assert_eq!(s.sent_retention, SentRetentionMode::Keep);
        assert_eq!(s.overrides["PaymentCaptured"].max_attempts(), 20);
        assert_eq!(s.overrides["EmailRequested"].max_attempts(), 3);
        assert_eq!(s.poll_interval, Some(Duration::from_millis(200)));
    }

    #[test]
    fn sent_retention_defaults_to_keep_and_a_flag_beats_the_file() {
        let resolve = |argv: &[&str], file: &str| {
            let cli = <Cli as clap::Parser>::try_parse_from(argv).map_err(|e| e.to_string())?;
            let crate::cli::Command::Relay(args) = &cli.command else {
                unreachable!("parsed relay")
            };
            let file = FileConfig::parse(&format!("database_url = 'postgres://u@h/db'\n{file}"))?;
            RelaySettings::resolve(&cli, args, &file)
                .map(|s| s.sent_retention)
                .map_err(|e| e.to_string())
        };
        let relay = ["outbox", "relay"];
        assert_eq!(resolve(&relay, ""), Ok(SentRetentionMode::Keep));
        let delete_file = "[relay]\nsent_retention = 'delete'";
        assert_eq!(resolve(&relay, delete_file), Ok(SentRetentionMode::Delete));
        assert_eq!(
            resolve(
                &["outbox", "relay", "--sent-retention", "keep"],
                delete_file
            ),
            Ok(SentRetentionMode::Keep)
        );
        assert_eq!(
            resolve(&["outbox", "relay", "--sent-retention", "delete"], ""),
            Ok(SentRetentionMode::Delete)
        );
        let bad_file =
            resolve(&relay, "[relay]\nsent_retention = 'archive'").expect_err("not a retention");
        assert!(bad_file.contains("archive"), "{bad_file}");
        let bad_flag = resolve(&["outbox", "relay", "--sent-retention", "archive"], "")
            .expect_err("not a retention");
        assert!(bad_flag.contains("keep, delete"), "{bad_flag}");
        assert_eq!(
            outboxkit_core::SentRetention::from(SentRetentionMode::Delete),
            outboxkit_core::SentRetention::Delete
        );
    }

    #[test]
    fn debug_never_shows_passwords() {
        let file = FileConfig::parse(
            "database_url = 'postgres://app:s3cret@db:5432/app'\n\
             [relay]\nbroker_url = 'amqp://guest:1234/s3cret@mq:5672/%2f'\nbatch_size = 7\n",
        )
        .expect("valid");
        let nats_file = FileConfig::parse(
            "[relay]\ntransport = 'nats'\nbroker_url = 'nats://s3cret@nats:4222'\n",
        )
        .expect("valid");
        let unknown_transport =
            FileConfig::parse("[relay]\nbroker_url = 'nats://s3cret@nats:4222'\n").expect("valid");
        // Unparsable as a database URL, still redacted.
        let odd = <Cli as clap::Parser>::parse_from([
            "outbox",
            "--database-url",
            "postgres://app:12/s3cret@db:5432/app",
            "relay",
            "--broker-url",
            "nats://app:s3/cret@nats:4222",
        ]);
        let cli = <Cli as clap::Parser>::parse_from([
            "outbox",
            "--database-url",
            "postgres://app:s3cret@db:5432/app",
            "relay",
            "--broker-url",
            "amqp://guest:s3cret@mq:5672/%2f",
            "--batch-size",
            "9",
        ]);
        let crate::cli::Command::Relay(args) = &cli.command else {
            unreachable!("parsed relay")
        };
        let db = DbSettings::resolve(&cli, &file).expect("db");
        let relay = RelaySettings::resolve(&cli, args, &file).expect("relay");
        let mut nats = relay.clone();
        nats.transport = TransportKind::Nats;
        nats.broker_url = "nats://s3cret@nats:4222,nats://u:s3cret@n2:4222".into();
        // A password as a query parameter, as libpq and sqlx take it.
        let query = <Cli as clap::Parser>::parse_from([
            "outbox",
            "--database-url",
            "postgres://app@db:5432/app?password=s3cret&sslmode=require",
            "stats",
        ]);
        let query_db = DbSettings::resolve(&query, &FileConfig::default()).expect("db");
        let shown = [
            format!("{query:?}"),
            format!("{query_db:?}"),
            format!("{file:?}"),
            format!("{:?}", file.relay),
            format!("{nats_file:#?}"),
            format!("{unknown_transport:?}"),
            format!("{cli:?}"),
            format!("{args:#?}"),
            format!("{db:?}"),
            format!("{relay:?}"),
            format!("{nats:?}"),
            format!("{odd:?}"),
        ];
        for text in &shown {
            assert!(
                !text.contains("s3cret") && !text.contains("s3/cret"),
                "{text}"
            );
            assert!(text.contains("***"), "{text}");
        }
        // Every other field is still shown.
        assert!(shown[2].contains("batch_size: Some(7)"), "{}", shown[2]);
        assert!(shown[2].contains("app:***@db:5432/app"), "{}", shown[2]);
        assert!(shown[6].contains("batch_size: Some(9)"), "{}", shown[6]);
        assert!(shown[8].contains("schema: \"outbox\""), "{}", shown[8]);
        assert!(shown[9].contains("batch_size: 9"), "{}", shown[9]);
        assert!(shown[9].contains("guest:***@mq:5672"), "{}", shown[9]);
        assert!(
            shown[1].contains("password=***&sslmode=require"),
            "{}",
            shown[1]
        );
    }

    #[test]
    fn file_rejects_unknown_keys_and_reads_overrides() {
        assert!(FileConfig::parse("databse_url = 'x'").is_err());
        assert!(FileConfig::parse("[relay]\nbatch_size = 'many'").is_err());
        let f = FileConfig::parse(
            "database_url = 'postgres://u@h/db'\n[relay]\nbatch_size = 10\n[relay.event_types.A]\nmax_attempts = 2\n",
        )
        .expect("valid");
        assert_eq!(f.relay.batch_size, Some(10));
        assert_eq!(f.relay.event_types["A"].max_attempts, Some(2));
    }
}
