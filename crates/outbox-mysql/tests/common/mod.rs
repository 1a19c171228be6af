//! Shared helpers: every test gets its own database (`t_<uuid>`) in the real MariaDB /
//! MySQL at `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`), dropped when the
//! test's handle is dropped (a panic included).
#![allow(dead_code, unreachable_pub)] // reason: each test binary uses a different subset

use std::sync::Arc;

use async_trait::async_trait;
use outbox_core::NewMessage;
use outbox_core::conformance::Harness;
use outbox_mysql::{MySqlConfig, MySqlOutbox};

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
            if let Ok(pool) = MySqlConfig::new(mysql_url())
                .with_max_connections(1)
                .connect()
                .await
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
            .with_sent_retention(outbox_core::SentRetention::Delete);
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
