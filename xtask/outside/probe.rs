//! The test's side of `cargo xtask outside` (xtask/src/outside.rs), in the project
//! outside the workspace, on the clients the packaged crates re-export:
//!
//! * `probe prepare`: creates the schema (PostgreSQL) or database (MySQL / MariaDB)
//!   `OUTBOX_SCHEMA`, where the run's `DATABASE_URL` puts the quick start's `projected`
//!   table (PostgreSQL: its `search_path`; MySQL: its database).
//! * `probe wait SECS`: polls `OUTBOX_SCHEMA.projected` until it holds a row (exit 0)
//!   or `SECS` seconds pass (exit 1).
//! * `probe enqueue`: enqueues the quick start's `OrderPlaced` in `OUTBOX_SCHEMA` at
//!   `DATABASE_URL` (PostgreSQL), for a relay of another build to publish.
//! * `probe sent SECS`: polls `OUTBOX_SCHEMA.outbox_messages` (PostgreSQL) until a
//!   message is `Sent` (exit 0) or `SECS` seconds pass (exit 1).
//! * `probe clean STREAM QUEUE`: drops what a run of the quick start made: the schema
//!   (PostgreSQL) or database (MySQL / MariaDB) `OUTBOX_SCHEMA`, with its `projected`
//!   table; at `OUTBOX_BROKER_URL`, the queue `QUEUE` and the exchange
//!   `OUTBOX_EXCHANGE` (RabbitMQ) or the stream `STREAM` with its durable (NATS).
//!
//! The database is reached at `OUTSIDE_ADMIN_URL` (the server's own database: the
//! run's may not exist yet).

use std::time::{Duration, Instant};

use outboxkit::{NewMessage, OutboxProducer};
use outboxkit::mysql::sqlx::MySqlPool;
use outboxkit::nats::async_nats;
use outboxkit::postgres::sqlx::{self, AssertSqlSafe, PgPool};
use outboxkit::postgres::{PgConfig, PgOutbox};
use outboxkit::rabbit::lapin;

type Error = Box<dyn std::error::Error>;

fn var(name: &str) -> Result<String, Error> {
    std::env::var(name).map_err(|e| format!("{name}: {e}").into())
}

/// The count `sql` gives (an error while its table is not there yet; the schema is
/// the run's own, made by `cargo xtask outside`).
async fn count(url: &str, sql: String) -> Result<i64, Error> {
    let rows = if url.starts_with("postgres") {
        let pool = PgPool::connect(url).await?;
        let rows = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&pool)
            .await;
        pool.close().await;
        rows?
    } else {
        let pool = MySqlPool::connect(url).await?;
        let rows = sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&pool)
            .await;
        pool.close().await;
        rows?
    };
    Ok(rows)
}

/// Runs one statement on the server at `url` (its names are the run's own, made by
/// `cargo xtask outside`).
async fn execute(url: &str, sql: String) -> Result<(), Error> {
    if url.starts_with("postgres") {
        let pool = PgPool::connect(url).await?;
        let done = sqlx::query(AssertSqlSafe(sql)).execute(&pool).await;
        pool.close().await;
        done?;
    } else {
        let pool = MySqlPool::connect(url).await?;
        let done = sqlx::query(AssertSqlSafe(sql)).execute(&pool).await;
        pool.close().await;
        done?;
    }
    Ok(())
}

async fn prepare() -> Result<(), Error> {
    let (url, schema) = (var("OUTSIDE_ADMIN_URL")?, var("OUTBOX_SCHEMA")?);
    let kind = if url.starts_with("postgres") {
        "SCHEMA"
    } else {
        "DATABASE"
    };
    execute(&url, format!("CREATE {kind} IF NOT EXISTS {schema}")).await
}

/// Polls `sql` (a count) until it is positive or `secs` seconds pass.
async fn wait(sql: String, secs: u64) -> Result<(), Error> {
    let url = var("OUTSIDE_ADMIN_URL")?;
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let last = match count(&url, sql.clone()).await {
            Ok(n) if n > 0 => {
                println!("probe: `{sql}`: {n}");
                return Ok(());
            }
            Ok(n) => n.to_string(),
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(format!("`{sql}`: none after {secs} s ({last})").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn enqueue() -> Result<(), Error> {
    let store = PgOutbox::connect(&PgConfig::from_env()?).await?;
    let mut tx = store.begin().await?;
    let event = NewMessage::builder("order", "42", "OrderPlaced")
        .payload(&serde_json::json!({ "id": 42 }))
        .build()?;
    store.enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    Ok(())
}

fn stream_not_found(e: &async_nats::jetstream::context::DeleteStreamError) -> bool {
    use async_nats::jetstream::{ErrorCode, context::DeleteStreamErrorKind as Kind};
    matches!(e.kind(), Kind::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

async fn clean(stream: &str, queue: &str) -> Result<(), Error> {
    let (url, schema) = (var("OUTSIDE_ADMIN_URL")?, var("OUTBOX_SCHEMA")?);
    let mut failed = Vec::new();
    let sql = if url.starts_with("postgres") {
        format!("DROP SCHEMA IF EXISTS {schema} CASCADE")
    } else {
        format!("DROP DATABASE IF EXISTS {schema}")
    };
    if let Err(e) = execute(&url, sql).await {
        failed.push(format!("schema {schema}: {e}"));
    }
    let broker = var("OUTBOX_BROKER_URL")?;
    if broker.starts_with("amqp://") {
        let exchange = var("OUTBOX_EXCHANGE")?;
        let conn =
            lapin::Connection::connect(&broker, lapin::ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        let options = lapin::options::QueueDeleteOptions::default();
        if let Err(e) = channel.queue_delete(queue.into(), options).await {
            failed.push(format!("queue {queue}: {e}"));
        }
        let options = lapin::options::ExchangeDeleteOptions::default();
        if let Err(e) = channel
            .exchange_delete(exchange.as_str().into(), options)
            .await
        {
            failed.push(format!("exchange {exchange}: {e}"));
        }
        let _ = conn.close(200, "".into()).await;
    } else {
        let client = async_nats::connect(&broker).await?;
        // The durable goes with its stream. A stream never made (a run that failed
        // before) is not a failure to clean up.
        match async_nats::jetstream::new(client)
            .delete_stream(stream)
            .await
        {
            Err(e) if !stream_not_found(&e) => failed.push(format!("stream {stream}: {e}")),
            _ => {}
        }
    }
    if failed.is_empty() {
        println!("probe: dropped {schema} and the broker's {stream} / {queue}");
        Ok(())
    } else {
        Err(format!("could not drop: {}", failed.join("; ")).into())
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["prepare"] => prepare().await,
        ["wait", secs] => {
            let sql = format!("SELECT COUNT(*) FROM {}.projected", var("OUTBOX_SCHEMA")?);
            wait(sql, secs.parse()?).await
        }
        ["enqueue"] => enqueue().await,
        ["sent", secs] => {
            let schema = var("OUTBOX_SCHEMA")?;
            let sql = format!("SELECT COUNT(*) FROM {schema}.outbox_messages WHERE status = 1");
            wait(sql, secs.parse()?).await
        }
        ["clean", stream, queue] => clean(stream, queue).await,
        _ => Err("usage: probe prepare | probe wait SECS | probe enqueue | probe sent SECS | probe clean STREAM QUEUE".into()),
    }
}
