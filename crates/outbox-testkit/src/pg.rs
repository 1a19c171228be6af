//! A PostgreSQL outage as one consumer sees it, without touching anyone else: the
//! consumer connects as a role of its own, which the test locks out (its connections
//! terminated with `pg_terminate_backend`, new ones refused by `ALTER ROLE … NOLOGIN`:
//! SQLSTATE 57P01 and 28000, as during a failover or a server restart) and lets in
//! again. Tests running at the same time are unaffected, so no fault lock is needed.

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, PgPool};

/// A login role of its own for one test, with every privilege on one schema's tables
/// and sequences (create the tables first).
#[derive(Debug)]
pub struct PgLockout {
    admin: PgPool,
    role: String,
    options: PgConnectOptions,
}

impl PgLockout {
    /// Creates the role `t_role_<uuid>` on the server of `admin` (a pool of a superuser
    /// or of the schema's owner) and grants it `schema`'s tables and sequences.
    /// `options` are the admin's connect options; the role's are the same with its name.
    ///
    /// # Panics
    /// When a statement fails.
    pub async fn new(admin: &PgPool, options: &PgConnectOptions, schema: &str) -> Self {
        let role = format!("t_role_{}", uuid::Uuid::new_v4().simple());
        for sql in [
            format!("CREATE ROLE {role} LOGIN"),
            format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
            format!("GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO {role}"),
            format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"),
        ] {
            sqlx::raw_sql(AssertSqlSafe(sql.clone()))
                .execute(admin)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        Self {
            admin: admin.clone(),
            options: options.clone().username(&role),
            role,
        }
    }

    /// How to connect as the role.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone()
    }

    /// Refuses the role's new connections and terminates its open ones.
    ///
    /// # Panics
    /// When a statement fails.
    pub async fn lock_out(&self) {
        self.exec(&format!("ALTER ROLE {} NOLOGIN", self.role))
            .await;
        self.exec(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{}'",
            self.role
        ))
        .await;
    }

    /// Accepts the role's connections again.
    ///
    /// # Panics
    /// When the statement fails.
    pub async fn let_in(&self) {
        self.exec(&format!("ALTER ROLE {} LOGIN", self.role)).await;
    }

    /// Terminates the role's connections and drops it (with its privileges).
    pub async fn drop_role(self) {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{0}';
             DROP OWNED BY {0}; DROP ROLE {0}",
            self.role
        )))
        .execute(&self.admin)
        .await;
    }

    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}
