//! The run's database (`--database`): PostgreSQL, or MariaDB / MySQL through
//! `outboxkit-mysql`. One [`Db`] pool type and one [`Outbox`] store type for the harness,
//! and a [`Database`] that writes the few things its SQL says differently (bind
//! placeholders, the clock, seconds since the epoch); every query of the harness, the
//! verdict and the consumers is written once, in SQL both servers read.
//!
//! What differs for real is elsewhere, each next to its PostgreSQL counterpart: the
//! run's tables and logins (`setup`), the poison rows' spoiling assignments
//! (`producers`), the database faults (`injector`: MariaDB restarted by its PID,
//! connections ended with `KILL CONNECTION`, the consumers' account held at
//! `MAX_USER_CONNECTIONS -1`), and what a handler's swallowed error does to its
//! transaction (`verdict::consumer_side`: InnoDB undoes the failed statement alone).

use std::sync::OnceLock;

use outboxkit_mysql::{MySqlConfig, MySqlOutbox};
use outboxkit_postgres::{PgConfig, PgOutbox};
use sqlx::mysql::MySqlRow;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, MySqlPool, PgPool};
use uuid::Uuid;

use crate::common;

/// The database a chaos run runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Database {
    /// PostgreSQL (`DATABASE_URL`).
    #[default]
    Postgres,
    /// MariaDB or MySQL (`MYSQL_URL`).
    Mysql,
}

impl Database {
    /// The value of `--database`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Mysql => "mysql",
        }
    }

    /// The server, as the output names it.
    pub(crate) fn server(self) -> &'static str {
        match self {
            Self::Postgres => "PostgreSQL",
            Self::Mysql => "MariaDB",
        }
    }

    /// The harness's URL (a superuser's): `DATABASE_URL` or `MYSQL_URL`.
    pub(crate) fn url(self) -> String {
        match self {
            Self::Postgres => common::database_url(),
            Self::Mysql => common::mysql_url(),
        }
    }

    /// The server's TCP port, as the harness checks it answers.
    pub(crate) fn port(self) -> u16 {
        match self {
            Self::Postgres => 5432,
            Self::Mysql => outboxkit_testkit::faults::MYSQL_PORT,
        }
    }

    /// The `n`th bind placeholder (from 1).
    pub(crate) fn arg(self, n: usize) -> String {
        match self {
            Self::Postgres => format!("${n}"),
            Self::Mysql => "?".to_owned(),
        }
    }

    /// `rows` rows of `columns` placeholders each, for `INSERT … VALUES`.
    pub(crate) fn rows(self, rows: usize, columns: usize) -> String {
        (0..rows)
            .map(|r| {
                let row: Vec<String> = (1..=columns).map(|c| self.arg(r * columns + c)).collect();
                format!("({})", row.join(", "))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The database clock, as close to the moment of the statement as it gets.
    pub(crate) fn now(self) -> &'static str {
        match self {
            Self::Postgres => "clock_timestamp()",
            Self::Mysql => "NOW(6)",
        }
    }

    /// Seconds since the epoch of the timestamp expression `expr`, a double (MySQL's
    /// sessions here are in UTC: `outboxkit_mysql::parse_url`).
    pub(crate) fn epoch(self, expr: &str) -> String {
        match self {
            Self::Postgres => format!("extract(epoch FROM {expr})::float8"),
            Self::Mysql => format!("CAST(UNIX_TIMESTAMP({expr}) AS DOUBLE)"),
        }
    }
}

/// The run's database for this process (set once by the harness and the consumer
/// processes; PostgreSQL until then): the fault labels name its server.
static DATABASE: OnceLock<Database> = OnceLock::new();

/// Makes [`database`] return `database` for the rest of this process.
pub(crate) fn use_database(database: Database) {
    let _ = DATABASE.set(database);
}

/// The database [`use_database`] set, else PostgreSQL.
pub(crate) fn database() -> Database {
    DATABASE.get().copied().unwrap_or_default()
}

/// A value bound to a placeholder.
#[derive(Debug, Clone)]
pub(crate) enum Arg {
    Uuid(Uuid),
    Text(String),
    Bool(bool),
    Int(i64),
}

/// `sqlx::query(sql)` (or `query_as`, `query_scalar`: the first token) with `args`
/// bound, for the database of the executor it runs on.
macro_rules! bound {
    ($query:ident, $sql:expr, $args:expr) => {{
        let mut q = sqlx::$query(sqlx::AssertSqlSafe($sql));
        for a in $args {
            q = match a {
                $crate::chaos::db::Arg::Uuid(v) => q.bind(v),
                $crate::chaos::db::Arg::Text(v) => q.bind(v),
                $crate::chaos::db::Arg::Bool(v) => q.bind(v),
                $crate::chaos::db::Arg::Int(v) => q.bind(v),
            };
        }
        q
    }};
}
pub(crate) use bound;

/// A pool of either database.
#[derive(Debug, Clone)]
pub(crate) enum Db {
    Pg(PgPool),
    My(MySqlPool),
}

/// Runs `$body` with `$pool` bound to the pool of either variant of `$db`.
macro_rules! on_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            Db::Pg($pool) => $body,
            Db::My($pool) => $body,
        }
    };
}

/// A row type both databases decode.
pub(crate) trait Row:
    for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, MySqlRow> + Send + Unpin
{
}
impl<T: for<'r> FromRow<'r, PgRow> + for<'r> FromRow<'r, MySqlRow> + Send + Unpin> Row for T {}

impl Db {
    /// The harness's own pool (`max` connections, 10 s acquire timeout) on `database`'s
    /// URL; on PostgreSQL with `application_name` = `app`.
    pub(crate) async fn connect(database: Database, app: &str, max: u32) -> anyhow::Result<Self> {
        let timeout = std::time::Duration::from_secs(10);
        Ok(match database {
            Database::Postgres => Self::Pg(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(max)
                    .acquire_timeout(timeout)
                    .connect_with(super::topology::pg_options(app)?)
                    .await?,
            ),
            Database::Mysql => Self::My(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(max)
                    .acquire_timeout(timeout)
                    .connect_with(outboxkit_mysql::parse_url(&common::mysql_url())?)
                    .await?,
            ),
        })
    }

    pub(crate) fn database(&self) -> Database {
        match self {
            Self::Pg(_) => Database::Postgres,
            Self::My(_) => Database::Mysql,
        }
    }

    /// Runs one statement; returns the rows it affected.
    pub(crate) async fn execute(&self, sql: String, args: Vec<Arg>) -> anyhow::Result<u64> {
        Ok(on_pool!(self, pool => bound!(query, sql, args)
            .execute(pool)
            .await?
            .rows_affected()))
    }

    /// Runs statements one after the other (no transaction: DDL, setup).
    pub(crate) async fn execute_all(&self, statements: &[String]) -> anyhow::Result<()> {
        for sql in statements {
            self.execute(sql.clone(), Vec::new()).await?;
        }
        Ok(())
    }

    pub(crate) async fn fetch_all<T: Row>(
        &self,
        sql: String,
        args: Vec<Arg>,
    ) -> anyhow::Result<Vec<T>> {
        Ok(on_pool!(self, pool => bound!(query_as, sql, args).fetch_all(pool).await?))
    }

    pub(crate) async fn fetch_one<T: Row>(&self, sql: String, args: Vec<Arg>) -> anyhow::Result<T> {
        Ok(on_pool!(self, pool => bound!(query_as, sql, args).fetch_one(pool).await?))
    }

    /// The one column `sql` selects, row by row.
    pub(crate) async fn column<T>(&self, sql: String) -> anyhow::Result<Vec<T>>
    where
        (T,): Row,
    {
        Ok(self
            .fetch_all::<(T,)>(sql, Vec::new())
            .await?
            .into_iter()
            .map(|(v,)| v)
            .collect())
    }

    /// The one `BIGINT` (a count) `sql` selects.
    pub(crate) async fn count(&self, sql: String) -> anyhow::Result<i64> {
        Ok(self.fetch_one::<(i64,)>(sql, Vec::new()).await?.0)
    }

    pub(crate) async fn close(&self) {
        on_pool!(self, pool => pool.close().await);
    }
}

/// Ends every MariaDB connection of `users` with `KILL CONNECTION` (the session's
/// statement is interrupted, its transaction rolled back, the client sees error 1927 or
/// a closed socket: as in a failover); returns how many it ended. A connection gone
/// meanwhile is not counted.
pub(crate) async fn kill_connections(admin: &Db, users: &[&str]) -> anyhow::Result<u64> {
    let list: Vec<String> = users.iter().map(|u| format!("'{u}'")).collect();
    let ids: Vec<(i64,)> = admin
        .fetch_all(
            format!(
                "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST
                  WHERE USER IN ({}) AND ID <> CONNECTION_ID()",
                list.join(", ")
            ),
            Vec::new(),
        )
        .await?;
    let mut killed = 0;
    for (id,) in ids {
        // 1094 "Unknown thread id": it ended by itself meanwhile.
        if admin
            .execute(format!("KILL CONNECTION {id}"), Vec::new())
            .await
            .is_ok()
        {
            killed += 1;
        }
    }
    Ok(killed)
}

/// The producers' outbox store on either database.
#[derive(Debug, Clone)]
pub(crate) enum Outbox {
    Pg(PgOutbox),
    My(MySqlOutbox),
}

/// Runs `$body` with `$store` bound to the store of either variant of `$outbox` (both
/// stores have the same `begin`, `enqueue`, `migrate` and `pool`).
macro_rules! on_outbox {
    ($outbox:expr, $store:ident => $body:expr) => {
        match $outbox {
            $crate::chaos::db::Outbox::Pg($store) => $body,
            $crate::chaos::db::Outbox::My($store) => $body,
        }
    };
}
pub(crate) use on_outbox;

impl Outbox {
    /// The store of the run's `schema`, as the harness (`max` connections).
    pub(crate) async fn connect(
        database: Database,
        schema: &str,
        max: u32,
    ) -> anyhow::Result<Self> {
        Ok(match database {
            Database::Postgres => Self::Pg(
                PgOutbox::connect(
                    &PgConfig::new(super::topology::database_url_as(
                        super::topology::HARNESS_APP,
                    ))
                    .with_schema(schema)
                    .with_max_connections(max),
                )
                .await?,
            ),
            Database::Mysql => Self::My(
                MySqlOutbox::connect(
                    &MySqlConfig::new(common::mysql_url())
                        .with_schema(schema)
                        .with_max_connections(max),
                )
                .await?,
            ),
        })
    }

    pub(crate) async fn migrate(&self) -> anyhow::Result<()> {
        on_outbox!(self, store => { store.migrate().await?; });
        Ok(())
    }

    pub(crate) fn database(&self) -> Database {
        match self {
            Self::Pg(_) => Database::Postgres,
            Self::My(_) => Database::Mysql,
        }
    }

    /// The store's pool.
    pub(crate) fn pool(&self) -> Db {
        match self {
            Self::Pg(store) => Db::Pg(store.pool().clone()),
            Self::My(store) => Db::My(store.pool().clone()),
        }
    }
}

/// `url` (`scheme://[user[:password]@]host[:port][/database][?query]`) with the user
/// `user` (the password kept) and, when given, the database `database`.
pub(crate) fn url_with_user(url: &str, user: &str, database: Option<&str>) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (userinfo, rest) = match rest.split_once('@') {
        Some((userinfo, rest)) if !userinfo.contains('/') => (Some(userinfo), rest),
        _ => (None, rest),
    };
    let password = userinfo
        .and_then(|u| u.split_once(':'))
        .map(|(_, p)| format!(":{p}"))
        .unwrap_or_default();
    let (location, query) = match rest.split_once('?') {
        Some((location, query)) => (location, format!("?{query}")),
        None => (rest, String::new()),
    };
    let host = location.split('/').next().unwrap_or(location);
    let path = match database {
        Some(db) => format!("/{db}"),
        None => location[host.len()..].to_owned(),
    };
    format!("{scheme}://{user}{password}@{host}{path}{query}")
}

#[cfg(test)]
mod tests {
    use super::{Database, url_with_user};

    #[test]
    fn placeholders_and_rows() {
        assert_eq!(Database::Postgres.rows(2, 2), "($1, $2), ($3, $4)");
        assert_eq!(Database::Mysql.rows(2, 2), "(?, ?), (?, ?)");
    }

    #[test]
    fn urls_get_another_user_and_database() {
        assert_eq!(
            url_with_user("mysql://root@127.0.0.1:3306/test", "r", Some("chaos")),
            "mysql://r@127.0.0.1:3306/chaos"
        );
        assert_eq!(
            url_with_user(
                "mariadb://root:p%40ss@db/test?ssl-mode=disabled",
                "c",
                Some("x")
            ),
            "mariadb://c:p%40ss@db/x?ssl-mode=disabled"
        );
        assert_eq!(
            url_with_user("mysql://127.0.0.1:3306", "u", None),
            "mysql://u@127.0.0.1:3306"
        );
    }
}
