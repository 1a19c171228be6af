//! Shared helpers: every test gets its own database (`t_<uuid>`) in the real MariaDB /
//! MySQL at `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`), dropped when the
//! test's handle is dropped (a panic included).
#![allow(dead_code, unreachable_pub)] // reason: each test binary uses a different subset

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::conformance::Harness;
use outboxkit_core::{NewMessage, OutboxProducer};
use outboxkit_mysql::{MySqlConfig, MySqlOutbox};
use sqlx::{AssertSqlSafe, Connection as _, MySqlConnection, MySqlPool};

pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// Drops the database `schema` on a thread and runtime of its own (callable from
/// `Drop`, inside or outside a runtime).
pub fn drop_database(schema: &str) {
    let schema = schema.to_owned();
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            if let Ok(pool) =
                MySqlOutbox::connect(&MySqlConfig::new(mysql_url()).with_max_connections(1))
                    .await
                    .map(|outbox| outbox.pool().clone())
            {
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS `{schema}`"
                )))
                .execute(&pool)
                .await;
                pool.close().await;
            }
        });
    })
    .join();
}

/// Drops test databases (`t_<uuid>`) created more than an hour ago: left behind by a
/// test process that was killed. Once per test binary.
async fn sweep_old_databases(pool: &sqlx::MySqlPool) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let old: Vec<String> = sqlx::query_scalar(
                "SELECT CAST(table_schema AS CHAR) FROM information_schema.tables
                  WHERE table_name = 'outbox_schema_migrations'
                    AND table_schema REGEXP '^t_[0-9a-f]{32}$'
                    AND create_time < NOW() - INTERVAL 1 HOUR",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            for schema in old {
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS `{schema}`"
                )))
                .execute(pool)
                .await;
            }
        })
        .await;
}

/// A fresh, migrated database named `t_<uuid>`, dropped with the returned guard.
pub async fn fresh_outbox() -> (MySqlOutbox, DropDatabase) {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let config = MySqlConfig::new(mysql_url())
        .with_schema(&schema)
        .with_max_connections(8);
    let outbox = MySqlOutbox::connect(&config)
        .await
        .expect("connect to MariaDB (is it running? `cargo xtask services`)");
    sweep_old_databases(outbox.pool()).await;
    let guard = DropDatabase(schema);
    outbox.migrate().await.expect("migrate");
    (outbox, guard)
}

/// Drops its database when dropped.
pub struct DropDatabase(pub String);

impl Drop for DropDatabase {
    fn drop(&mut self) {
        drop_database(&self.0);
    }
}

/// Enqueues `messages` in one transaction and commits it.
pub async fn enqueue_committed(outbox: &MySqlOutbox, messages: &[NewMessage]) {
    let mut tx = outbox.begin().await.expect("begin");
    outbox
        .enqueue_batch(&mut tx, messages)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
}

pub struct MySqlHarness(
    pub Arc<MySqlOutbox>,
    #[allow(dead_code)] // reason: held for its Drop
    pub  DropDatabase,
);

#[async_trait]
impl Harness for MySqlHarness {
    type Store = MySqlOutbox;

    fn store(&self) -> Arc<MySqlOutbox> {
        Arc::clone(&self.0)
    }

    fn store_deleting_sent(&self) -> Arc<MySqlOutbox> {
        let config = MySqlConfig::default()
            .with_schema(self.0.schema())
            .with_sent_retention(outboxkit_core::SentRetention::Delete);
        Arc::new(MySqlOutbox::new(self.0.pool().clone(), &config).expect("outbox"))
    }

    async fn enqueue(&self, messages: &[NewMessage]) {
        enqueue_committed(&self.0, messages).await;
    }

    async fn set_headers_json(&self, id: uuid::Uuid, json: &str) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE `{}`.outbox_messages SET headers = ? WHERE id = ?",
            self.0.schema()
        )))
        .bind(json)
        .bind(id)
        .execute(self.0.pool())
        .await
        .expect("set headers");
    }
}

pub async fn harness() -> MySqlHarness {
    let (outbox, guard) = fresh_outbox().await;
    MySqlHarness(Arc::new(outbox), guard)
}

/// Creates in database `schema` the two tables [`make_deadlock_victim`] works on.
pub async fn create_deadlock_probe(pool: &MySqlPool, schema: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE `{schema}`.deadlock_probe (id INT PRIMARY KEY) ENGINE = InnoDB;
         INSERT INTO `{schema}`.deadlock_probe VALUES (1), (2);
         CREATE TABLE `{schema}`.deadlock_ballast (n INT) ENGINE = InnoDB;"
    )))
    .execute(pool)
    .await
    .expect("deadlock probe tables");
}

/// Makes the transaction open on `conn` a real InnoDB deadlock victim and returns the
/// error its statement got (1213; InnoDB then rolls the whole transaction back). InnoDB
/// aborts a transaction whole only as a deadlock victim (any other failed statement is
/// undone alone and the transaction goes on), so: `conn` locks row 1 of
/// `schema`.deadlock_probe ([`create_deadlock_probe`]), a second connection that has
/// written more (InnoDB rolls back the transaction that wrote less) locks row 2 and
/// waits for row 1, and `conn` asks for row 2. `monitor` watches the second connection
/// wait. One call at a time per database: the probe rows are shared.
pub async fn make_deadlock_victim(
    conn: &mut MySqlConnection,
    schema: &str,
    monitor: &MySqlPool,
) -> sqlx::Error {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id FROM `{schema}`.deadlock_probe WHERE id = 1 FOR UPDATE"
    )))
    .fetch_all(&mut *conn)
    .await
    .expect("lock row 1");
    let mut other = MySqlConnection::connect(&mysql_url())
        .await
        .expect("connect");
    let other_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(&mut other)
        .await
        .expect("connection id");
    let s = schema.to_owned();
    let waiter = tokio::spawn(async move {
        let mut tx = other.begin().await.expect("begin");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{s}`.deadlock_ballast (n)
             WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 200)
             SELECT n FROM r"
        )))
        .execute(&mut *tx)
        .await
        .expect("ballast");
        sqlx::query(AssertSqlSafe(format!(
            "SELECT id FROM `{s}`.deadlock_probe WHERE id = 2 FOR UPDATE"
        )))
        .fetch_all(&mut *tx)
        .await
        .expect("lock row 2");
        let waited = sqlx::query(AssertSqlSafe(format!(
            "SELECT id FROM `{s}`.deadlock_probe WHERE id = 1 FOR UPDATE"
        )))
        .fetch_all(&mut *tx)
        .await;
        let _ = tx.rollback().await;
        waited.is_ok()
    });
    // Wait (with a deadline) until the other transaction waits for row 1.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        // The statement waiting for a primary-key row shows as running in the process
        // list (InnoDB waits for the lock while the optimizer reads the row as a
        // constant: state "Statistics").
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.processlist
              WHERE id = ? AND info LIKE '%id = 1 FOR UPDATE'",
        )
        .bind(other_id)
        .fetch_one(monitor)
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
                    .fetch_all(monitor)
                    .await
                    .expect("processlist");
            panic!("the other transaction ({other_id}) never waited: {rows:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let failed = sqlx::query(AssertSqlSafe(format!(
        "SELECT id FROM `{schema}`.deadlock_probe WHERE id = 2 FOR UPDATE"
    )))
    .fetch_all(&mut *conn)
    .await
    .expect_err("the statement fails (a deadlock victim)");
    assert!(
        waiter.await.expect("waiter"),
        "the other transaction went on"
    );
    failed
}
