//! Shared helpers: every test gets its own schema in the SQL Server named by
//! `MSSQL_URL`. The tests that need it are `#[ignore = "needs MSSQL_URL"]`, so that a
//! run without SQL Server reports them as ignored rather than passed; `cargo test -p
//! outboxkit-sqlserver -- --ignored` (which `cargo xtask itest` runs when `MSSQL_URL` is
//! set) runs them.
#![allow(dead_code, unreachable_pub)] // reason: each test binary uses a different subset

use std::sync::Arc;

use async_trait::async_trait;
use outboxkit_core::conformance::Harness;
use outboxkit_core::{NewMessage, OutboxProducer};
use outboxkit_sqlserver::{MssqlConfig, MssqlOutbox, MssqlPool};

/// `MSSQL_URL`. Panics when it is not set: the caller is an ignored test that was asked
/// for explicitly (`--ignored`, `--include-ignored`), and passing without a server would
/// be the dishonest count the `#[ignore]` is there to avoid.
pub fn mssql_url() -> String {
    match std::env::var("MSSQL_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "needs MSSQL_URL: start SQL Server with `docker compose up -d mssql` and export \
             MSSQL_URL='server=tcp:127.0.0.1,1433;user=sa;password=Outbox_Passw0rd!;TrustServerCertificate=true' \
             (see docs/sqlserver.md)"
        ),
    }
}

/// Drops test schemas (`t_<uuid>`) migrated more than an hour ago: left behind by
/// earlier runs, never by a test still running. Once per test binary.
async fn sweep_old_schemas(pool: &MssqlPool) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let Ok(mut conn) = pool.get().await else {
                return;
            };
            // Test-only cleanup: object names come from the catalog and are quoted with
            // QUOTENAME; the schema pattern is fixed.
            let sweep = r"
                DECLARE @schema sysname, @sql nvarchar(max), @old bit;
                DECLARE schemas CURSOR LOCAL FAST_FORWARD FOR
                    SELECT name FROM sys.schemas
                     WHERE name LIKE 't[_]%' AND LEN(name) = 34;
                OPEN schemas;
                FETCH NEXT FROM schemas INTO @schema;
                WHILE @@FETCH_STATUS = 0
                BEGIN
                    SET @old = 0;
                    IF OBJECT_ID(QUOTENAME(@schema) + N'.outbox_schema_migrations', N'U') IS NOT NULL
                    BEGIN
                        SET @sql = N'SELECT @o = CASE WHEN MAX(applied_at) < DATEADD(hour, -1, SYSUTCDATETIME()) THEN 1 ELSE 0 END FROM '
                                 + QUOTENAME(@schema) + N'.outbox_schema_migrations';
                        EXEC sp_executesql @sql, N'@o bit OUTPUT', @o = @old OUTPUT;
                    END;
                    IF @old = 1
                    BEGIN
                        SET @sql = N'';
                        SELECT @sql = @sql + N'DROP TABLE ' + QUOTENAME(@schema) + N'.' + QUOTENAME(t.name) + N';'
                          FROM sys.tables AS t WHERE t.schema_id = SCHEMA_ID(@schema);
                        SET @sql = @sql + N'DROP SCHEMA ' + QUOTENAME(@schema) + N';';
                        EXEC (@sql);
                    END;
                    FETCH NEXT FROM schemas INTO @schema;
                END;
                CLOSE schemas;
                DEALLOCATE schemas;";
            if let Ok(stream) = conn.simple_query(sweep).await {
                let _ = stream.into_results().await;
            }
        })
        .await;
}

/// A fresh, migrated schema named `t_<uuid>` on the server at `url`.
pub async fn fresh_outbox(url: &str) -> MssqlOutbox {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let config = MssqlConfig::new(url)
        .with_schema(&schema)
        .with_max_connections(6);
    let outbox = MssqlOutbox::connect(&config)
        .await
        .expect("connect to SQL Server (is it running? `docker compose up -d mssql`)");
    sweep_old_schemas(outbox.pool()).await;
    outbox.migrate().await.expect("migrate");
    outbox
}

pub struct MssqlHarness(pub Arc<MssqlOutbox>);

#[async_trait]
impl Harness for MssqlHarness {
    type Store = MssqlOutbox;

    fn store(&self) -> Arc<MssqlOutbox> {
        Arc::clone(&self.0)
    }

    fn store_deleting_sent(&self) -> Arc<MssqlOutbox> {
        let config = outboxkit_sqlserver::MssqlConfig::default()
            .with_schema(self.0.schema())
            .with_sent_retention(outboxkit_core::SentRetention::Delete);
        Arc::new(MssqlOutbox::new(self.0.pool().clone(), &config).expect("outbox"))
    }

    async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.0.begin().await.expect("begin");
        for chunk in messages.chunks(1000) {
            self.0.enqueue_batch(&mut tx, chunk).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }

    async fn set_headers_json(&self, id: uuid::Uuid, json: &str) {
        let sql = format!(
            "UPDATE [{}].outbox_messages SET headers = @P2 WHERE id = @P1",
            self.0.schema()
        );
        let mut conn = self.0.pool().get().await.expect("connection");
        conn.execute(sql, &[&id, &json]).await.expect("set headers");
    }
}

/// The harness of the shared suites: a fresh schema on the SQL Server at `MSSQL_URL`.
pub async fn harness() -> MssqlHarness {
    MssqlHarness(Arc::new(fresh_outbox(&mssql_url()).await))
}
