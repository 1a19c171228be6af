//! SQL Server specifics of the inbox store (what the shared inbox conformance suite in
//! `inbox_conformance.rs` does not state: waits and errors that must leave the
//! transaction usable, long keys, the `inbox` crate's consumer), against a real SQL
//! Server when `MSSQL_URL` is set; each test prints that it was skipped otherwise.

mod common;

use std::time::Duration;

use outbox_core::inbox::{ConsumerDeadLetters, VersionTracking};
use outbox_core::wire::IncomingMessage;
use outbox_core::{InboxStore, NewMessage, OutboxStore};
use outbox_sqlserver::MssqlInbox;
use uuid::Uuid;

async fn inbox(test: &str) -> Option<MssqlInbox> {
    let url = common::mssql_url(test)?;
    let outbox = common::fresh_outbox(&url).await;
    Some(MssqlInbox::new(outbox.pool().clone(), outbox.schema()).expect("inbox"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waiting_on_a_rolled_back_one_wins() {
    let Some(inbox) = inbox("a_claim_waiting_on_a_rolled_back_one_wins").await else {
        return;
    };
    let id = Uuid::now_v7();
    let mut first = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut first, id, "c").await.expect("claim"));
    let second = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.expect("begin");
            let won = inbox.try_claim(&mut tx, id, "c").await.expect("claim");
            // The transaction is still usable: the wait did not doom it.
            inbox
                .record_version(&mut tx, "c", "order", "1", 1)
                .await
                .expect("a statement after the claim");
            inbox.commit(tx).await.expect("commit");
            won
        })
    };
    inbox.rollback(first).await.expect("rollback");
    let won = tokio::time::timeout(Duration::from_secs(30), second)
        .await
        .expect("the second claim finishes once the first rolls back")
        .expect("task");
    assert!(won, "a claim is never lost to a rolled-back one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_claim_leaves_the_transaction_usable() {
    let Some(inbox) = inbox("a_duplicate_claim_leaves_the_transaction_usable").await else {
        return;
    };
    let id = Uuid::now_v7();
    let mut first = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut first, id, "c").await.expect("claim"));
    let second = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.expect("begin");
            // Both found the key missing or this one waits on the first's lock; the
            // duplicate key is caught in the statement either way.
            let won = inbox.try_claim(&mut tx, id, "c").await.expect("claim");
            let other = inbox
                .try_claim(&mut tx, Uuid::now_v7(), "c")
                .await
                .expect("the transaction goes on after a duplicate");
            inbox.commit(tx).await.expect("commit");
            (won, other)
        })
    };
    inbox.commit(first).await.expect("commit");
    let (won, other) = tokio::time::timeout(Duration::from_secs(30), second)
        .await
        .expect("the second claim finishes once the first commits")
        .expect("task");
    assert!(!won, "the second claim of one pair is a duplicate");
    assert!(other, "and its transaction claimed another message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_keys_longer_than_4000_characters_match() {
    let Some(inbox) = inbox("version_keys_longer_than_4000_characters_match").await else {
        return;
    };
    // 3,990 + 20 characters: each parameter fits nvarchar(4000), their concatenation
    // does not.
    let id = "x".repeat(3_990);
    let aggregate_type = "t".repeat(20);
    for version in [1, 2] {
        let mut tx = inbox.begin().await.expect("begin");
        let applied = inbox
            .applied_version(&mut tx, "c", &aggregate_type, &id)
            .await
            .expect("the second message finds the first one's record");
        assert_eq!(applied, (version > 1).then_some(version - 1));
        inbox
            .record_version(&mut tx, "c", &aggregate_type, &id, version)
            .await
            .expect("record");
        inbox.commit(tx).await.expect("commit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_after_an_aborting_error_succeeds() {
    let Some(inbox) = inbox("rollback_after_an_aborting_error_succeeds").await else {
        return;
    };
    let id = Uuid::now_v7();
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, id, "c").await.expect("claim"));
    // A handler's failing statement: under XACT_ABORT ON the server rolls the whole
    // transaction back at once.
    let failed = async {
        tx.simple_query("SELECT CAST(N'not a number' AS int);")
            .await?
            .into_results()
            .await
    }
    .await;
    assert!(failed.is_err(), "the conversion fails (error 245)");
    inbox
        .rollback(tx)
        .await
        .expect("rolling back an already aborted transaction is done, not error 3903");
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox.try_claim(&mut tx, id, "c").await.expect("claim"),
        "the aborted claim left nothing behind"
    );
    inbox
        .rollback(tx)
        .await
        .expect("rollback of a live transaction");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_only_rise() {
    let Some(inbox) = inbox("versions_only_rise").await else {
        return;
    };
    let long_id = "x".repeat(2000);
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut tx, "c", "order", &long_id)
            .await
            .expect("version"),
        None
    );
    inbox
        .record_version(&mut tx, "c", "order", &long_id, 3)
        .await
        .expect("record");
    inbox
        .record_version(&mut tx, "c", "order", &long_id, 2)
        .await
        .expect("record");
    inbox.commit(tx).await.expect("commit");
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut tx, "c", "order", &long_id)
            .await
            .expect("version"),
        Some(3)
    );
    assert_eq!(
        inbox
            .applied_version(&mut tx, "c", "order", "other")
            .await
            .expect("version"),
        None
    );
    inbox.rollback(tx).await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_rolls_back_its_enqueue() {
    let Some(url) = common::mssql_url("a_dropped_transaction_rolls_back_its_enqueue") else {
        return;
    };
    let outbox = common::fresh_outbox(&url).await;
    let event = NewMessage::builder("order", "1", "Placed")
        .payload(&serde_json::json!({}))
        .build()
        .expect("valid");
    {
        let mut tx = outbox.begin().await.expect("begin");
        outbox.enqueue(&mut tx, &event).await.expect("enqueue");
        // Dropped without commit: the connection is discarded, the server rolls back.
    }
    assert!(outbox.get(event.id).await.expect("get").is_none());
    let mut tx = outbox.begin().await.expect("begin");
    outbox.enqueue(&mut tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let row = outbox.get(event.id).await.expect("get").expect("row");
    assert_eq!(row.payload.get(), "{}");
}

/// Writes a projection row on the consumer's transaction (the inbox crate's handler
/// contract: every effect through `conn`).
struct Project {
    table: String,
    fail: bool,
}

#[async_trait::async_trait]
impl inbox::Handler<MssqlInbox> for Project {
    async fn handle(
        &self,
        conn: &mut outbox_sqlserver::MssqlClient,
        msg: &IncomingMessage,
        _ctx: &inbox::HandlerContext,
    ) -> Result<(), inbox::HandlerError> {
        conn.execute(
            format!("INSERT INTO {} (id) VALUES (@P1)", self.table),
            &[&msg.id],
        )
        .await
        .map_err(inbox::HandlerError::retryable)?;
        if self.fail {
            return Err(inbox::HandlerError::retryable(std::io::Error::other(
                "handler failed after writing",
            )));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_crate_consumer_applies_a_message_once() {
    use std::sync::Arc;

    use outbox_core::HandlerDecision;

    let Some(url) = common::mssql_url("the_inbox_crate_consumer_applies_a_message_once") else {
        return;
    };
    let outbox = common::fresh_outbox(&url).await;
    let table = format!("[{}].projection", outbox.schema());
    let mut conn = outbox.pool().get().await.expect("conn");
    conn.simple_query(format!(
        "CREATE TABLE {table} (id uniqueidentifier PRIMARY KEY)"
    ))
    .await
    .expect("create")
    .into_results()
    .await
    .expect("create");
    drop(conn);
    let store = Arc::new(MssqlInbox::new(outbox.pool().clone(), outbox.schema()).expect("inbox"));
    let consumer = inbox::IdempotentConsumer::new(
        Arc::clone(&store),
        inbox::Pipeline::new().on(
            "OrderPlaced",
            "projection",
            Project {
                table: table.clone(),
                fail: false,
            },
        ),
    );
    let msg = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    assert_eq!(
        consumer.process(&msg).await,
        HandlerDecision::Ack,
        "the duplicate is acked without a second effect"
    );

    let failing = inbox::IdempotentConsumer::new(
        Arc::clone(&store),
        inbox::Pipeline::new().on(
            "OrderPlaced",
            "failing",
            Project {
                table: table.clone(),
                fail: true,
            },
        ),
    );
    let other = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(failing.process(&other).await, HandlerDecision::Requeue);

    let mut conn = outbox.pool().get().await.expect("conn");
    let rows = conn
        .simple_query(format!("SELECT COUNT_BIG(*) FROM {table}"))
        .await
        .expect("count")
        .into_row()
        .await
        .expect("count")
        .and_then(|row| row.try_get::<i64, _>(0).ok().flatten());
    assert_eq!(
        rows,
        Some(1),
        "one effect for the duplicate pair, none for the rolled-back failure"
    );
}

/// The consumer's fault properties over SQL Server (as over PostgreSQL in the `inbox`
/// crate's tests): a handler that panics is a counted failure and then a consumer dead
/// letter carrying the panic message; a message no handler subscribes to is recorded
/// under `unhandled` with `UnhandledPolicy::DeadLetter`; an inbox whose pool cannot
/// hand out a connection answers `Defer`, not `Requeue`, and counts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_crate_consumer_survives_faults() {
    use std::sync::Arc;

    use inbox::{
        Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline, UNHANDLED_CONSUMER,
        UnhandledPolicy,
    };
    use outbox_core::HandlerDecision;
    use outbox_sqlserver::{MssqlClient, MssqlConfig};

    struct Panics;
    #[async_trait::async_trait]
    impl Handler<MssqlInbox> for Panics {
        async fn handle(
            &self,
            _: &mut MssqlClient,
            _: &IncomingMessage,
            _: &HandlerContext,
        ) -> Result<(), HandlerError> {
            panic!("projection bug (expected by the test)");
        }
    }

    let Some(url) = common::mssql_url("the_inbox_crate_consumer_survives_faults") else {
        return;
    };
    let outbox = common::fresh_outbox(&url).await;
    let store = Arc::new(MssqlInbox::new(outbox.pool().clone(), outbox.schema()).expect("inbox"));
    let consumer = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new().on("OrderPlaced", "projection", Panics),
    )
    .with_max_deliveries(2)
    .with_unhandled(UnhandledPolicy::DeadLetter);
    let msg = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Requeue);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    let dead = store
        .consumer_dead_letters(Some("projection"), 10)
        .await
        .expect("dead letters");
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0]
            .last_error
            .contains("the handler panicked: projection bug"),
        "{}",
        dead[0].last_error
    );

    let unhandled = IncomingMessage::new(Uuid::now_v7(), "OrderShipped", b"{}".to_vec());
    assert_eq!(consumer.process(&unhandled).await, HandlerDecision::Ack);
    assert!(
        store
            .is_dead(unhandled.id, UNHANDLED_CONSUMER)
            .await
            .expect("dead")
    );

    let starved_pool = MssqlConfig::new(&url)
        .with_schema(outbox.schema())
        .with_max_connections(1)
        .with_acquire_timeout(Duration::from_millis(300))
        .connect()
        .await
        .expect("connect");
    let held = starved_pool.get().await.expect("the only connection");
    let starved = Arc::new(MssqlInbox::new(starved_pool.clone(), outbox.schema()).expect("inbox"));
    let waiting = IdempotentConsumer::new(
        Arc::clone(&starved),
        Pipeline::new().on("OrderPlaced", "projection", Panics),
    );
    let fresh = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(waiting.process(&fresh).await, HandlerDecision::Defer);
    drop(held);
    assert!(
        !store.is_dead(fresh.id, "projection").await.expect("dead"),
        "the outage counted nothing"
    );
}
