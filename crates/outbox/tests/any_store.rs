//! `AnyStore` against the real PostgreSQL and MariaDB: built from a URL, migrated into a
//! fresh schema (MySQL: database), a message enqueued with the concrete store, claimed,
//! completed and counted through the traits; the schema is dropped afterwards.
//!
//! `DATABASE_URL` (PostgreSQL) and `MYSQL_URL` (MariaDB) are this test environment's
//! settings, defaulting to the local services.

use std::sync::Arc;
use std::time::Duration;

use outboxkit::{
    AnyStore, AnyStoreConfig, CancellationToken, Completion, CompletionOutcome, DatabaseKind,
    Dispatcher, DispatcherConfig, MessageStatus, NewMessage, OutboxAdmin, OutboxProducer,
    OutboxStore,
};
use outboxkit_memory::MemoryPublisher;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn pg_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A schema name of its own for each run.
fn fresh_schema(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// `Err` with `what` unless `ok`.
fn check(ok: bool, what: impl Into<String>) -> TestResult {
    if ok { Ok(()) } else { Err(what.into().into()) }
}

/// Migrate, enqueue (through `enqueue_one`), claim, complete, count: every step but the
/// enqueue through the traits only.
async fn scenario(
    store: &AnyStore,
    schema: &str,
    enqueue_one: impl AsyncFnOnce(&NewMessage) -> TestResult,
) -> TestResult {
    check(
        OutboxAdmin::schema(store) == schema,
        format!("schema {}", OutboxAdmin::schema(store)),
    )?;
    let applied = store.migrate().await?;
    check(!applied.is_empty(), "a fresh schema gets every migration")?;
    check(store.migrate().await?.is_empty(), "migrate is idempotent")?;

    let message = NewMessage::builder("order", "42", "OrderPlaced")
        .aggregate_version(1)
        .payload(&serde_json::json!({ "order_id": 42 }))
        .build()?;
    enqueue_one(&message).await?;
    let pending = store.pending_stats().await?;
    check(pending.new == 1, format!("pending {pending:?}"))?;

    let batch = store.claim(10, Duration::from_secs(30)).await?;
    check(
        batch.messages.len() == 1 && batch.poison.is_empty(),
        format!("claimed {batch:?}"),
    )?;
    let claimed = &batch.messages[0];
    check(claimed.id == message.id, "the enqueued message is claimed")?;
    check(
        claimed.status == MessageStatus::Processing,
        "claimed rows are Processing",
    )?;
    let token = claimed
        .claim_token
        .ok_or("a claimed row carries its token")?;
    let report = store
        .complete(&[Completion {
            id: claimed.id,
            claim_token: token,
            outcome: CompletionOutcome::Sent,
        }])
        .await?;
    check(
        report.applied == 1 && report.fenced.is_empty(),
        format!("report {report:?}"),
    )?;

    let stats = store.stats().await?;
    check(
        stats.sent == 1 && stats.new == 0 && stats.processing == 0,
        format!("stats {stats:?}"),
    )?;
    let groups = store.stats_by_group().await?;
    check(
        groups.len() == 1 && groups[0].event_type == "OrderPlaced" && groups[0].sent == 1,
        format!("groups {groups:?}"),
    )?;
    let sent = store.get(message.id).await?.ok_or("the sent row is kept")?;
    check(
        sent.status == MessageStatus::Sent,
        format!("status {:?}", sent.status),
    )?;
    Ok(())
}

#[tokio::test]
async fn any_store_runs_the_outbox_on_postgres() -> TestResult {
    let schema = fresh_schema("any_store");
    let config = AnyStoreConfig::from_url(&pg_url())?.with_schema(&schema);
    check(
        config.kind() == DatabaseKind::Postgres,
        "postgres:// is PostgreSQL",
    )?;
    let store = AnyStore::connect(config).await?;
    check(
        store.backend() == "postgres",
        format!("backend {}", store.backend()),
    )?;
    let pg = store.as_postgres().ok_or("a PostgreSQL store")?.clone();
    let result = scenario(&store, &schema, async |message: &NewMessage| {
        let mut tx = pg.begin().await?;
        pg.enqueue(&mut tx, message).await?;
        tx.commit().await?;
        Ok(())
    })
    .await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(pg.pool())
    .await?;
    result
}

#[tokio::test]
async fn any_store_runs_the_outbox_on_mariadb() -> TestResult {
    let schema = fresh_schema("any_store");
    let config = AnyStoreConfig::from_url(&mysql_url())?.with_schema(&schema);
    check(config.kind() == DatabaseKind::MySql, "mysql:// is MySQL")?;
    let store = AnyStore::connect(config).await?;
    check(
        store.backend() == "mysql",
        format!("backend {}", store.backend()),
    )?;
    let my = store.as_mysql().ok_or("a MySQL store")?.clone();
    let result = scenario(&store, &schema, async |message: &NewMessage| {
        let mut tx = my.begin().await?;
        my.enqueue(&mut tx, message).await?;
        tx.commit().await?;
        Ok(())
    })
    .await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {schema}"
    )))
    .execute(my.pool())
    .await?;
    result
}

/// A relay over `AnyStore` is woken by the store's own wake source (PostgreSQL's
/// `LISTEN`), as a relay over `PgOutbox` is: with a one-minute poll, a message committed
/// while the relay waits is published within seconds. `AnyStore` forwards
/// `spawn_wake_source`; with the trait's default (no source) the relay would wait for
/// its next poll.
#[tokio::test]
async fn a_relay_over_any_store_is_woken_by_a_postgres_commit() -> TestResult {
    let schema = fresh_schema("any_store_wake");
    let store =
        AnyStore::connect(AnyStoreConfig::from_url(&pg_url())?.with_schema(&schema)).await?;
    store.migrate().await?;
    let pg = store.as_postgres().ok_or("a PostgreSQL store")?.clone();
    let enqueue = async |n: u32| -> TestResult {
        let message = NewMessage::builder("order", n.to_string(), "OrderPlaced")
            .payload(&serde_json::json!({ "n": n }))
            .build()?;
        let mut tx = pg.begin().await?;
        pg.enqueue(&mut tx, &message).await?;
        tx.commit().await?;
        Ok(())
    };
    let publisher = Arc::new(MemoryPublisher::new());
    let dispatcher = Dispatcher::new(
        Arc::new(store),
        Arc::clone(&publisher),
        DispatcherConfig::new()
            .with_poll_interval(Duration::from_secs(60))
            .with_min_poll_interval(Duration::from_secs(60)),
    )
    .expect("valid dispatcher config");
    let token = CancellationToken::new();
    let relay = {
        let (dispatcher, token) = (dispatcher.clone(), token.clone());
        tokio::spawn(async move { dispatcher.run(token).await })
    };
    let result = async {
        enqueue(1).await?;
        // The first claim (or the wake-up once the source listens) finds it; from then
        // on the relay waits a minute unless woken.
        check(
            publisher.wait_published(1, Duration::from_secs(10)).await,
            "the first message is published",
        )?;
        enqueue(2).await?;
        check(
            publisher.wait_published(2, Duration::from_secs(10)).await,
            "a commit wakes the relay over AnyStore (poll interval 60 s)",
        )
    }
    .await;
    token.cancel();
    let stopped = relay.await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(pg.pool())
    .await?;
    stopped??;
    result
}
