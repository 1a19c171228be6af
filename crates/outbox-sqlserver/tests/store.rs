//! The producer side on SQL Server: `OutboxProducer` writes on the caller's client in the
//! caller's transaction, so a rollback leaves nothing and a commit leaves every message,
//! claimed in the order written.

mod common;

use std::time::Duration;

use outboxkit_core::{InvalidMessage, NewMessage, OutboxError, OutboxProducer, OutboxStore};
use outboxkit_sqlserver::{MssqlConfig, MssqlOutbox};

fn event(n: usize) -> NewMessage {
    NewMessage::builder("order", n.to_string(), "OrderPlaced")
        .aggregate_version(n as i64)
        .payload(&serde_json::json!({ "order": n }))
        .build()
        .expect("valid")
}

async fn count_rows(outbox: &MssqlOutbox) -> i32 {
    let mut conn = outbox.pool().get().await.expect("connection");
    let row = conn
        .query(
            format!("SELECT COUNT(*) FROM [{}].outbox_messages", outbox.schema()),
            &[],
        )
        .await
        .expect("count")
        .into_row()
        .await
        .expect("row")
        .expect("one row");
    row.get::<i32, _>(0).expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn a_rollback_stores_nothing_and_a_commit_stores_all_in_order() {
    let outbox = common::fresh_outbox(&common::mssql_url()).await;
    let lease = Duration::from_secs(30);

    let mut tx = outbox.begin().await.expect("begin");
    outbox.enqueue(&mut tx, &event(0)).await.expect("enqueue");
    outbox
        .enqueue_batch(&mut tx, &(1..10).map(event).collect::<Vec<_>>())
        .await
        .expect("enqueue_batch");
    tx.rollback().await.expect("rollback");
    assert_eq!(count_rows(&outbox).await, 0, "rolled back: nothing stored");

    // `BEGIN TRAN` on a client of the caller's own works the same.
    let messages: Vec<NewMessage> = (0..300).map(event).collect();
    let mut conn = outbox.pool().get().await.expect("connection");
    conn.simple_query("BEGIN TRAN")
        .await
        .expect("begin")
        .into_results()
        .await
        .expect("begin");
    let first = outbox
        .enqueue(&mut conn, &messages[0])
        .await
        .expect("enqueue");
    let rest = outbox
        .enqueue_batch(&mut conn, &messages[1..])
        .await
        .expect("enqueue_batch");
    conn.simple_query("COMMIT")
        .await
        .expect("commit")
        .into_results()
        .await
        .expect("commit");
    let written: Vec<uuid::Uuid> = std::iter::once(first).chain(rest).collect();
    assert_eq!(written, messages.iter().map(|m| m.id).collect::<Vec<_>>());
    let claimed = outbox.claim(1_000, lease).await.expect("claim").messages;
    assert_eq!(
        claimed.iter().map(|m| m.id).collect::<Vec<_>>(),
        written,
        "every message, claimed in the order written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn an_oversized_payload_writes_nothing_and_leaves_the_transaction_usable() {
    let outbox = common::fresh_outbox(&common::mssql_url()).await;
    let tight = MssqlOutbox::new(
        outbox.pool().clone(),
        &MssqlConfig::default()
            .with_schema(outbox.schema())
            .with_max_payload_bytes(16),
    )
    .expect("outbox");
    let big = NewMessage::builder("order", "1", "OrderPlaced")
        .payload(&"x".repeat(32))
        .build()
        .expect("valid");
    let mut tx = tight.begin().await.expect("begin");
    let err = tight
        .enqueue_batch(&mut tx, &[event(1), big])
        .await
        .expect_err("over 16 bytes");
    assert!(
        matches!(
            err,
            OutboxError::InvalidMessage(InvalidMessage::PayloadTooLarge { max: 16, .. })
        ),
        "{err}"
    );
    tight
        .enqueue(&mut tx, &event(2))
        .await
        .expect("still usable");
    tx.commit().await.expect("commit");
    assert_eq!(
        count_rows(&outbox).await,
        1,
        "only the message after the refusal"
    );
}
