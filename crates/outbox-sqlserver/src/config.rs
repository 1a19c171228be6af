//! Configuration of the SQL Server backend: the connection string, the schema, the pool.

use std::fmt;
use std::time::Duration;

use outboxkit_core::{
    DEFAULT_CRASH_LOOP_LIMIT, DEFAULT_MAX_PAYLOAD_BYTES, OutboxError, SentRetention,
};

use crate::connection::{MssqlConnectionManager, MssqlPool};

/// Default schema holding the outbox and inbox tables.
pub const DEFAULT_SCHEMA: &str = "outbox";

/// The environment variable [`MssqlConfig::from_env`] reads the connection string from.
pub const MSSQL_URL_ENV: &str = "MSSQL_URL";

/// Settings of [`MssqlOutbox`](crate::MssqlOutbox) and [`MssqlInbox`](crate::MssqlInbox).
///
/// The connection string is an ADO.NET string
/// (`server=tcp:127.0.0.1,1433;user=sa;password=...;database=app;TrustServerCertificate=true`)
/// or a JDBC one (`jdbc:sqlserver://127.0.0.1:1433;user=sa;password=...`), as parsed by
/// tiberius. TLS is rustls; `TrustServerCertificate=true` (or
/// [`with_trust_cert`](Self::with_trust_cert)) accepts the self-signed certificate of a
/// development container and MUST NOT be used against a server reached over an
/// untrusted network.
///
/// `Debug` and [`redacted`](Self::redacted) never show the password.
#[derive(Clone)]
pub struct MssqlConfig {
    connection_string: Option<String>,
    schema: String,
    max_connections: u32,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    trust_cert: bool,
    application_name: String,
    sent_retention: SentRetention,
    crash_loop_limit: u32,
    max_payload_bytes: usize,
}

impl Default for MssqlConfig {
    fn default() -> Self {
        Self {
            connection_string: None,
            schema: DEFAULT_SCHEMA.to_owned(),
            max_connections: 8,
            acquire_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            trust_cert: false,
            application_name: "outbox-sqlserver".to_owned(),
            sent_retention: SentRetention::Keep,
            crash_loop_limit: DEFAULT_CRASH_LOOP_LIMIT,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl fmt::Debug for MssqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MssqlConfig")
            .field(
                "connection_string",
                &self
                    .connection_string
                    .as_deref()
                    .map(redact_connection_string),
            )
            .field("schema", &self.schema)
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("trust_cert", &self.trust_cert)
            .field("application_name", &self.application_name)
            .field("sent_retention", &self.sent_retention)
            .field("crash_loop_limit", &self.crash_loop_limit)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .finish()
    }
}

impl MssqlConfig {
    /// Settings for the server named by `connection_string` (ADO.NET or JDBC form, see
    /// the type docs).
    pub fn new(connection_string: impl Into<String>) -> Self {
        Self {
            connection_string: Some(connection_string.into()),
            ..Self::default()
        }
    }

    /// Settings from the environment: `MSSQL_URL` (required, a connection string),
    /// `OUTBOX_SCHEMA` (default `outbox`), `OUTBOX_SENT_RETENTION` (`keep` or `delete`,
    /// default `keep`), `OUTBOX_CRASH_LOOP_LIMIT` (claims, default 5) and
    /// `OUTBOX_MAX_PAYLOAD_BYTES` (bytes, default 1,048,576).
    ///
    /// # Errors
    /// [`OutboxError::Config`] when `MSSQL_URL` is not set, `OUTBOX_SENT_RETENTION` is
    /// neither `keep` nor `delete`, or `OUTBOX_CRASH_LOOP_LIMIT` or
    /// `OUTBOX_MAX_PAYLOAD_BYTES` is not a positive integer.
    pub fn from_env() -> Result<Self, OutboxError> {
        let url = std::env::var(MSSQL_URL_ENV)
            .map_err(|_| OutboxError::Config(format!("{MSSQL_URL_ENV} is not set")))?;
        let mut config = Self::new(url);
        if let Ok(schema) = std::env::var("OUTBOX_SCHEMA") {
            config = config.with_schema(schema);
        }
        if let Ok(retention) = std::env::var("OUTBOX_SENT_RETENTION") {
            config = config.with_sent_retention(retention.parse()?);
        }
        if let Ok(limit) = std::env::var("OUTBOX_CRASH_LOOP_LIMIT") {
            config = config.with_crash_loop_limit(parse_crash_loop_limit(&limit)?);
        }
        if let Ok(max) = std::env::var("OUTBOX_MAX_PAYLOAD_BYTES") {
            config = config.with_max_payload_bytes(parse_max_payload_bytes(&max)?);
        }
        Ok(config)
    }

    /// Schema of the tables (default `outbox`). Must match `[a-z_][a-z0-9_]{0,62}`;
    /// checked by [`validate`](Self::validate). It is created by the migrations when
    /// missing.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Pool size (default 8 connections; at least 1).
    #[must_use]
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long to wait for a free pooled connection (default 10 s).
    #[must_use]
    pub fn with_acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// How long the TCP connect plus TLS handshake plus login of one new connection may
    /// take (default 10 s).
    #[must_use]
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Trust the server's certificate without validating it (default `false`), like
    /// `TrustServerCertificate=true` in the connection string. For development
    /// containers with self-signed certificates only.
    #[must_use]
    pub fn with_trust_cert(mut self, trust: bool) -> Self {
        self.trust_cert = trust;
        self
    }

    /// Application name reported to the server (default `outboxkit-sqlserver`; visible in
    /// `sys.dm_exec_sessions`). A name in the connection string wins.
    #[must_use]
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// What completions do with messages the broker confirmed (default
    /// [`SentRetention::Keep`]: mark them `Sent` and keep them until purged;
    /// [`SentRetention::Delete`]: delete them, leaving no record of delivered messages,
    /// see [`SentRetention`]).
    #[must_use]
    pub fn with_sent_retention(mut self, retention: SentRetention) -> Self {
        self.sent_retention = retention;
        self
    }

    /// Claims alone without an outcome after which the claim moves a row to `Dead` as a
    /// suspected crash loop (a count of claims of the row alone, default
    /// [`DEFAULT_CRASH_LOOP_LIMIT`]; 0 counts as 1): a row that crashes every relay
    /// publishing it stops doing so after this many crashes on its own; its batch-mates
    /// are each claimed alone once and published. See
    /// [`Poison::CrashLoop`](outboxkit_core::Poison::CrashLoop).
    #[must_use]
    pub fn with_crash_loop_limit(mut self, limit: u32) -> Self {
        self.crash_loop_limit = limit.max(1);
        self
    }

    /// Longest payload [`enqueue`](outboxkit_core::OutboxProducer::enqueue) accepts, in
    /// bytes of its JSON text (default [`DEFAULT_MAX_PAYLOAD_BYTES`], 1 MiB; 0 counts as
    /// 1). A longer one fails with
    /// [`InvalidMessage::PayloadTooLarge`](outboxkit_core::InvalidMessage::PayloadTooLarge)
    /// and nothing of its batch is written. Keep it at or below what the broker takes.
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

    /// The crash-loop limit (claims).
    pub fn crash_loop_limit(&self) -> u32 {
        self.crash_loop_limit
    }

    /// Pool size.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// Acquire timeout of the pool.
    pub fn acquire_timeout(&self) -> Duration {
        self.acquire_timeout
    }

    /// The connection string with its password replaced by `***` (for logs), or `None`
    /// when none is configured.
    pub fn redacted(&self) -> Option<String> {
        self.connection_string
            .as_deref()
            .map(redact_connection_string)
    }

    /// Checks the schema name (it is spliced into SQL, so only a plain lower-case
    /// identifier is accepted) and that the connection string parses.
    ///
    /// # Errors
    /// [`OutboxError::Config`] naming the bad value (never the password).
    pub fn validate(&self) -> Result<(), OutboxError> {
        validate_schema(&self.schema)?;
        self.tiberius_config().map(|_| ())
    }

    /// The tiberius configuration this builds (the connection string parsed, the trust
    /// and application-name settings applied).
    ///
    /// # Errors
    /// [`OutboxError::Config`] for a missing or malformed connection string.
    pub fn tiberius_config(&self) -> Result<tiberius::Config, OutboxError> {
        let raw = self.connection_string.as_deref().ok_or_else(|| {
            OutboxError::Config("no SQL Server connection string configured".into())
        })?;
        let mut text = raw.trim().to_owned();
        let jdbc = text.to_ascii_lowercase().starts_with("jdbc:sqlserver://");
        let squashed: String = text
            .to_ascii_lowercase()
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        if !jdbc && !squashed.contains("server=") && !squashed.contains("datasource=") {
            return Err(OutboxError::Config(format!(
                "SQL Server connection string {:?} names no server: expected \
                 `server=tcp:HOST,PORT;user=...;password=...` (ADO.NET) or \
                 `jdbc:sqlserver://HOST:PORT;user=...;password=...`",
                redact_connection_string(raw)
            )));
        }
        if self.trust_cert {
            // Appended rather than applied with `Config::trust_cert`, so a conflicting
            // `TrustServerCertificateCA` is reported as an error by the parser.
            if !text.ends_with(';') {
                text.push(';');
            }
            text.push_str("TrustServerCertificate=true");
        }
        let parsed = if jdbc {
            tiberius::Config::from_jdbc_string(&text)
        } else {
            tiberius::Config::from_ado_string(&text)
        };
        let mut config = parsed.map_err(|e| {
            OutboxError::Config(format!(
                "malformed SQL Server connection string {:?}: {e}",
                redact_connection_string(raw)
            ))
        })?;
        let lower = raw.to_ascii_lowercase();
        if !lower.contains("application name") && !lower.contains("applicationname") {
            config.application_name(&self.application_name);
        }
        Ok(config)
    }

    /// Opens a pool, connecting once eagerly so that a wrong address, a down server or
    /// bad credentials fail here with the server's own reason.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for a missing or malformed connection string or schema;
    /// [`OutboxError::Database`] (kind `Unavailable` for an unreachable server or a
    /// timeout, `Permanent` for a failed login) with a [`ConnectError`](crate::ConnectError)
    /// source naming the address, never the password.
    pub async fn connect(&self) -> Result<MssqlPool, OutboxError> {
        validate_schema(&self.schema)?;
        let manager = MssqlConnectionManager::new(self.tiberius_config()?, self.connect_timeout);
        let first = manager
            .open()
            .await
            .map_err(crate::error::connect("connect"))?;
        let pool = bb8::Pool::builder()
            .max_size(self.max_connections)
            .connection_timeout(self.acquire_timeout)
            .build_unchecked(manager);
        // The probe connection becomes the pool's first idle connection; a full pool
        // (impossible with max_size >= 1 and nothing borrowed) just drops it.
        let _ = pool.add(first);
        Ok(MssqlPool::new(pool, self.acquire_timeout))
    }
}

/// The value of `OUTBOX_CRASH_LOOP_LIMIT`: a positive integer, else a typed
/// [`OutboxError::Config`].
fn parse_crash_loop_limit(text: &str) -> Result<u32, OutboxError> {
    text.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
        OutboxError::Config(format!(
            "OUTBOX_CRASH_LOOP_LIMIT {text:?} is not a positive integer"
        ))
    })
}

/// The value of `OUTBOX_MAX_PAYLOAD_BYTES`: a positive integer, else a typed
/// [`OutboxError::Config`].
fn parse_max_payload_bytes(text: &str) -> Result<usize, OutboxError> {
    text.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
        OutboxError::Config(format!(
            "OUTBOX_MAX_PAYLOAD_BYTES {text:?} is not a positive integer"
        ))
    })
}

/// `connection_string` with the values of `password` / `pwd` replaced by `***`.
/// Works on ADO.NET and JDBC strings (`key=value;` pairs, values optionally quoted
/// with `{}`, `"` or `'`); best effort on malformed input: everything from a password
/// key to the next `;` is hidden.
pub fn redact_connection_string(connection_string: &str) -> String {
    let mut out = String::with_capacity(connection_string.len());
    let mut rest = connection_string;
    while !rest.is_empty() {
        // One `key=value` part, honouring quoted values that may contain `;`.
        let (part, tail) = split_part(rest);
        let redacted = match part.split_once('=') {
            Some((key, _)) if is_secret_key(key) => format!("{key}=***"),
            _ => part.to_owned(),
        };
        out.push_str(&redacted);
        if let Some(tail) = tail {
            out.push(';');
            rest = tail;
        } else {
            break;
        }
    }
    out
}

fn is_secret_key(key: &str) -> bool {
    let key = key.trim().to_ascii_lowercase();
    // The JDBC prefix may carry the first key after `jdbc:sqlserver://host:port;`.
    matches!(key.as_str(), "password" | "pwd")
}

/// Splits off the first `;`-separated part, skipping `;` inside a quoted value.
fn split_part(s: &str) -> (&str, Option<&str>) {
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut in_value = false;
    while i < bytes.len() {
        match bytes[i] {
            b'=' if !in_value => {
                in_value = true;
                // Skip spaces, then a quoted value if one opens here.
                let mut j = i + 1;
                while j < bytes.len() && bytes[j] == b' ' {
                    j += 1;
                }
                if j < bytes.len() {
                    let close = match bytes[j] {
                        b'{' => Some(b'}'),
                        b'"' => Some(b'"'),
                        b'\'' => Some(b'\''),
                        _ => None,
                    };
                    if let Some(close) = close {
                        match bytes[j + 1..].iter().position(|&b| b == close) {
                            Some(p) => i = j + 1 + p,
                            // Unterminated quote: hide to the end.
                            None => return (s, None),
                        }
                    }
                }
            }
            b';' => return (&s[..i], Some(&s[i + 1..])),
            _ => {}
        }
        i += 1;
    }
    (s, None)
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
            "x];drop table y",
            "x;drop table y",
            "[dbo]",
            "1abc",
            &"a".repeat(64),
        ] {
            assert!(validate_schema(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_connection_string(
                "server=tcp:127.0.0.1,1433;user=sa;password=Outbox_Passw0rd!;TrustServerCertificate=true"
            ),
            "server=tcp:127.0.0.1,1433;user=sa;password=***;TrustServerCertificate=true"
        );
        assert_eq!(
            redact_connection_string("Server=db;PWD={a;b=c};Database=x"),
            "Server=db;PWD=***;Database=x"
        );
        assert_eq!(
            redact_connection_string("jdbc:sqlserver://h:1433;user=sa;Password='p;w';x=1"),
            "jdbc:sqlserver://h:1433;user=sa;Password=***;x=1"
        );
        assert_eq!(
            redact_connection_string("server=h;password={unterminated;x=1"),
            "server=h;password=***"
        );
        assert!(!redact_connection_string("password=s3cret").contains("s3cret"));
    }

    #[test]
    fn crash_loop_limits_are_positive() {
        assert_eq!(
            MssqlConfig::default().crash_loop_limit(),
            DEFAULT_CRASH_LOOP_LIMIT
        );
        assert_eq!(
            MssqlConfig::default()
                .with_crash_loop_limit(0)
                .crash_loop_limit(),
            1
        );
        assert_eq!(parse_crash_loop_limit("3").ok(), Some(3));
        for bad in ["0", "-1", "five", "", "4294967296"] {
            assert!(
                matches!(parse_crash_loop_limit(bad), Err(OutboxError::Config(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn payload_limits_are_positive() {
        assert_eq!(
            MssqlConfig::default().max_payload_bytes(),
            DEFAULT_MAX_PAYLOAD_BYTES
        );
        assert_eq!(
            MssqlConfig::default()
                .with_max_payload_bytes(0)
                .max_payload_bytes(),
            1
        );
        assert_eq!(parse_max_payload_bytes("2048").ok(), Some(2048));
        for bad in ["0", "-1", "1MiB", ""] {
            assert!(
                matches!(parse_max_payload_bytes(bad), Err(OutboxError::Config(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn debug_never_shows_the_password() {
        let config = MssqlConfig::new("server=tcp:h,1433;user=sa;password=hunter2");
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("password=***"), "{shown}");
        for text in [
            "server=tcp:h,1433;user=sa;password=s3cret",
            "Server=h;User ID=sa;Pwd={s3;cret};Database=x",
            "jdbc:sqlserver://h:1433;user=sa;password=s3cret/?#@:x",
            "server=h;password='s3cret",
        ] {
            let shown = format!("{:?}", MssqlConfig::new(text).with_max_payload_bytes(10));
            assert!(
                !shown.contains("s3cret") && !shown.contains("cret}"),
                "{shown}"
            );
            assert!(shown.contains("max_payload_bytes: 10"), "{shown}");
        }
    }

    #[test]
    fn connection_strings_are_parsed() {
        let ado = MssqlConfig::new(
            "server=tcp:127.0.0.1,1433;user=sa;password=pw;TrustServerCertificate=true",
        );
        assert_eq!(
            ado.tiberius_config().expect("ado").get_addr(),
            "127.0.0.1:1433"
        );
        let jdbc = MssqlConfig::new("jdbc:sqlserver://db.example:1444;user=sa;password=pw")
            .with_trust_cert(true);
        assert_eq!(
            jdbc.tiberius_config().expect("jdbc").get_addr(),
            "db.example:1444"
        );
        let data_source = MssqlConfig::new("Data Source=tcp:db,1433;User ID=sa;Password=pw");
        assert_eq!(
            data_source
                .tiberius_config()
                .expect("data source")
                .get_addr(),
            "db:1433"
        );
        for bad in ["", "postgres://x/y", "user=sa;password=hunter2"] {
            let err = MssqlConfig::new(bad).validate().expect_err(bad);
            assert!(matches!(err, OutboxError::Config(_)), "{bad}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
        let err = MssqlConfig::default().validate().expect_err("no string");
        assert!(matches!(err, OutboxError::Config(_)));
        let conflict = MssqlConfig::new("server=tcp:h,1433;TrustServerCertificateCA=/x.pem")
            .with_trust_cert(true);
        assert!(matches!(
            conflict.tiberius_config(),
            Err(OutboxError::Config(_))
        ));
    }
}
