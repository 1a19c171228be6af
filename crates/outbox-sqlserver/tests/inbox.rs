//! SQL Server specifics of the inbox store (what the shared inbox conformance suite in
//! `inbox_conformance.rs` does not state: waits and errors that must leave the
//! transaction usable, commits of transactions a swallowed error aborted, claims while
//! every pooled connection is held, long keys, the `outboxkit-inbox` crate's consumer), against a
//! real SQL Server: ignored unless run with `--ignored` and `MSSQL_URL` set.

mod common;

use std::time::Duration;

use outboxkit_core::inbox::{ConsumerDeadLetters, VersionTracking};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{InboxStore, NewMessage, OutboxProducer, OutboxStore};
use outboxkit_sqlserver::{MssqlConfig, MssqlInbox, MssqlOutbox};
use uuid::Uuid;

async fn inbox() -> MssqlInbox {
    let outbox = common::fresh_outbox(&common::mssql_url()).await;
    outbox.inbox()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn a_claim_waiting_on_a_rolled_back_one_wins() {
    let inbox = inbox().await;
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
#[ignore = "needs MSSQL_URL"]
async fn a_duplicate_claim_leaves_the_transaction_usable() {
    let inbox = inbox().await;
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
#[ignore = "needs MSSQL_URL"]
async fn version_keys_longer_than_4000_characters_match() {
    let inbox = inbox().await;
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
#[ignore = "needs MSSQL_URL"]
async fn rollback_after_an_aborting_error_succeeds() {
    let inbox = inbox().await;
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
#[ignore = "needs MSSQL_URL"]
async fn versions_only_rise() {
    let inbox = inbox().await;
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
#[ignore = "needs MSSQL_URL"]
async fn a_dropped_transaction_rolls_back_its_enqueue() {
    let url = common::mssql_url();
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

/// Writes a projection row on the consumer's transaction (the outboxkit-inbox crate's handler
/// contract: every effect through `conn`).
struct Project {
    table: String,
    fail: bool,
}

#[async_trait::async_trait]
impl outboxkit_inbox::Handler<MssqlInbox> for Project {
    async fn handle(
        &self,
        conn: &mut outboxkit_sqlserver::MssqlClient,
        msg: &IncomingMessage,
        _ctx: &outboxkit_inbox::HandlerContext,
    ) -> Result<(), outboxkit_inbox::HandlerError> {
        conn.execute(
            format!("INSERT INTO {} (id) VALUES (@P1)", self.table),
            &[&msg.id],
        )
        .await
        .map_err(outboxkit_inbox::HandlerError::retryable)?;
        if self.fail {
            return Err(outboxkit_inbox::HandlerError::retryable(
                std::io::Error::other("handler failed after writing"),
            ));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn the_inbox_crate_consumer_applies_a_message_once() {
    use std::sync::Arc;

    use outboxkit_core::HandlerDecision;

    let url = common::mssql_url();
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
    let store = Arc::new(outbox.inbox());
    let consumer = outboxkit_inbox::IdempotentConsumer::new(
        Arc::clone(&store),
        outboxkit_inbox::Pipeline::new().on(
            "OrderPlaced",
            "projection",
            Project {
                table: table.clone(),
                fail: false,
            },
        ),
        outboxkit_inbox::ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msg = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    assert_eq!(
        consumer.process(&msg).await,
        HandlerDecision::Ack,
        "the duplicate is acked without a second effect"
    );

    let failing = outboxkit_inbox::IdempotentConsumer::new(
        Arc::clone(&store),
        outboxkit_inbox::Pipeline::new().on(
            "OrderPlaced",
            "failing",
            Project {
                table: table.clone(),
                fail: true,
            },
        ),
        outboxkit_inbox::ConsumerConfig::new(),
    )
    .expect("valid consumer config");
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

/// The consumer's fault properties over SQL Server (as over PostgreSQL in the `outboxkit-inbox`
/// crate's tests): a handler that panics is a counted failure and then a consumer dead
/// letter carrying the panic message; a message no handler subscribes to is recorded
/// under `unhandled` with `UnhandledPolicy::DeadLetter`; an inbox whose pool cannot
/// hand out a connection answers `Defer`, not `Requeue`, and counts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn the_inbox_crate_consumer_survives_faults() {
    use std::sync::Arc;

    use outboxkit_core::HandlerDecision;
    use outboxkit_inbox::{
        ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
        UNHANDLED_CONSUMER, UnhandledPolicy,
    };
    use outboxkit_sqlserver::{MssqlClient, MssqlConfig};

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

    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let store = Arc::new(outbox.inbox());
    let consumer = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new().on("OrderPlaced", "projection", Panics),
        ConsumerConfig::new()
            .with_max_deliveries(2)
            .with_unhandled(UnhandledPolicy::DeadLetter),
    )
    .expect("valid consumer config");
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

    let starved_pool = MssqlOutbox::connect(
        &MssqlConfig::new(&url)
            .with_schema(outbox.schema())
            .with_max_connections(1)
            .with_acquire_timeout(Duration::from_millis(300)),
    )
    .await
    .expect("connect")
    .pool()
    .clone();
    let held = starved_pool.get().await.expect("the only connection");
    let starved = Arc::new(
        MssqlOutbox::new(
            starved_pool.clone(),
            &MssqlConfig::default().with_schema(outbox.schema()),
        )
        .expect("outbox")
        .inbox(),
    );
    let waiting = IdempotentConsumer::new(
        Arc::clone(&starved),
        Pipeline::new().on("OrderPlaced", "projection", Panics),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let fresh = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(waiting.process(&fresh).await, HandlerDecision::Defer);
    drop(held);
    assert!(
        !store.is_dead(fresh.id, "projection").await.expect("dead"),
        "the outage counted nothing"
    );
}

/// A pool of `connections` over `outbox`'s schema, giving up on a borrow after 5 s (the
/// default 10 s would only make a starved test slower to fail).
async fn small_pool(
    url: &str,
    outbox: &outboxkit_sqlserver::MssqlOutbox,
    connections: u32,
) -> MssqlInbox {
    let pool = outboxkit_sqlserver::MssqlOutbox::connect(
        &outboxkit_sqlserver::MssqlConfig::new(url)
            .with_schema(outbox.schema())
            .with_max_connections(connections)
            .with_acquire_timeout(Duration::from_secs(5)),
    )
    .await
    .expect("connect")
    .pool()
    .clone();
    MssqlOutbox::new(pool, &MssqlConfig::default().with_schema(outbox.schema()))
        .expect("outbox")
        .inbox()
}

/// Makes `(id, consumer)` a consumer dead letter (one failure of at most one).
async fn kill(inbox: &MssqlInbox, id: Uuid, consumer: &str) {
    let msg = IncomingMessage::new(id, "OrderPlaced", b"{}".to_vec());
    let count = inbox
        .record_failure(&msg, consumer, "poison", 1)
        .await
        .expect("record failure");
    assert!(count.dead);
}

/// Issue 26 item 7: with every pooled connection held by a consumer transaction, the
/// dead-letter check and the claim must not need another one. The default
/// `claim_unless_dead` asked `is_dead` on the pool: each holder waited for a connection
/// only another holder could free, until the acquire timeout, and every delivery was
/// deferred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn claims_never_wait_for_a_second_connection() {
    use outboxkit_core::inbox::InboxClaim;

    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let inbox = small_pool(&url, &outbox, 2).await;
    let (dead, done) = (Uuid::now_v7(), Uuid::now_v7());
    kill(&inbox, dead, "c").await;
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, done, "c").await.expect("claim"));
    inbox.commit(tx).await.expect("commit");

    // Both connections held by transactions at once, each claiming on its own.
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let holders: Vec<_> = (0..2)
        .map(|n| {
            let (inbox, barrier) = (inbox.clone(), std::sync::Arc::clone(&barrier));
            tokio::spawn(async move {
                let mut tx = inbox.begin().await.expect("begin");
                barrier.wait().await; // now no connection is free
                let fresh = Uuid::now_v7();
                let single = [
                    inbox.claim_unless_dead(&mut tx, fresh, "c").await,
                    inbox.claim_unless_dead(&mut tx, dead, "c").await,
                    inbox.claim_unless_dead(&mut tx, done, "c").await,
                    inbox.claim_unless_dead(&mut tx, fresh, "c").await,
                ];
                let other = Uuid::now_v7();
                let pairs = [(done, "c"), (other, "c"), (dead, "c"), (other, "c")];
                let batch = inbox.claim_batch_unless_dead(&mut tx, &pairs).await;
                inbox.commit(tx).await.expect("commit");
                (n, single, batch)
            })
        })
        .collect();
    for holder in holders {
        let (n, single, batch) = tokio::time::timeout(Duration::from_secs(30), holder)
            .await
            .expect("claims finish while both connections are held")
            .expect("task");
        let single: Vec<InboxClaim> = single
            .into_iter()
            .map(|c| c.expect("no second connection needed"))
            .collect();
        assert_eq!(
            single,
            [
                InboxClaim::Claimed,
                InboxClaim::DeadLetter,
                InboxClaim::Duplicate,
                InboxClaim::Duplicate, // claimed earlier in this transaction
            ],
            "holder {n}"
        );
        assert_eq!(
            batch.expect("no second connection needed"),
            [
                InboxClaim::Duplicate,
                InboxClaim::Claimed,
                InboxClaim::DeadLetter,
                InboxClaim::Duplicate,
            ],
            "holder {n}"
        );
    }

    // Eight concurrent claimers on two connections: each waits for a connection to
    // begin, never for a second one once it has begun.
    let claimers: Vec<_> = (0..8)
        .map(|_| {
            let inbox = inbox.clone();
            tokio::spawn(async move {
                let id = Uuid::now_v7();
                let mut tx = inbox.begin().await?;
                let claim = inbox.claim_unless_dead(&mut tx, id, "c").await?;
                tokio::time::sleep(Duration::from_millis(50)).await; // a handler's work
                inbox.commit(tx).await?;
                Ok::<_, outboxkit_core::OutboxError>((id, claim))
            })
        })
        .collect();
    for claimer in claimers {
        let (id, claim) = tokio::time::timeout(Duration::from_secs(60), claimer)
            .await
            .expect("every claimer finishes")
            .expect("task")
            .expect("no pool timeout");
        assert_eq!(claim, InboxClaim::Claimed);
        let mut tx = inbox.begin().await.expect("begin");
        assert_eq!(
            inbox
                .claim_unless_dead(&mut tx, id, "c")
                .await
                .expect("claim"),
            InboxClaim::Duplicate,
            "committed"
        );
        inbox.rollback(tx).await.expect("rollback");
    }
}

/// Writes a row on the consumer's transaction and holds it a while, so that concurrent
/// deliveries hold every pooled connection at once.
struct SlowProject {
    table: String,
}

#[async_trait::async_trait]
impl outboxkit_inbox::Handler<MssqlInbox> for SlowProject {
    async fn handle(
        &self,
        conn: &mut outboxkit_sqlserver::MssqlClient,
        msg: &IncomingMessage,
        _ctx: &outboxkit_inbox::HandlerContext,
    ) -> Result<(), outboxkit_inbox::HandlerError> {
        conn.execute(
            format!("INSERT INTO {} (id) VALUES (@P1)", self.table),
            &[&msg.id],
        )
        .await
        .map_err(outboxkit_inbox::HandlerError::retryable)?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok(())
    }
}

/// The symptom of issue 26 item 7 through the `outboxkit-inbox` crate: an `IdempotentConsumer`
/// handling more deliveries at once than its pool has connections acks them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn a_consumer_busier_than_its_pool_acks_every_delivery() {
    use std::sync::Arc;

    use outboxkit_core::HandlerDecision;

    let url = common::mssql_url();
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
    let store = Arc::new(small_pool(&url, &outbox, 2).await);
    let consumer = Arc::new(
        outboxkit_inbox::IdempotentConsumer::new(
            Arc::clone(&store),
            outboxkit_inbox::Pipeline::new().on(
                "OrderPlaced",
                "projection",
                SlowProject {
                    table: table.clone(),
                },
            ),
            outboxkit_inbox::ConsumerConfig::new(),
        )
        .expect("valid consumer config"),
    );
    let deliveries: Vec<_> = (0..6)
        .map(|_| {
            let consumer = Arc::clone(&consumer);
            tokio::spawn(async move {
                let msg = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
                consumer.process(&msg).await
            })
        })
        .collect();
    for delivery in deliveries {
        let decision = tokio::time::timeout(Duration::from_secs(60), delivery)
            .await
            .expect("every delivery is decided")
            .expect("task");
        assert_eq!(decision, HandlerDecision::Ack);
    }
    let mut conn = outbox.pool().get().await.expect("conn");
    let rows = conn
        .simple_query(format!("SELECT COUNT_BIG(*) FROM {table}"))
        .await
        .expect("count")
        .into_row()
        .await
        .expect("count")
        .and_then(|row| row.try_get::<i64, _>(0).ok().flatten());
    assert_eq!(rows, Some(6), "one effect per delivery");
}

/// Runs `sql` on `tx` as a handler that swallows its error would, returning whether it
/// failed.
async fn swallow(tx: &mut outboxkit_sqlserver::MssqlTransaction, sql: &str) -> bool {
    let result = async { tx.simple_query(sql).await?.into_results().await }.await;
    result.is_err()
}

/// A commit is only a commit when the server says so (`InboxStore::commit`'s contract):
/// a transaction a swallowed error aborted is `TransactionAborted`, and nothing of it
/// committed; a statement-level error with `XACT_ABORT OFF` did not abort it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn commit_reports_a_transaction_a_swallowed_error_aborted() {
    use outboxkit_core::OutboxError;

    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    // One connection: every transaction below reuses the previous one's.
    let inbox = small_pool(&url, &outbox, 1).await;
    let session = |inbox: &MssqlInbox| {
        let pool = inbox.pool().clone();
        async move {
            let mut conn = pool
                .get()
                .await
                .expect("the only connection, back in the pool");
            let row = conn
                .simple_query("SELECT @@TRANCOUNT, CAST(@@OPTIONS & 16384 AS int)")
                .await
                .expect("query")
                .into_row()
                .await
                .expect("row")
                .expect("a row");
            let trancount: i32 = row.try_get(0).expect("int").expect("not null");
            let xact_abort: i32 = row.try_get(1).expect("int").expect("not null");
            (trancount, xact_abort != 0)
        }
    };

    // XACT_ABORT ON (the session default): the error rolled everything back at once.
    let id = Uuid::now_v7();
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, id, "c").await.expect("claim"));
    assert!(swallow(&mut tx, "SELECT CAST(N'not a number' AS int);").await);
    match inbox.commit(tx).await {
        Err(OutboxError::TransactionAborted { operation }) => {
            assert_eq!(operation, "inbox_commit");
        }
        other => panic!("expected TransactionAborted, got {other:?}"),
    }
    assert_eq!(session(&inbox).await, (0, true), "clean connection, reused");
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox.try_claim(&mut tx, id, "c").await.expect("claim"),
        "the aborted claim did not commit"
    );
    inbox.rollback(tx).await.expect("rollback");

    // Doomed inside TRY ... CATCH: the server rolls it back at the end of that batch
    // (3998, which the handler swallows too).
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, id, "c").await.expect("claim"));
    swallow(
        &mut tx,
        "BEGIN TRY SELECT CAST(N'not a number' AS int); END TRY BEGIN CATCH END CATCH;",
    )
    .await;
    assert!(matches!(
        inbox.commit(tx).await,
        Err(OutboxError::TransactionAborted { .. })
    ));

    // The handler's own ROLLBACK ends the inbox's transaction too.
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, id, "c").await.expect("claim"));
    assert!(!swallow(&mut tx, "ROLLBACK TRANSACTION;").await);
    assert!(matches!(
        inbox.commit(tx).await,
        Err(OutboxError::TransactionAborted { .. })
    ));

    // XACT_ABORT OFF and a statement-level error (a duplicate key): only the statement
    // failed, the transaction commits, and the session gets XACT_ABORT ON back.
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, id, "c").await.expect("claim"));
    let insert = format!(
        "SET XACT_ABORT OFF; INSERT INTO [{}].inbox_records (message_id, consumer) VALUES ('{id}', N'c');",
        outbox.schema()
    );
    assert!(swallow(&mut tx, &insert).await, "2627");
    inbox
        .commit(tx)
        .await
        .expect("a transaction that can commit commits");
    assert_eq!(session(&inbox).await, (0, true));
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        !inbox.try_claim(&mut tx, id, "c").await.expect("claim"),
        "committed"
    );
    inbox.rollback(tx).await.expect("rollback");

    // A nested BEGIN TRANSACTION left open is committed with the transaction, and the
    // connection goes back to the pool with none open.
    let nested = Uuid::now_v7();
    let mut tx = inbox.begin().await.expect("begin");
    assert!(!swallow(&mut tx, "BEGIN TRANSACTION;").await);
    assert!(inbox.try_claim(&mut tx, nested, "c").await.expect("claim"));
    inbox.commit(tx).await.expect("commit");
    assert_eq!(session(&inbox).await, (0, true));
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        !inbox.try_claim(&mut tx, nested, "c").await.expect("claim"),
        "committed"
    );
    inbox.rollback(tx).await.expect("rollback");
}

/// After a swallowed error rolled the transaction back, recording the version would
/// run on its own and commit: the redelivered message would then find its own version
/// applied and be skipped as stale. It is refused instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn a_version_is_not_recorded_after_the_transaction_aborted() {
    use outboxkit_core::OutboxError;

    let inbox = inbox().await;
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut tx, "c", "order", "1")
            .await
            .expect("version"),
        None
    );
    inbox
        .record_version(&mut tx, "c", "order", "1", 1)
        .await
        .expect("record");
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut tx, Uuid::now_v7(), "c")
            .await
            .expect("claim")
    );
    assert_eq!(
        inbox
            .applied_version(&mut tx, "c", "order", "1")
            .await
            .expect("version"),
        Some(1)
    );
    assert!(swallow(&mut tx, "SELECT CAST(N'not a number' AS int);").await);
    match inbox.record_version(&mut tx, "c", "order", "1", 2).await {
        Err(OutboxError::TransactionAborted { operation }) => {
            assert_eq!(operation, "inbox_version");
        }
        other => panic!("expected TransactionAborted, got {other:?}"),
    }
    inbox.rollback(tx).await.expect("rollback");
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut tx, "c", "order", "1")
            .await
            .expect("version"),
        Some(1),
        "the version did not rise"
    );
    inbox.rollback(tx).await.expect("rollback");
}
