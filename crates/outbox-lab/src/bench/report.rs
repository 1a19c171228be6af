//! The relay benchmark's report: the rounds' ratios, the medians, CPU and publishers'
//! load in the median round, the figure of merit and the latencies.

use std::time::Duration;

use outboxkit_core::SentRetention;

use super::phases::Publishing;
use super::{Args, Broker};
use crate::common;

pub(super) struct Round {
    /// Whether the relay ran before the broker ceiling in this round.
    pub(super) relay_first: bool,
    pub(super) store: Duration,
    pub(super) store_cpu: common::CpuTimes,
    pub(super) broker: Duration,
    pub(super) broker_cpu: common::CpuTimes,
    pub(super) relay: Duration,
    pub(super) relay_cpu: common::CpuTimes,
    pub(super) relay_publishing: Publishing,
    pub(super) pipeline: Duration,
    pub(super) pipeline_cpu: common::CpuTimes,
    pub(super) pipeline_publishing: Publishing,
    pub(super) bare: Duration,
    /// The reference relay (claim, pipelined publish, mark sent; nothing else).
    pub(super) reference: Duration,
    pub(super) reference_cpu: common::CpuTimes,
}

impl Round {
    /// The relay's rate over the lower of the two ceilings measured in this round.
    pub(super) fn ratio(&self, n: usize) -> f64 {
        rate(n, self.relay) / rate(n, self.store).min(rate(n, self.broker))
    }
}

pub(super) fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// The median of `v` (the mean of the two middle ones of an even count).
pub(super) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let k = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[k - 1] + v[k]) / 2
    } else {
        v[k]
    }
}

/// One phase's line of CPU seconds (broker / database / this process) and the share of
/// the machine's cores they kept busy over `elapsed`.
pub(super) fn print_cpu(phase: &str, cpu: common::CpuTimes, elapsed: Duration) {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let busy = cpu.broker + cpu.database + cpu.relay;
    println!(
        "  {phase:<15} {:.2} / {:.2} / {:.2} s, {:.0}% of {cores} cores",
        cpu.broker,
        cpu.database,
        cpu.relay,
        100.0 * busy / elapsed.as_secs_f64() / cores as f64,
    );
}

/// What the rounds measured besides the phases' times.
pub(super) struct Totals {
    /// Commit-to-publish p50 and p99 of the last round's backlog.
    pub(super) latency: Option<(Duration, Duration)>,
    /// Commit-to-publish p50 and p99 of the steady-state phase.
    pub(super) steady: Option<(Duration, Duration)>,
    /// Messages marked Sent (rows left, under `SentRetention::Delete`) after the last
    /// round's relay.
    pub(super) sent: i64,
    /// The longest wait for a quiet machine before a phase.
    pub(super) settled: Duration,
    /// The relay process's peak RSS in the first round, bytes.
    pub(super) peak_rss: u64,
    /// The RSS before the first relay phase, bytes.
    pub(super) baseline_rss: u64,
}

/// Prints the medians of `rounds`, the CPU use and the publishers' load in the round with
/// the median relay time, the figure of merit and the latencies.
pub(super) fn print(args: &Args, broker: &Broker, rounds: &[Round], totals: Totals) {
    let Totals {
        latency,
        steady,
        sent,
        settled,
        peak_rss,
        baseline_rss,
    } = totals;
    let n = args.messages;
    let median = |f: &dyn Fn(&Round) -> Duration| median(rounds.iter().map(f).collect());
    let store = median(&|r| r.store);
    let broker_median = median(&|r| r.broker);
    let relay = median(&|r| r.relay);
    let pipeline = median(&|r| r.pipeline);
    let bare = median(&|r| r.bare);
    let reference = median(&|r| r.reference);
    // The round whose relay time is the median (the upper one of an even count): its
    // CPU figures are printed.
    let mid = {
        let mut by_relay: Vec<&Round> = rounds.iter().collect();
        by_relay.sort_by_key(|r| r.relay);
        by_relay[by_relay.len() / 2]
    };
    let (store_cpu, broker_cpu, relay_cpu, pipeline_cpu) = (
        mid.store_cpu,
        mid.broker_cpu,
        mid.relay_cpu,
        mid.pipeline_cpu,
    );

    let (store_rate, broker_rate, relay_rate) =
        (rate(n, store), rate(n, broker_median), rate(n, relay));
    let ceiling = store_rate.min(broker_rate);
    println!();
    println!("medians of {} rounds:", rounds.len());
    println!("| phase                                   | messages/s | elapsed   |");
    println!("|-----------------------------------------|-----------:|----------:|");
    println!(
        "| store ceiling (claim + complete, no broker) | {store_rate:>10.0} | {:>9} |",
        common::ms(store)
    );
    println!(
        "| {} | {broker_rate:>10.0} | {:>9} |",
        broker.ceiling_label(),
        common::ms(broker_median)
    );
    println!(
        "| relay PostgreSQL → {:<20} | {relay_rate:>10.0} | {:>9} |",
        broker.name(),
        common::ms(relay)
    );
    println!(
        "| reference relay (claim, pipelined publish, mark sent; no retries, no circuit) | {:>10.0} | {:>9} |",
        rate(n, reference),
        common::ms(reference)
    );
    println!(
        "| (reference) relay without the database in the phase | {:>10.0} | {:>9} |",
        rate(n, pipeline),
        common::ms(pipeline)
    );
    println!(
        "| {} | {:>10.0} | {:>9} |",
        broker.bare_label(),
        rate(n, bare),
        common::ms(bare)
    );
    println!();
    println!(
        "CPU seconds per phase in the round with the median relay time ({} / PostgreSQL / this process):",
        broker.name()
    );
    for (phase, cpu, d) in [
        ("store ceiling", store_cpu, mid.store),
        ("broker ceiling", broker_cpu, mid.broker),
        ("relay", relay_cpu, mid.relay),
        ("relay, no db", pipeline_cpu, mid.pipeline),
        ("reference", mid.reference_cpu, mid.reference),
    ] {
        print_cpu(phase, cpu, d);
    }
    // Whether the relay waited on the database (publishers idle) or on the broker
    // (publishers busy, each batch taking longer to be confirmed).
    let (with_db, no_db) = (mid.relay_publishing, mid.pipeline_publishing);
    println!(
        "publishers in that round: busy {:.0}% of the relay phase, a batch confirmed {} after its first send (no database in the phase: {:.0}%, {})",
        100.0 * with_db.busy,
        common::ms(with_db.per_batch),
        100.0 * no_db.busy,
        common::ms(no_db.per_batch),
    );
    println!();
    // The figure of merit pairs each relay with the ceilings measured in its own round,
    // and averages the rounds' ratios geometrically: with as many rounds run relay-first
    // as ceiling-first, the effect of the order cancels out.
    let geomean = |rs: &[&Round]| -> Option<f64> {
        (!rs.is_empty())
            .then(|| (rs.iter().map(|r| r.ratio(n).ln()).sum::<f64>() / rs.len() as f64).exp())
    };
    let all: Vec<&Round> = rounds.iter().collect();
    let (relay_first, ceiling_first): (Vec<&Round>, Vec<&Round>) =
        rounds.iter().partition(|r| r.relay_first);
    let show = |g: Option<f64>| g.map_or_else(|| "-".to_owned(), |g| format!("{g:.2}"));
    println!(
        "relay / lower ceiling = {} (target ≥ 0.90): geometric mean of the {} rounds' ratios; \
         rounds with the relay first {}, with the ceiling first {}; ratio of the medians {:.2}",
        show(geomean(&all)),
        rounds.len(),
        show(geomean(&relay_first)),
        show(geomean(&ceiling_first)),
        relay_rate / ceiling
    );
    // The relay against the reference relay of its own round, in both orders equally
    // often.
    let vs_reference = (rounds
        .iter()
        .map(|r| (r.reference.as_secs_f64() / r.relay.as_secs_f64()).ln())
        .sum::<f64>()
        / rounds.len() as f64)
        .exp();
    println!(
        "relay / reference relay = {vs_reference:.2} (target ≥ 1.0): geometric mean of the {} rounds' ratios; ratio of the medians {:.2}",
        rounds.len(),
        relay_rate / rate(n, reference)
    );
    println!(
        "each timed phase started after a checkpoint and sync, on idle cores (longest wait {}), \
         each broker phase right after an untimed warm-up of the same size",
        common::ms(settled)
    );
    if args.sent_retention == SentRetention::Delete {
        println!("rows left in the outbox after the relay: {sent} of {n} (sent rows are deleted)");
        println!(
            "commit-to-publish latency of the backlog: not measured (it is read from sent_at, and sent rows are deleted)"
        );
    } else {
        println!("messages marked Sent: {sent} of {n}");
    }
    if let Some((p50, p99)) = latency {
        println!(
            "commit-to-publish latency, backlog of {n} pre-inserted (last round): p50 {} p99 {}",
            common::ms(p50),
            common::ms(p99)
        );
    }
    if let Some((p50, p99)) = steady {
        println!(
            "commit-to-publish latency, steady {} messages/s for {} s (sent rows kept): p50 {} p99 {}",
            args.steady_rate,
            args.steady_secs,
            common::ms(p50),
            common::ms(p99)
        );
    }
    println!(
        "relay process peak RSS in the first round {:.1} MiB (baseline before the relay {:.1} MiB)",
        peak_rss as f64 / 1048576.0,
        baseline_rss as f64 / 1048576.0
    );
}
