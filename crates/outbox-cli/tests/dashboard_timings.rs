//! Page timings of the dashboard at 1,000,000 pending and 10,000 dead rows: each page's
//! server time (its `Server-Timing` header), printed, not asserted (a shared 2-core
//! machine makes timed assertions flaky). Ignored by default: loading the rows takes a
//! minute or two.
//!
//! ```text
//! cargo test -p outboxkit-cli --release --test dashboard_timings -- --ignored --nocapture
//! ```

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use common::{exec, fresh_outbox, request, scalar};
use outboxkit_cli::testing::internals::{DashboardSettings, RunningDashboard};
use outboxkit_core::OutboxAdmin;
use outboxkit_postgres::{PgConfig, PgOutbox};
use tokio_util::sync::CancellationToken;

const PENDING: i64 = 1_000_000;
const DEAD: i64 = 10_000;
/// Requests per page; the first warms the connection pool and the plan caches.
const RUNS: usize = 6;

/// The server time of one request of `path`, in ms.
async fn server_ms(addr: SocketAddr, path: &str) -> f64 {
    let r = request(addr, "GET", path, &[], None).await;
    assert_eq!(
        r.status,
        200,
        "{path}: {}",
        r.body.chars().take(500).collect::<String>()
    );
    r.header("server-timing")
        .and_then(|t| t.strip_prefix("app;dur="))
        .and_then(|ms| ms.parse().ok())
        .expect("Server-Timing")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "loads 1,000,000 rows: cargo test -p outboxkit-cli --release --test dashboard_timings -- --ignored --nocapture"]
async fn every_page_at_a_million_pending_and_ten_thousand_dead() {
    let db = fresh_outbox().await;
    let load = Instant::now();
    // Pending rows as producers write them (ten event types, fifty tenants), then dead
    // ones with errors, and an hour of sent ones for the chart.
    exec(&db, &format!(
        "INSERT INTO \"{{s}}\".outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, headers, tenant_id)
         SELECT gen_random_uuid(), 'order', g::text, 'Event' || (g % 10), json_build_object('order', g, 'lines', json_build_array(1, 2, 3)),
                '{{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}}'::jsonb, 'tenant-' || (g % 50)
           FROM generate_series(1, {PENDING}) g"
    )).await;
    exec(&db, &format!(
        "INSERT INTO \"{{s}}\".outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, tenant_id, status, attempts, last_error, first_failed_at)
         SELECT gen_random_uuid(), 'payment', 'd' || g, 'Payment' || (g % 5), json_build_object('n', g), 'tenant-' || (g % 50), 3, 8,
                CASE WHEN g % 4 = 0 THEN 'unroutable: NO_ROUTE' ELSE 'no broker confirmation within 10s' END, now()
           FROM generate_series(1, {DEAD}) g"
    )).await;
    exec(&db,
        "INSERT INTO \"{s}\".outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, status, sent_at)
         SELECT gen_random_uuid(), 'order', 's' || g, 'Event1', '{}', 1, now() - (g % 3600) * interval '1 second'
           FROM generate_series(1, 60000) g",
    ).await;
    exec(&db,
        "INSERT INTO \"{s}\".inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
         SELECT gen_random_uuid(), 'projection', 'Event' || (g % 10), 5, 'handler failed', now() FROM generate_series(1, 500) g",
    ).await;
    // PostgreSQL here runs with autovacuum off: statistics and the visibility map by hand.
    // One statement each: VACUUM cannot run in the implicit transaction of a batch.
    for table in ["outbox_messages", "inbox_failures"] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "VACUUM ANALYZE \"{}\".{table}",
            db.schema()
        )))
        .execute(db.pool())
        .await
        .expect("vacuum");
    }
    println!(
        "loaded {PENDING} pending, {DEAD} dead, 60000 sent rows in {:.0} s",
        load.elapsed().as_secs_f64()
    );

    let admin: Arc<dyn OutboxAdmin> = Arc::new(
        PgOutbox::connect(&PgConfig::new(common::database_url()).with_schema(db.schema()))
            .await
            .expect("connect"),
    );
    let mut settings = DashboardSettings::new();
    settings.listen = "127.0.0.1:0".parse().expect("addr");
    let dashboard = RunningDashboard::start(admin, &settings, CancellationToken::new())
        .await
        .expect("dashboard");
    let addr = dashboard.local_addr();

    // A page in the middle of the backlog: the cursor of its 500,000th row.
    let (nanos, seq) = sqlx::query_as::<_, (i64, i64)>(sqlx::AssertSqlSafe(format!(
        "SELECT (extract(epoch FROM visible_at) * 1000000)::int8, seq FROM \"{}\".outbox_messages
          WHERE phase = 0 ORDER BY visible_at, seq OFFSET 500000 LIMIT 1",
        db.schema()
    )))
    .fetch_one(db.pool())
    .await
    .expect("cursor");
    let deep = format!(
        "/messages?state=pending&after={}.{:09}_{seq}",
        nanos.div_euclid(1_000_000),
        nanos.rem_euclid(1_000_000) * 1000
    );
    let one = scalar(
        &db,
        "SELECT seq FROM \"{s}\".outbox_messages WHERE status = 3 ORDER BY seq LIMIT 1",
    )
    .await;
    let dead_id: uuid::Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM \"{}\".outbox_messages WHERE seq = {one}",
        db.schema()
    )))
    .fetch_one(db.pool())
    .await
    .expect("id");
    let pages: Vec<(&str, String)> = vec![
        ("overview", "/".into()),
        ("pending, first page", "/messages?state=pending".into()),
        ("pending, page at row 500,000", deep),
        (
            "pending, event type filter",
            "/messages?state=pending&event_type=Event3".into(),
        ),
        (
            "pending, tenant + event type",
            "/messages?state=pending&tenant=tenant-7&event_type=Event7".into(),
        ),
        // The worst case: a filter no pending row matches walks the whole state.
        (
            "pending, error text no row has",
            "/messages?state=pending&error=no-such-error".into(),
        ),
        ("dead, first page", "/messages?state=dead".into()),
        (
            "dead, error filter",
            "/messages?state=dead&error=no_route".into(),
        ),
        ("sent, first page", "/messages?state=sent".into()),
        ("message detail", format!("/messages/{dead_id}")),
        ("blocked keys", "/blocked".into()),
        ("consumer dead letters", "/inbox".into()),
        ("replay preview (filter)", "/replay?error=no_route".into()),
        ("replay preview (one id)", format!("/replay?id={dead_id}")),
    ];
    println!(
        "{:<32} {:>10} {:>10}  (server time, ms; {} runs after a warm-up)",
        "page",
        "median",
        "max",
        RUNS - 1
    );
    let mut worst = 0.0f64;
    for (name, path) in &pages {
        let mut ms = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            ms.push(server_ms(addr, path).await);
        }
        let mut timed = ms[1..].to_vec();
        timed.sort_by(f64::total_cmp);
        let median = timed[timed.len() / 2];
        let max = timed[timed.len() - 1];
        worst = worst.max(median);
        println!("{name:<32} {median:>10.1} {max:>10.1}");
    }
    println!("slowest median: {worst:.1} ms (target: 200 ms)");
    dashboard.stop().await.expect("stops");
    exec(&db, "DROP SCHEMA \"{s}\" CASCADE").await;
}
