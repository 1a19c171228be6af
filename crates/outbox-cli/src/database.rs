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
//! `sqlserver://` and `mssql://` take either the JDBC tail
//! (`sqlserver://HOST:PORT;user=sa;password=…;database=app`) or a URL
//! (`mssql://USER:PASSWORD@HOST:PORT/DATABASE?TrustServerCertificate=true`, percent-encoded),
//! which becomes the ADO.NET string `server=tcp:HOST,PORT;user=USER;password=…;database=DATABASE`
//! plus its query pairs.

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
        let lower = url.trim().to_ascii_lowercase();
        if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
            return Ok(Self::Postgres);
        }
        if lower.starts_with("mysql://") || lower.starts_with("mariadb://") {
            return Ok(Self::MySql);
        }
        if ["sqlserver://", "mssql://", "jdbc:sqlserver://"]
            .iter()
            .any(|p| lower.starts_with(p))
        {
            return Ok(Self::SqlServer);
        }
        let squashed: String = lower.chars().filter(|c| !c.is_whitespace()).collect();
        if !lower.contains("://")
            && squashed
                .split(';')
                .any(|pair| pair.starts_with("server=") || pair.starts_with("datasource="))
        {
            return Ok(Self::SqlServer);
        }
        Err(CliError::Invalid {
            field: "database_url",
            reason: "expected a PostgreSQL URL (postgres://…), a MySQL or MariaDB URL \
                     (mysql://…, mariadb://…), a SQL Server URL \
                     (sqlserver://…, mssql://…, jdbc:sqlserver://…) or an ADO.NET \
                     connection string (server=tcp:HOST,PORT;user=…;password=…)"
                .into(),
        })
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

/// The connection string `outboxkit-sqlserver` parses (ADO.NET or JDBC) for a SQL Server
/// `url` in any of the accepted forms (see the module docs).
///
/// # Errors
/// [`CliError::Invalid`] for a `mssql://` / `sqlserver://` URL that does not parse.
pub fn sqlserver_connection_string(url: &str) -> Result<String, CliError> {
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
    let invalid = |reason: String| CliError::Invalid {
        field: "database_url",
        reason,
    };
    let parsed = url::Url::parse(&format!("mssql://{tail}"))
        .map_err(|e| invalid(format!("not a SQL Server URL: {e}")))?;
    let host = parsed
        .host_str()
        .ok_or_else(|| invalid("SQL Server URL names no host".into()))?;
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

/// `url` with its password replaced by `***`, whichever backend it names.
pub(crate) fn redact_database_url(url: &str) -> String {
    match DatabaseKind::of_url(url) {
        Ok(DatabaseKind::SqlServer) if !url.contains("://") || url.contains(';') => redact_ado(url),
        _ => outboxkit_core::error::redact_url(url, outboxkit_core::error::LoneUserInfo::UserName),
    }
}

/// Redacts `password=` / `pwd=` values of an ADO.NET or JDBC string.
fn redact_ado(text: &str) -> String {
    #[cfg(feature = "sqlserver")]
    {
        outboxkit_sqlserver::redact_connection_string(text)
    }
    #[cfg(not(feature = "sqlserver"))]
    {
        text.split(';')
            .map(|pair| {
                let key = pair
                    .split('=')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase();
                if key == "password" || key == "pwd" {
                    format!("{}=***", pair.split('=').next().unwrap_or(""))
                } else {
                    pair.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(";")
    }
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
    fn sqlserver_urls_become_connection_strings() -> Result<(), CliError> {
        assert_eq!(
            sqlserver_connection_string("sqlserver://db:1444;user=sa;password=pw")?,
            "jdbc:sqlserver://db:1444;user=sa;password=pw"
        );
        assert_eq!(
            sqlserver_connection_string(
                "mssql://sa:p%3Bw%40rd@db.example:1444/app?TrustServerCertificate=true"
            )?,
            "server=tcp:db.example,1444;user=sa;password={p;w@rd};database=app;\
             TrustServerCertificate=true"
        );
        assert_eq!(
            sqlserver_connection_string("mssql://sa:pw@db")?,
            "server=tcp:db,1433;user=sa;password=pw"
        );
        let ado = "server=tcp:h,1433;user=sa;password=x";
        assert_eq!(sqlserver_connection_string(ado)?, ado);
        Ok(())
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
