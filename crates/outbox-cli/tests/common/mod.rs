//! Shared fixtures: a fresh schema per test, isolated RabbitMQ names, a tiny HTTP GET.
#![allow(dead_code, unreachable_pub, unused_imports)] // reason: each test binary uses a different subset

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use outboxkit_core::{NewMessage, OutboxProducer};
use outboxkit_postgres::{PgConfig, PgOutbox};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use uuid::Uuid;

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub use outboxkit_testkit::rabbit::amqp_url;

/// A test's outbox over a fresh, migrated schema `t_<uuid>` (derefs to the
/// [`PgOutbox`]; `clone()` gives a `PgOutbox` to move into tasks); the schema is dropped
/// when it goes out of scope, also when the test panics.
pub type TestOutbox = outboxkit_testkit::pg::InSchema<PgOutbox>;

/// A fresh, migrated schema `t_<uuid>`, dropped with the returned value.
pub async fn fresh_outbox() -> TestOutbox {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let url = database_url();
    let outbox = PgOutbox::connect(
        &PgConfig::new(&url)
            .with_schema(&schema)
            .with_max_connections(4),
    )
    .await
    .expect("connect to PostgreSQL (is it running? `cargo xtask services`)");
    outbox.migrate().await.expect("migrate");
    TestOutbox::new(outbox, &url, &schema)
}

pub async fn exec(outbox: &PgOutbox, sql: &str) -> u64 {
    let sql = sql.replace("{s}", outbox.schema());
    sqlx::query(AssertSqlSafe(sql))
        .execute(outbox.pool())
        .await
        .expect("sql")
        .rows_affected()
}

pub async fn scalar(outbox: &PgOutbox, sql: &str) -> i64 {
    let sql = sql.replace("{s}", outbox.schema());
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
        .fetch_one(outbox.pool())
        .await
        .expect("sql")
}

pub fn message(event_type: &str, tenant: &str, aggregate: &str) -> NewMessage {
    NewMessage::builder("order", aggregate, event_type)
        .aggregate_version(1)
        .tenant_id(tenant)
        .payload_json("{}")
        .build()
        .expect("valid message")
}

pub async fn enqueue(outbox: &PgOutbox, messages: &[NewMessage]) {
    let mut tx = outbox.begin().await.expect("begin");
    outbox
        .enqueue_batch(&mut tx, messages)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
}

/// `GET path` over HTTP/1.1; returns the status code and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// An HTTP response: status, headers (names lower-case) and body.
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request with `headers` (a `Host` is added unless given) and a form body.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    form: Option<&str>,
) -> Resp {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = form.unwrap_or("");
    if form.is_some() {
        head.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(head.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Resp {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// Polls `f` every 50 ms until it is true or a timeout passes (shared test support).
pub use outboxkit_testkit::rabbit::eventually;

/// A running `outbox relay`, its log in a file; killed on drop if still running.
pub struct RelayProcess {
    child: Child,
    log: PathBuf,
}

impl RelayProcess {
    /// `outbox relay` over `db`'s schema with `args` after the subcommand.
    pub fn start(db: &PgOutbox, args: &[&str]) -> Self {
        Self::start_with_env(db, args, &[])
    }

    /// [`start`](Self::start) with extra environment variables.
    pub fn start_with_env(db: &PgOutbox, args: &[&str], env: &[(&str, &str)]) -> Self {
        let log = std::env::temp_dir().join(format!("outbox-relay-{}.log", Uuid::new_v4()));
        let file = std::fs::File::create(&log).expect("log file");
        let bin = std::env::var_os("OUTBOX_RELAY_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_outbox").into());
        let child = Command::new(bin)
            .args(["--database-url", &database_url(), "--schema", db.schema()])
            .arg("relay")
            .args(["--listen", "127.0.0.1:0", "--poll-interval", "50ms"])
            .args(args)
            .env_remove("OUTBOX_CONFIG")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start outbox relay");
        Self { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The address of `/metrics` and `/healthz`, from the "relay started" line of its
    /// log (waits up to 30 s for it).
    pub async fn addr(&self) -> SocketAddr {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(addr) = self
                .log()
                .split_whitespace()
                .find_map(|w| w.strip_prefix("listen="))
            {
                return addr.parse().expect("an address");
            }
            assert!(
                Instant::now() < deadline,
                "the relay logs no address; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal("-TERM");
    }

    /// Sends SIGKILL (`kill -9`).
    pub fn kill_9(&self) {
        self.signal("-KILL");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args([signal, &pid])
                .status()
                .is_ok_and(|s| s.success()),
            "kill {signal} {pid}"
        );
    }

    /// Waits up to `limit` for the process to exit.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// Waits for `condition` (checked every 100 ms) up to `limit`; panics naming `what`,
/// with the relay's log.
pub async fn wait_until<F, Fut>(relay: &RelayProcess, limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !condition().await {
        assert!(
            Instant::now() < deadline,
            "timed out waiting until {what}; relay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Drops the test's slot, publication and schema when the test ends, panic or not (a
/// forgotten slot retains WAL forever).
pub struct WalCleanup {
    pub schema: String,
}

impl WalCleanup {
    /// `outbox wal setup` on `db`'s schema (the slot and publication `{schema}_outbox`),
    /// and the guard that drops them and the schema.
    pub fn setup(db: &PgOutbox) -> Self {
        let cleanup = Self {
            schema: db.schema().to_owned(),
        };
        let (ok, out) = wal_command(db, &["setup"]);
        assert!(ok, "outbox wal setup: {out}");
        assert!(out.contains("slot") && out.contains("created"), "{out}");
        cleanup
    }
}

impl Drop for WalCleanup {
    fn drop(&mut self) {
        let slot = format!("{}_outbox", self.schema);
        outboxkit_testkit::pg::drop_wal_objects_blocking(
            &database_url(),
            &slot,
            &slot,
            &self.schema,
        );
    }
}

/// `outbox --schema S wal ARGS...`; returns (success, stdout + stderr).
pub fn wal_command(db: &PgOutbox, args: &[&str]) -> (bool, String) {
    let mut all = vec!["wal"];
    all.extend_from_slice(args);
    outbox_command(db, &all)
}

/// `outbox --schema S ARGS...`; returns (success, stdout + stderr).
pub fn outbox_command(db: &PgOutbox, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["--database-url", &database_url(), "--schema", db.schema()])
        .args(args)
        .env_remove("OUTBOX_CONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("run outbox wal");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}
