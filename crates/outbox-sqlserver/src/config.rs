//! Configuration of the SQL Server backend: the connection string, the schema, the pool.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use outboxkit_core::database::{redact_connection_string, redact_database_url};
use outboxkit_core::env::{
    DATABASE_URL, Env, EnvError, OUTBOX_CRASH_LOOP_LIMIT, OUTBOX_MAX_PAYLOAD_BYTES,
};
use outboxkit_core::error::{LoneUserInfo, redact_url};
use outboxkit_core::{
    DEFAULT_CRASH_LOOP_LIMIT, DEFAULT_MAX_PAYLOAD_BYTES, DatabaseKind, OutboxError, SentRetention,
};

use crate::connection::{MssqlConnectionManager, MssqlPool};

/// Default schema holding the outbox and inbox tables.
pub const DEFAULT_SCHEMA: &str = "outbox";

/// Settings of [`MssqlOutbox`](crate::MssqlOutbox) and [`MssqlInbox`](crate::MssqlInbox).
///
/// Built with [`new`](Self::new) from a connection string, or parsed
/// ([`FromStr`](#impl-FromStr-for-MssqlConfig), as sqlx's connect options are) from any
/// of the forms the `outbox` binary takes in `DATABASE_URL`:
///
/// | Form | Example |
/// |---|---|
/// | ADO.NET | `server=tcp:HOST,PORT;user=sa;password=…;database=app` (`Data Source=…` too) |
/// | JDBC | `jdbc:sqlserver://HOST:PORT;user=sa;password=…;database=app` |
/// | `sqlserver://` or `mssql://` with a JDBC tail | `sqlserver://HOST:PORT;user=sa;password=…` |
/// | `sqlserver://` or `mssql://` URL | `mssql://USER:PASSWORD@HOST:PORT/DATABASE?TrustServerCertificate=true` |
///
/// A URL's user, password and database are percent-decoded, its port defaults to 1433
/// and its query pairs are appended as connection-string keys: it becomes
/// `server=tcp:HOST,PORT;user=USER;password=…;database=DATABASE;KEY=VALUE…`.
///
/// ```
/// use outboxkit_sqlserver::MssqlConfig;
///
/// let config: MssqlConfig = "mssql://sa:p%3Bw@db.example:1444/app?TrustServerCertificate=true".parse()?;
/// assert_eq!(
///     config.redacted().as_deref(),
///     Some("server=tcp:db.example,1444;user=sa;password=***;database=app;TrustServerCertificate=true")
/// );
/// assert!("postgres://app@db/app".parse::<MssqlConfig>().is_err());
/// # Ok::<(), outboxkit_core::OutboxError>(())
/// ```
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

    /// Settings from the environment, under the names the `outbox` binary reads
    /// (the table: [`outboxkit_core::env`]):
    ///
    /// | Variable | Setting | Default |
    /// |---|---|---|
    /// | `DATABASE_URL` | the server, in any form [`FromStr`](#impl-FromStr-for-MssqlConfig) takes | required |
    /// | `OUTBOX_SCHEMA` | [`with_schema`](Self::with_schema) | `outbox` |
    /// | `OUTBOX_SENT_RETENTION` | [`with_sent_retention`](Self::with_sent_retention): `keep` or `delete` | `keep` |
    /// | `OUTBOX_CRASH_LOOP_LIMIT` | [`with_crash_loop_limit`](Self::with_crash_loop_limit), claims | 5 |
    /// | `OUTBOX_MAX_PAYLOAD_BYTES` | [`with_max_payload_bytes`](Self::with_max_payload_bytes), bytes | 1,048,576 |
    ///
    /// Unset or blank variables take the default.
    ///
    /// # Errors
    /// [`OutboxError::Env`] naming the variable and its value (the password hidden):
    /// `DATABASE_URL` unset, naming another database (`postgres://…`) or malformed; a
    /// schema name the store refuses; a retention other than `keep` or `delete`; a
    /// limit that is not a positive integer.
    pub fn from_env() -> Result<Self, OutboxError> {
        Ok(Self::from_lookup(&Env::process())?)
    }

    /// [`from_env`](Self::from_env) over any environment (a map in tests).
    pub(crate) fn from_lookup(
        env: &Env<impl Fn(&str) -> Option<String>>,
    ) -> Result<Self, EnvError> {
        let url = env.database_url(DatabaseKind::SqlServer)?;
        let mut config: Self = url.parse().map_err(|e| {
            EnvError::invalid(DATABASE_URL, redact_database_url(&url), config_reason(e))
        })?;
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
    pub(crate) async fn connect(&self) -> Result<MssqlPool, OutboxError> {
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

impl FromStr for MssqlConfig {
    type Err = OutboxError;

    /// Parses a SQL Server URL or connection string in any of the forms in the type
    /// docs into settings (everything but the server at its default), checking that the
    /// result is a connection string tiberius accepts.
    ///
    /// # Errors
    /// [`OutboxError::Config`] for text that names another database (`postgres://…`)
    /// or none, a `mssql://` / `sqlserver://` URL that does not parse or names no host,
    /// or a connection string tiberius refuses. The password is never in the message.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match DatabaseKind::of_url(s) {
            Some(DatabaseKind::SqlServer) => {}
            found => {
                return Err(OutboxError::Config(format!(
                    "{:?} is not a SQL Server URL or connection string{}: expected {}",
                    redact_database_url(s),
                    found.map_or(String::new(), |kind| format!(" (it names {kind})")),
                    DatabaseKind::SqlServer.forms()
                )));
            }
        }
        let config = Self::new(connection_string(s)?);
        config.tiberius_config()?;
        Ok(config)
    }
}

/// The ADO.NET or JDBC connection string tiberius parses for `url`, a SQL Server URL or
/// connection string in any of the forms of [`MssqlConfig`]'s docs.
///
/// # Errors
/// [`OutboxError::Config`] for a `mssql://` / `sqlserver://` URL that does not parse.
fn connection_string(url: &str) -> Result<String, OutboxError> {
    let trimmed = url.trim();
    let lower = trimmed.to_ascii_lowercase();
    let tail = ["sqlserver://", "mssql://"]
        .iter()
        .find(|p| lower.starts_with(*p))
        .map(|p| &trimmed[p.len()..]);
    let Some(tail) = tail else {
        // jdbc:sqlserver:// or ADO.NET: as given.
        return Ok(trimmed.to_owned());
    };
    if tail.contains(';') || !tail.contains('@') {
        // The JDBC tail: `HOST:PORT;key=value;…`.
        return Ok(format!("jdbc:sqlserver://{tail}"));
    }
    let invalid = |reason: String| {
        OutboxError::Config(format!(
            "SQL Server URL {:?}: {reason}",
            redact_url(url, LoneUserInfo::UserName)
        ))
    };
    let parsed = url::Url::parse(&format!("mssql://{tail}"))
        .map_err(|e| invalid(format!("not a valid URL: {e}")))?;
    let host = parsed
        .host_str()
        .ok_or_else(|| invalid("names no host".into()))?;
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    // ADO.NET values with `;`, `=` or braces must be braced, a `}` doubled.
    let value = |v: &str| {
        if v.contains([';', '=', '{', '}']) || v.trim() != v {
            format!("{{{}}}", v.replace('}', "}}"))
        } else {
            v.to_owned()
        }
    };
    let mut ado = format!("server=tcp:{host},{}", parsed.port().unwrap_or(1433));
    if !parsed.username().is_empty() {
        ado.push_str(&format!(";user={}", value(&decode(parsed.username()))));
    }
    if let Some(password) = parsed.password() {
        ado.push_str(&format!(";password={}", value(&decode(password))));
    }
    let database = parsed.path().trim_start_matches('/');
    if !database.is_empty() {
        ado.push_str(&format!(";database={}", value(&decode(database))));
    }
    for (k, v) in parsed.query_pairs() {
        ado.push_str(&format!(";{}={}", k, value(&v)));
    }
    Ok(ado)
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

    /// The connection string `text` parses into.
    fn parsed(text: &str) -> Result<String, OutboxError> {
        let config: MssqlConfig = text.parse()?;
        Ok(config.connection_string.unwrap_or_default())
    }

    #[test]
    fn sqlserver_urls_become_connection_strings() -> Result<(), OutboxError> {
        assert_eq!(
            parsed("sqlserver://db:1444;user=sa;password=pw")?,
            "jdbc:sqlserver://db:1444;user=sa;password=pw"
        );
        assert_eq!(
            parsed("mssql://sa:p%3Bw%40rd@db.example:1444/app?TrustServerCertificate=true")?,
            "server=tcp:db.example,1444;user=sa;password={p;w@rd};database=app;\
             TrustServerCertificate=true"
        );
        assert_eq!(
            parsed("MSSQL://sa:pw@db")?,
            "server=tcp:db,1433;user=sa;password=pw"
        );
        let ado = "server=tcp:h,1433;user=sa;password=x";
        assert_eq!(parsed(ado)?, ado);
        let jdbc = "jdbc:sqlserver://h:1433;user=sa;password=x";
        assert_eq!(parsed(jdbc)?, jdbc);
        assert_eq!(
            parsed("mssql://sa:pw@db:1444")?
                .parse::<MssqlConfig>()?
                .tiberius_config()?
                .get_addr(),
            "db:1444"
        );
        Ok(())
    }

    #[test]
    fn other_databases_and_malformed_urls_are_refused_without_the_password() {
        for bad in [
            "postgres://app:s3cret@db/app",
            "mysql://app:s3cret@db/app",
            "mssql://sa:s3cret@db:notaport/app",
            "mssql://sa:s3cret@/app",
            "user=sa;password=s3cret",
            "",
        ] {
            let err = bad.parse::<MssqlConfig>().expect_err(bad);
            assert!(matches!(err, OutboxError::Config(_)), "{bad}: {err}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
        let err = "postgres://h/db"
            .parse::<MssqlConfig>()
            .expect_err("pg")
            .to_string();
        assert!(
            err.contains("PostgreSQL") && err.contains("mssql://"),
            "{err}"
        );
    }

    #[test]
    fn redaction_covers_every_form() {
        for text in [
            "mssql://sa:s3cret@db/app",
            "sqlserver://db:1433;user=sa;password=s3cret",
            "server=tcp:db,1433;user=sa;Password=s3cret;database=app",
            "postgres://app:s3cret@db/app",
        ] {
            let shown = redact_database_url(text);
            assert!(!shown.contains("s3cret"), "{text} -> {shown}");
        }
    }

    #[test]
    fn from_env_reads_the_binarys_variables() -> Result<(), EnvError> {
        let config = MssqlConfig::from_lookup(&Env::from_pairs(&[
            ("DATABASE_URL", "mssql://sa:s3cret@db:1444/app"),
            ("OUTBOX_SCHEMA", "orders"),
            ("OUTBOX_SENT_RETENTION", "delete"),
            ("OUTBOX_CRASH_LOOP_LIMIT", "3"),
            ("OUTBOX_MAX_PAYLOAD_BYTES", "2048"),
        ]))?;
        assert_eq!(
            config.redacted().as_deref(),
            Some("server=tcp:db,1444;user=sa;password=***;database=app")
        );
        assert_eq!(config.schema(), "orders");
        assert_eq!(config.sent_retention(), SentRetention::Delete);
        assert_eq!(config.crash_loop_limit(), 3);
        assert_eq!(config.max_payload_bytes(), 2048);
        let defaults = MssqlConfig::from_lookup(&Env::from_pairs(&[(
            "DATABASE_URL",
            "server=tcp:h,1433;user=sa;password=x",
        )]))?;
        assert_eq!(defaults.schema(), DEFAULT_SCHEMA);
        assert_eq!(defaults.sent_retention(), SentRetention::Keep);
        assert_eq!(defaults.crash_loop_limit(), DEFAULT_CRASH_LOOP_LIMIT);
        assert_eq!(defaults.max_payload_bytes(), DEFAULT_MAX_PAYLOAD_BYTES);
        Ok(())
    }

    #[test]
    fn from_env_names_the_bad_variable() {
        let url = ("DATABASE_URL", "mssql://sa:s3cret@db/app");
        assert_eq!(
            MssqlConfig::from_lookup(&Env::from_pairs(&[])).expect_err("unset"),
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
                vec![("DATABASE_URL", "mysql://app:s3cret@db/app")],
                "DATABASE_URL",
            ),
            (
                vec![("DATABASE_URL", "mssql://sa:s3cret@db:port/app")],
                "DATABASE_URL",
            ),
            (vec![url, ("OUTBOX_SCHEMA", "Orders")], "OUTBOX_SCHEMA"),
            (
                vec![url, ("OUTBOX_SENT_RETENTION", "none")],
                "OUTBOX_SENT_RETENTION",
            ),
            (
                vec![url, ("OUTBOX_CRASH_LOOP_LIMIT", "five")],
                "OUTBOX_CRASH_LOOP_LIMIT",
            ),
            (
                vec![url, ("OUTBOX_MAX_PAYLOAD_BYTES", "")],
                "DATABASE_URL_OK",
            ),
        ] {
            if var == "DATABASE_URL_OK" {
                // Blank counts as unset.
                assert!(MssqlConfig::from_lookup(&Env::from_pairs(&pairs)).is_ok());
                continue;
            }
            let err = MssqlConfig::from_lookup(&Env::from_pairs(&pairs)).expect_err(var);
            assert_eq!(err.var(), var, "{err}");
            let text = OutboxError::from(err).to_string();
            assert!(text.contains(var) && !text.contains("s3cret"), "{text}");
        }
    }
}
