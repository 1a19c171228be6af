//! How the batched consumer isolates its handlers, measured: one transaction of 100
//! messages with a savepoint around each handler, against the same transaction without
//! savepoints (the batched consumer's choice: on a failure the batch is rolled back and
//! replayed), with one message per transaction as a reference. Each variant claims its
//! messages as the consumer does (one `claim_batch_unless_dead` per batch, or
//! `claim_unless_dead` per message) and inserts one row per message, on a pool of one
//! connection, against the real PostgreSQL at `DATABASE_URL`.
//!
//! ```sh
//! cargo run --release -p outboxkit-inbox --example savepoint_timing -- [rounds]
//! ```
//!
//! Prints messages per second per variant and round, then the medians; also the cost
//! of one failing message in a batch under each scheme. A timing run, not a test.

use std::time::{Duration, Instant};

use outboxkit_core::InboxStore;
use outboxkit_core::inbox::ConsumerDeadLetters;
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

const BATCH: usize = 100;
const BATCHES_PER_ROUND: usize = 30;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    PerMessage,
    Optimistic,
    Savepoints,
}

type Error = Box<dyn std::error::Error>;

async fn insert(conn: &mut PgConnection, schema: &str, id: Uuid) -> Result<(), Error> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.effects (message_id) VALUES ($1)"
    )))
    .bind(id)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// One batch of `BATCH` fresh messages; `fail_at`: the message whose handler fails.
async fn batch(
    inbox: &PgInbox,
    schema: &str,
    variant: Variant,
    fail_at: Option<usize>,
) -> Result<(), Error> {
    let ids: Vec<Uuid> = (0..BATCH).map(|_| Uuid::now_v7()).collect();
    match variant {
        Variant::PerMessage => {
            for &id in &ids {
                let mut tx = inbox.begin().await?;
                inbox.claim_unless_dead(&mut tx, id, "timing").await?;
                if fail_at.is_some_and(|f| ids[f] == id) {
                    inbox.rollback(tx).await?;
                    continue;
                }
                insert(&mut tx, schema, id).await?;
                inbox.commit(tx).await?;
            }
        }
        Variant::Optimistic => {
            // Attempt; on a failure roll back, redo the prefix as a batch, the failing
            // message alone (here: claimed and rolled back), then the suffix.
            let run = async |range: &[Uuid], fails: Option<Uuid>| -> Result<bool, Error> {
                let mut tx = inbox.begin().await?;
                let pairs: Vec<(Uuid, &str)> = range.iter().map(|&id| (id, "timing")).collect();
                inbox.claim_batch_unless_dead(&mut tx, &pairs).await?;
                for &id in range {
                    if Some(id) == fails {
                        inbox.rollback(tx).await?;
                        return Ok(false);
                    }
                    insert(&mut tx, schema, id).await?;
                }
                inbox.commit(tx).await?;
                Ok(true)
            };
            let fails = fail_at.map(|f| ids[f]);
            if !run(&ids, fails).await? {
                let f = fail_at.unwrap_or(0);
                run(&ids[..f], None).await?;
                let mut tx = inbox.begin().await?;
                inbox.claim_unless_dead(&mut tx, ids[f], "timing").await?;
                inbox.rollback(tx).await?;
                run(&ids[f + 1..], None).await?;
            }
        }
        Variant::Savepoints => {
            let mut tx = inbox.begin().await?;
            let pairs: Vec<(Uuid, &str)> = ids.iter().map(|&id| (id, "timing")).collect();
            inbox.claim_batch_unless_dead(&mut tx, &pairs).await?;
            for &id in &ids {
                sqlx::raw_sql("SAVEPOINT handler").execute(&mut *tx).await?;
                if fail_at.is_some_and(|f| ids[f] == id) {
                    // Undo the handler, and its claim (made before the savepoint).
                    sqlx::raw_sql("ROLLBACK TO SAVEPOINT handler")
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query(AssertSqlSafe(format!(
                        "DELETE FROM {schema}.inbox_records WHERE message_id = $1 AND consumer = 'timing'"
                    )))
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                    continue;
                }
                insert(&mut tx, schema, id).await?;
                sqlx::raw_sql("RELEASE SAVEPOINT handler")
                    .execute(&mut *tx)
                    .await?;
            }
            inbox.commit(tx).await?;
        }
    }
    Ok(())
}

/// Messages per second of `BATCHES_PER_ROUND` batches.
async fn round(
    inbox: &PgInbox,
    schema: &str,
    variant: Variant,
    fail_at: Option<usize>,
) -> Result<f64, Error> {
    let started = Instant::now();
    for _ in 0..BATCHES_PER_ROUND {
        batch(inbox, schema, variant, fail_at).await?;
    }
    Ok((BATCH * BATCHES_PER_ROUND) as f64 / started.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("t_timing_{}", Uuid::new_v4().simple());
    let outbox = PgOutbox::connect(&PgConfig::new(&url).with_schema(&schema)).await?;
    outbox.migrate().await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.effects (message_id uuid NOT NULL)"
    )))
    .execute(outbox.pool())
    .await?;
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(options)
        .await?;
    let inbox = PgOutbox::new(pool, &PgConfig::default().with_schema(&schema))?.inbox();
    // Warm up: statements prepared, caches filled.
    for variant in [
        Variant::PerMessage,
        Variant::Optimistic,
        Variant::Savepoints,
    ] {
        batch(&inbox, &schema, variant, None).await?;
    }
    let variants = [
        Variant::PerMessage,
        Variant::Optimistic,
        Variant::Savepoints,
    ];
    let mut results: Vec<(Variant, Option<usize>, Vec<f64>)> = Vec::new();
    for fail_at in [None, Some(BATCH / 2)] {
        for variant in variants {
            results.push((variant, fail_at, Vec::new()));
        }
    }
    for r in 0..rounds {
        // Alternate the order of the variants from round to round.
        let mut order: Vec<usize> = (0..results.len()).collect();
        if r % 2 == 1 {
            order.reverse();
        }
        for k in order {
            let (variant, fail_at, ref mut rates) = results[k];
            let rate = round(&inbox, &schema, variant, fail_at).await?;
            println!("round {r} {variant:?} fail_at={fail_at:?}: {rate:.0} msg/s");
            rates.push(rate);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("\nmedian of {rounds} rounds, batches of {BATCH}, one insert per message:");
    for (variant, fail_at, rates) in results {
        let label = if fail_at.is_some() {
            "one failing message per batch"
        } else {
            "no failure"
        };
        println!("  {variant:?} ({label}): {:.0} msg/s", median(rates));
    }
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(outbox.pool())
        .await?;
    Ok(())
}
