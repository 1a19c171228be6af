//! The outbox-core inbox conformance suite (claims, consumer dead letters, version
//! tracking, the durable inbox, and the commit of an aborted transaction), run against
//! the real MariaDB / MySQL, a fresh database per property.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::inbox_conformance::{AbortingHarness, InboxHarness};
use outbox_mysql::MySqlInbox;
use sqlx::{AssertSqlSafe, Connection, MySqlConnection};

/// A [`MySqlInbox`] over a fresh, migrated database (its name; dropped with the
/// guard).
struct MySqlInboxHarness(
    Arc<MySqlInbox>,
    String,
    #[allow(dead_code)] // reason: held for its Drop
    common::DropDatabase,
);

impl InboxHarness for MySqlInboxHarness {
    type Inbox = MySqlInbox;

    fn inbox(&self) -> Arc<MySqlInbox> {
        Arc::clone(&self.0)
    }
}

#[async_trait]
impl AbortingHarness for MySqlInboxHarness {
    /// InnoDB aborts a transaction whole only as a deadlock victim (any other failed
    /// statement is undone alone and the transaction goes on), so this makes `conn` one:
    /// it locks row 1, a second connection that has written more (InnoDB rolls back the
    /// transaction that wrote less) locks row 2 and waits for row 1, and `conn` asks for
    /// row 2.
    async fn swallow_a_failed_statement(&self, conn: &mut MySqlConnection) {
        let s = &self.1;
        sqlx::query(AssertSqlSafe(format!(
            "SELECT id FROM `{s}`.deadlock_probe WHERE id = 1 FOR UPDATE"
        )))
        .fetch_all(&mut *conn)
        .await
        .expect("lock row 1");
        let mut other = MySqlConnection::connect(&common::mysql_url())
            .await
            .expect("connect");
        let other_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut other)
            .await
            .expect("connection id");
        let schema = s.clone();
        let waiter = tokio::spawn(async move {
            let mut tx = other.begin().await.expect("begin");
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO `{schema}`.deadlock_ballast (n)
                 WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 200)
                 SELECT n FROM r"
            )))
            .execute(&mut *tx)
            .await
            .expect("ballast");
            sqlx::query(AssertSqlSafe(format!(
                "SELECT id FROM `{schema}`.deadlock_probe WHERE id = 2 FOR UPDATE"
            )))
            .fetch_all(&mut *tx)
            .await
            .expect("lock row 2");
            let waited = sqlx::query(AssertSqlSafe(format!(
                "SELECT id FROM `{schema}`.deadlock_probe WHERE id = 1 FOR UPDATE"
            )))
            .fetch_all(&mut *tx)
            .await;
            let _ = tx.rollback().await;
            waited.is_ok()
        });
        // Wait (with a deadline) until the other transaction waits for row 1.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            // The statement waiting for a primary-key row shows as running in the
            // process list (InnoDB waits for the lock while the optimizer reads the
            // row as a constant: state "Statistics").
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.processlist
                  WHERE id = ? AND info LIKE '%id = 1 FOR UPDATE'",
            )
            .bind(other_id)
            .fetch_one(self.0.pool())
            .await
            .expect("processlist");
            if waiting > 0 {
                // It is in the statement; give it a moment to reach the lock queue.
                tokio::time::sleep(Duration::from_millis(200)).await;
                break;
            }
            if tokio::time::Instant::now() > deadline {
                let rows: Vec<(i64, Option<String>, Option<String>)> =
                    sqlx::query_as("SELECT id, state, info FROM information_schema.processlist")
                        .fetch_all(self.0.pool())
                        .await
                        .expect("processlist");
                panic!("the other transaction ({other_id}) never waited: {rows:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let failed = sqlx::query(AssertSqlSafe(format!(
            "SELECT id FROM `{s}`.deadlock_probe WHERE id = 2 FOR UPDATE"
        )))
        .fetch_all(&mut *conn)
        .await;
        assert!(failed.is_err(), "the statement fails (a deadlock victim)");
        assert!(
            waiter.await.expect("waiter"),
            "the other transaction went on"
        );
    }
}

async fn harness() -> MySqlInboxHarness {
    let (outbox, guard) = common::fresh_outbox().await;
    let s = outbox.schema().to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE `{s}`.deadlock_probe (id INT PRIMARY KEY) ENGINE = InnoDB;
         INSERT INTO `{s}`.deadlock_probe VALUES (1), (2);
         CREATE TABLE `{s}`.deadlock_ballast (n INT) ENGINE = InnoDB;"
    )))
    .execute(outbox.pool())
    .await
    .expect("deadlock probe tables");
    MySqlInboxHarness(Arc::new(outbox.inbox()), s, guard)
}

outbox_core::inbox_conformance_tests!(harness; dead_letters, versions, durable, aborts);
