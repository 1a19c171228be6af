//! Which database a URL names, and the admin capability
//! ([`outboxkit_core::OutboxAdmin`]) of each backend compiled in.
//!
//! | URL or connection string | Backend | Cargo feature |
//! |---|---|---|
//! | `postgres://…`, `postgresql://…` | PostgreSQL (`outboxkit-postgres`) | `postgres` |
//! | `sqlserver://…`, `mssql://…`, `jdbc:sqlserver://…` | SQL Server (`outboxkit-sqlserver`) | `sqlserver` |
//! | ADO.NET string (`server=tcp:HOST,PORT;user=…;password=…`) | SQL Server | `sqlserver` |
//! | `mysql://…`, `mariadb://…` | MySQL 8.0+ / MariaDB 10.6+ (`outboxkit-mysql`) | `mysql` |
//!
//! The kind is decided by [`outboxkit_core::DatabaseKind::of_url`], as in every store's
//! `from_env` and the facade's `AnyStore`. `sqlserver://` and `mssql://` take either the
//! JDBC tail (`sqlserver://HOST:PORT;user=sa;password=…;database=app`) or a URL
//! (`mssql://USER:PASSWORD@HOST:PORT/DATABASE?TrustServerCertificate=true`,
//! percent-encoded): `outboxkit-sqlserver` parses them (`MssqlConfig`'s `FromStr`).

use outboxkit_core::OutboxAdmin;

use crate::config::DbSettings;
use crate::error::CliError;

/// A database backend of the `outbox` binary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseKind {
    /// PostgreSQL 13+.
    Postgres,
    /// SQL Server 2016+ (or Azure SQL).
    SqlServer,
    /// MySQL 8.0+ or MariaDB 10.6+.
    MySql,
}

impl DatabaseKind {
    /// The backend `url` names, by its scheme or (ADO.NET) its `server=` key; whether
    /// it is compiled in is checked by [`require`](Self::require).
    ///
    /// # Errors
    /// [`CliError::Invalid`] (`database_url`) when neither form is recognised.
    pub fn of_url(url: &str) -> Result<Self, CliError> {
        match outboxkit_core::DatabaseKind::of_url(url) {
            Some(outboxkit_core::DatabaseKind::Postgres) => Ok(Self::Postgres),
            Some(outboxkit_core::DatabaseKind::MySql) => Ok(Self::MySql),
            Some(outboxkit_core::DatabaseKind::SqlServer) => Ok(Self::SqlServer),
            // `DatabaseKind` is non-exhaustive: a kind this binary does not know yet.
            _ => Err(CliError::Invalid {
                field: "database_url",
                reason: "expected a PostgreSQL URL (postgres://…), a MySQL or MariaDB URL \
                         (mysql://…, mariadb://…), a SQL Server URL \
                         (sqlserver://…, mssql://…, jdbc:sqlserver://…) or an ADO.NET \
                         connection string (server=tcp:HOST,PORT;user=…;password=…)"
                    .into(),
            }),
        }
    }

    /// The backend's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Postgres => "PostgreSQL",
            Self::SqlServer => "SQL Server",
            Self::MySql => "MySQL",
        }
    }

    /// The cargo feature of `outboxkit-cli` that compiles the backend in.
    pub fn feature(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::SqlServer => "sqlserver",
            Self::MySql => "mysql",
        }
    }

    /// Whether this binary was built with the backend.
    pub fn is_compiled(self) -> bool {
        match self {
            Self::Postgres => cfg!(feature = "postgres"),
            Self::SqlServer => cfg!(feature = "sqlserver"),
            Self::MySql => cfg!(feature = "mysql"),
        }
    }

    /// `Ok(self)` when compiled in.
    ///
    /// # Errors
    /// [`CliError::FeatureMissing`] naming the feature otherwise.
    pub fn require(self) -> Result<Self, CliError> {
        if self.is_compiled() {
            Ok(self)
        } else {
            Err(self.missing())
        }
    }

    /// The [`CliError::FeatureMissing`] that names this backend's feature.
    pub fn missing(self) -> CliError {
        CliError::FeatureMissing {
            backend: self.name(),
            feature: self.feature(),
        }
    }
}

/// `url` with its password replaced by `***`, whichever backend it names.
pub(crate) fn redact_database_url(url: &str) -> String {
    outboxkit_core::database::redact_database_url(url)
}

/// Connects to the database of `db` (its URL picks the backend) in its schema, as the
/// admin capability every command uses (the relay builds its own store, with its
/// settings, from the same [`DbSettings`] configurations).
///
/// # Errors
/// [`CliError::FeatureMissing`] when the backend is compiled out,
/// [`CliError::Invalid`] for a malformed URL, [`CliError::Store`] when the database
/// cannot be reached.
pub async fn connect_admin(db: &DbSettings) -> Result<Box<dyn OutboxAdmin>, CliError> {
    match db.kind()?.require()? {
        #[cfg(feature = "postgres")]
        DatabaseKind::Postgres => Ok(Box::new(
            outboxkit_postgres::PgOutbox::connect(&db.pg_config()).await?,
        )),
        #[cfg(feature = "sqlserver")]
        DatabaseKind::SqlServer => Ok(Box::new(
            outboxkit_sqlserver::MssqlOutbox::connect(&db.mssql_config()?).await?,
        )),
        #[cfg(feature = "mysql")]
        DatabaseKind::MySql => Ok(Box::new(
            outboxkit_mysql::MySqlOutbox::connect(&db.mysql_config()).await?,
        )),
        #[allow(unreachable_patterns)] // reason: `require` failed for a compiled-out one
        other => Err(other.missing()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_their_backend() {
        for (url, kind) in [
            ("postgres://u@h/db", DatabaseKind::Postgres),
            ("postgresql://u:p@h:5432/db", DatabaseKind::Postgres),
            (
                "sqlserver://h:1433;user=sa;password=x",
                DatabaseKind::SqlServer,
            ),
            ("mssql://sa:x@h/app", DatabaseKind::SqlServer),
            ("jdbc:sqlserver://h:1433;user=sa", DatabaseKind::SqlServer),
            (
                "server=tcp:h,1433;user=sa;password=x",
                DatabaseKind::SqlServer,
            ),
            ("Data Source=h;User ID=sa", DatabaseKind::SqlServer),
            ("mysql://root@127.0.0.1:3306/test", DatabaseKind::MySql),
            ("MariaDB://u:p@h/db", DatabaseKind::MySql),
        ] {
            assert_eq!(DatabaseKind::of_url(url).ok(), Some(kind), "{url}");
        }
        for url in ["oracle://u@h/db", "h:5432", "", "user=sa;password=x"] {
            assert!(
                matches!(
                    DatabaseKind::of_url(url),
                    Err(CliError::Invalid {
                        field: "database_url",
                        ..
                    })
                ),
                "{url}"
            );
        }
    }

    #[test]
    fn redaction_covers_every_form() {
        for url in [
            "postgres://app:s3cret@db/app",
            "mssql://sa:s3cret@db/app",
            "mysql://app:s3cret@db:3306/app",
            "mariadb://app:s3cret@db/app",
            "sqlserver://db:1433;user=sa;password=s3cret",
            "server=tcp:db,1433;user=sa;Password=s3cret;database=app",
        ] {
            let shown = redact_database_url(url);
            assert!(!shown.contains("s3cret"), "{url} -> {shown}");
        }
    }

    #[test]
    fn a_compiled_out_backend_is_named() {
        for kind in [
            DatabaseKind::Postgres,
            DatabaseKind::SqlServer,
            DatabaseKind::MySql,
        ] {
            match kind.require() {
                Ok(k) => assert!(k.is_compiled()),
                Err(e) => {
                    let text = e.to_string();
                    assert!(text.contains(kind.feature()) && text.contains(kind.name()));
                    assert_eq!(e.exit_code(), 2);
                }
            }
        }
    }
}
