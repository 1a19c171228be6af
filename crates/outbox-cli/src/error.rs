//! [`CliError`]: every failure of the binary, typed, with the exit code it maps to.

use std::net::SocketAddr;
use std::path::PathBuf;

use outboxkit_core::OutboxError;

/// A failure of an `outbox` command. Bad input (configuration, flags, time windows)
/// is reported before anything is touched and exits with code 2; failures while
/// running exit with code 1.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML or has unknown or mistyped keys.
    #[error("invalid config file {path}: {message}")]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// The parser's description, with line and column.
        message: String,
    },
    /// A required setting is missing.
    #[error("missing setting {field}: {hint}")]
    Missing {
        /// The setting, as named in the config file.
        field: &'static str,
        /// How to provide it.
        hint: &'static str,
    },
    /// A setting has an invalid value (URL, duration, size, address, name).
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The setting, as named in the config file.
        field: &'static str,
        /// What is wrong (URLs are shown with their password redacted).
        reason: String,
    },
    /// A per-event-type override is malformed (expected
    /// `EVENT_TYPE:key=value[,key=value...]` with keys `max_attempts`, `base`, `cap`,
    /// `jitter`).
    #[error("invalid event type override {input:?}: {reason}")]
    EventTypeOverride {
        /// The text given.
        input: String,
        /// What is wrong.
        reason: String,
    },
    /// A time bound does not parse, or the window is empty.
    #[error("invalid time window: {reason}")]
    TimeWindow {
        /// What is wrong.
        reason: String,
    },
    /// The store failed (database unreachable, statement rejected, invalid schema).
    #[error(transparent)]
    Store(#[from] OutboxError),
    /// The database URL or the transport names a backend this binary was built
    /// without (its cargo feature is off).
    #[error(
        "{backend} support is not compiled into this binary: rebuild with `--features {feature}`"
    )]
    FeatureMissing {
        /// The backend (`"SQL Server"`, `"NATS JetStream"`, ...).
        backend: &'static str,
        /// The cargo feature of `outboxkit-cli` that adds it.
        feature: &'static str,
    },
    /// The RabbitMQ transport could not be configured or reached.
    #[cfg(feature = "rabbit")]
    #[error("RabbitMQ: {0}")]
    Rabbit(#[from] outboxkit_rabbit::RabbitError),
    /// The NATS transport could not be configured or reached.
    #[cfg(feature = "nats")]
    #[error("NATS: {0}")]
    Nats(#[from] outboxkit_nats::NatsError),
    /// The WAL relay or `outbox wal` failed (wal_level, the slot, the stream).
    #[cfg(feature = "postgres")]
    #[error(transparent)]
    Wal(#[from] outboxkit_postgres::wal::WalError),
    /// The metrics/health endpoint could not bind its address.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The Prometheus recorder could not be installed.
    #[error("metrics: {0}")]
    Metrics(String),
    /// Writing the output failed.
    #[error("output: {0}")]
    Output(#[from] std::io::Error),
    /// A background task of the relay failed or panicked.
    #[error("relay task failed: {0}")]
    Task(String),
}

impl From<outboxkit::AnyPublisherError> for CliError {
    fn from(e: outboxkit::AnyPublisherError) -> Self {
        match e {
            #[cfg(feature = "rabbit")]
            outboxkit::AnyPublisherError::Rabbit(e) => Self::Rabbit(e),
            #[cfg(feature = "nats")]
            outboxkit::AnyPublisherError::Nats(e) => Self::Nats(e),
            other => Self::Invalid {
                field: "broker_url",
                reason: other.to_string(),
            },
        }
    }
}

impl CliError {
    /// Whether this is bad input (exit code 2) rather than a runtime failure (1).
    pub fn is_bad_input(&self) -> bool {
        match self {
            Self::ConfigRead { .. }
            | Self::ConfigParse { .. }
            | Self::Missing { .. }
            | Self::Invalid { .. }
            | Self::EventTypeOverride { .. }
            | Self::TimeWindow { .. }
            | Self::FeatureMissing { .. } => true,
            Self::Store(OutboxError::Config(_) | OutboxError::InvalidConfig { .. }) => true,
            #[cfg(feature = "postgres")]
            Self::Wal(e) => matches!(
                e,
                outboxkit_postgres::wal::WalError::InvalidName { .. }
                    | outboxkit_postgres::wal::WalError::InvalidConfig { .. }
                    | outboxkit_postgres::wal::WalError::Url(_)
            ),
            #[cfg(feature = "rabbit")]
            Self::Rabbit(e) => matches!(
                e,
                outboxkit_rabbit::RabbitError::InvalidUrl { .. }
                    | outboxkit_rabbit::RabbitError::InvalidConfig { .. }
            ),
            #[cfg(feature = "nats")]
            Self::Nats(e) => matches!(
                e,
                outboxkit_nats::NatsError::InvalidUrl { .. }
                    | outboxkit_nats::NatsError::InvalidConfig { .. }
            ),
            _ => false,
        }
    }

    /// The process exit code: 2 for bad input, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        if self.is_bad_input() { 2 } else { 1 }
    }
}
