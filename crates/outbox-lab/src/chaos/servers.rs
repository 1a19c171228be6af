//! The servers as the run found them, and the check that it leaves them so: each
//! answers on its port, RabbitMQ has no alarm, the same memory watermark and
//! `max_message_size`, and no queue-full policy; no server process is left stopped; on
//! the clusters, every node answers and sees the others.

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use super::db::Database;
use outboxkit_testkit::faults::{
    self, QUEUE_FULL_POLICY, RabbitQueueFull, rabbit_max_message_size, rabbit_memory_alarm_active,
    rabbit_memory_watermark,
};

/// RabbitMQ's settings that faults change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) watermark: Option<String>,
    pub(crate) max_message_size: Option<u64>,
    /// The run's database, whose server must answer after the run.
    pub(crate) database: Database,
}

fn answers(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    )
    .is_ok()
}

/// Undoes what an earlier run killed with SIGKILL may have left (a stopped server
/// process, the queue-full policy), then reads RabbitMQ's settings. Fails when RabbitMQ
/// is under a memory alarm already: the run could not tell its own alarm from it, nor
/// restore the watermark it should.
pub(crate) fn before(cluster: bool, database: Database) -> anyhow::Result<Snapshot> {
    for process in ["beam.smp", "nats-server"] {
        let n = faults::continue_stopped(process);
        if n > 0 {
            println!(
                "chaos: continued {n} stopped `{process}` process(es) left by an interrupted run"
            );
        }
    }
    RabbitQueueFull::clear_leftover();
    if cluster {
        anyhow::ensure!(
            outboxkit_testkit::cluster::running(),
            "the clusters are not running: start them with `cargo xtask services --cluster`"
        );
    }
    if rabbit_memory_alarm_active() == Some(true) {
        anyhow::bail!(
            "RabbitMQ reports a memory alarm before the run (watermark {:?}); restore it first \
             (`rabbitmqctl set_vm_memory_high_watermark 0.4`)",
            rabbit_memory_watermark()
        );
    }
    Ok(Snapshot {
        watermark: rabbit_memory_watermark(),
        max_message_size: rabbit_max_message_size(),
        database,
    })
}

/// Checks the servers against `before`, waiting up to 60 s for them to answer; returns
/// one line per server and whether all are as found.
pub(crate) fn after(before: &Snapshot, cluster: bool) -> (Vec<String>, bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let database = before.database;
    let ports = [
        (database.server(), database.port()),
        ("RabbitMQ", 5672),
        ("NATS", 4222),
    ];
    while Instant::now() < deadline && !ports.iter().all(|(_, p)| answers(*p)) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut lines = Vec::new();
    let mut ok = true;
    for (name, port) in ports {
        let up = answers(port);
        ok &= up;
        lines.push(format!(
            "{name}: {}",
            if up { "answers" } else { "DOES NOT ANSWER" }
        ));
    }
    if cluster {
        use outboxkit_testkit::cluster::{nats_cluster_whole, rabbit_cluster_whole, running};
        // A node killed, frozen or cut off last comes back within two minutes.
        let deadline = Instant::now() + Duration::from_secs(120);
        let whole = || running() && rabbit_cluster_whole() && nats_cluster_whole();
        while Instant::now() < deadline && !whole() {
            std::thread::sleep(Duration::from_secs(1));
        }
        let whole = whole();
        ok &= whole;
        lines.push(format!(
            "clusters: {}",
            if whole {
                "every node answers, both clusters whole"
            } else {
                "NOT WHOLE (a node does not answer or does not see the others)"
            }
        ));
    }
    let now = Snapshot {
        watermark: rabbit_memory_watermark(),
        max_message_size: rabbit_max_message_size(),
        database,
    };
    let alarm = rabbit_memory_alarm_active();
    let policy = Command::new("rabbitmqctl")
        .args(["-q", "list_policies"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(QUEUE_FULL_POLICY));
    let same = now == *before && alarm != Some(true) && policy != Some(true);
    ok &= same;
    lines.push(format!(
        "RabbitMQ: memory alarm {}, watermark {} (was {}), max_message_size {} (was {}), queue-full policy {}{}",
        shown(alarm.map(|a| if a { "ACTIVE" } else { "none" })),
        shown(now.watermark.as_deref()),
        shown(before.watermark.as_deref()),
        shown(now.max_message_size),
        shown(before.max_message_size),
        shown(policy.map(|p| if p { "PRESENT" } else { "none" })),
        if same { "" } else { "  <- NOT AS FOUND" }
    ));
    (lines, ok)
}

fn shown<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "unknown (no rabbitmqctl)".to_owned(), |v| v.to_string())
}
