//! The demo on PostgreSQL: the schema holds the business tables and the outbox/inbox
//! tables.

use anyhow::Context as _;
use outboxkit_core::async_trait;
use outboxkit_core::{NewMessage, OutboxProducer};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::{AssertSqlSafe, PgConnection};

use super::{Database, Projection};
use crate::OrderPlaced;

#[derive(Clone)]
pub(crate) struct Postgres {
    outbox: PgOutbox,
    schema: String,
}

#[async_trait]
impl Database for Postgres {
    type Outbox = PgOutbox;
    type Inbox = PgInbox;

    async fn open(url: &str, schema: &str) -> anyhow::Result<Self> {
        let outbox = PgOutbox::connect(
            &PgConfig::new(url)
                .with_schema(schema)
                .with_max_connections(16),
        )
        .await
        .context("connect to PostgreSQL (is it running? `cargo xtask services`)")?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE;
             CREATE SCHEMA {schema};
             CREATE TABLE {schema}.orders (
                 id uuid PRIMARY KEY,
                 customer text NOT NULL,
                 total_cents bigint NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now(),
                 trace_id text);
             CREATE TABLE {schema}.order_projection (
                 order_id uuid PRIMARY KEY,
                 customer text NOT NULL,
                 total_cents bigint NOT NULL,
                 event_id uuid NOT NULL,
                 projected_at timestamptz NOT NULL,
                 times_applied integer NOT NULL,
                 delivered_trace_id text,
                 handler_trace_id text);"
        )))
        .execute(outbox.pool())
        .await?;
        outbox.migrate().await?;
        Ok(Self {
            outbox,
            schema: schema.to_owned(),
        })
    }

    fn outbox(&self) -> &PgOutbox {
        &self.outbox
    }

    fn inbox(&self) -> PgInbox {
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
            "INSERT INTO {}.orders (id, customer, total_cents, trace_id) VALUES ($1, $2, $3, $4)",
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
        conn: &mut PgConnection,
        schema: &str,
        row: Projection<'_>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.order_projection (order_id, customer, total_cents, event_id, projected_at, times_applied, delivered_trace_id, handler_trace_id)
             VALUES ($1, $2, $3, $4, clock_timestamp(), 1, $5, $6)
             ON CONFLICT (order_id) DO UPDATE SET times_applied = {schema}.order_projection.times_applied + 1"
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
            "SELECT (extract(epoch FROM p.projected_at - m.created_at) * 1000000)::int8
               FROM {s}.order_projection p JOIN {s}.outbox_messages m ON m.id = p.event_id",
            s = self.schema
        )))
        .fetch_all(self.outbox.pool())
        .await?)
    }
}
