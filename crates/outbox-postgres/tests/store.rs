//! PostgreSQL-specific behaviour: same-transaction atomicity, migrations, bad input,
//! the inbox.

mod common;

use std::time::Duration;

use common::fresh_outbox;
use outboxkit_core::{
    DomainEvents, InboxStore, NewMessage, OutboxError, OutboxProducer, OutboxStore,
};
use outboxkit_postgres::{PgConfig, PgOutbox};

fn event(n: i64) -> NewMessage {
    NewMessage::builder("order", n.to_string(), "OrderPlaced")
        .aggregate_version(1)
        .payload(&serde_json::json!({ "order": n }))
        .build()
        .expect("valid")
}

async fn count_rows(outbox: &PgOutbox) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.outbox_messages",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("count")
}

#[tokio::test]
async fn rolled_back_transaction_leaves_no_event_and_commit_keeps_both() {
    let outbox = fresh_outbox().await;
    let business = format!("{}.orders", outbox.schema());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {business} (id bigint PRIMARY KEY)"
    )))
    .execute(outbox.pool())
    .await
    .expect("create");

    let mut tx = outbox.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {business} VALUES (1)"
    )))
    .execute(&mut *tx)
    .await
    .expect("insert");
    outbox.enqueue(&mut tx, &event(1)).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        count_rows(&outbox).await,
        0,
        "rolled-back event must not exist"
    );

    let mut tx = outbox.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {business} VALUES (2)"
    )))
    .execute(&mut *tx)
    .await
    .expect("insert");
    let id = outbox.enqueue(&mut tx, &event(2)).await.expect("enqueue");
    // Not visible to the relay before commit.
    assert!(
        outbox
            .claim(10, Duration::from_secs(30))
            .await
            .expect("claim")
            .messages
            .is_empty()
    );
    tx.commit().await.expect("commit");
    let claimed = outbox
        .claim(10, Duration::from_secs(30))
        .await
        .expect("claim")
        .messages;
    assert_eq!(claimed.iter().map(|m| m.id).collect::<Vec<_>>(), [id]);
}

/// Application code written once against [`OutboxProducer`]: an order's events, written
/// on whatever connection the caller's transaction is, of whichever store.
async fn place_order<P: OutboxProducer>(
    producer: &P,
    conn: &mut P::Connection,
    order: i64,
    lines: usize,
) -> Result<Vec<uuid::Uuid>, OutboxError> {
    let placed = NewMessage::builder("order", order.to_string(), "OrderPlaced")
        .aggregate_version(1)
        .payload(&serde_json::json!({ "order": order, "lines": lines }))
        .build()?;
    let mut ids = vec![producer.enqueue(conn, &placed).await?];
    let added: Vec<NewMessage> = (0..lines)
        .map(|line| {
            NewMessage::builder("order", order.to_string(), "LineAdded")
                .aggregate_version(2 + line as i64)
                .payload(&serde_json::json!({ "order": order, "line": line }))
                .build()
        })
        .collect::<Result<_, _>>()?;
    ids.extend(producer.enqueue_batch(conn, &added).await?);
    Ok(ids)
}

/// The same producer function runs on PostgreSQL (on a `sqlx` transaction) and on the
/// in-memory store (on its own transaction): on both, a rolled-back transaction leaves
/// nothing, and a committed one leaves every message, claimed in the order written.
#[tokio::test]
async fn one_producer_function_serves_every_store() {
    async fn claimed_order<S: OutboxStore>(store: &S) -> Vec<(String, i64)> {
        store
            .claim(100, Duration::from_secs(30))
            .await
            .expect("claim")
            .messages
            .into_iter()
            .map(|m| (m.event_type, m.aggregate_version))
            .collect()
    }
    let expected: Vec<(String, i64)> = std::iter::once(("OrderPlaced".to_owned(), 1))
        .chain((0..3).map(|l| ("LineAdded".to_owned(), 2 + l)))
        .collect();

    let pg = fresh_outbox().await;
    let mut tx = pg.begin().await.expect("begin");
    place_order(&*pg, &mut tx, 1, 3).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(count_rows(&pg).await, 0, "rolled back: nothing stored");
    let mut tx = pg.begin().await.expect("begin");
    let ids = place_order(&*pg, &mut tx, 2, 3).await.expect("enqueue");
    assert!(
        claimed_order(&*pg).await.is_empty(),
        "invisible before commit"
    );
    tx.commit().await.expect("commit");
    assert_eq!(claimed_order(&*pg).await, expected);
    assert_eq!(ids.len(), 4);

    let memory = outboxkit_memory::MemoryOutbox::new();
    let mut tx = memory.begin();
    place_order(&memory, &mut tx, 1, 3).await.expect("enqueue");
    drop(tx);
    assert!(memory.is_empty(), "rolled back: nothing stored");
    let mut tx = memory.begin();
    let ids = place_order(&memory, &mut tx, 2, 3).await.expect("enqueue");
    assert!(
        claimed_order(&memory).await.is_empty(),
        "invisible before commit"
    );
    tx.commit().expect("commit");
    assert_eq!(claimed_order(&memory).await, expected);
    assert_eq!(ids.len(), 4);
}

#[tokio::test]
async fn batch_enqueue_keeps_order_fields_and_payload_text() {
    let outbox = fresh_outbox().await;
    let msgs: Vec<NewMessage> = (0..300)
        .map(|i| {
            NewMessage::builder("order", format!("{i}"), "OrderPlaced")
                .aggregate_version(i)
                .tenant_id("acme")
                .routing_key("orders.placed")
                .partition_key(format!("k{}", i % 7))
                .header("x-custom", "v")
                .payload_json(format!(r#"{{"z": {i},  "a": [1, 2]}}"#))
                .build()
                .expect("valid")
        })
        .collect();
    let mut tx = outbox.begin().await.expect("begin");
    let ids = outbox.enqueue_batch(&mut tx, &msgs).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let claimed = outbox
        .claim(1000, Duration::from_secs(30))
        .await
        .expect("claim")
        .messages;
    assert_eq!(
        claimed.iter().map(|m| m.id).collect::<Vec<_>>(),
        ids,
        "seq follows input order"
    );
    let m = &claimed[5];
    assert_eq!(
        m.payload.get(),
        r#"{"z": 5,  "a": [1, 2]}"#,
        "json column keeps the text"
    );
    assert_eq!(m.tenant_id.as_deref(), Some("acme"));
    assert_eq!(m.routing_key.as_deref(), Some("orders.placed"));
    assert_eq!(m.partition_key.as_deref(), Some("k5"));
    assert_eq!(m.headers.get("x-custom").map(String::as_str), Some("v"));
    assert_eq!(m.aggregate_version, 5);
}

#[tokio::test]
async fn delayed_message_is_not_claimable_before_its_time() {
    let outbox = fresh_outbox().await;
    let later = NewMessage::builder("order", "1", "Reminder")
        .payload(&1)
        .deliver_after(Duration::from_secs(3600))
        .build()
        .expect("valid");
    let mut tx = outbox.begin().await.expect("begin");
    outbox.enqueue(&mut tx, &later).await.expect("enqueue");
    outbox.enqueue(&mut tx, &event(2)).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let claimed = outbox
        .claim(10, Duration::from_secs(30))
        .await
        .expect("claim")
        .messages;
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].event_type, "OrderPlaced");
}

#[tokio::test]
async fn domain_events_are_drained_once_and_restored_on_failure() {
    let outbox = fresh_outbox().await;
    let mut events = DomainEvents::new();
    events.raise(event(1));
    events.raise(event(2));
    let mut tx = outbox.begin().await.expect("begin");
    let ids = outbox
        .save_events(&mut tx, &mut events)
        .await
        .expect("save");
    assert_eq!(ids.len(), 2);
    // A second save in the same unit of work writes nothing more.
    assert!(
        outbox
            .save_events(&mut tx, &mut events)
            .await
            .expect("save")
            .is_empty()
    );
    tx.commit().await.expect("commit");
    assert_eq!(count_rows(&outbox).await, 2);

    // Failure: the same ids again violate the primary key; the events are put back.
    let mut again = DomainEvents::new();
    let dup = NewMessage::builder("order", "1", "OrderPlaced")
        .id(ids[0])
        .payload(&1)
        .build()
        .expect("valid");
    again.raise(dup);
    let mut tx = outbox.begin().await.expect("begin");
    let err = outbox
        .save_events(&mut tx, &mut again)
        .await
        .expect_err("duplicate id");
    assert!(matches!(err, OutboxError::Database { .. }), "{err}");
    assert_eq!(
        again.pending().len(),
        1,
        "events restored after a failed write"
    );
}

#[tokio::test]
async fn bad_input_gets_typed_errors_and_writes_nothing() {
    let outbox = fresh_outbox().await;
    let invalid_json = NewMessage::builder("order", "1", "OrderPlaced")
        .payload_json("{\"a\":")
        .build();
    assert!(matches!(invalid_json, Err(OutboxError::InvalidMessage(_))));
    let empty_type = NewMessage::builder("order", "1", "").payload(&1).build();
    assert!(matches!(empty_type, Err(OutboxError::InvalidMessage(_))));
    assert_eq!(count_rows(&outbox).await, 0);

    // The database refuses what bypasses the builder, too.
    let bad = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'a', '1', '', '1')",
        outbox.schema()
    )))
    .bind(uuid::Uuid::now_v7())
    .execute(outbox.pool())
    .await;
    assert!(
        bad.is_err(),
        "empty event type is rejected by the CHECK constraint"
    );
    let bad_json = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'a', '1', 'E', '{{oops')",
        outbox.schema()
    )))
    .bind(uuid::Uuid::now_v7())
    .execute(outbox.pool())
    .await;
    assert!(
        bad_json.is_err(),
        "invalid JSON is rejected by the json column"
    );
    assert_eq!(count_rows(&outbox).await, 0);

    for url in [
        "not a url",
        "postgres://host:99999999/db",
        "http://127.0.0.1/x",
    ] {
        let err = PgOutbox::connect(&PgConfig::new(url))
            .await
            .expect_err("malformed URL");
        assert!(matches!(err, OutboxError::Config(_)), "{url}: {err}");
    }
    let err = PgOutbox::connect(
        &PgConfig::new(common::database_url()).with_schema("Robert'); DROP TABLE x;--"),
    )
    .await
    .expect_err("bad schema");
    assert!(matches!(err, OutboxError::Config(_)));
}

#[tokio::test]
async fn unknown_status_code_in_the_table_is_a_typed_error() {
    let outbox = fresh_outbox().await;
    let mut tx = outbox.begin().await.expect("begin");
    let id = outbox.enqueue(&mut tx, &event(1)).await.expect("enqueue");
    tx.commit().await.expect("commit");
    // Simulate a row written by a newer version with a status this one does not know.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {s}.outbox_messages DROP CONSTRAINT outbox_messages_status_check;
         UPDATE {s}.outbox_messages SET status = 7",
        s = outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("corrupt");
    let err = outbox.get(id).await.expect_err("unknown status");
    assert!(matches!(err, OutboxError::UnknownStatus(7)), "{err}");
}

#[tokio::test]
async fn migrations_are_idempotent_and_concurrent_safe() {
    let outbox = fresh_outbox().await;
    let (a, b) = tokio::join!(outbox.migrate(), outbox.migrate());
    assert!(
        a.expect("migrate").is_empty() && b.expect("migrate").is_empty(),
        "already at latest"
    );
    let v: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT max(version) FROM {}.outbox_schema_migrations",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("version");
    assert_eq!(v, outboxkit_postgres::LATEST_VERSION);
}

#[tokio::test]
async fn inbox_suppresses_duplicates_and_rollback_releases_the_claim() {
    let outbox = fresh_outbox().await;
    let inbox = outbox.inbox();
    let id = uuid::Uuid::now_v7();

    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut tx, id, "projector")
            .await
            .expect("claim")
    );
    assert!(
        !inbox
            .try_claim(&mut tx, id, "projector")
            .await
            .expect("claim"),
        "duplicate in same tx"
    );
    assert!(
        inbox.try_claim(&mut tx, id, "mailer").await.expect("claim"),
        "other consumer is independent"
    );
    tx.rollback().await.expect("rollback");

    // The rollback removed the record: the redelivery is processed.
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut tx, id, "projector")
            .await
            .expect("claim")
    );
    tx.commit().await.expect("commit");
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        !inbox
            .try_claim(&mut tx, id, "projector")
            .await
            .expect("claim"),
        "committed duplicate"
    );
    tx.rollback().await.expect("rollback");

    assert!(matches!(
        inbox
            .try_claim(&mut *inbox.pool().acquire().await.expect("conn"), id, "")
            .await,
        Err(OutboxError::Config(_))
    ));
}
