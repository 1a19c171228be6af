//! Configuration of the MySQL / MariaDB backend.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use outboxkit_core::env::{
    DATABASE_URL, Env, EnvError, OUTBOX_CRASH_LOOP_LIMIT, OUTBOX_MAX_PAYLOAD_BYTES,
};
use outboxkit_core::error::{LoneUserInfo, redact_url};
use outboxkit_core::{
    DEFAULT_CRASH_LOOP_LIMIT, DEFAULT_MAX_PAYLOAD_BYTES, DatabaseKind, OutboxError, SentRetention,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

/// Default database (MySQL's "schema") holding the outbox and inbox tables.
pub const DEFAULT_SCHEMA: &str = "outbox";

/// Settings of [`MySqlOutbox`](crate::MySqlOutbox) and [`MySqlInbox`](crate::MySqlInbox).
///
/// `Debug` never shows the URL's password.
#[derive(Clone)]
pub struct MySqlConfig {
    url: Option<String>,
    schema: String,
    max_connections: u32,
    acquire_timeout: Duration,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
    max_payload_bytes: usize,
}

impl fmt::Debug for MySqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlConfig")
            .field(
                "url",
                &self
                    .url
                    .as_deref()
                    .map(|url| redact_url(url, LoneUserInfo::UserName)),
            )
            .field("schema", &self.schema)
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("sent_retention", &self.sent_retention)
            .field("crash_loop_limit", &self.crash_loop_limit)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .finish()
    }
}

impl Default for MySqlConfig {
    fn default() -> Self {
        Self {
            url: None,
            schema: DEFAULT_SCHEMA.to_owned(),
            max_connections: 8,
            acquire_timeout: Duration::from_secs(10),
            sent_retention: SentRetention::Keep,
            crash_loop_limit: DEFAULT_CRASH_LOOP_LIMIT,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl MySqlConfig {
    /// Settings for the database at `url` (`mysql://user@host:port/db` or `mariadb://…`).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            ..Self::default()
        }
    }

    /// Settings from the environment, under the names the `outbox` binary reads
    /// (the table: [`outboxkit_core::env`]):
    ///
    /// | Variable | Setting | Default |
    /// |---|---|---|
    /// | `DATABASE_URL` | the URL, `mysql://…` or `mariadb://…` | required |
    /// | `OUTBOX_SCHEMA` | [`with_schema`](Self::with_schema) (the database of the tables) | `outbox` |
    /// | `OUTBOX_SENT_RETENTION` | [`with_sent_retention`](Self::with_sent_retention): `keep` or `delete` | `keep` |
    /// | `OUTBOX_CRASH_LOOP_LIMIT` | [`with_crash_loop_limit`](Self::with_crash_loop_limit), claims | 5 |
    /// | `OUTBOX_MAX_PAYLOAD_BYTES` | [`with_max_payload_bytes`](Self::with_max_payload_bytes), bytes | 1,048,576 |
    ///
    /// Unset or blank variables take the default.
    ///
    /// # Errors
    /// [`OutboxError::Env`] naming the variable and its value (the URL's password
    /// hidden): `DATABASE_URL` unset, naming another database (`postgres://…`) or
    /// malformed; a schema name the store refuses; a retention other than `keep` or
    /// `delete`; a limit that is not a positive integer.
    pub fn from_env() -> Result<Self, OutboxError> {
        Ok(Self::from_lookup(&Env::process())?)
    }

    /// [`from_env`](Self::from_env) over any environment (a map in tests).
    pub(crate) fn from_lookup(
        env: &Env<impl Fn(&str) -> Option<String>>,
    ) -> Result<Self, EnvError> {
        let redact = |url: &str| redact_url(url, LoneUserInfo::UserName);
        let url = env.database_url(DatabaseKind::MySql)?;
        if let Err(e) = parse_url(&url) {
            return Err(EnvError::invalid(
                DATABASE_URL,
                redact(&url),
                config_reason(e),
            ));
        }
        let mut config = Self::new(url);
        if let Some(schema) = env.schema()? {
            config = config.with_schema(schema);
        }
        if let Some(retention) = env.sent_retention()? {
            config = config.with_sent_retention(retention);
        }
        if let Some(limit) = env.positive(OUTBOX_CRASH_LOOP_LIMIT)? {
            config = config.with_crash_loop_limit(limit);
        }
        if let Some(max) = env.positive(OUTBOX_MAX_PAYLOAD_BYTES)? {
            config = config.with_max_payload_bytes(max);
        }
        Ok(config)
    }

    /// Database of the tables (MySQL's "schema", default `outbox`; created by
    /// [`MySqlOutbox::migrate`](crate::MySqlOutbox::migrate) when missing, so the user needs `CREATE` on it).
    /// Must match `[a-z_][a-z0-9_]{0,62}`; checked by [`validate`](Self::validate).
    /// The database of the URL is only where connections start.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Pool size of [`MySqlOutbox::connect`](crate::MySqlOutbox::connect) (default 8 connections).
    #[must_use]
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long to wait for a pooled connection (default 10 s).
    #[must_use]
    pub fn with_acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// What completions do with messages the broker confirmed (default
    /// [`SentRetention::Keep`]: mark them `Sent` and keep them until purged;
    /// [`SentRetention::Delete`]: delete them, which takes about half of the claim and
    /// completion work off the database but leaves no record of delivered messages, see
    /// [`SentRetention`]).
    #[must_use]
    pub fn with_sent_retention(mut self, retention: SentRetention) -> Self {
        self.sent_retention = retention;
        self
    }

    /// Claims alone without an outcome after which the claim moves a row to `Dead` as a
    /// suspected crash loop (default [`DEFAULT_CRASH_LOOP_LIMIT`], at least 1): a row
    /// that crashes every relay publishing it stops doing so after this many crashes
    /// alone (a row whose claim ended without an outcome is claimed alone from then on,
    /// so its batch-mates are never counted).
    #[must_use]
    pub fn with_crash_loop_limit(mut self, limit: u32) -> Self {
        self.crash_loop_limit = limit.max(1);
        self
    }

    /// The crash-loop limit.
    pub fn crash_loop_limit(&self) -> u32 {
        self.crash_loop_limit
    }

    /// Longest payload [`enqueue`](outboxkit_core::OutboxProducer::enqueue) accepts, in bytes
    /// of its JSON text (default [`DEFAULT_MAX_PAYLOAD_BYTES`], 1 MiB; at least 1). A
    /// longer one fails with [`InvalidMessage::PayloadTooLarge`](outboxkit_core::InvalidMessage::PayloadTooLarge)
    /// and nothing of its batch is written. Keep it at or below what the broker takes
    /// (RabbitMQ's `max_message_size`, NATS' `max_payload`, 1 MiB by default).
    #[must_use]
    pub fn with_max_payload_bytes(mut self, max: usize) -> Self {
        self.max_payload_bytes = max.max(1);
        self
    }

    /// The payload limit of enqueue, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// What completions do with sent messages.
    pub fn sent_retention(&self) -> SentRetention {
        self.sent_retention
    }

    /// Checks the schema name (it is spliced into SQL, so only a plain lower-case
    /// identifier is accepted) and, when set, that the URL parses.
    ///
    /// # Errors
    /// [`OutboxError::Config`] naming the bad value.
    pub fn validate(&self) -> Result<(), OutboxError> {
        validate_schema(&self.schema)?;
        if let Some(url) = &self.url {
            parse_url(url)?;
        }
        Ok(())
    }

    /// Opens a pool (connecting eagerly, so a wrong URL or a down server fails here),
    /// without sqlx's ping before each acquire (`test_before_acquire(false)`: a round
    /// trip per transaction saved; a connection broken meanwhile fails its next statement,
    /// which the relay retries and the inbox defers).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for a missing or malformed URL or schema, or
    /// [`OutboxError::Database`] when the server cannot be reached.
    pub(crate) async fn connect(&self) -> Result<sqlx::MySqlPool, OutboxError> {
        self.validate()?;
        let url = self
            .url
            .as_deref()
            .ok_or_else(|| OutboxError::Config("no database URL configured".into()))?;
        MySqlPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            // No ping before every acquire: it is one more round trip per transaction
            // (the relay's claims and completions, the consumer's deliveries). A broken
            // connection fails its first statement instead, which every caller here
            // retries or defers; sqlx still pings a connection when it comes back.
            .test_before_acquire(false)
            .connect_with(parse_url(url)?)
            .await
            .map_err(crate::error::db("connect"))
    }
}

/// Parses a MySQL or MariaDB URL (`mysql://` or `mariadb://`, the latter read as the
/// former) into connect options, with the session time zone set to UTC
/// (`time_zone = '+00:00'`: every `DATETIME(6)` column holds UTC from `NOW(6)`) and the
/// character set `utf8mb4`.
///
/// # Errors
/// [`OutboxError::Config`] for a malformed URL (the password is not echoed).
pub fn parse_url(url: &str) -> Result<MySqlConnectOptions, OutboxError> {
    let url = if let Some(rest) = url.strip_prefix("mariadb://") {
        std::borrow::Cow::Owned(format!("mysql://{rest}"))
    } else if url.starts_with("mysql://") {
        std::borrow::Cow::Borrowed(url)
    } else {
        return Err(OutboxError::Config(
            "database URL must start with mysql:// or mariadb://".into(),
        ));
    };
    MySqlConnectOptions::from_str(&url)
        .map(|o| o.timezone(Some("+00:00".to_owned())).charset("utf8mb4"))
        .map_err(|e| OutboxError::Config(format!("malformed database URL: {e}")))
}

/// The reason of a configuration error, without the `invalid configuration:` prefix.
fn config_reason(e: OutboxError) -> String {
    match e {
        OutboxError::Config(reason) => reason,
        other => other.to_string(),
    }
}

pub(crate) use outboxkit_core::store::validate_schema;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_checked() {
        assert!(validate_schema("outbox").is_ok());
        assert!(validate_schema("t_0123").is_ok());
        for bad in [
            "",
            "Outbox",
            "a-b",
            "x;drop table y",
            "1abc",
            &"a".repeat(64),
        ] {
            assert!(validate_schema(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn debug_never_shows_the_password() {
        for url in [
            "mysql://app:s3cret@db:3306/app",
            "mysql://app:s3/cret@db:3306/app",
            "mariadb://app:12/s3cret@db/app",
        ] {
            let shown = format!("{:?}", MySqlConfig::new(url).with_max_payload_bytes(10));
            assert!(
                !shown.contains("s3cret") && !shown.contains("s3/cret"),
                "{shown}"
            );
            assert!(shown.contains("app:***@"), "{shown}");
            assert!(shown.contains("max_payload_bytes: 10"), "{shown}");
        }
        assert!(format!("{:?}", MySqlConfig::default()).contains("url: None"));
    }

    #[test]
    fn payload_limits_are_positive() {
        assert_eq!(
            MySqlConfig::default().max_payload_bytes(),
            DEFAULT_MAX_PAYLOAD_BYTES
        );
        assert_eq!(
            MySqlConfig::default()
                .with_max_payload_bytes(0)
                .max_payload_bytes(),
            1
        );
    }

    #[test]
    fn malformed_urls_are_config_errors() {
        for bad in ["", "http://x", "mysql://host:notaport/db", "postgres://x/y"] {
            assert!(
                matches!(parse_url(bad), Err(OutboxError::Config(_))),
                "{bad}"
            );
        }
        assert!(parse_url("mysql://root@127.0.0.1:3306/test").is_ok());
        assert!(parse_url("mariadb://root@127.0.0.1:3306/test").is_ok());
    }

    #[test]
    fn from_env_reads_the_binarys_variables() -> Result<(), EnvError> {
        let config = MySqlConfig::from_lookup(&Env::from_pairs(&[
            ("DATABASE_URL", "mariadb://app:s3cret@db:3306/app"),
            ("OUTBOX_SCHEMA", "orders"),
            ("OUTBOX_SENT_RETENTION", "delete"),
            ("OUTBOX_CRASH_LOOP_LIMIT", "3"),
            ("OUTBOX_MAX_PAYLOAD_BYTES", "2048"),
        ]))?;
        assert_eq!(config.schema(), "orders");
        assert_eq!(config.sent_retention(), SentRetention::Delete);
        assert_eq!(config.crash_loop_limit(), 3);
        assert_eq!(config.max_payload_bytes(), 2048);
        let defaults =
            MySqlConfig::from_lookup(&Env::from_pairs(&[("DATABASE_URL", "mysql://h/db")]))?;
        assert_eq!(defaults.schema(), DEFAULT_SCHEMA);
        assert_eq!(defaults.sent_retention(), SentRetention::Keep);
        assert_eq!(defaults.crash_loop_limit(), DEFAULT_CRASH_LOOP_LIMIT);
        assert_eq!(defaults.max_payload_bytes(), DEFAULT_MAX_PAYLOAD_BYTES);
        Ok(())
    }

    #[test]
    fn from_env_names_the_bad_variable() {
        let url = ("DATABASE_URL", "mysql://app:s3cret@db/app");
        assert_eq!(
            MySqlConfig::from_lookup(&Env::from_pairs(&[])).expect_err("unset"),
            EnvError::Missing {
                var: "DATABASE_URL"
            }
        );
        for (pairs, var) in [
            (
                vec![("DATABASE_URL", "postgres://app:s3cret@db/app")],
                "DATABASE_URL",
            ),
            (
                vec![("DATABASE_URL", "mssql://sa:s3cret@db/app")],
                "DATABASE_URL",
            ),
            (
                vec![("DATABASE_URL", "mysql://app:s3cret@db:port/app")],
                "DATABASE_URL",
            ),
            (vec![url, ("OUTBOX_SCHEMA", "Orders")], "OUTBOX_SCHEMA"),
            (
                vec![url, ("OUTBOX_SENT_RETENTION", "never")],
                "OUTBOX_SENT_RETENTION",
            ),
            (
                vec![url, ("OUTBOX_CRASH_LOOP_LIMIT", "-1")],
                "OUTBOX_CRASH_LOOP_LIMIT",
            ),
            (
                vec![url, ("OUTBOX_MAX_PAYLOAD_BYTES", "0")],
                "OUTBOX_MAX_PAYLOAD_BYTES",
            ),
        ] {
            let err = MySqlConfig::from_lookup(&Env::from_pairs(&pairs)).expect_err(var);
            assert_eq!(err.var(), var, "{err}");
            let text = OutboxError::from(err).to_string();
            assert!(text.contains(var) && !text.contains("s3cret"), "{text}");
        }
        let err =
            MySqlConfig::from_lookup(&Env::from_pairs(&[("DATABASE_URL", "postgres://h/db")]))
                .expect_err("postgres")
                .to_string();
        assert!(
            err.contains("PostgreSQL") && err.contains("mysql://"),
            "{err}"
        );
    }
}
