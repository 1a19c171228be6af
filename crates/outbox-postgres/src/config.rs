//! Configuration of the PostgreSQL backend.

use std::str::FromStr;
use std::time::Duration;

use outbox_core::{DEFAULT_CRASH_LOOP_LIMIT, OutboxError, SentRetention};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Default schema holding the outbox and inbox tables.
pub const DEFAULT_SCHEMA: &str = "outbox";

/// Settings of [`PgOutbox`](crate::PgOutbox) and [`PgInbox`](crate::PgInbox).
#[derive(Debug, Clone)]
pub struct PgConfig {
    url: Option<String>,
    schema: String,
    max_connections: u32,
    acquire_timeout: Duration,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
}

impl Default for PgConfig {
    fn default() -> Self {
        Self {
            url: None,
            schema: DEFAULT_SCHEMA.to_owned(),
            max_connections: 8,
            acquire_timeout: Duration::from_secs(10),
            sent_retention: SentRetention::Keep,
            crash_loop_limit: DEFAULT_CRASH_LOOP_LIMIT,
        }
    }
}

impl PgConfig {
    /// Settings for the database at `url` (`postgres://user@host:port/db`).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: Some(url.into()),
            ..Self::default()
        }
    }

    /// Settings from the environment: `DATABASE_URL` (required), `OUTBOX_SCHEMA`
    /// (default `outbox`), `OUTBOX_SENT_RETENTION` (`keep` or `delete`, default
    /// `keep`) and `OUTBOX_CRASH_LOOP_LIMIT` (claims, default 5).
    ///
    /// # Errors
    /// [`OutboxError::Config`] when `DATABASE_URL` is not set,
    /// `OUTBOX_SENT_RETENTION` is neither `keep` nor `delete`, or
    /// `OUTBOX_CRASH_LOOP_LIMIT` is not a positive integer.
    pub fn from_env() -> Result<Self, OutboxError> {
        let url = std::env::var("DATABASE_URL")
            .map_err(|_| OutboxError::Config("DATABASE_URL is not set".into()))?;
        let mut config = Self::new(url);
        if let Ok(schema) = std::env::var("OUTBOX_SCHEMA") {
            config = config.with_schema(schema);
        }
        if let Ok(retention) = std::env::var("OUTBOX_SENT_RETENTION") {
            config = config.with_sent_retention(retention.parse()?);
        }
        if let Ok(limit) = std::env::var("OUTBOX_CRASH_LOOP_LIMIT") {
            config = config.with_crash_loop_limit(
                limit.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    OutboxError::Config(format!(
                        "OUTBOX_CRASH_LOOP_LIMIT {limit:?} is not a positive integer"
                    ))
                })?,
            );
        }
        Ok(config)
    }

    /// Schema of the tables (default `outbox`). Must match `[a-z_][a-z0-9_]{0,62}`;
    /// checked by [`validate`](Self::validate).
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Pool size for [`connect`](Self::connect) (default 8 connections).
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

    /// Claims without an outcome after which the claim moves a row to `Dead` as a
    /// suspected crash loop (default [`DEFAULT_CRASH_LOOP_LIMIT`], at least 1): a row
    /// that crashes every relay publishing it stops doing so after this many crashes.
    #[must_use]
    pub fn with_crash_loop_limit(mut self, limit: u32) -> Self {
        self.crash_loop_limit = limit.max(1);
        self
    }

    /// The crash-loop limit.
    pub fn crash_loop_limit(&self) -> u32 {
        self.crash_loop_limit
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

    /// Opens a pool (connecting eagerly, so a wrong URL or a down server fails here).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for a missing or malformed URL or schema, or
    /// [`OutboxError::Database`] when the server cannot be reached.
    pub async fn connect(&self) -> Result<sqlx::PgPool, OutboxError> {
        self.validate()?;
        let url = self
            .url
            .as_deref()
            .ok_or_else(|| OutboxError::Config("no database URL configured".into()))?;
        PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .connect_with(parse_url(url)?)
            .await
            .map_err(crate::error::db("connect"))
    }
}

/// Parses a PostgreSQL URL into connect options.
///
/// # Errors
/// [`OutboxError::Config`] for a malformed URL (the password is not echoed).
pub fn parse_url(url: &str) -> Result<PgConnectOptions, OutboxError> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(OutboxError::Config(
            "database URL must start with postgres:// or postgresql://".into(),
        ));
    }
    PgConnectOptions::from_str(url)
        .map_err(|e| OutboxError::Config(format!("malformed database URL: {e}")))
}

pub(crate) use outbox_core::store::validate_schema;

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
    fn malformed_urls_are_config_errors() {
        for bad in ["", "http://x", "postgres://host:notaport/db", "mysql://x/y"] {
            assert!(
                matches!(parse_url(bad), Err(OutboxError::Config(_))),
                "{bad}"
            );
        }
        assert!(parse_url("postgres://postgres@127.0.0.1:5432/test").is_ok());
    }
}
