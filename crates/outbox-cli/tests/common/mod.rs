//! Shared fixtures: a fresh schema per test, isolated RabbitMQ names, a tiny HTTP GET.
#![allow(dead_code, unreachable_pub, unused_imports)] // reason: each test binary uses a different subset

use std::net::SocketAddr;

use outbox_core::NewMessage;
use outbox_postgres::{PgConfig, PgOutbox};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub use outbox_testkit::rabbit::amqp_url;

/// A fresh, migrated schema `t_<uuid>` (swept by the outbox-postgres tests after an hour).
pub async fn fresh_outbox() -> PgOutbox {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let outbox = PgOutbox::connect(
        &PgConfig::new(database_url())
            .with_schema(&schema)
            .with_max_connections(4),
    )
    .await
    .expect("connect to PostgreSQL (is it running? `cargo xtask services`)");
    outbox.migrate().await.expect("migrate");
    outbox
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
    let mut tx = outbox.pool().begin().await.expect("begin");
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

/// Polls `f` every 50 ms until it is true or a timeout passes (shared test support).
pub use outbox_testkit::rabbit::eventually;
