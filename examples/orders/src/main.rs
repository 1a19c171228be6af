//! The main job, end to end on real PostgreSQL and RabbitMQ:
//!
//! 1. **producers** write orders, each in one transaction with its `OrderPlaced` event
//!    (the order row and the outbox row commit together or not at all);
//! 2. the **relay** ([`Dispatcher`] + [`RabbitPublisher`]) publishes committed events
//!    with publisher confirms;
//! 3. a **consumer** projects each event into `order_projection` through the inbox: the
//!    inbox record, the projection upsert and the broker ack follow one another so the
//!    effect happens exactly once;
//! 4. duplicates are made **on purpose** on both sides: a relay "crashes" after
//!    publishing a batch and before recording it (the batch is published again after
//!    its lease expires), and the consumer "crashes" after committing some deliveries
//!    and before acking them (the broker redelivers them);
//! 5. a **reconciliation** compares orders written, events published, projection rows,
//!    duplicates suppressed, and commit-to-consume latency.
//!
//! Run it with `cargo xtask demo` (defaults need no configuration).

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use clap::Parser;
use outbox_core::wire::IncomingMessage;
use outbox_core::{
    Dispatcher, DispatcherConfig, EventPublisher, InboxStore, NewMessage, OutboxStore,
};
use outbox_postgres::{PgConfig, PgInbox, PgOutbox};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;
use transport_rabbit::{
    DeliveryHandler, HandlerDecision, RabbitConfig, RabbitConsumer, RabbitPublisher,
};

/// Orders demo: outbox → RabbitMQ → inbox → projection, then a reconciliation.
#[derive(Debug, Parser)]
struct Args {
    /// Orders to place.
    #[arg(long, default_value_t = 2_000)]
    orders: usize,
    /// Concurrent producer tasks.
    #[arg(long, default_value_t = 4)]
    producers: usize,
    /// Every N-th delivery is committed but not acked the first time (the broker
    /// redelivers it); 0 disables.
    #[arg(long, default_value_t = 10)]
    redeliver_every: u64,
    /// Messages a crashing relay publishes and abandons before the real relay starts.
    #[arg(long, default_value_t = 50)]
    relay_crash_batch: usize,
    /// Schema for the demo's tables (dropped and recreated on each run).
    #[arg(long, default_value = "orders_demo")]
    schema: String,
    /// Seconds to wait for every order to be projected.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
}

const CONSUMER: &str = "order-projection";

#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: uuid::Uuid,
    customer: String,
    total_cents: i64,
}

#[derive(Default)]
struct ConsumerCounters {
    deliveries: AtomicU64,
    applied: AtomicU64,
    duplicates: AtomicU64,
    forced_redeliveries: AtomicU64,
}

/// The projection handler: one transaction per delivery (inbox claim + upsert), commit,
/// then ack.
struct Projector {
    pool: PgPool,
    inbox: PgInbox,
    schema: String,
    redeliver_every: u64,
    counters: Arc<ConsumerCounters>,
    withheld: Mutex<HashSet<uuid::Uuid>>,
}

impl Projector {
    async fn apply(&self, msg: &IncomingMessage) -> anyhow::Result<bool> {
        let event: OrderPlaced = msg.json().context("OrderPlaced payload")?;
        let mut tx = self.pool.begin().await?;
        if !self.inbox.try_claim(&mut tx, msg.id, CONSUMER).await? {
            tx.rollback().await?;
            return Ok(false);
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.order_projection (order_id, customer, total_cents, event_id, projected_at, times_applied)
             VALUES ($1, $2, $3, $4, clock_timestamp(), 1)
             ON CONFLICT (order_id) DO UPDATE SET times_applied = {s}.order_projection.times_applied + 1",
            s = self.schema
        )))
        .bind(event.order_id)
        .bind(&event.customer)
        .bind(event.total_cents)
        .bind(msg.id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }
}

#[async_trait]
impl DeliveryHandler for Projector {
    async fn handle(&self, msg: IncomingMessage) -> HandlerDecision {
        let n = self.counters.deliveries.fetch_add(1, Ordering::Relaxed) + 1;
        match self.apply(&msg).await {
            Ok(true) => {
                self.counters.applied.fetch_add(1, Ordering::Relaxed);
                // Simulate a consumer crash between commit and ack for every N-th
                // delivery: the broker will deliver it again.
                if self.redeliver_every > 0 && n.is_multiple_of(self.redeliver_every) {
                    let first = self
                        .withheld
                        .lock()
                        .map(|mut w| w.insert(msg.id))
                        .unwrap_or(false);
                    if first {
                        self.counters
                            .forced_redeliveries
                            .fetch_add(1, Ordering::Relaxed);
                        return HandlerDecision::Requeue;
                    }
                }
                HandlerDecision::Ack
            }
            Ok(false) => {
                self.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                HandlerDecision::Ack
            }
            Err(e) => {
                tracing::warn!(id = %msg.id, error = %e, "projection failed, will be redelivered");
                HandlerDecision::Requeue
            }
        }
    }
}

async fn setup_schema(pool: &PgPool, schema: &str) -> anyhow::Result<()> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE;
         CREATE SCHEMA {schema};
         CREATE TABLE {schema}.orders (
             id uuid PRIMARY KEY,
             customer text NOT NULL,
             total_cents bigint NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE {schema}.order_projection (
             order_id uuid PRIMARY KEY,
             customer text NOT NULL,
             total_cents bigint NOT NULL,
             event_id uuid NOT NULL,
             projected_at timestamptz NOT NULL,
             times_applied integer NOT NULL);"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// Places `count` orders, one transaction each: the order row and its event.
async fn produce(
    outbox: PgOutbox,
    schema: String,
    first: usize,
    count: usize,
    wake: outbox_core::WakeHandle,
) -> anyhow::Result<()> {
    for i in first..first + count {
        let order = OrderPlaced {
            order_id: uuid::Uuid::now_v7(),
            customer: format!("customer-{}", i % 97),
            total_cents: 1_000 + (i as i64 * 37) % 50_000,
        };
        let event = NewMessage::builder("order", order.order_id.to_string(), "OrderPlaced")
            .aggregate_version(1)
            .payload(&order)
            .build()?;
        let mut tx = outbox.pool().begin().await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {schema}.orders (id, customer, total_cents) VALUES ($1, $2, $3)"
        )))
        .bind(order.order_id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .execute(&mut *tx)
        .await?;
        outbox.enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        wake.wake();
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let started = Instant::now();

    // PostgreSQL: the demo schema holds the business tables and the outbox/inbox tables.
    let outbox = PgOutbox::connect(
        &PgConfig::new(common::database_url())
            .with_schema(&args.schema)
            .with_max_connections(16),
    )
    .await
    .context("connect to PostgreSQL (is it running? `cargo xtask services`)")?;
    setup_schema(outbox.pool(), &args.schema).await?;
    outbox.migrate().await?;
    let inbox = PgInbox::new(outbox.pool().clone(), &args.schema)?;

    // RabbitMQ: a durable topic exchange and the projection's queue bound to OrderPlaced.
    let exchange = format!("{}.events", args.schema);
    let queue = format!("{}.projection", args.schema);
    let rabbit = RabbitConfig::builder(common::amqp_url())
        .with_exchange(&exchange)
        .build()?;
    let publisher = Arc::new(
        RabbitPublisher::connect(rabbit.clone())
            .await
            .context("connect to RabbitMQ")?,
    );
    // Start from an empty queue: delete what an earlier run may have left behind.
    {
        let conn =
            lapin::Connection::connect(&common::amqp_url(), lapin::ConnectionProperties::default())
                .await?;
        let ch = conn.create_channel().await?;
        ch.queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await?;
        conn.close(200, "reset".into()).await?;
    }
    let consumer = RabbitConsumer::builder(rabbit.clone(), &queue)
        .with_binding_keys(["OrderPlaced"])
        .with_prefetch(200)
        .build()?;
    // Declare and bind the queue before anything is published, so nothing is missed.
    consumer.declare().await?;

    let counters = Arc::new(ConsumerCounters::default());
    let shutdown = CancellationToken::new();
    let consumer_task = {
        let handler = Projector {
            pool: outbox.pool().clone(),
            inbox,
            schema: args.schema.clone(),
            redeliver_every: args.redeliver_every,
            counters: Arc::clone(&counters),
            withheld: Mutex::new(HashSet::new()),
        };
        let token = shutdown.clone();
        tokio::spawn(async move { consumer.run(handler, token).await })
    };

    let dispatcher = Dispatcher::new(
        Arc::new(outbox.clone()),
        Arc::clone(&publisher),
        DispatcherConfig::new()
            .with_batch_size(200)
            .with_poll_interval(Duration::from_millis(100)),
    );

    // Producers start first; the relay is not running yet, so a backlog builds up.
    let per = args.orders.div_ceil(args.producers.max(1));
    let mut producers = Vec::new();
    for p in 0..args.producers.max(1) {
        let first = p * per;
        let count = per.min(args.orders.saturating_sub(first));
        producers.push(tokio::spawn(produce(
            outbox.clone(),
            args.schema.clone(),
            first,
            count,
            dispatcher.wake_handle(),
        )));
    }

    // A relay that crashes: it claims a batch with a short lease, publishes it, and dies
    // before recording the result. The real relay republishes those after the lease.
    let mut crashed = 0;
    if args.relay_crash_batch > 0 {
        let deadline = Instant::now() + Duration::from_secs(30);
        while crashed == 0 && Instant::now() < deadline {
            let claimed = outbox
                .claim(args.relay_crash_batch, Duration::from_secs(2))
                .await?;
            crashed = claimed.len();
            if crashed > 0 {
                let outcomes = publisher.publish_batch(&claimed).await;
                let published = outcomes.iter().filter(|o| o.is_published()).count();
                println!(
                    "crashing relay: published {published} messages and died before recording them"
                );
            } else {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    let relay_task = {
        let d = dispatcher.clone();
        let token = shutdown.clone();
        tokio::spawn(async move { d.run(token).await })
    };
    for p in producers {
        p.await??;
    }
    let produced_at = started.elapsed();

    // Wait until every order is projected (and the duplicates have drained).
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let schema = &args.schema;
    loop {
        let projected: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {schema}.order_projection"
        )))
        .fetch_one(outbox.pool())
        .await?;
        let pending = outbox.stats().await?;
        if projected as usize >= args.orders && pending.new == 0 && pending.processing == 0 {
            break;
        }
        if Instant::now() > deadline {
            shutdown.cancel();
            bail!(
                "timed out: {projected} of {} orders projected; outbox {pending:?}",
                args.orders
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let the redeliveries and republished duplicates arrive before reconciling.
    let settle = Instant::now() + Duration::from_secs(10);
    let expected_dupes = counters.forced_redeliveries.load(Ordering::Relaxed) + crashed as u64;
    while counters.duplicates.load(Ordering::Relaxed) < expected_dupes && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let relay_stats = relay_task.await??;
    consumer_task.await??;

    // Reconciliation, from the database.
    let one = |sql: String| {
        let pool = outbox.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
        }
    };
    let orders = one(format!("SELECT count(*) FROM {schema}.orders")).await?;
    let events = one(format!("SELECT count(*) FROM {schema}.outbox_messages")).await?;
    let sent = one(format!(
        "SELECT count(*) FROM {schema}.outbox_messages WHERE status = 1"
    ))
    .await?;
    let dead = one(format!(
        "SELECT count(*) FROM {schema}.outbox_messages WHERE status = 3"
    ))
    .await?;
    let projected = one(format!("SELECT count(*) FROM {schema}.order_projection")).await?;
    let exactly_once = one(format!(
        "SELECT count(*) FROM {schema}.order_projection WHERE times_applied = 1"
    ))
    .await?;
    let missing = one(format!(
        "SELECT count(*) FROM {schema}.orders o LEFT JOIN {schema}.order_projection p ON p.order_id = o.id WHERE p.order_id IS NULL"
    ))
    .await?;
    let mismatched = one(format!(
        "SELECT count(*) FROM {schema}.orders o JOIN {schema}.order_projection p ON p.order_id = o.id
          WHERE p.customer <> o.customer OR p.total_cents <> o.total_cents"
    ))
    .await?;
    let inbox_rows = one(format!(
        "SELECT count(*) FROM {schema}.inbox_records WHERE consumer = '{CONSUMER}'"
    ))
    .await?;
    let latencies: Vec<f64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT extract(epoch FROM p.projected_at - m.created_at)::float8 * 1000
           FROM {schema}.order_projection p JOIN {schema}.outbox_messages m ON m.id = p.event_id"
    )))
    .fetch_all(outbox.pool())
    .await?;

    let c = &counters;
    println!();
    println!(
        "reconciliation ({:.1} s in all, producers finished after {:.1} s)",
        started.elapsed().as_secs_f64(),
        produced_at.as_secs_f64()
    );
    println!("  orders written                 {orders}");
    println!("  events in the outbox           {events}");
    println!("  events sent (confirmed)        {sent}");
    println!("  events dead                    {dead}");
    println!(
        "  broker deliveries              {}",
        c.deliveries.load(Ordering::Relaxed)
    );
    println!(
        "  duplicates suppressed by inbox {}",
        c.duplicates.load(Ordering::Relaxed)
    );
    println!("    from the crashed relay       {crashed} republished");
    println!(
        "    from withheld acks           {} redelivered",
        c.forced_redeliveries.load(Ordering::Relaxed)
    );
    println!("  projection rows                {projected}");
    println!("  rows applied exactly once      {exactly_once}");
    println!("  orders without projection      {missing}");
    println!("  projection rows not matching   {mismatched}");
    println!("  inbox records                  {inbox_rows}");
    println!(
        "  relay: {} published, {} batches, {} retried, {} fenced",
        relay_stats.published, relay_stats.batches, relay_stats.retried, relay_stats.fenced
    );
    if let Some((p50, p99)) = common::percentiles(&latencies) {
        println!(
            "  commit-to-consume latency      p50 {}  p99 {}",
            common::ms(p50),
            common::ms(p99)
        );
    }
    let ok = orders as usize == args.orders
        && events == orders
        && sent == events
        && dead == 0
        && projected == orders
        && exactly_once == orders
        && missing == 0
        && mismatched == 0
        && inbox_rows == orders;
    if ok {
        println!("\nOK: every order has exactly one projection row.");
        Ok(())
    } else {
        bail!("reconciliation failed: see the figures above")
    }
}
