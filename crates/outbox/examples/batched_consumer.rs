//! A batched consumer: up to 100 deliveries handled in one database transaction (one
//! inbox claim statement, the handlers, one commit, then the acknowledgements), on a
//! RabbitMQ quorum queue. Same exactly-once effects as `consume_exactly_once.rs`, about
//! three times its rate (docs/performance.md). The same `BatchSettings` go to
//! `NatsConsumerConfig::with_batch`.
//!
//! `OUTBOX_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/%2f DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!  cargo run -p outboxkit --example batched_consumer --features inbox`
use std::sync::Arc;
use std::time::Duration;

use outboxkit::inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit::postgres::sqlx::{self, PgConnection};
use outboxkit::postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit::rabbit::lapin::types::{AMQPValue, FieldTable};
use outboxkit::rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig};
use outboxkit::{BatchSettings, Consumer as _, IncomingMessage};
use tokio_util::sync::CancellationToken;

/// Records each order placed; one statement per message here (override
/// `Handler::handle_batch` to write a whole batch with one statement).
struct AuditLog;

#[async_trait::async_trait]
impl Handler<PgInbox> for AuditLog {
    async fn handle(
        &self,
        conn: &mut PgConnection, // the batch's transaction
        msg: &IncomingMessage,
        _ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO audit_log (event_id, event_type) VALUES ($1, $2)")
            .bind(msg.id)
            .bind(&msg.event_type)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let inbox = PgOutbox::connect(&PgConfig::from_env()?).await?.inbox();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS audit_log (event_id uuid PRIMARY KEY, event_type text)",
    )
    .execute(inbox.pool())
    .await?;

    let mut quorum = FieldTable::default(); // replicated: survives the loss of a node
    quorum.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(RabbitConfig::from_env()?, "audit")
            .with_binding_key("OrderPlaced") // routing key: the event type, by default
            .with_queue_arguments(quorum)
            .with_prefetch(200)
            // Batches of 100 with 2 in flight: the next batch arrives while one commits.
            .with_batch(
                BatchSettings::new()
                    .with_size(100)
                    .with_linger(Duration::from_millis(5)),
            ),
    )?;

    let pipeline = Pipeline::new().on("OrderPlaced", "audit", AuditLog);
    let handler = IdempotentConsumer::new(Arc::new(inbox), pipeline, ConsumerConfig::new())?;
    let shutdown = CancellationToken::new();
    let on_ctrl_c = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_ctrl_c.cancel();
    });
    consumer.run_batched(handler, shutdown).await?;
    Ok(())
}
