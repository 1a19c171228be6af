//! The command line (clap). Every setting of `relay` can also come from an environment
//! variable (shown in `--help`) or the config file; flags and environment variables
//! win over the file, the file wins over the defaults.
//!
//! The top level ([`Cli`], [`Command`]) and the relay's settings live here; each admin
//! command's arguments live next to its validation, run and output in its module under
//! [`crate::commands`], and are re-exported here.

use std::fmt;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub(crate) use crate::commands::dashboard::DashboardArgs;
pub(crate) use crate::commands::dead::DeadCommand;
pub(crate) use crate::commands::inbox_dead::InboxDeadCommand;
pub(crate) use crate::commands::purge::PurgeArgs;
pub(crate) use crate::commands::reconcile::ReconcileArgs;
pub(crate) use crate::commands::stats::StatsArgs;
pub(crate) use crate::commands::wal::{WalArgs, WalCommand};
use crate::config::{redact_broker_url, redact_database_url};

/// Operate a transactional outbox: run the relay, migrate, inspect, reconcile, replay
/// dead letters, purge.
// `Debug` (below) hides the URLs' passwords.
#[derive(Parser)]
#[command(name = "outbox", version)]
pub struct Cli {
    /// TOML config file (see docs/operations.md). Flags and environment variables
    /// override its values.
    #[arg(
        long,
        short = 'c',
        global = true,
        env = "OUTBOX_CONFIG",
        value_name = "FILE"
    )]
    pub(crate) config: Option<PathBuf>,

    /// Database URL: postgres://user:password@host:5432/db, mysql://… or mariadb://…,
    /// or a SQL Server URL or connection string (the URL picks the backend).
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub(crate) database_url: Option<String>,

    /// Schema holding the outbox and inbox tables [default: outbox].
    #[arg(long, global = true, env = "OUTBOX_SCHEMA", value_name = "NAME")]
    pub(crate) schema: Option<String>,

    /// Log format on stderr [default: text]. The level comes from RUST_LOG
    /// (default `info`).
    #[arg(long, global = true, env = "OUTBOX_LOG_FORMAT", value_enum)]
    pub(crate) log_format: Option<LogFormat>,

    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

impl fmt::Debug for Cli {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured, so that a new field cannot be forgotten here.
        let Self {
            config,
            database_url,
            schema,
            log_format,
            command,
        } = self;
        f.debug_struct("Cli")
            .field("config", config)
            .field(
                "database_url",
                &database_url.as_deref().map(redact_database_url),
            )
            .field("schema", schema)
            .field("log_format", log_format)
            .field("command", command)
            .finish()
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (for log shippers).
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the relay: publish committed outbox messages to the broker until SIGINT or
    /// SIGTERM; serve /metrics and /healthz.
    Relay(Box<RelayArgs>),
    /// Create the schema and apply pending migrations (idempotent, safe to run from
    /// several processes at once).
    Migrate,
    /// Counts by status, oldest pending age, dead count, per event type and tenant,
    /// and keys blocked in ordered mode.
    Stats(StatsArgs),
    /// Per day, tenant, event type and consumer: messages written to the outbox vs
    /// processed by the consumer's inbox, and the difference.
    Reconcile(ReconcileArgs),
    /// Outbox dead letters: list or replay.
    Dead {
        /// list or replay.
        #[command(subcommand)]
        command: DeadCommand,
    },
    /// Consumer-side (inbox) operations.
    Inbox {
        /// dead.
        #[command(subcommand)]
        command: InboxCommand,
    },
    /// Delete (or archive) sent outbox rows and inbox records older than a retention,
    /// in small batches that never block the relay.
    Purge(PurgeArgs),
    /// Serve the operations dashboard in the browser (overview, messages by state, dead
    /// letters, replay with a dry run and confirmation) until SIGINT or SIGTERM.
    /// Read-only unless --allow-replay; loopback unless OUTBOX_DASHBOARD_TOKEN is set.
    Dashboard(DashboardArgs),
    /// PostgreSQL: the logical replication slot and publication of `outbox relay
    /// --source wal` (docs/wal.md): setup, status or drop.
    Wal {
        /// setup, status or drop.
        #[command(subcommand)]
        command: WalCommand,
    },
}

/// `outbox inbox ...`
#[derive(Debug, Subcommand)]
pub(crate) enum InboxCommand {
    /// Consumer dead letters: list or replay.
    Dead {
        /// list or replay.
        #[command(subcommand)]
        command: InboxDeadCommand,
    },
}

/// Settings of `outbox relay`. `Debug` hides the broker URL's password.
#[derive(Default, Args)]
pub struct RelayArgs {
    /// Where the relay finds committed messages: poll (claim rows from the outbox
    /// table; every database) or wal (PostgreSQL: read them from a logical replication
    /// slot, no claims and no NOTIFY trigger; needs `outbox wal setup`, see docs/wal.md)
    /// [default: poll].
    #[arg(long, env = "OUTBOX_SOURCE", value_enum)]
    pub source: Option<SourceKind>,

    /// The slot and publication of --source wal.
    #[command(flatten)]
    pub wal: WalArgs,

    /// --source wal: /healthz fails when the replication slot retains more WAL than
    /// this many bytes [default: 1073741824 (1 GiB)].
    #[arg(long, env = "OUTBOX_MAX_WAL_RETAINED", value_name = "BYTES")]
    pub max_wal_retained: Option<u64>,

    /// --source wal: how long a batch gathers more changes after its first transaction
    /// when the relay had been waiting for the stream, at most 1s [default: 0s:
    /// published at once]. A linger makes fuller batches at moderate rates (less
    /// PostgreSQL work per message) and adds up to that much to each message's latency
    /// (docs/wal.md).
    #[arg(long, env = "OUTBOX_WAL_LINGER", value_name = "DURATION")]
    pub wal_linger: Option<String>,

    /// --source wal: a producer transaction of more rows than this is held as row ids
    /// and published in parts of this many rows, each read back from the table, so
    /// that the relay's memory does not grow with the transaction (docs/wal.md, Large
    /// transactions) [default: 5000].
    #[arg(long, env = "OUTBOX_WAL_PART_SIZE", value_name = "ROWS")]
    pub wal_part_size: Option<usize>,

    /// Broker: rabbit or nats [default: the broker URL's (amqp://, amqps://: rabbit;
    /// nats://, tls://: nats), else rabbit].
    #[arg(long, env = "OUTBOX_TRANSPORT", value_enum)]
    pub transport: Option<TransportKind>,

    /// Broker URL (amqp:// or amqps://user:password@host:port/vhost, or nats://host:port)
    /// [default: the local broker, amqp://guest:guest@127.0.0.1:5672/%2f or
    /// nats://127.0.0.1:4222].
    #[arg(
        long,
        env = "OUTBOX_BROKER_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    pub broker_url: Option<String>,

    /// RabbitMQ: durable topic exchange to publish to [default: outbox.events].
    #[arg(long, env = "OUTBOX_EXCHANGE", value_name = "NAME")]
    pub exchange: Option<String>,

    /// NATS: subject prefix; the subject is PREFIX.{routing key or event type}
    /// [default: outbox.events].
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX", value_name = "PREFIX")]
    pub subject_prefix: Option<String>,

    /// NATS: the JetStream stream the relay declares, capturing PREFIX.> (created if
    /// missing, with file storage and a 2-minute duplicate window; an existing
    /// stream's settings are left as they are), as it declares the RabbitMQ exchange
    /// [default: none: the stream must exist].
    #[arg(long, env = "OUTBOX_STREAM", value_name = "NAME")]
    pub stream: Option<String>,

    /// RabbitMQ: routing keys that are one destination, PATTERN=NAME (an AMQP topic
    /// pattern, e.g. orders.#=orders): while the queue behind them refuses messages
    /// (full, reject-publish) they share one circuit and one trial. Repeat the flag
    /// (or separate with commas); the first matching rule wins [default: each routing
    /// key is its own destination]. NATS needs none: it names the refusing stream.
    #[arg(
        long = "destination-rule",
        env = "OUTBOX_DESTINATION_RULES",
        value_name = "PATTERN=NAME",
        value_delimiter = ','
    )]
    pub destination_rules: Vec<String>,

    /// Messages claimed per batch [default: 500].
    #[arg(long, env = "OUTBOX_BATCH_SIZE", value_name = "N")]
    pub batch_size: Option<usize>,

    /// Longest wait between polls when a batch was not full, e.g. 500ms [default: 2s on
    /// PostgreSQL, whose commits wake the relay at once (LISTEN/NOTIFY), 500ms on SQL
    /// Server].
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", value_name = "DURATION")]
    pub poll_interval: Option<String>,

    /// How long a claim is held before another relay may take it over; at least twice
    /// the longest publish (the connect timeout plus the confirm timeout), e.g. 30s
    /// [default: 30s].
    #[arg(long, env = "OUTBOX_LEASE", value_name = "DURATION")]
    pub lease: Option<String>,

    /// How long connecting to the broker may take (TCP, TLS and the protocol's
    /// handshake) before the broker is taken to be unavailable: the relay says so and
    /// claims nothing until it can connect, e.g. 5s [default: 5s].
    #[arg(long, env = "OUTBOX_CONNECT_TIMEOUT", value_name = "DURATION")]
    pub connect_timeout: Option<String>,

    /// How long a batch waits for the broker's confirmations (RabbitMQ publisher
    /// confirms, JetStream PubAcks) before the broker is taken to be unavailable (the
    /// circuit opens; no attempt is charged), e.g. 10s [default: 10s].
    #[arg(long, env = "OUTBOX_CONFIRM_TIMEOUT", value_name = "DURATION")]
    pub confirm_timeout: Option<String>,

    /// On SIGTERM or SIGINT: how long publishes in flight may take to finish; batches
    /// not yet started are released at once, and whatever is still unconfirmed when
    /// this is up is released too. Keep it under the platform's kill grace period
    /// (Kubernetes terminationGracePeriodSeconds, 30s by default), e.g. 10s
    /// [default: 10s].
    #[arg(long, env = "OUTBOX_DRAIN_TIMEOUT", value_name = "DURATION")]
    pub drain_timeout: Option<String>,

    /// A row claimed alone this many times in a row without any outcome (each relay
    /// holding it, and only it, crashed, was killed or lost its lease) is moved to Dead
    /// as a suspected crash loop at its next claim. A row whose claim ended without an
    /// outcome is always claimed alone afterwards, so its batch-mates never count
    /// [default: 5].
    #[arg(long, env = "OUTBOX_CRASH_LOOP_LIMIT", value_name = "N")]
    pub crash_loop_limit: Option<u32>,

    /// Attempts before a message goes Dead [default: 8].
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", value_name = "N")]
    pub max_attempts: Option<u32>,

    /// Batches published at once [default: 2].
    #[arg(long, env = "OUTBOX_CONCURRENCY", value_name = "N")]
    pub concurrency: Option<usize>,

    /// Retry policy of one event type:
    /// EVENT_TYPE:key=value[,key=value...] with keys max_attempts (count), base
    /// (growth factor, delay = base^attempt seconds), cap and jitter (durations).
    /// Repeatable; in the environment separate several with `;`.
    #[arg(
        long = "event-type",
        env = "OUTBOX_EVENT_TYPES",
        value_name = "OVERRIDE",
        value_delimiter = ';'
    )]
    pub event_types: Vec<String>,

    /// Publish order: unordered (fastest, no order promised), per-key (FIFO per
    /// partition key or aggregate; a dead message blocks its key until replayed) or
    /// per-key-skip (FIFO per key; a dead message is passed over) [default: unordered].
    #[arg(long, env = "OUTBOX_ORDERING", value_enum)]
    pub ordering: Option<OrderingMode>,

    /// What happens to a message once the broker confirmed it: keep (mark it Sent and
    /// keep the row until `outbox purge`; needed by `reconcile` and the sent count of
    /// `stats`) or delete (delete the row in the same statement: about half the database
    /// work of claiming and completing a message, no purge needed, but no record of
    /// delivered messages) [default: keep].
    #[arg(long, env = "OUTBOX_SENT_RETENTION", value_enum)]
    pub sent_retention: Option<SentRetentionMode>,

    /// Address of the /metrics and /healthz endpoint [default: 127.0.0.1:9464].
    #[arg(long, env = "OUTBOX_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,

    /// Serve the operations dashboard's pages on the same address (read-only unless
    /// --allow-replay). On an address that is not loopback it needs
    /// OUTBOX_DASHBOARD_TOKEN; /metrics and /healthz stay unauthenticated.
    #[arg(long, env = "OUTBOX_DASHBOARD")]
    pub dashboard: bool,

    /// With --dashboard: allow replaying dead letters from it.
    #[arg(long, env = "OUTBOX_DASHBOARD_ALLOW_REPLAY")]
    pub allow_replay: bool,

    /// /healthz fails when the oldest pending message is older than this, e.g. 5m
    /// [default: 5m].
    #[arg(long, env = "OUTBOX_MAX_LAG", value_name = "DURATION")]
    pub max_lag: Option<String>,

    /// /healthz fails when a claimable message has waited this long without being
    /// claimed (the relay is stuck), e.g. 2m [default: 2m].
    #[arg(long, env = "OUTBOX_STUCK_AFTER", value_name = "DURATION")]
    pub stuck_after: Option<String>,

    /// How often the health checker queries the table (gauges) and probes the broker
    /// [default: 5s].
    #[arg(long, env = "OUTBOX_HEALTH_INTERVAL", value_name = "DURATION")]
    pub health_interval: Option<String>,
}

impl fmt::Debug for RelayArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            source,
            wal,
            max_wal_retained,
            wal_linger,
            wal_part_size,
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
            event_types,
            ordering,
            sent_retention,
            listen,
            dashboard,
            allow_replay,
            max_lag,
            stuck_after,
            health_interval,
        } = self;
        f.debug_struct("RelayArgs")
            .field("source", source)
            .field("wal", wal)
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
            .field("event_types", event_types)
            .field("ordering", ordering)
            .field("sent_retention", sent_retention)
            .field("listen", listen)
            .field("dashboard", dashboard)
            .field("allow_replay", allow_replay)
            .field("max_lag", max_lag)
            .field("stuck_after", stuck_after)
            .field("health_interval", health_interval)
            .finish()
    }
}

/// The broker (`--transport rabbit|nats`): the core's one [`TransportKind`].
pub(crate) use outboxkit_core::TransportKind;

/// Where the relay reads committed messages from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// Claim rows from the outbox table (every database).
    #[default]
    Poll,
    /// PostgreSQL: a logical replication slot (`pgoutput`) on the outbox table.
    Wal,
}

/// Publish order of the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OrderingMode {
    /// No order promised.
    Unordered,
    /// FIFO per key; a dead message blocks its key.
    PerKey,
    /// FIFO per key; a dead message is skipped.
    PerKeySkip,
}

/// What the relay does with sent messages ([`outboxkit_core::SentRetention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SentRetentionMode {
    /// Mark them Sent and keep them until purged.
    Keep,
    /// Delete them when they are recorded as sent.
    Delete,
}

impl From<SentRetentionMode> for outboxkit_core::SentRetention {
    fn from(mode: SentRetentionMode) -> Self {
        match mode {
            SentRetentionMode::Keep => Self::Keep,
            SentRetentionMode::Delete => Self::Delete,
        }
    }
}
