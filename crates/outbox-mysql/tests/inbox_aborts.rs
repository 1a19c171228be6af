//! A handler that swallows a real rollback of its transaction, on the MySQL inbox over
//! the real MariaDB and RabbitMQ: the handler's own `ROLLBACK`, or a real InnoDB
//! deadlock it is made the victim of (error 1213), caught and ignored; it then goes on
//! with another statement and returns `Ok`, on a versioned message, in the per-message
//! consumer and in `run_batched`. Nothing may be acked without its effect: the
//! sabotaged delivery fails, and its redelivery applies the message exactly once (the
//! statement the handler sent after the rollback included, once, not twice).

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lapin::types::FieldTable;
use outboxkit_core::InboxStore as _;
use outboxkit_core::consumer::{BatchDeliveryHandler, DeliveryHandler, HandlerDecision};
use outboxkit_core::inbox::{ConsumerDeadLetters as _, VersionTracking as _};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{
    BatchSettings, Consumer as _, EventPublisher as _, NewMessage, OutboxMessage,
};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_mysql::{MySqlInbox, MySqlOutbox};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};
use outboxkit_testkit::rabbit::{Fixture, eventually, relay_fixture};
use sqlx::{AssertSqlSafe, Executor as _, MySqlConnection, MySqlPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const CONSUMER: &str = "projector";

/// How the handler loses its transaction, once, on one message.
#[derive(Debug, Clone, Copy)]
enum Sabotage {
    /// It sends `ROLLBACK` itself.
    Rollback,
    /// InnoDB makes it a deadlock victim (the error is caught and ignored).
    Deadlock,
}

/// Writes the message's effect, loses its transaction the first time it handles the
/// sabotaged message (without returning an error), then writes a second row, `late`
/// (a statement sent after the rollback), and returns `Ok`. Each row counts how often
/// it was written.
struct Hostile {
    schema: String,
    monitor: MySqlPool,
    target: Uuid,
    sabotage: Sabotage,
    done: Mutex<bool>,
}

impl Hostile {
    async fn count(&self, conn: &mut MySqlConnection, table: &str, id: Uuid) -> sqlx::Result<()> {
        let schema = &self.schema;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{schema}`.{table} (message_id, applied) VALUES (?, 1)
             ON DUPLICATE KEY UPDATE applied = applied + 1"
        )))
        .bind(id)
        .execute(conn)
        .await
        .map(drop)
    }
}

#[async_trait]
impl Handler<MySqlInbox> for Hostile {
    async fn handle(
        &self,
        conn: &mut MySqlConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        self.count(conn, "effects", msg.id).await?;
        let sabotage = msg.id == self.target
            && !std::mem::replace(&mut *self.done.lock().expect("lock"), true);
        if sabotage {
            match self.sabotage {
                Sabotage::Rollback => {
                    conn.execute("ROLLBACK").await?;
                }
                Sabotage::Deadlock => {
                    // Caught and ignored, as a handler that treats a failed statement
                    // as "nothing to do" would.
                    let e = common::make_deadlock_victim(conn, &self.schema, &self.monitor).await;
                    assert!(e.to_string().contains("1213"), "a deadlock: {e}");
                }
            }
        }
        self.count(conn, "late", msg.id).await?;
        Ok(())
    }
}

/// The idempotent consumer, checking at each `Ack` that the message's effect is
/// committed (read on another connection): any message acked without it is recorded.
struct Checked {
    inner: IdempotentConsumer<MySqlInbox>,
    pool: MySqlPool,
    schema: String,
    acked: Arc<Mutex<HashSet<Uuid>>>,
    without_effect: Arc<Mutex<Vec<Uuid>>>,
}

impl Checked {
    async fn answered(&self, id: Uuid, decision: HandlerDecision) {
        if decision != HandlerDecision::Ack {
            return;
        }
        let applied: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}`.effects WHERE message_id = ?",
            self.schema
        )))
        .bind(id)
        .fetch_one(&self.pool)
        .await
        .expect("effects");
        if applied == 0 {
            self.without_effect.lock().expect("lock").push(id);
        }
        self.acked.lock().expect("lock").insert(id);
    }
}

#[async_trait]
impl DeliveryHandler for Checked {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let decision = self.inner.process(msg).await;
        self.answered(msg.id, decision).await;
        decision
    }
}

#[async_trait]
impl BatchDeliveryHandler for Checked {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        let decisions = self.inner.process_batch(msgs).await;
        for (msg, decision) in msgs.iter().zip(&decisions) {
            self.answered(msg.id, *decision).await;
        }
        decisions
    }
}

/// A versioned message of an aggregate of its own.
fn message(version: i64) -> OutboxMessage {
    let id = Uuid::now_v7();
    let msg = NewMessage::builder("order", id.to_string(), "OrderPlaced")
        .id(id)
        .aggregate_version(version)
        .payload_json("{}")
        .build()
        .expect("valid");
    OutboxMessage::claimed_from(msg, chrono::Utc::now())
}

async fn counts(outbox: &MySqlOutbox, table: &str) -> HashMap<Uuid, i32> {
    sqlx::query_as::<_, (Uuid, i32)>(AssertSqlSafe(format!(
        "SELECT message_id, applied FROM `{}`.{table}",
        outbox.schema()
    )))
    .fetch_all(outbox.pool())
    .await
    .expect(table)
    .into_iter()
    .collect()
}

/// Ten messages, each version 2 of an aggregate whose version 1 the consumer applied
/// already, the sixth sabotaged the first time it is handled: every one ends applied
/// exactly once (its effect and its `late` row written once, its inbox record and
/// version 2 recorded), none acked before its effect committed, none a dead letter.
async fn a_swallowed_rollback_is_never_acked_without_its_effect(sabotage: Sabotage, batched: bool) {
    let (outbox, _drop) = common::fresh_outbox().await;
    let schema = outbox.schema().to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE `{schema}`.effects (message_id BINARY(16) PRIMARY KEY, applied INT NOT NULL);
         CREATE TABLE `{schema}`.late (message_id BINARY(16) PRIMARY KEY, applied INT NOT NULL);"
    )))
    .execute(outbox.pool())
    .await
    .expect("tables");
    common::create_deadlock_probe(outbox.pool(), &schema).await;
    let messages: Vec<OutboxMessage> = (0..10).map(|_| message(2)).collect();
    let target = messages[5].id;
    // Version 1 of each aggregate was applied before: a version recorded without its
    // effect would make the redelivery stale.
    let inbox = outbox.inbox();
    for m in &messages {
        let mut tx = inbox.begin().await.expect("begin");
        inbox
            .applied_version(&mut tx, CONSUMER, &m.aggregate_type, &m.aggregate_id)
            .await
            .expect("lock the version");
        inbox
            .record_version(&mut tx, CONSUMER, &m.aggregate_type, &m.aggregate_id, 1)
            .await
            .expect("version 1");
        inbox.commit(tx).await.expect("commit");
    }

    let fx: Fixture = relay_fixture(FieldTable::default()).await;
    let rabbit = RabbitConfig::new(outboxkit_testkit::rabbit::amqp_url())
        .with_exchange(&fx.exchange)
        .with_declare_exchange(false);
    let publisher = RabbitPublisher::connect(rabbit.clone())
        .await
        .expect("publisher");
    let outcomes = publisher.publish_batch(&messages).await;
    assert!(outcomes.iter().all(|o| o.is_published()), "{outcomes:?}");
    publisher.close().await;

    let acked = Arc::new(Mutex::new(HashSet::new()));
    let without_effect = Arc::new(Mutex::new(Vec::new()));
    let handler = Checked {
        inner: IdempotentConsumer::new(
            Arc::new(outbox.inbox()),
            Pipeline::new().on(
                "OrderPlaced",
                CONSUMER,
                Hostile {
                    schema: schema.clone(),
                    monitor: outbox.pool().clone(),
                    target,
                    sabotage,
                    done: Mutex::new(false),
                },
            ),
            ConsumerConfig::new().with_max_deliveries(3),
        )
        .expect("valid consumer config"),
        pool: outbox.pool().clone(),
        schema: schema.clone(),
        acked: Arc::clone(&acked),
        without_effect: Arc::clone(&without_effect),
    };
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit, &fx.queue)
            .with_declare_queue(false)
            .with_prefetch(10)
            .with_batch(
                BatchSettings::new()
                    .with_size(10)
                    .with_linger(Duration::from_millis(200)),
            )
            .with_requeue_delay(Duration::from_millis(50)),
    )
    .expect("consumer");
    let token = CancellationToken::new();
    let running = {
        let t = token.clone();
        tokio::spawn(async move {
            if batched {
                consumer.run_batched(handler, t).await
            } else {
                consumer.run(handler, t).await
            }
        })
    };
    assert!(
        eventually(Duration::from_secs(60), || async {
            acked.lock().expect("lock").len() == messages.len()
        })
        .await,
        "every message is acked: {} of {}",
        acked.lock().expect("lock").len(),
        messages.len()
    );
    token.cancel();
    running.await.expect("join").expect("consumer");
    fx.delete_exchange().await;

    assert_eq!(
        *without_effect.lock().expect("lock"),
        Vec::<Uuid>::new(),
        "messages acked without their effect (the sabotaged one is {target})"
    );
    let (effects, late) = (
        counts(&outbox, "effects").await,
        counts(&outbox, "late").await,
    );
    let versions: HashMap<Vec<u8>, Option<i64>> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT aggregate_id, version FROM `{schema}`.inbox_versions WHERE consumer = ?"
    )))
    .bind(CONSUMER)
    .fetch_all(outbox.pool())
    .await
    .expect("versions")
    .into_iter()
    .collect();
    let records: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{schema}`.inbox_records WHERE consumer = ?"
    )))
    .bind(CONSUMER)
    .fetch_one(outbox.pool())
    .await
    .expect("records");
    for m in &messages {
        let which = if m.id == target { "the sabotaged" } else { "a" };
        assert_eq!(
            effects.get(&m.id),
            Some(&1),
            "{which} message's effect is applied exactly once ({})",
            m.id
        );
        assert_eq!(
            late.get(&m.id),
            Some(&1),
            "{which} message's statement after the rollback is committed once ({})",
            m.id
        );
        assert_eq!(
            versions.get(m.aggregate_id.as_bytes()),
            Some(&Some(2)),
            "{which} message's version is recorded ({})",
            m.id
        );
    }
    assert_eq!(records, 10, "one inbox record per message");
    let dead = outbox
        .inbox()
        .consumer_dead_letters(None, 10)
        .await
        .expect("dead letters");
    assert!(dead.is_empty(), "no dead letter: {dead:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_own_rollback_is_never_acked_without_its_effect() {
    a_swallowed_rollback_is_never_acked_without_its_effect(Sabotage::Rollback, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_deadlock_is_never_acked_without_its_effect() {
    a_swallowed_rollback_is_never_acked_without_its_effect(Sabotage::Deadlock, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_own_rollback_in_a_batch_is_never_acked_without_its_effect() {
    a_swallowed_rollback_is_never_acked_without_its_effect(Sabotage::Rollback, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_deadlock_in_a_batch_is_never_acked_without_its_effect() {
    a_swallowed_rollback_is_never_acked_without_its_effect(Sabotage::Deadlock, true).await;
}

/// The inbox's transaction turns autocommit off for its session and back on when it
/// ends (commit, rollback, or the commit of a transaction a rollback ended), so the
/// connection goes back to the pool as it came; a nested `begin` inside it is a
/// savepoint; dropped unended, its connection is closed rather than reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_transaction_gives_its_connection_back_in_autocommit() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let schema = outbox.schema().to_owned();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE `{schema}`.effects (message_id BINARY(16) PRIMARY KEY, applied INT NOT NULL)"
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    // One connection: every transaction below runs on it, unless it was closed.
    let config = outboxkit_mysql::MySqlConfig::new(common::mysql_url())
        .with_schema(&schema)
        .with_max_connections(1);
    let inbox = MySqlOutbox::connect(&config).await.expect("outbox").inbox();
    let session = async || -> (u64, i64) {
        sqlx::query_as("SELECT CONNECTION_ID(), @@autocommit")
            .fetch_one(inbox.pool())
            .await
            .expect("session")
    };
    let (first, autocommit) = session().await;
    assert_eq!(autocommit, 1);
    let claim = async |tx: &mut outboxkit_mysql::MySqlInboxTransaction| {
        let id = Uuid::now_v7();
        assert!(inbox.try_claim(tx, id, CONSUMER).await.expect("claim"));
        id
    };
    let claimed = async |id: Uuid| -> bool {
        let mut tx = inbox.begin().await.expect("begin");
        let again = inbox.try_claim(&mut tx, id, CONSUMER).await.expect("claim");
        inbox.rollback(tx).await.expect("rollback");
        !again
    };

    let mut tx = inbox.begin().await.expect("begin");
    let committed = claim(&mut tx).await;
    inbox.commit(tx).await.expect("commit");
    assert_eq!(session().await, (first, 1), "after a commit");
    assert!(claimed(committed).await, "the commit committed");

    let mut tx = inbox.begin().await.expect("begin");
    let rolled_back = claim(&mut tx).await;
    inbox.rollback(tx).await.expect("rollback");
    assert_eq!(session().await, (first, 1), "after a rollback");
    assert!(!claimed(rolled_back).await, "the rollback rolled back");

    let mut tx = inbox.begin().await.expect("begin");
    let aborted = claim(&mut tx).await;
    tx.execute("ROLLBACK").await.expect("ROLLBACK");
    tx.execute(AssertSqlSafe(format!(
        "INSERT INTO `{schema}`.effects (message_id, applied) VALUES (UNHEX(REPLACE('{aborted}', '-', '')), 1)"
    )))
    .await
    .expect("a statement after the rollback");
    match inbox.commit(tx).await {
        Err(outboxkit_core::OutboxError::TransactionAborted { .. }) => {}
        other => panic!("the commit after a rollback is TransactionAborted, got {other:?}"),
    }
    assert_eq!(session().await, (first, 1), "after an aborted commit");
    assert!(!claimed(aborted).await, "the claim was rolled back");
    assert!(
        counts(&outbox, "effects").await.is_empty(),
        "the statement after the rollback was rolled back"
    );

    // A handler's nested transaction is a savepoint of the inbox's.
    let mut tx = inbox.begin().await.expect("begin");
    let outer = claim(&mut tx).await;
    {
        let mut nested = sqlx::Connection::begin(&mut *tx)
            .await
            .expect("nested begin");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{schema}`.effects (message_id, applied) VALUES (?, 1)"
        )))
        .bind(outer)
        .execute(&mut *nested)
        .await
        .expect("insert");
        nested.rollback().await.expect("rollback to the savepoint");
    }
    inbox.commit(tx).await.expect("commit");
    assert!(claimed(outer).await, "the outer transaction committed");
    assert!(
        counts(&outbox, "effects").await.is_empty(),
        "the savepoint was rolled back alone"
    );
    assert_eq!(session().await, (first, 1), "after a nested transaction");

    let tx = inbox.begin().await.expect("begin");
    drop(tx);
    let (next, autocommit) = session().await;
    assert_ne!(
        next, first,
        "a transaction dropped unended closes its connection"
    );
    assert_eq!(autocommit, 1);
}
