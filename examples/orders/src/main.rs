//! The main job, end to end on real PostgreSQL or MySQL / MariaDB
//! (`--database postgres|mysql`, see [`db`]) and RabbitMQ or NATS JetStream
//! (`--transport rabbit|nats`, see [`transport`]):
//!
//! 1. **producers** write orders, each in one transaction with its `OrderPlaced` event
//!    (the order row and the outbox row commit together or not at all);
//! 2. the **relay** ([`Dispatcher`] + `RabbitPublisher` or `NatsPublisher`) publishes
//!    committed events with publisher confirms or JetStream PubAcks;
//! 3. a **consumer** projects each event into `order_projection` through the `outboxkit-inbox`
//!    crate's idempotent consumer: the inbox record and the projection upsert commit
//!    together, then the broker is acked, so the effect happens exactly once;
//! 4. duplicates are made **on purpose** on both sides: a relay "crashes" after
//!    publishing a batch and before recording it (the batch is published again after
//!    its lease expires), and the consumer "crashes" after committing some deliveries
//!    and before acking them (the broker redelivers them);
//! 5. a **reconciliation** compares orders written, events published, projection rows,
//!    duplicates suppressed, and commit-to-consume latency;
//! 6. **tracing**: each order is placed in its own `orders.place` span (an
//!    OpenTelemetry trace, see [`telemetry`]); its event carries that trace as a W3C
//!    `traceparent` header to the broker, and the consumer's `inbox.handle` span
//!    continues it. The reconciliation fails unless every delivery's header, as
//!    delivered, is a valid `traceparent` and every projection continued the trace its
//!    order was placed in.
//!
//! Run it with `cargo xtask demo` (defaults need no configuration).

mod db;
mod projection;
mod telemetry;
mod transport;

use db::{Database, DatabaseKind};
use outboxkit::Consumer as _;
use projection::{CONSUMER, ConsumerCounters, Projector};

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Parser;
use outboxkit_core::{Dispatcher, DispatcherConfig, EventPublisher, NewMessage, OutboxStore};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

/// Orders demo: outbox (PostgreSQL or MySQL / MariaDB) → RabbitMQ or NATS JetStream →
/// inbox → projection, then a reconciliation.
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
    /// Schema for the demo's tables (dropped and recreated on each run; a database on
    /// MySQL).
    #[arg(long, default_value = "orders_demo")]
    schema: String,
    /// The database: PostgreSQL or MySQL / MariaDB.
    #[arg(long, value_enum, default_value_t = DatabaseKind::Postgres)]
    database: DatabaseKind,
    /// The broker: RabbitMQ or NATS JetStream.
    #[arg(long, value_enum, default_value_t = transport::TransportKind::Rabbit)]
    transport: transport::TransportKind,
    /// Seconds to wait for every order to be projected.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
    /// PostgreSQL, with `--database postgres`.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    /// MySQL / MariaDB, with `--database mysql`.
    #[arg(
        long,
        env = "MYSQL_URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    mysql_url: String,
    /// RabbitMQ, with `--transport rabbit`.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// NATS with JetStream, with `--transport nats`.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
}

impl Args {
    /// The URL of the database picked by `--database`.
    fn db_url(&self) -> &str {
        match self.database {
            DatabaseKind::Postgres => &self.database_url,
            DatabaseKind::Mysql => &self.mysql_url,
        }
    }

    /// The URL of the broker picked by `--transport`.
    fn broker_url(&self) -> &str {
        match self.transport {
            transport::TransportKind::Rabbit => &self.amqp_url,
            transport::TransportKind::Nats => &self.nats_url,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct OrderPlaced {
    order_id: uuid::Uuid,
    customer: String,
    total_cents: i64,
}

/// Places `count` orders, one transaction each: the order row and its event. Each order
/// is placed in its own `orders.place` span, a new trace whose id the order row keeps
/// and whose context the event captures (its `traceparent` header).
async fn produce<D: Database>(
    db: D,
    first: usize,
    count: usize,
    wake: outboxkit_core::WakeHandle,
) -> anyhow::Result<()> {
    for i in first..first + count {
        let order = OrderPlaced {
            order_id: uuid::Uuid::now_v7(),
            customer: format!("customer-{}", i % 97),
            total_cents: 1_000 + (i as i64 * 37) % 50_000,
        };
        let span = tracing::info_span!("orders.place", order_id = %order.order_id);
        let trace_id = telemetry::trace_id(&span);
        async {
            let event = NewMessage::builder("order", order.order_id.to_string(), "OrderPlaced")
                .aggregate_version(1)
                .payload(&order)
                .build()?;
            db.place_order(&order, trace_id, &event).await
        }
        .instrument(span)
        .await?;
        wake.wake();
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.database {
        DatabaseKind::Postgres => run::<db::Postgres>(args).await,
        DatabaseKind::Mysql => run::<db::MySql>(args).await,
    }
}

async fn run<D: Database>(args: Args) -> anyhow::Result<()> {
    let telemetry = telemetry::install()?;
    println!("{}", telemetry.describe());
    let started = Instant::now();

    // The demo schema holds the business tables and the outbox/inbox tables.
    let db = D::open(args.db_url(), &args.schema).await?;
    let outbox = db.outbox();
    let inbox = db.inbox();

    // The broker (RabbitMQ or NATS JetStream): publisher, and the projection's queue or
    // durable consumer, which exists before anything is published.
    let transport::Wiring {
        publisher,
        consumer,
        broker,
    } = transport::wire(args.transport, args.broker_url(), &args.schema).await?;
    let publisher = Arc::new(publisher);

    let counters = Arc::new(ConsumerCounters::default());
    let shutdown = CancellationToken::new();
    let consumer_task = {
        let handler = Projector::<D>::new(
            inbox,
            &args.schema,
            args.redeliver_every,
            Arc::clone(&counters),
        );
        let token = shutdown.clone();
        tokio::spawn(async move { consumer.run(handler, token).await })
    };

    let dispatcher = Dispatcher::new(
        Arc::new(outbox.clone()),
        Arc::clone(&publisher),
        DispatcherConfig::new()
            .with_batch_size(200)
            .with_poll_interval(Duration::from_millis(100)),
    )?;

    // Producers start first; the relay is not running yet, so a backlog builds up.
    let per = args.orders.div_ceil(args.producers.max(1));
    let mut producers = Vec::new();
    for p in 0..args.producers.max(1) {
        let first = p * per;
        let count = per.min(args.orders.saturating_sub(first));
        producers.push(tokio::spawn(produce(
            db.clone(),
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
        // Wait until a full batch is committed, so the crash abandons that many.
        let want = args.relay_crash_batch.min(args.orders) as u64;
        while outbox.stats().await?.new < want && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        while crashed == 0 && Instant::now() < deadline {
            let claimed = outbox
                .claim(args.relay_crash_batch, Duration::from_secs(2))
                .await?
                .messages;
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
        let projected = db
            .count(format!("SELECT count(*) FROM {schema}.order_projection"))
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
    let expected_dupes = counters.forced_redeliveries.load(Ordering::Relaxed)
        + broker.relay_duplicates_delivered(crashed);
    while counters.duplicates() < expected_dupes && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let relay_stats = relay_task.await??;
    consumer_task.await??;

    // Reconciliation, from the database.
    let one = |sql: String| db.count(sql);
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
    // The trace as placed (orders.trace_id), as delivered (the traceparent header the
    // consumer received) and as continued (the handler's inbox.handle span).
    let delivered_in_trace = one(format!(
        "SELECT count(*) FROM {schema}.orders o JOIN {schema}.order_projection p ON p.order_id = o.id
          WHERE o.trace_id IS NOT NULL AND p.delivered_trace_id = o.trace_id"
    ))
    .await?;
    let continued = one(format!(
        "SELECT count(*) FROM {schema}.orders o JOIN {schema}.order_projection p ON p.order_id = o.id
          WHERE o.trace_id IS NOT NULL AND p.delivered_trace_id = o.trace_id
            AND p.handler_trace_id = o.trace_id"
    ))
    .await?;
    // Commit-to-consume latency in milliseconds: p50 and p99 (none without rows).
    let mut latencies_ms: Vec<f64> = db
        .latencies_us()
        .await?
        .into_iter()
        .map(|us| us as f64 / 1000.0)
        .collect();
    latencies_ms.sort_by(f64::total_cmp);
    let (p50, p99) = (
        db::percentile(&latencies_ms, 0.5),
        db::percentile(&latencies_ms, 0.99),
    );

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
    println!("  duplicates suppressed by inbox {}", c.duplicates());
    let stored = broker.stored_messages().await?;
    if stored.is_some() {
        println!(
            "    from the crashed relay       0 ({crashed} republished, dropped by the stream's duplicate window)"
        );
    } else {
        println!("    from the crashed relay       {crashed} republished");
    }
    println!(
        "    from withheld acks           {} redelivered",
        c.forced_redeliveries.load(Ordering::Relaxed)
    );
    println!("  projection rows                {projected}");
    println!("  rows applied exactly once      {exactly_once}");
    println!("  orders without projection      {missing}");
    println!("  projection rows not matching   {mismatched}");
    println!("  inbox records                  {inbox_rows}");
    if let Some(stored) = stored {
        println!("  messages in the NATS stream    {stored}");
    }
    println!(
        "  relay: {} published, {} batches, {} retried, {} fenced",
        relay_stats.published, relay_stats.batches, relay_stats.retried, relay_stats.fenced
    );
    let deliveries = c.deliveries.load(Ordering::Relaxed);
    let traced = c.traced.load(Ordering::Relaxed);
    let untraced = c.untraced.load(Ordering::Relaxed);
    println!(
        "  deliveries with traceparent    {traced} of {deliveries} ({untraced} missing or malformed)"
    );
    println!(
        "  delivered in the order's trace {delivered_in_trace} (the traceparent's trace id is the order's)"
    );
    println!(
        "  consumers continuing the trace {continued} (the handler's inbox.handle span is in it)"
    );
    if let Some((id, header)) = c.first_untraced.lock().ok().and_then(|f| f.clone()) {
        println!("    first without a valid one    message {id}: traceparent {header:?}");
    }
    println!(
        "  spans                          {}",
        telemetry.finish().await?
    );
    if let (Some(p50), Some(p99)) = (p50, p99) {
        println!("  commit-to-consume latency      p50 {p50:.1} ms  p99 {p99:.1} ms");
    }
    let ok = orders as usize == args.orders
        && events == orders
        && sent == events
        && dead == 0
        && projected == orders
        && exactly_once == orders
        && missing == 0
        && mismatched == 0
        && inbox_rows == orders
        && stored.is_none_or(|n| i64::try_from(n).is_ok_and(|n| n == events))
        && untraced == 0
        && traced == deliveries
        && delivered_in_trace == orders
        && continued == orders;
    if ok {
        println!(
            "\nOK: every order has exactly one projection row, and every delivery carried its order's trace."
        );
        Ok(())
    } else {
        bail!("reconciliation failed: see the figures above")
    }
}
