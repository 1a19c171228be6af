//! The producer side on the real MariaDB: `OutboxProducer` writes in the caller's
//! transaction, so a rollback leaves nothing and a commit leaves every message, claimed
//! in the order written (across the 500-row statements of a large batch).

mod common;

use std::time::Duration;

use common::fresh_outbox;
use outboxkit_core::{InvalidMessage, NewMessage, OutboxError, OutboxProducer, OutboxStore};
use outboxkit_mysql::{MySqlConfig, MySqlOutbox};

fn event(n: usize) -> NewMessage {
    NewMessage::builder("order", n.to_string(), "OrderPlaced")
        .aggregate_version(n as i64)
        .payload(&serde_json::json!({ "order": n }))
        .build()
        .expect("valid")
}

async fn count_rows(outbox: &MySqlOutbox) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{}`.outbox_messages",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("count")
}

#[tokio::test]
async fn a_rollback_stores_nothing_and_a_commit_stores_all_in_order() {
    let (outbox, _db) = fresh_outbox().await;
    let lease = Duration::from_secs(30);

    let mut tx = outbox.begin().await.expect("begin");
    outbox.enqueue(&mut tx, &event(0)).await.expect("enqueue");
    outbox
        .enqueue_batch(&mut tx, &(1..10).map(event).collect::<Vec<_>>())
        .await
        .expect("enqueue_batch");
    tx.rollback().await.expect("rollback");
    assert_eq!(count_rows(&outbox).await, 0, "rolled back: nothing stored");

    // More than two of enqueue_batch's 500-row statements.
    let messages: Vec<NewMessage> = (0..1_203).map(event).collect();
    let mut tx = outbox.begin().await.expect("begin");
    let first = outbox
        .enqueue(&mut tx, &messages[0])
        .await
        .expect("enqueue");
    let rest = outbox
        .enqueue_batch(&mut tx, &messages[1..])
        .await
        .expect("enqueue_batch");
    assert!(
        outbox.claim(10, lease).await.expect("claim").is_empty(),
        "invisible to the relay before the commit"
    );
    tx.commit().await.expect("commit");
    let written: Vec<uuid::Uuid> = std::iter::once(first).chain(rest).collect();
    assert_eq!(
        written,
        messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        "the ids, in order"
    );
    let claimed = outbox.claim(2_000, lease).await.expect("claim").messages;
    assert_eq!(
        claimed.iter().map(|m| m.id).collect::<Vec<_>>(),
        written,
        "every message, claimed in the order written"
    );
}

#[tokio::test]
async fn an_oversized_payload_writes_nothing_and_leaves_the_transaction_usable() {
    let (outbox, _db) = fresh_outbox().await;
    let tight = MySqlOutbox::new(
        outbox.pool().clone(),
        &MySqlConfig::new(common::mysql_url())
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
