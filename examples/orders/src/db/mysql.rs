//! The demo on MySQL / MariaDB: the schema is a database holding the business tables and
//! the outbox/inbox tables. Ids are `BINARY(16)` and times `DATETIME(6)` in UTC, as in
//! the outbox's own tables (every connection of the backend's pools runs in UTC).

use anyhow::Context as _;
use outboxkit_core::async_trait;
use outboxkit_core::{NewMessage, OutboxProducer};
use outboxkit_mysql::{MySqlConfig, MySqlInbox, MySqlOutbox};
use sqlx::{AssertSqlSafe, MySqlConnection};

use super::{Database, Projection};
use crate::OrderPlaced;

#[derive(Clone)]
pub(crate) struct MySql {
    outbox: MySqlOutbox,
    schema: String,
}

#[async_trait]
impl Database for MySql {
    type Outbox = MySqlOutbox;
    type Inbox = MySqlInbox;

    async fn open(url: &str, schema: &str) -> anyhow::Result<Self> {
        let outbox = MySqlOutbox::connect(
            &MySqlConfig::new(url)
                .with_schema(schema)
                .with_max_connections(16),
        )
        .await
        .context("connect to MySQL / MariaDB (is it running? `cargo xtask services`)")?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {schema};
             CREATE DATABASE {schema} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
             CREATE TABLE {schema}.orders (
                 id BINARY(16) PRIMARY KEY,
                 customer VARCHAR(255) NOT NULL,
                 total_cents BIGINT NOT NULL,
                 created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                 trace_id VARCHAR(32));
             CREATE TABLE {schema}.order_projection (
                 order_id BINARY(16) PRIMARY KEY,
                 customer VARCHAR(255) NOT NULL,
                 total_cents BIGINT NOT NULL,
                 event_id BINARY(16) NOT NULL,
                 projected_at DATETIME(6) NOT NULL,
                 times_applied INT NOT NULL,
                 delivered_trace_id VARCHAR(32),
                 handler_trace_id VARCHAR(32));"
        )))
        .execute(outbox.pool())
        .await?;
        outbox.migrate().await?;
        Ok(Self {
            outbox,
            schema: schema.to_owned(),
        })
    }

    fn outbox(&self) -> &MySqlOutbox {
        &self.outbox
    }

    fn inbox(&self) -> MySqlInbox {
        self.outbox.inbox()
    }

    async fn place_order(
        &self,
        order: &OrderPlaced,
        trace_id: Option<String>,
        event: &NewMessage,
    ) -> anyhow::Result<()> {
        let mut tx = self.outbox.begin().await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.orders (id, customer, total_cents, trace_id) VALUES (?, ?, ?, ?)",
            self.schema
        )))
        .bind(order.order_id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .bind(trace_id)
        .execute(&mut *tx)
        .await?;
        self.outbox.enqueue(&mut tx, event).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn project(
        conn: &mut MySqlConnection,
        schema: &str,
        row: Projection<'_>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.order_projection (order_id, customer, total_cents, event_id, projected_at, times_applied, delivered_trace_id, handler_trace_id)
             VALUES (?, ?, ?, ?, NOW(6), 1, ?, ?)
             ON DUPLICATE KEY UPDATE times_applied = times_applied + 1"
        )))
        .bind(row.order.order_id)
        .bind(&row.order.customer)
        .bind(row.order.total_cents)
        .bind(row.event_id)
        .bind(row.delivered_trace_id)
        .bind(row.handler_trace_id)
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn count(&self, sql: String) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(self.outbox.pool())
            .await?)
    }

    async fn latencies_us(&self) -> anyhow::Result<Vec<i64>> {
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT TIMESTAMPDIFF(MICROSECOND, m.created_at, p.projected_at)
               FROM {s}.order_projection p JOIN {s}.outbox_messages m ON m.id = p.event_id",
            s = self.schema
        )))
        .fetch_all(self.outbox.pool())
        .await?)
    }
}
