//! The 3-node RabbitMQ and NATS JetStream clusters of `cargo xtask services
//! --cluster`, for the tests that run on them: their URLs, whether they run, and node
//! faults injected for real (a node killed with `SIGKILL` and started again with its
//! own start script, a node frozen with `SIGSTOP`).
//!
//! The nodes are the project's own processes (data under `target/cluster/`, or
//! `OUTBOX_CLUSTER_DIR`), found by their ports, so a fault never touches the shared
//! single-node servers. Take the machine-wide [`faults::lock`](crate::faults::lock)
//! around a fault as for the shared servers: the chaos harness and other fault tests
//! must not overlap.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::faults::pid_listening_on;

/// Nodes per cluster.
pub const NODES: usize = 3;

/// The RabbitMQ nodes' AMQP ports (node 1, 2, 3).
pub const RABBIT_PORTS: [u16; NODES] = [5681, 5682, 5683];

/// The NATS nodes' client ports (node 1, 2, 3).
pub const NATS_PORTS: [u16; NODES] = [4231, 4232, 4233];

/// Where `cargo xtask services --cluster` keeps the nodes' data, configuration and
/// start scripts: `OUTBOX_CLUSTER_DIR`, else `target/cluster` in the workspace.
pub fn dir() -> PathBuf {
    std::env::var_os("OUTBOX_CLUSTER_DIR").map_or_else(
        || {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/cluster")
                .components()
                .collect()
        },
        PathBuf::from,
    )
}

fn answers(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

/// Whether every node of both clusters answers on its client port.
pub fn running() -> bool {
    RABBIT_PORTS
        .iter()
        .chain(&NATS_PORTS)
        .all(|port| answers(*port))
}

/// Panics with the command that starts the clusters when they do not run.
///
/// # Panics
/// When a node does not answer.
pub fn require() {
    assert!(
        running(),
        "the clusters are not running: start them with `cargo xtask services --cluster`"
    );
}

/// The AMQP URL of RabbitMQ node `node` (1 to 3).
pub fn rabbit_url(node: usize) -> String {
    format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        RABBIT_PORTS[node - 1]
    )
}

/// The AMQP URLs of every RabbitMQ node, comma-separated (what `RabbitConfigBuilder`
/// takes for a cluster).
pub fn rabbit_urls() -> String {
    (1..=NODES).map(rabbit_url).collect::<Vec<_>>().join(",")
}

/// The URLs of every NATS node, comma-separated.
pub fn nats_urls() -> String {
    NATS_PORTS
        .iter()
        .map(|port| format!("nats://127.0.0.1:{port}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The Erlang node name of RabbitMQ node `node`.
pub fn rabbit_node(node: usize) -> String {
    format!("outbox-rabbit-{node}@localhost")
}

/// `rabbitmqctl -n NODE ARGS` with the cluster's Erlang cookie; its standard output,
/// or why it failed.
///
/// # Errors
/// The command's exit status and standard error.
pub fn rabbitmqctl(node: usize, args: &[&str]) -> Result<String, String> {
    let direct = PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmqctl");
    let program = if direct.exists() {
        direct
    } else {
        PathBuf::from("rabbitmqctl")
    };
    let output = Command::new(program)
        .env("HOME", dir().join("rabbitmq"))
        .args(["-n", &rabbit_node(node)])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run rabbitmqctl: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "rabbitmqctl -n {} {} failed ({}): {}",
            rabbit_node(node),
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// The node (1 to 3) holding the leader of quorum queue `queue`, asked of any node
/// that answers.
pub fn quorum_leader(queue: &str) -> Option<usize> {
    (1..=NODES).find_map(|asked| {
        let text = rabbitmqctl(
            asked,
            &[
                "list_queues",
                "name",
                "leader",
                "--formatter",
                "json",
                "--online",
            ],
        )
        .ok()?;
        let rows: serde_json::Value = serde_json::from_str(&text).ok()?;
        let leader = rows.as_array()?.iter().find(|row| row["name"] == queue)?["leader"]
            .as_str()?
            .to_owned();
        (1..=NODES).find(|node| rabbit_node(*node) == leader)
    })
}

/// The server name (`outbox-nats-N`) of the leader of JetStream stream `stream`, read
/// from a node's monitoring endpoint (`/jsz?streams=true`), as the node index.
pub fn stream_leader(stream: &str) -> Option<usize> {
    (1..=NODES).find_map(|asked| {
        let body = http_get(8230 + u16::try_from(asked).ok()?, "/jsz?streams=true")?;
        let json: serde_json::Value = serde_json::from_str(&body).ok()?;
        let leader = json["account_details"]
            .as_array()?
            .iter()
            .flat_map(|account| account["stream_detail"].as_array().into_iter().flatten())
            .find(|detail| detail["name"] == stream)?["cluster"]["leader"]
            .as_str()?
            .to_owned();
        (1..=NODES).find(|node| format!("outbox-nats-{node}") == leader)
    })
}

fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    )
    .ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// The node (1 to 3) of `broker`'s cluster that process `pid` holds a TCP connection
/// to, if any (from `/proc/net/tcp` and the process's open sockets): which node a
/// relay or a consumer is connected to.
pub fn connected_node(pid: u32, broker: Broker) -> Option<usize> {
    let sockets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .map(|target| target.to_string_lossy().into_owned())
        .filter(|target| target.starts_with("socket:["))
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
    table.lines().skip(1).find_map(|line| {
        // sl local_address rem_address st ... inode
        let fields: Vec<&str> = line.split_whitespace().collect();
        let remote = u16::from_str_radix(fields.get(2)?.rsplit(':').next()?, 16).ok()?;
        let established = fields.get(3)? == &"01";
        let inode = format!("socket:[{}]", fields.get(9)?);
        (established && sockets.contains(&inode))
            .then(|| (1..=NODES).find(|node| broker.port(*node) == remote))
            .flatten()
    })
}

/// Which cluster a node belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// The RabbitMQ cluster.
    Rabbit,
    /// The NATS JetStream cluster.
    Nats,
}

impl Broker {
    fn port(self, node: usize) -> u16 {
        match self {
            Self::Rabbit => RABBIT_PORTS[node - 1],
            Self::Nats => NATS_PORTS[node - 1],
        }
    }

    fn start_script(self, node: usize) -> PathBuf {
        let sub = match self {
            Self::Rabbit => "rabbitmq",
            Self::Nats => "nats",
        };
        dir().join(sub).join(node.to_string()).join("start.sh")
    }
}

/// A cluster node killed with `SIGKILL` (no shutdown, as a crashed host): dropping the
/// guard starts it again with its start script and waits until it serves clients
/// again (RabbitMQ: `rabbitmqctl await_startup`).
#[derive(Debug)]
pub struct NodeKilled {
    broker: Broker,
    node: usize,
}

impl NodeKilled {
    /// Kills node `node` (1 to 3) of `broker`'s cluster.
    ///
    /// # Panics
    /// When no process listens on the node's port or it survives `SIGKILL`.
    pub fn kill(broker: Broker, node: usize) -> Self {
        let port = broker.port(node);
        let pid = pid_listening_on(port)
            .unwrap_or_else(|| panic!("no {broker:?} node {node} listens on port {port}"));
        let killed = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(killed, "kill -9 {pid}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { broker, node }
    }

    /// Starts the node again now (dropping the guard does it too).
    pub fn restart(self) {}
}

impl Drop for NodeKilled {
    fn drop(&mut self) {
        let script = self.broker.start_script(self.node);
        let started = Command::new("sh")
            .arg(&script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            started || std::thread::panicking(),
            "failed to start {} again",
            script.display()
        );
        let port = self.broker.port(self.node);
        let deadline = Instant::now() + Duration::from_secs(90);
        while !answers(port) {
            if Instant::now() >= deadline {
                assert!(
                    std::thread::panicking(),
                    "node on port {port} did not come back"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        if self.broker == Broker::Rabbit {
            let _ = rabbitmqctl(self.node, &["-t", "90", "await_startup"]);
        }
    }
}
