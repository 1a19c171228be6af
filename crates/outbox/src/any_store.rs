//! [`AnyStore`]: one [`OutboxStore`] and [`OutboxAdmin`] over the databases this crate
//! was built with, chosen by the URL at run time, beside [`AnyPublisher`](crate::AnyPublisher)
//! for the brokers.
//!
//! | URL or connection string | Database | Feature |
//! |---|---|---|
//! | `postgres://…`, `postgresql://…` | PostgreSQL ([`PgOutbox`]) | `postgres` |
//! | `mysql://…`, `mariadb://…` | MySQL 8.0+ / MariaDB 10.6+ ([`MySqlOutbox`]) | `mysql` |
//! | `sqlserver://…`, `mssql://…`, `jdbc:sqlserver://…`, ADO.NET string | SQL Server ([`MssqlOutbox`]) | `sqlserver` |
//!
//! What forwards and what does not: the relay's side ([`OutboxStore`]: claims,
//! completions, dead letters, replay, purge) and the operator's side ([`OutboxAdmin`],
//! with [`migrate`](OutboxAdmin::migrate)) are the same calls on every database and are
//! forwarded as they are. Writing a message (`enqueue`) happens in the *caller's*
//! transaction, whose type is the driver's (`sqlx::Transaction<Postgres>`,
//! `MssqlTransaction`, …), and the inbox hands its handlers the driver's connection
//! ([`InboxStore::Connection`](outboxkit_core::InboxStore::Connection)): neither has one
//! type across databases, so a program that writes business rows takes the concrete
//! store ([`as_postgres`](AnyStore::as_postgres), [`as_mysql`](AnyStore::as_mysql),
//! [`as_sqlserver`](AnyStore::as_sqlserver)) and that store's inbox (`inbox()`), as with
//! a concrete store: connect, [`migrate`](AnyStore::migrate) (the outbox's and the
//! inbox's tables), then `inbox()`.
//!
//! [`PgOutbox`]: https://docs.rs/outboxkit-postgres
//! [`MySqlOutbox`]: https://docs.rs/outboxkit-mysql
//! [`MssqlOutbox`]: https://docs.rs/outboxkit-sqlserver

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outboxkit_core::env::{DATABASE_URL, Env};
use outboxkit_core::{
    BlockedKey, ClaimedBatch, CompleteReport, Completion, DatabaseKind, EnvError, ErrorKind,
    GroupStats, InboxDeadFilter, InboxDeadLetter, InboxReplayMode, InboxReplayReport, MessageCount,
    MessageCursor, MessageFilter, MessagePage, MessageState, OnDead, OutboxAdmin, OutboxError,
    OutboxMessage, OutboxStats, OutboxStore, ReconcileRow, RelayHeartbeat, RelaySeen, ReplayReport,
    SentPerMinute, VacuumPressure, WakeHandle,
};
#[cfg(feature = "mysql")]
use outboxkit_mysql::{MySqlConfig, MySqlOutbox};
#[cfg(feature = "postgres")]
use outboxkit_postgres::{PgConfig, PgOutbox};
#[cfg(feature = "sqlserver")]
use outboxkit_sqlserver::{MssqlConfig, MssqlOutbox};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The configuration of an [`AnyStore`]: one store's own configuration.
///
/// Build it from a store's config and `.into()` when the program has settings of its
/// own (pool size, retention), with [`from_url`](Self::from_url) when a URL is all
/// there is, or with [`from_env`](Self::from_env) from the `outbox` binary's variables.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStoreConfig {
    /// PostgreSQL (feature `postgres`).
    #[cfg(feature = "postgres")]
    Postgres(PgConfig),
    /// MySQL / MariaDB (feature `mysql`).
    #[cfg(feature = "mysql")]
    MySql(MySqlConfig),
    /// SQL Server (feature `sqlserver`).
    #[cfg(feature = "sqlserver")]
    SqlServer(MssqlConfig),
}

impl AnyStoreConfig {
    /// The store's default configuration for `url`, picked by
    /// [`DatabaseKind::of_url`] (the table on [`DatabaseKind`]): schema `outbox`,
    /// the store's pool and retention defaults.
    ///
    /// # Errors
    /// [`AnyStoreError::UnsupportedUrl`] for a URL that names no database,
    /// [`AnyStoreError::BackendDisabled`] when the database's feature is off, and
    /// [`AnyStoreError::Store`] ([`OutboxError::Config`]) when the store refuses the URL.
    pub fn from_url(url: &str) -> Result<Self, AnyStoreError> {
        match require(url)? {
            #[cfg(feature = "postgres")]
            DatabaseKind::Postgres => {
                let config = PgConfig::new(url.trim());
                config.validate()?;
                Ok(Self::Postgres(config))
            }
            #[cfg(feature = "mysql")]
            DatabaseKind::MySql => {
                let config = MySqlConfig::new(url.trim());
                config.validate()?;
                Ok(Self::MySql(config))
            }
            #[cfg(feature = "sqlserver")]
            DatabaseKind::SqlServer => Ok(Self::SqlServer(url.parse()?)),
            #[allow(unreachable_patterns, reason = "`require` refused the others")]
            other => Err(disabled(url, other)),
        }
    }

    /// The store's configuration from the environment: `DATABASE_URL` picks the
    /// database, whose config's `from_env` then reads the rest (`OUTBOX_SCHEMA`,
    /// `OUTBOX_SENT_RETENTION`, `OUTBOX_CRASH_LOOP_LIMIT`, `OUTBOX_MAX_PAYLOAD_BYTES`;
    /// the table: [`outboxkit_core::env`]).
    ///
    /// # Errors
    /// [`AnyStoreError::Store`] with [`OutboxError::Env`] naming the variable (unset
    /// `DATABASE_URL`, a bad value), [`AnyStoreError::UnsupportedUrl`] /
    /// [`AnyStoreError::BackendDisabled`] as for [`from_url`](Self::from_url).
    pub fn from_env() -> Result<Self, AnyStoreError> {
        let url = Env::process()
            .get(DATABASE_URL)
            .ok_or(OutboxError::Env(EnvError::Missing { var: DATABASE_URL }))?;
        match require(&url)? {
            #[cfg(feature = "postgres")]
            DatabaseKind::Postgres => Ok(Self::Postgres(PgConfig::from_env()?)),
            #[cfg(feature = "mysql")]
            DatabaseKind::MySql => Ok(Self::MySql(MySqlConfig::from_env()?)),
            #[cfg(feature = "sqlserver")]
            DatabaseKind::SqlServer => Ok(Self::SqlServer(MssqlConfig::from_env()?)),
            #[allow(unreachable_patterns, reason = "`require` refused the others")]
            other => Err(disabled(&url, other)),
        }
    }

    /// The same configuration with the tables in `schema` (MySQL: that database); see
    /// each store's `with_schema`.
    #[must_use]
    pub fn with_schema(self, schema: impl Into<String>) -> Self {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(c) => Self::Postgres(c.with_schema(schema)),
            #[cfg(feature = "mysql")]
            Self::MySql(c) => Self::MySql(c.with_schema(schema)),
            #[cfg(feature = "sqlserver")]
            Self::SqlServer(c) => Self::SqlServer(c.with_schema(schema)),
        }
    }

    /// The database this configuration is for.
    pub fn kind(&self) -> DatabaseKind {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => DatabaseKind::Postgres,
            #[cfg(feature = "mysql")]
            Self::MySql(_) => DatabaseKind::MySql,
            #[cfg(feature = "sqlserver")]
            Self::SqlServer(_) => DatabaseKind::SqlServer,
        }
    }

    /// The schema of the tables.
    pub fn schema(&self) -> &str {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(c) => c.schema(),
            #[cfg(feature = "mysql")]
            Self::MySql(c) => c.schema(),
            #[cfg(feature = "sqlserver")]
            Self::SqlServer(c) => c.schema(),
        }
    }
}

/// The databases this build has.
const COMPILED: &[DatabaseKind] = &[
    #[cfg(feature = "postgres")]
    DatabaseKind::Postgres,
    #[cfg(feature = "mysql")]
    DatabaseKind::MySql,
    #[cfg(feature = "sqlserver")]
    DatabaseKind::SqlServer,
];

/// The kind of `url`, required to be compiled in.
fn require(url: &str) -> Result<DatabaseKind, AnyStoreError> {
    let kind = DatabaseKind::of_url(url).ok_or_else(|| AnyStoreError::UnsupportedUrl {
        url_redacted: outboxkit_core::database::redact_database_url(url),
    })?;
    if COMPILED.contains(&kind) {
        Ok(kind)
    } else {
        Err(disabled(url, kind))
    }
}

fn disabled(url: &str, kind: DatabaseKind) -> AnyStoreError {
    AnyStoreError::BackendDisabled {
        url_redacted: outboxkit_core::database::redact_database_url(url),
        database: kind,
        feature: kind.feature(),
    }
}

#[cfg(feature = "postgres")]
impl From<PgConfig> for AnyStoreConfig {
    fn from(config: PgConfig) -> Self {
        Self::Postgres(config)
    }
}

#[cfg(feature = "mysql")]
impl From<MySqlConfig> for AnyStoreConfig {
    fn from(config: MySqlConfig) -> Self {
        Self::MySql(config)
    }
}

#[cfg(feature = "sqlserver")]
impl From<MssqlConfig> for AnyStoreConfig {
    fn from(config: MssqlConfig) -> Self {
        Self::SqlServer(config)
    }
}

/// The URL forms and features of every database, for [`AnyStoreError::UnsupportedUrl`].
fn accepted() -> String {
    DatabaseKind::ALL
        .iter()
        .map(|k| format!("{} (feature `{}`): {}", k.name(), k.feature(), k.forms()))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why an [`AnyStore`] or its [`AnyStoreConfig`] could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnyStoreError {
    /// The store refused the configuration or, for [`AnyStore::connect`], the
    /// connection (see [`OutboxError::kind`]); an environment variable is named by
    /// [`OutboxError::Env`].
    #[error(transparent)]
    Store(#[from] OutboxError),
    /// The URL names no database this toolkit knows.
    #[error(
        "database URL {url_redacted:?} names no known database; accepted: {}",
        accepted()
    )]
    UnsupportedUrl {
        /// The URL, password hidden.
        url_redacted: String,
    },
    /// The URL names a database whose feature of the `outboxkit` crate is off.
    #[error(
        "database URL {url_redacted:?} is {database}'s: the `outboxkit` crate was built without its `{feature}` feature"
    )]
    BackendDisabled {
        /// The URL, password hidden.
        url_redacted: String,
        /// The database it names.
        database: DatabaseKind,
        /// The feature to enable: `"postgres"`, `"mysql"` or `"sqlserver"`.
        feature: &'static str,
    },
}

impl AnyStoreError {
    /// What the caller can do about it: the store's own kind for
    /// [`Store`](Self::Store) (an unreachable server is [`ErrorKind::Unavailable`]),
    /// [`ErrorKind::Permanent`] for the others.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Store(e) => e.kind(),
            Self::UnsupportedUrl { .. } | Self::BackendDisabled { .. } => ErrorKind::Permanent,
        }
    }
}

/// One outbox store over the enabled databases; an [`OutboxStore`] and an
/// [`OutboxAdmin`] by delegation, so the [`Dispatcher`](outboxkit_core::Dispatcher) and
/// admin code take it like any other. Each variant keeps its store's guarantees (claim
/// protocol, fencing, database clock): every call is the store's own.
///
/// ```no_run
/// use outboxkit::{AnyStore, AnyStoreConfig, OutboxAdmin, OutboxStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// // DATABASE_URL=postgres://… or mysql://… or mssql://…, OUTBOX_SCHEMA, …
/// let store = AnyStore::connect(AnyStoreConfig::from_env()?).await?;
/// store.migrate().await?;
/// println!("{} {}: {:?}", store.backend(), store.schema(), store.stats().await?);
/// # Ok(())
/// # }
/// ```
///
/// `#[non_exhaustive]`: match with a wildcard arm, or use
/// [`as_postgres`](Self::as_postgres) / [`as_mysql`](Self::as_mysql) /
/// [`as_sqlserver`](Self::as_sqlserver).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyStore {
    /// PostgreSQL (feature `postgres`).
    #[cfg(feature = "postgres")]
    Postgres(PgOutbox),
    /// MySQL / MariaDB (feature `mysql`).
    #[cfg(feature = "mysql")]
    MySql(MySqlOutbox),
    /// SQL Server (feature `sqlserver`).
    #[cfg(feature = "sqlserver")]
    SqlServer(MssqlOutbox),
}

/// `$body` with `$s` bound to the store inside `$self`, for every enabled variant.
macro_rules! forward {
    ($self:expr, $s:ident => $body:expr) => {
        match $self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres($s) => $body,
            #[cfg(feature = "mysql")]
            AnyStore::MySql($s) => $body,
            #[cfg(feature = "sqlserver")]
            AnyStore::SqlServer($s) => $body,
        }
    };
}

impl AnyStore {
    /// Opens the store's connection pool (eagerly: a wrong URL, a down server or bad
    /// credentials fail here). The tables are not touched: call
    /// [`migrate`](OutboxAdmin::migrate) to create or upgrade them.
    ///
    /// # Errors
    /// [`AnyStoreError::Store`] with the store's error ([`OutboxError::Config`] for a
    /// bad schema, [`OutboxError::Database`] when the server cannot be reached).
    pub async fn connect(config: impl Into<AnyStoreConfig>) -> Result<Self, AnyStoreError> {
        Ok(match config.into() {
            #[cfg(feature = "postgres")]
            AnyStoreConfig::Postgres(c) => Self::Postgres(PgOutbox::connect(&c).await?),
            #[cfg(feature = "mysql")]
            AnyStoreConfig::MySql(c) => Self::MySql(MySqlOutbox::connect(&c).await?),
            #[cfg(feature = "sqlserver")]
            AnyStoreConfig::SqlServer(c) => Self::SqlServer(MssqlOutbox::connect(&c).await?),
        })
    }

    /// Creates or upgrades the tables (the outbox's and the inbox's) in the configured
    /// schema; returns the versions applied. The store's own `migrate`, also reachable
    /// as [`OutboxAdmin::migrate`].
    ///
    /// # Errors
    /// As the store's `migrate`: [`OutboxError::Config`] when the database has a newer
    /// version than this build knows, [`OutboxError::Database`] when a statement fails.
    pub async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        forward!(self, s => s.migrate().await)
    }

    /// The database this store talks to.
    pub fn kind(&self) -> DatabaseKind {
        match self {
            #[cfg(feature = "postgres")]
            Self::Postgres(_) => DatabaseKind::Postgres,
            #[cfg(feature = "mysql")]
            Self::MySql(_) => DatabaseKind::MySql,
            #[cfg(feature = "sqlserver")]
            Self::SqlServer(_) => DatabaseKind::SqlServer,
        }
    }

    /// The PostgreSQL store, if this is one (to `enqueue` in a transaction of its pool,
    /// or for its inbox: `store.as_postgres().map(PgOutbox::inbox)`).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn as_postgres(&self) -> Option<&PgOutbox> {
        match self {
            Self::Postgres(s) => Some(s),
            #[allow(
                unreachable_patterns,
                reason = "reachable with another database enabled"
            )]
            _ => None,
        }
    }

    /// The MySQL / MariaDB store, if this is one.
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub fn as_mysql(&self) -> Option<&MySqlOutbox> {
        match self {
            Self::MySql(s) => Some(s),
            #[allow(
                unreachable_patterns,
                reason = "reachable with another database enabled"
            )]
            _ => None,
        }
    }

    /// The SQL Server store, if this is one.
    #[cfg(feature = "sqlserver")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlserver")))]
    pub fn as_sqlserver(&self) -> Option<&MssqlOutbox> {
        match self {
            Self::SqlServer(s) => Some(s),
            #[allow(
                unreachable_patterns,
                reason = "reachable with another database enabled"
            )]
            _ => None,
        }
    }
}

#[cfg(feature = "postgres")]
impl From<PgOutbox> for AnyStore {
    fn from(store: PgOutbox) -> Self {
        Self::Postgres(store)
    }
}

#[cfg(feature = "mysql")]
impl From<MySqlOutbox> for AnyStore {
    fn from(store: MySqlOutbox) -> Self {
        Self::MySql(store)
    }
}

#[cfg(feature = "sqlserver")]
impl From<MssqlOutbox> for AnyStore {
    fn from(store: MssqlOutbox) -> Self {
        Self::SqlServer(store)
    }
}

#[async_trait]
impl OutboxStore for AnyStore {
    async fn claim(&self, batch_size: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError> {
        forward!(self, s => OutboxStore::claim(s, batch_size, lease).await)
    }

    async fn claim_ordered(
        &self,
        batch_size: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        forward!(self, s => s.claim_ordered(batch_size, lease, on_dead).await)
    }

    async fn claim_held(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        forward!(self, s => s.claim_held(destinations, lease, order).await)
    }

    async fn release_held(&self, destination: &str, limit: usize) -> Result<u64, OutboxError> {
        forward!(self, s => s.release_held(destination, limit).await)
    }

    async fn held_destinations(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>, OutboxError> {
        forward!(self, s => s.held_destinations(after, limit).await)
    }

    async fn blocked_keys(&self, limit: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        forward!(self, s => s.blocked_keys(limit).await)
    }

    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        forward!(self, s => OutboxStore::complete(s, completions).await)
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        forward!(self, s => OutboxStore::get(s, id).await)
    }

    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        forward!(self, s => OutboxStore::stats(s).await)
    }

    async fn dead_letters(
        &self,
        filter: &MessageFilter,
        limit: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        forward!(self, s => OutboxStore::dead_letters(s, filter, limit).await)
    }

    async fn replay(
        &self,
        filter: &MessageFilter,
        dry_run: bool,
    ) -> Result<ReplayReport, OutboxError> {
        forward!(self, s => OutboxStore::replay(s, filter, dry_run).await)
    }

    async fn purge_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        forward!(self, s => OutboxStore::purge_sent(s, older_than, batch_size).await)
    }

    fn spawn_wake_source(
        &self,
        wake: WakeHandle,
        shutdown: CancellationToken,
    ) -> Option<JoinHandle<()>> {
        // The store's own (PostgreSQL: its LISTEN); the trait's default would leave a
        // relay over `AnyStore` polling.
        forward!(self, s => s.spawn_wake_source(wake, shutdown))
    }
}

#[async_trait]
impl OutboxAdmin for AnyStore {
    fn backend(&self) -> &'static str {
        forward!(self, s => OutboxAdmin::backend(s))
    }

    fn schema(&self) -> &str {
        forward!(self, s => OutboxAdmin::schema(s))
    }

    async fn migrate(&self) -> Result<Vec<i32>, OutboxError> {
        forward!(self, s => OutboxAdmin::migrate(s).await)
    }

    async fn stats_by_group(&self) -> Result<Vec<GroupStats>, OutboxError> {
        forward!(self, s => s.stats_by_group().await)
    }

    async fn pending_stats(&self) -> Result<OutboxStats, OutboxError> {
        forward!(self, s => s.pending_stats().await)
    }

    async fn oldest_claimable_wait(
        &self,
        ordered: Option<OnDead>,
    ) -> Result<Option<Duration>, OutboxError> {
        forward!(self, s => s.oldest_claimable_wait(ordered).await)
    }

    async fn reconcile(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        consumers: &[String],
    ) -> Result<Vec<ReconcileRow>, OutboxError> {
        forward!(self, s => s.reconcile(from, to, consumers).await)
    }

    async fn archive_sent(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        forward!(self, s => s.archive_sent(older_than, batch_size).await)
    }

    async fn purge_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        forward!(self, s => s.purge_inbox_records(older_than, batch_size).await)
    }

    async fn purge_inbox_processed(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        forward!(self, s => s.purge_inbox_processed(older_than, batch_size).await)
    }

    async fn archive_inbox_records(
        &self,
        older_than: Duration,
        batch_size: usize,
    ) -> Result<u64, OutboxError> {
        forward!(self, s => s.archive_inbox_records(older_than, batch_size).await)
    }

    async fn inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        limit: usize,
    ) -> Result<Vec<InboxDeadLetter>, OutboxError> {
        forward!(self, s => s.inbox_dead_letters(filter, limit).await)
    }

    async fn replay_inbox_dead_letters(
        &self,
        filter: &InboxDeadFilter,
        mode: InboxReplayMode,
    ) -> Result<InboxReplayReport, OutboxError> {
        forward!(self, s => s.replay_inbox_dead_letters(filter, mode).await)
    }

    async fn list_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        after: Option<MessageCursor>,
        limit: usize,
        scan: u64,
    ) -> Result<MessagePage, OutboxError> {
        forward!(self, s => s.list_messages(state, filter, after, limit, scan).await)
    }

    async fn count_messages(
        &self,
        state: MessageState,
        filter: &MessageFilter,
        bound: u64,
        scan: u64,
    ) -> Result<MessageCount, OutboxError> {
        forward!(self, s => s.count_messages(state, filter, bound, scan).await)
    }

    async fn sent_per_minute(&self, minutes: u32) -> Result<SentPerMinute, OutboxError> {
        forward!(self, s => s.sent_per_minute(minutes).await)
    }

    async fn vacuum_pressure(&self) -> Result<Option<VacuumPressure>, OutboxError> {
        forward!(self, s => s.vacuum_pressure().await)
    }

    async fn record_heartbeat(&self, beat: &RelayHeartbeat) -> Result<(), OutboxError> {
        forward!(self, s => s.record_heartbeat(beat).await)
    }

    async fn relays_seen(
        &self,
        within: Duration,
        limit: usize,
    ) -> Result<Vec<RelaySeen>, OutboxError> {
        forward!(self, s => s.relays_seen(within, limit).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_pick_the_store_and_bad_ones_name_schemes_and_features() {
        #[cfg(feature = "postgres")]
        assert_eq!(
            AnyStoreConfig::from_url("postgres://app:s3cret@db/app")
                .map(|c| c.kind())
                .ok(),
            Some(DatabaseKind::Postgres)
        );
        #[cfg(feature = "mysql")]
        assert_eq!(
            AnyStoreConfig::from_url("mariadb://app:s3cret@db/app")
                .map(|c| c.kind())
                .ok(),
            Some(DatabaseKind::MySql)
        );
        #[cfg(feature = "sqlserver")]
        assert_eq!(
            AnyStoreConfig::from_url("mssql://sa:s3cret@db/app")
                .map(|c| c.kind())
                .ok(),
            Some(DatabaseKind::SqlServer)
        );
        let err = AnyStoreConfig::from_url("oracle://app:s3cret@db/app").expect_err("oracle");
        let text = err.to_string();
        assert!(
            matches!(err, AnyStoreError::UnsupportedUrl { .. }),
            "{text}"
        );
        for needle in [
            "postgres://",
            "mysql://",
            "mssql://",
            "`postgres`",
            "`mysql`",
            "`sqlserver`",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        assert!(!text.contains("s3cret"), "{text}");
        assert_eq!(err.kind(), ErrorKind::Permanent);
        #[cfg(not(feature = "sqlserver"))]
        assert!(matches!(
            AnyStoreConfig::from_url("mssql://sa:s3cret@db/app"),
            Err(AnyStoreError::BackendDisabled {
                feature: "sqlserver",
                ..
            })
        ));
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn a_malformed_url_is_the_stores_config_error() {
        let err = AnyStoreConfig::from_url("postgres://app:s3cret@db:port/app").expect_err("port");
        assert!(
            matches!(err, AnyStoreError::Store(OutboxError::Config(_))),
            "{err}"
        );
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
