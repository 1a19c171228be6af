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

/// A TCP proxy in front of PostgreSQL that counts the client's round trips: every
/// simple `Query` and every `Sync` (the end of an extended-protocol exchange) the client
/// sends is one request answered by one `ReadyForQuery`. Connect through
/// [`options`](Self::options) (`sslmode=disable`, so the protocol can be read).
///
/// [`freeze_open_connections`](Self::freeze_open_connections) makes the connections
/// open at that moment half-open: both sockets stay open and nothing passes any more,
/// either way, as when a peer or a middlebox vanishes without a word; connections made
/// afterwards pass as usual. [`drop_notifications`](Self::drop_notifications) makes it
/// drop every notification (`NotificationResponse`) the server sends, as a connection
/// pooler in transaction mode does in effect: `LISTEN` succeeds and nothing arrives.
#[derive(Debug)]
pub struct RoundTripCounter {
    addr: std::net::SocketAddr,
    count: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Connections accepted so far (each one's number is its order).
    opened: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Connections numbered up to this one are frozen (0: none).
    frozen_up_to: std::sync::Arc<std::sync::atomic::AtomicU64>,
    deaf: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl RoundTripCounter {
    /// Listens on a free local port and forwards every connection to `upstream`
    /// (`host:port`).
    ///
    /// # Panics
    /// When it cannot listen.
    pub async fn start(upstream: &str) -> Self {
        use std::sync::atomic::AtomicU64;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listen");
        let addr = listener.local_addr().expect("address");
        let count = std::sync::Arc::new(AtomicU64::new(0));
        let opened = std::sync::Arc::new(AtomicU64::new(0));
        let frozen_up_to = std::sync::Arc::new(AtomicU64::new(0));
        let upstream = upstream.to_owned();
        let counter = std::sync::Arc::clone(&count);
        let deaf = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (accepted, freeze) = (
            std::sync::Arc::clone(&opened),
            std::sync::Arc::clone(&frozen_up_to),
        );
        let deafness = std::sync::Arc::clone(&deaf);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let number = accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                let upstream = upstream.clone();
                let counter = std::sync::Arc::clone(&counter);
                let frozen = Frozen {
                    number,
                    frozen_up_to: std::sync::Arc::clone(&freeze),
                    deaf: std::sync::Arc::clone(&deafness),
                };
                tokio::spawn(async move {
                    if let Ok(server) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        proxy(client, server, counter, frozen).await;
                    }
                });
            }
        });
        Self {
            addr,
            count,
            opened,
            frozen_up_to,
            deaf,
        }
    }

    /// Drops (`true`) or passes (`false`, the default) the server's notifications.
    pub fn drop_notifications(&self, drop: bool) {
        self.deaf.store(drop, std::sync::atomic::Ordering::SeqCst);
    }

    /// Makes every connection open now half-open (see the type's docs).
    pub fn freeze_open_connections(&self) {
        let opened = self.opened.load(std::sync::atomic::Ordering::SeqCst);
        self.frozen_up_to
            .store(opened, std::sync::atomic::Ordering::SeqCst);
    }

    /// Connect options of `base` pointed at the proxy, without TLS.
    pub fn options(&self, base: &PgConnectOptions) -> PgConnectOptions {
        base.clone()
            .host(&self.addr.ip().to_string())
            .port(self.addr.port())
            .ssl_mode(sqlx::postgres::PgSslMode::Disable)
    }

    /// Round trips so far.
    pub fn count(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Whether one proxied connection is frozen, and whether notifications are dropped.
struct Frozen {
    number: u64,
    frozen_up_to: std::sync::Arc<std::sync::atomic::AtomicU64>,
    deaf: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Frozen {
    fn now(&self) -> bool {
        self.number <= self.frozen_up_to.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn proxy(
    client: tokio::net::TcpStream,
    server: tokio::net::TcpStream,
    count: std::sync::Arc<std::sync::atomic::AtomicU64>,
    frozen: Frozen,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let frozen_down = Frozen {
        number: frozen.number,
        frozen_up_to: std::sync::Arc::clone(&frozen.frozen_up_to),
        deaf: std::sync::Arc::clone(&frozen.deaf),
    };
    let upstream = async move {
        // The startup message has no type byte; every later message is
        // type (1) + length (4, itself included) + body.
        let mut buf = Vec::new();
        let mut started = false;
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if frozen.now() {
                // Half-open: the sockets stay, nothing passes.
                std::future::pending::<()>().await;
            }
            if server_write.write_all(&chunk[..n]).await.is_err() {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            loop {
                let header = if started { 5 } else { 4 };
                if buf.len() < header {
                    break;
                }
                let len_at = usize::from(started);
                let len = u32::from_be_bytes([
                    buf[len_at],
                    buf[len_at + 1],
                    buf[len_at + 2],
                    buf[len_at + 3],
                ]) as usize;
                let total = len + usize::from(started);
                if buf.len() < total {
                    break;
                }
                if started && matches!(buf[0], b'Q' | b'S') {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                started = true;
                buf.drain(..total);
            }
        }
    };
    let downstream = async move {
        // Every server message is type (1) + length (4, itself included) + body (no
        // TLS, no SSL negotiation byte).
        let mut buf: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let n = match server_read.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if frozen_down.now() {
                std::future::pending::<()>().await;
            }
            buf.extend_from_slice(&chunk[..n]);
            let mut out = Vec::with_capacity(buf.len());
            while buf.len() >= 5 {
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if buf.len() < len + 1 {
                    break;
                }
                let message: Vec<u8> = buf.drain(..len + 1).collect();
                let dropped = message[0] == b'A'
                    && frozen_down.deaf.load(std::sync::atomic::Ordering::SeqCst);
                if !dropped {
                    out.extend_from_slice(&message);
                }
            }
            if !out.is_empty() && client_write.write_all(&out).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(upstream, downstream);
}

/// Drops a test's replication slot (ending the session that reads it first), its
/// publication and its schema, on a runtime of its own, so that a guard's `Drop` can
/// call it while the test's runtime unwinds. Failures are printed, never raised (a
/// forgotten slot retains WAL for ever: the message says which to drop by hand).
pub fn drop_wal_objects_blocking(database_url: &str, slot: &str, publication: &str, schema: &str) {
    let (url, slot, publication, schema) = (
        database_url.to_owned(),
        slot.to_owned(),
        publication.to_owned(),
        schema.to_owned(),
    );
    let what = slot.clone();
    let done = crate::on_own_runtime(async move {
        let pool = PgPool::connect(&url).await.expect("connect");
        for _ in 0..100 {
            let active: Option<Option<i32>> = sqlx::query_scalar(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_optional(&pool)
            .await
            .expect("slots");
            match active {
                None => break,
                Some(Some(pid)) => {
                    let _ = sqlx::query("SELECT pg_terminate_backend($1)")
                        .bind(pid)
                        .execute(&pool)
                        .await;
                }
                Some(None) => {
                    let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
                        .bind(&slot)
                        .execute(&pool)
                        .await;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let _ = sqlx::query(AssertSqlSafe(format!(
            "DROP PUBLICATION IF EXISTS \"{publication}\""
        )))
        .execute(&pool)
        .await;
        if let Err(e) = drop_schema(&pool, &schema).await {
            crate::leftover(&format!("schema {schema} left behind: {e}"));
        }
    });
    if !done {
        crate::leftover(&format!(
            "cleanup of {what} failed: drop this replication slot by hand"
        ));
    }
}

/// The destinations the held rows of `schema`'s outbox name (`held_for`).
pub async fn held_destinations(pool: &PgPool, schema: &str) -> std::collections::HashSet<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT DISTINCT held_for FROM {schema}.outbox_messages WHERE held_for IS NOT NULL"
    )))
    .fetch_all(pool)
    .await
    .expect("held_for")
    .into_iter()
    .collect()
}

/// Drops a test's schema (`CASCADE`) on a runtime of its own, so that a guard's `Drop`
/// can call it while the test's runtime unwinds. A failure (also a lock held for more
/// than 10 s) is printed, never raised.
pub fn drop_schema_blocking(database_url: &str, schema: &str) {
    let (url, name) = (database_url.to_owned(), schema.to_owned());
    let done = crate::on_own_runtime(async move {
        let result = match PgPool::connect(&url).await {
            Ok(pool) => drop_schema(&pool, &name).await,
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            crate::leftover(&format!("schema {name} left behind: {e}"));
        }
    });
    if !done {
        crate::leftover(&format!(
            "cleanup of schema {schema} failed: drop it by hand"
        ));
    }
}

/// `DROP SCHEMA IF EXISTS schema CASCADE`, giving up after a 10 s wait for a lock: a
/// session of the test still holding one (a task not yet stopped) fails the drop rather
/// than hanging the test, and the schema is left for the sweep of old test schemas. One
/// simple-query string, so one session.
async fn drop_schema(pool: &PgPool, schema: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await
    .map(|_| ())
}

/// A value that lives in a test's own schema (an outbox, an inbox over it), holding the
/// [`DropSchema`] guard that drops the schema with it; derefs to the value.
#[derive(Debug)]
pub struct InSchema<T> {
    value: T,
    drop: DropSchema,
}

impl<T> InSchema<T> {
    /// `value`, whose schema `schema` of the database at `database_url` is dropped with it.
    pub fn new(value: T, database_url: &str, schema: &str) -> Self {
        Self {
            value,
            drop: DropSchema::new(database_url, schema),
        }
    }

    /// The value and the guard apart (the schema is dropped with the guard).
    pub fn into_parts(self) -> (T, DropSchema) {
        (self.value, self.drop)
    }
}

impl<T> std::ops::Deref for InSchema<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

/// Drops a test's schema ([`drop_schema_blocking`]) when it goes out of scope, also when
/// the test panics.
#[derive(Debug)]
pub struct DropSchema {
    database_url: String,
    schema: String,
}

impl DropSchema {
    /// A guard for `schema` of the database at `database_url`.
    pub fn new(database_url: &str, schema: &str) -> Self {
        Self {
            database_url: database_url.to_owned(),
            schema: schema.to_owned(),
        }
    }
}

impl Drop for DropSchema {
    fn drop(&mut self) {
        drop_schema_blocking(&self.database_url, &self.schema);
    }
}

/// The rows a WAL relay parks from its stream (`New` to `Processing`), recorded by a
/// trigger of a test's own schema in `{schema}.parked_log`: whether a message was
/// parked on its way, still known after it was sent.
#[derive(Debug)]
pub struct ParkLog {
    pool: PgPool,
    schema: String,
}

impl ParkLog {
    /// Creates the log table and its trigger in `schema` (migrated).
    ///
    /// # Panics
    /// When a statement fails.
    pub async fn install(pool: &PgPool, schema: &str) -> Self {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {schema}.parked_log (id uuid NOT NULL);
             CREATE FUNCTION {schema}.log_park() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO {schema}.parked_log VALUES (NEW.id); RETURN NULL; END $$;
             CREATE TRIGGER log_park AFTER UPDATE ON {schema}.outbox_messages FOR EACH ROW
                 WHEN (OLD.status = 0 AND NEW.status = 9) EXECUTE FUNCTION {schema}.log_park();"
        )))
        .execute(pool)
        .await
        .expect("the park log");
        Self {
            pool: pool.clone(),
            schema: schema.to_owned(),
        }
    }

    /// How many of `ids` were parked from the stream.
    ///
    /// # Panics
    /// When the query fails.
    pub async fn parked(&self, ids: &[uuid::Uuid]) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(DISTINCT id) FROM {}.parked_log WHERE id = ANY($1)",
            self.schema
        )))
        .bind(ids)
        .fetch_one(&self.pool)
        .await
        .expect("the park log")
    }
}
