//! [`DatabaseKind`]: which database a URL or connection string names, decided the same
//! way by every store's `from_env`, the facade's `AnyStore` and the `outbox` binary.

use std::fmt;

/// A database of the SQL backends, as named by its URL.
///
/// | URL or connection string | Kind |
/// |---|---|
/// | `postgres://…`, `postgresql://…` | [`Postgres`](Self::Postgres) |
/// | `mysql://…`, `mariadb://…` | [`MySql`](Self::MySql) |
/// | `sqlserver://…`, `mssql://…`, `jdbc:sqlserver://…` | [`SqlServer`](Self::SqlServer) |
/// | ADO.NET string (`server=tcp:HOST,PORT;user=…;password=…`, `Data Source=…`) | [`SqlServer`](Self::SqlServer) |
///
/// Schemes are matched without regard to case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DatabaseKind {
    /// PostgreSQL 13+ (the `outboxkit-postgres` crate).
    Postgres,
    /// MySQL 8.0+ or MariaDB 10.6+ (the `outboxkit-mysql` crate).
    MySql,
    /// SQL Server 2016+ or Azure SQL (the `outboxkit-sqlserver` crate).
    SqlServer,
}

impl DatabaseKind {
    /// Every kind, in declaration order.
    pub const ALL: [Self; 3] = [Self::Postgres, Self::MySql, Self::SqlServer];

    /// The database `url` names, by its scheme or (an ADO.NET connection string) its
    /// `server=` / `data source=` key; `None` when it names none of them. The rest of the
    /// URL is not checked here: each store's parser does that.
    pub fn of_url(url: &str) -> Option<Self> {
        let lower = url.trim().to_ascii_lowercase();
        if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
            return Some(Self::Postgres);
        }
        if lower.starts_with("mysql://") || lower.starts_with("mariadb://") {
            return Some(Self::MySql);
        }
        if ["sqlserver://", "mssql://", "jdbc:sqlserver://"]
            .iter()
            .any(|p| lower.starts_with(p))
        {
            return Some(Self::SqlServer);
        }
        let squashed: String = lower.chars().filter(|c| !c.is_whitespace()).collect();
        if !lower.contains("://")
            && squashed
                .split(';')
                .any(|pair| pair.starts_with("server=") || pair.starts_with("datasource="))
        {
            return Some(Self::SqlServer);
        }
        None
    }

    /// The product's name in messages: `"PostgreSQL"`, `"MySQL / MariaDB"` or
    /// `"SQL Server"`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Postgres => "PostgreSQL",
            Self::MySql => "MySQL / MariaDB",
            Self::SqlServer => "SQL Server",
        }
    }

    /// The URL forms this kind is recognised by, for messages, e.g.
    /// `"postgres://… or postgresql://…"`.
    pub const fn forms(self) -> &'static str {
        match self {
            Self::Postgres => "postgres://… or postgresql://…",
            Self::MySql => "mysql://… or mariadb://…",
            Self::SqlServer => {
                "sqlserver://…, mssql://…, jdbc:sqlserver://… or an ADO.NET string \
                 (server=tcp:HOST,PORT;user=…;password=…)"
            }
        }
    }

    /// The lower-case name of the cargo feature that compiles this backend into the
    /// facade crate `outboxkit` and the `outbox` binary: `"postgres"`, `"mysql"` or
    /// `"sqlserver"`.
    pub const fn feature(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
            Self::SqlServer => "sqlserver",
        }
    }
}

impl fmt::Display for DatabaseKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `text`, a database URL or connection string of any kind, with its password replaced
/// by `***`: [`redact_connection_string`] for `key=value;` pairs (ADO.NET, JDBC,
/// `sqlserver://HOST;…`) and [`redact_url`](crate::error::redact_url) for a URL's user
/// info and query; text with both gets both (over-redaction is preferred to a leak).
pub fn redact_database_url(text: &str) -> String {
    let url = |t: &str| crate::error::redact_url(t, crate::error::LoneUserInfo::UserName);
    match (
        text.contains("://"),
        text.contains(';') || !text.contains("://"),
    ) {
        (true, true) => url(&redact_connection_string(text)),
        (false, _) => redact_connection_string(text),
        (true, false) => url(text),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_covers_every_form() {
        for text in [
            "postgres://app:s3cret@db/app",
            "mysql://app:s3cret@db:3306/app",
            "mssql://sa:s3cret@db/app",
            "sqlserver://db:1433;user=sa;password=s3cret",
            "jdbc:sqlserver://h:1433;user=sa;Password='s3;cret';x=1",
            "server=tcp:db,1433;user=sa;Password=s3cret;database=app",
            "Server=db;PWD={s3;cret};Database=x",
            "postgres://app:s3;cret@db/app",
            "mssql://sa:s3;cret@db/app",
            "mysql://app:s3cret@db/app?ssl-mode=required;x=1",
        ] {
            let shown = redact_database_url(text);
            assert!(
                !shown.contains("s3cret") && !shown.contains("cret"),
                "{text} -> {shown}"
            );
        }
    }

    #[test]
    fn redaction_keeps_what_is_not_a_secret() {
        assert_eq!(
            redact_database_url("server=tcp:db,1433;user=sa;password=x;database=app"),
            "server=tcp:db,1433;user=sa;password=***;database=app"
        );
        assert_eq!(
            redact_database_url("postgres://app:x@db:5432/app"),
            "postgres://app:***@db:5432/app"
        );
        let jdbc = redact_database_url("jdbc:sqlserver://db:1433;user=sa;password=x");
        assert!(
            jdbc.contains("password=***") && jdbc.contains("db"),
            "{jdbc}"
        );
    }

    #[test]
    fn urls_name_their_database() {
        for (url, kind) in [
            ("postgres://u@h/db", DatabaseKind::Postgres),
            ("PostgreSQL://u:p@h:5432/db", DatabaseKind::Postgres),
            ("sqlserver://h:1433;user=sa", DatabaseKind::SqlServer),
            ("mssql://sa:x@h/app", DatabaseKind::SqlServer),
            ("jdbc:sqlserver://h:1433;user=sa", DatabaseKind::SqlServer),
            ("server=tcp:h,1433;user=sa", DatabaseKind::SqlServer),
            ("Data Source=h;User ID=sa", DatabaseKind::SqlServer),
            ("mysql://root@127.0.0.1:3306/test", DatabaseKind::MySql),
            (" MariaDB://u:p@h/db", DatabaseKind::MySql),
        ] {
            assert_eq!(DatabaseKind::of_url(url), Some(kind), "{url}");
        }
        for url in ["oracle://u@h/db", "h:5432", "", "user=sa;password=x"] {
            assert_eq!(DatabaseKind::of_url(url), None, "{url}");
        }
    }
}
