//! `--statements`: how long the producer's and the relay's large statements take on
//! PostgreSQL, the check that sqlx's connections set `TCP_NODELAY` (issue 47 item 2).
//!
//! sqlx 0.9.0 stopped setting it (launchbadge/sqlx#4335): a statement whose bind data
//! overflows the socket's send buffer then waits for the server's delayed ACK, about
//! 40 ms (Nagle's algorithm meeting delayed ACKs), so a completion of 500 messages took
//! 45 ms instead of about 3. sqlx 0.9.1 sets it again (launchbadge/sqlx#4336). This
//! times, on a fresh schema, `enqueue_batch` of 500 and of 5,000 messages (each in a
//! transaction of its own, the statement alone timed) and the completion of 500
//! claimed messages as `Sent` (one `UPDATE … FROM UNNEST`), [`ROUNDS`] times each. It
//! counts the 500-message statements that took 40 ms or more, and compares the
//! 5,000-message insert with ten times the 500-message one: the work grows linearly
//! with the rows, a stall adds a fixed 40 ms.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use outboxkit_core::{
    Completion, CompletionOutcome, NewMessage, OutboxProducer as _, OutboxStore, SentRetention,
};
use outboxkit_postgres::PgOutbox;

use super::phases::payload;
use super::stores::BenchStore;

/// Statements timed per kind.
const ROUNDS: usize = 30;
/// Messages per completion: the relay's default batch.
const COMPLETION: usize = 500;
/// Messages of the large `enqueue_batch`.
const LARGE: usize = 5_000;
/// A statement this long or longer is counted as a stall.
const STALL: Duration = Duration::from_millis(40);

/// Runs the measurement with messages of `payload_bytes` bytes.
pub(super) async fn run(payload_bytes: usize) -> anyhow::Result<()> {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let outbox = PgOutbox::fresh(&tag, SentRetention::Keep).await?;
    let measured = measure(&outbox, &payload(payload_bytes)).await;
    outbox.drop_schema().await;
    measured
}

async fn measure(outbox: &PgOutbox, body: &str) -> anyhow::Result<()> {
    println!(
        "statements, PostgreSQL: {ROUNDS} of each, {}-byte payloads, the statement alone timed",
        body.len()
    );
    let mut medians = Vec::new();
    for size in [COMPLETION, LARGE] {
        let mut times = Vec::with_capacity(ROUNDS);
        for round in 0..ROUNDS {
            let messages = (0..size)
                .map(|i| {
                    NewMessage::builder("bench", format!("{round}-{i}"), "BenchEvent")
                        .payload_json(body.to_owned())
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut tx = outbox.begin().await?;
            let started = Instant::now();
            outbox.enqueue_batch(&mut tx, &messages).await?;
            times.push(started.elapsed());
            tx.commit().await?;
        }
        medians.push(report("enqueue_batch", size, times));
    }
    let linear = medians[0] * (LARGE / COMPLETION) as u32;
    println!(
        "statements, PostgreSQL: enqueue_batch of {LARGE} messages: p50 {:.1} ms against {:.1} ms for {} times {COMPLETION} ({:+.1} ms; a Nagle stall adds a fixed ~40 ms)",
        medians[1].as_secs_f64() * 1_000.0,
        linear.as_secs_f64() * 1_000.0,
        LARGE / COMPLETION,
        (medians[1].as_secs_f64() - linear.as_secs_f64()) * 1_000.0,
    );
    let mut times = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let batch = outbox.claim(COMPLETION, Duration::from_secs(60)).await?;
        anyhow::ensure!(
            batch.messages.len() == COMPLETION,
            "claimed {} messages, not {COMPLETION}",
            batch.messages.len()
        );
        let completions = batch
            .messages
            .iter()
            .map(|m| {
                Ok(Completion {
                    id: m.id,
                    claim_token: m.claim_token.context("a claimed message has a token")?,
                    outcome: CompletionOutcome::Sent,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let started = Instant::now();
        let done = outbox.complete(&completions).await?;
        times.push(started.elapsed());
        anyhow::ensure!(
            done.applied == COMPLETION as u64,
            "{} of {COMPLETION} completions applied",
            done.applied
        );
    }
    report("complete (Sent)", COMPLETION, times);
    Ok(())
}

/// Prints the median, the 90th percentile and the longest of `times`, per message too,
/// and (for statements of [`COMPLETION`] messages) how many reached [`STALL`]; returns
/// the median.
fn report(what: &str, size: usize, mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1_000.0;
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let stalls = if size == COMPLETION {
        format!(
            "; {} of {} took {} ms or more",
            times.iter().filter(|t| **t >= STALL).count(),
            times.len(),
            STALL.as_millis()
        )
    } else {
        String::new()
    };
    println!(
        "statements, PostgreSQL: {what} of {size} messages: p50 {:.1} ms ({:.1} µs per message), p90 {:.1} ms, max {:.1} ms{stalls}",
        ms(at(0.5)),
        ms(at(0.5)) * 1_000.0 / size as f64,
        ms(at(0.9)),
        ms(at(1.0)),
    );
    at(0.5)
}
