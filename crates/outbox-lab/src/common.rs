//! Helpers shared by the benchmark and the chaos harness: service URLs, percentiles, CPU
//! and memory figures, waiting for idle cores.

use std::time::Duration;

use hdrhistogram::Histogram;
use outboxkit_nats::async_nats;

/// `DATABASE_URL`, or the local default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The PostgreSQL `url` with `application_name` = `app` added to its parameters, so
/// that one group's connections can be told apart in `pg_stat_activity`.
pub(crate) fn with_application_name(url: &str, app: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={app}")
}

/// `MYSQL_URL`, or the local default (MariaDB's `root` without a password).
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// The brokers' URLs set by [`use_cluster`], over the environment's.
static BROKERS: std::sync::OnceLock<(String, String)> = std::sync::OnceLock::new();

/// Makes [`amqp_url`] and [`nats_url`] return the URL lists of the 3-node clusters of
/// `cargo xtask services --cluster` for the rest of this process, and [`on_cluster`]
/// true. Child processes get them through [`broker_env`].
pub fn use_cluster() {
    let _ = BROKERS.set((
        outboxkit_testkit::cluster::rabbit_urls(),
        outboxkit_testkit::cluster::nats_urls(),
    ));
}

/// Whether this process runs on the clusters ([`use_cluster`]): queues are then quorum
/// queues and streams have 3 replicas.
pub fn on_cluster() -> bool {
    BROKERS.get().is_some()
}

/// The RabbitMQ URL, or a cluster's URLs separated by commas: what [`use_cluster`] set,
/// else `AMQP_URL`, else the local default.
pub fn amqp_url() -> String {
    BROKERS.get().map_or_else(
        || {
            std::env::var("AMQP_URL")
                .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
        },
        |(amqp, _)| amqp.clone(),
    )
}

/// The NATS URL, or a cluster's URLs separated by commas: what [`use_cluster`] set,
/// else `NATS_URL`, else the local default.
pub fn nats_url() -> String {
    BROKERS.get().map_or_else(
        || std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
        |(_, nats)| nats.clone(),
    )
}

/// `AMQP_URL` and `NATS_URL` for a child process, as this process uses them.
pub fn broker_env() -> [(&'static str, String); 2] {
    [("AMQP_URL", amqp_url()), ("NATS_URL", nats_url())]
}

/// A plain AMQP connection to the first node of [`amqp_url`] that accepts one, each
/// tried for at most 5 s.
///
/// # Errors
/// Every node's error when none accepts.
pub async fn amqp_connect() -> anyhow::Result<lapin::Connection> {
    let mut errors = Vec::new();
    for url in amqp_url().split(',').map(str::trim) {
        let attempt = tokio::time::timeout(
            Duration::from_secs(5),
            lapin::Connection::connect(url, lapin::ConnectionProperties::default()),
        )
        .await;
        let redacted = outboxkit_rabbit::redact_url(url);
        match attempt {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => errors.push(format!("{redacted}: {e}")),
            Err(_) => errors.push(format!("{redacted}: no answer within 5 s")),
        }
    }
    anyhow::bail!(
        "no RabbitMQ node accepted a connection: {}",
        errors.join("; ")
    )
}

/// A plain NATS client over the servers of [`nats_url`].
///
/// # Errors
/// When no server accepts a connection.
pub async fn nats_connect() -> Result<async_nats::Client, async_nats::ConnectError> {
    let servers: Vec<String> = nats_url().split(',').map(|s| s.trim().to_owned()).collect();
    async_nats::connect(servers).await
}

/// p50 and p99 of latencies given in milliseconds.
pub fn percentiles(latencies_ms: &[f64]) -> Option<(Duration, Duration)> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).ok()?;
    for &ms in latencies_ms {
        let us = (ms * 1000.0).max(1.0) as u64;
        h.saturating_record(us);
    }
    if h.is_empty() {
        return None;
    }
    Some((
        Duration::from_micros(h.value_at_quantile(0.50)),
        Duration::from_micros(h.value_at_quantile(0.99)),
    ))
}

/// Resident set size of this process, in bytes (Linux; 0 elsewhere).
pub(crate) fn rss_bytes() -> u64 {
    rss_of("self")
}

/// Resident set size of process `pid` (`self` for this one), in bytes (Linux; 0
/// elsewhere or when it is gone).
pub(crate) fn rss_of(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Formats a duration in milliseconds with one decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// CPU seconds used so far by the broker (RabbitMQ's `beam.smp` or `nats-server`),
/// the databases (PostgreSQL's `postgres`, MariaDB's `mariadbd`, MySQL's `mysqld`) and
/// this process, read from `/proc` (Linux; zeros elsewhere).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuTimes {
    pub(crate) broker: f64,
    pub(crate) database: f64,
    pub(crate) relay: f64,
}

impl CpuTimes {
    /// With RabbitMQ (`beam.smp`) as the broker.
    pub(crate) fn now() -> Self {
        Self::now_with("beam.smp")
    }

    /// With the processes named `broker_comm` as the broker.
    pub(crate) fn now_with(broker_comm: &str) -> Self {
        let mut t = Self::default();
        let me = std::process::id().to_string();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return t;
        };
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let Some((comm, used)) = comm_and_cpu(&stat) else {
                continue;
            };
            if name == me {
                t.relay += used;
            } else if comm == broker_comm {
                t.broker += used;
            } else if matches!(comm, "postgres" | "mariadbd" | "mysqld") {
                t.database += used;
            }
        }
        t
    }

    pub(crate) fn since(self, start: Self) -> Self {
        Self {
            broker: self.broker - start.broker,
            database: self.database - start.database,
            relay: self.relay - start.relay,
        }
    }
}

/// The command name and the CPU seconds (user and system) of a `/proc/{pid}/stat` line.
fn comm_and_cpu(stat: &str) -> Option<(&str, f64)> {
    let tick = 100.0; // USER_HZ on Linux
    // "pid (comm) state ... utime stime" with utime/stime the 14th/15th fields.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    let secs = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / tick
    };
    Some((stat.get(open + 1..close)?, secs(11) + secs(12)))
}

/// CPU seconds used so far by the process `pid` (`None` when it is gone or not on
/// Linux).
pub(crate) fn process_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    comm_and_cpu(&stat).map(|(_, secs)| secs)
}

/// Waits until the machine is quiet before a timed phase, so that no phase pays for
/// the aftermath of the one before it (a checkpoint, a dropped schema, the broker
/// deleting purged messages): until all cores were at least 95% idle over 250 ms, for
/// at most `max`. Returns how long it waited. Reads `/proc/stat` (Linux; elsewhere it
/// returns at once).
pub(crate) async fn settle(max: Duration) -> Duration {
    fn idle_and_total() -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        // "cpu  user nice system idle iowait irq softirq steal ..." in USER_HZ ticks.
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let ticks: Vec<u64> = line
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0);
        Some((idle, ticks.iter().take(8).sum()))
    }
    let started = std::time::Instant::now();
    while started.elapsed() < max {
        let Some((idle0, total0)) = idle_and_total() else {
            break;
        };
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Some((idle1, total1)) = idle_and_total() else {
            break;
        };
        let total = total1.saturating_sub(total0);
        if total > 0 && (idle1.saturating_sub(idle0)) as f64 >= 0.95 * total as f64 {
            break;
        }
    }
    started.elapsed()
}
