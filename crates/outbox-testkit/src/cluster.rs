//! The 3-node RabbitMQ and NATS JetStream clusters of `cargo xtask services
//! --cluster`, for the tests and the chaos harness that run on them: their URLs,
//! whether they run, which node leads a queue or a stream, which node a process is
//! connected to, and node faults injected for real: a node killed with `SIGKILL` and
//! started again with its own start script ([`NodeKilled`]), a node frozen with
//! `SIGSTOP` ([`NodeFrozen`]), and a node cut off from the network
//! ([`NodePartitioned`]: its namespace's link set down, a real partition).
//!
//! Every node runs in a network namespace of its own (`outbox-rabbit-N` at
//! `10.77.0.N`, `outbox-nats-N` at `10.77.0.1N`), reached from this machine's namespace
//! through a bridge. The nodes are the project's own processes (data under
//! `target/cluster/`, or `OUTBOX_CLUSTER_DIR`), found by their PID files, so a fault
//! never touches the shared single-node servers, nor the other broker's cluster. Take
//! the machine-wide [`faults::lock`](crate::faults::lock) around a fault as for the
//! shared servers: the chaos harness and other fault tests must not overlap.
//!
//! Dropping a guard undoes its fault and waits until the cluster is whole again; where
//! a broker does not heal by itself within a minute it restores the struck node the
//! way an operator would (RabbitMQ: its application restarted, after a freeze longer
//! than `net_ticktime` left a partition recorded; NATS: the server restarted, after a
//! partition left two nodes each taking itself for the JetStream meta leader, seen
//! with nats-server 2.9.10).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Nodes per cluster.
pub const NODES: usize = 3;

/// The RabbitMQ nodes' AMQP ports (node 1, 2, 3).
pub const RABBIT_PORTS: [u16; NODES] = [5681, 5682, 5683];

/// The NATS nodes' client ports (node 1, 2, 3).
pub const NATS_PORTS: [u16; NODES] = [4231, 4232, 4233];

/// The NATS nodes' monitoring ports (node 1, 2, 3).
const NATS_HTTP_PORTS: [u16; NODES] = [8231, 8232, 8233];

/// The address of `broker`'s node `node` (1 to 3): RabbitMQ `10.77.0.N`, NATS
/// `10.77.0.1N`.
///
/// # Panics
/// When `node` is not 1 to 3.
pub fn node_ip(broker: Broker, node: usize) -> IpAddr {
    assert!((1..=NODES).contains(&node), "no node {node}");
    let n = u8::try_from(node).unwrap_or(0);
    IpAddr::V4(Ipv4Addr::new(
        10,
        77,
        0,
        match broker {
            Broker::Rabbit => n,
            Broker::Nats => 10 + n,
        },
    ))
}

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

fn answers(broker: Broker, node: usize) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::new(node_ip(broker, node), broker.port(node)),
        Duration::from_secs(1),
    )
    .is_ok()
}

/// Whether every node of both clusters answers on its client port.
pub fn running() -> bool {
    (1..=NODES).all(|node| answers(Broker::Rabbit, node) && answers(Broker::Nats, node))
}

/// Panics with the command that starts the clusters when they do not run.
///
/// # Panics
/// When a node does not answer.
pub fn require() {
    assert!(
        running(),
        "the clusters are not running: start them with `cargo xtask services --cluster` \
         (`cargo xtask itest` does)"
    );
}

/// The AMQP URL of RabbitMQ node `node` (1 to 3).
pub fn rabbit_url(node: usize) -> String {
    format!(
        "amqp://guest:guest@{}:{}/%2f",
        node_ip(Broker::Rabbit, node),
        RABBIT_PORTS[node - 1]
    )
}

/// The AMQP URLs of every RabbitMQ node, comma-separated (what `RabbitConfig`
/// takes for a cluster).
pub fn rabbit_urls() -> String {
    (1..=NODES).map(rabbit_url).collect::<Vec<_>>().join(",")
}

/// The URL of NATS node `node` (1 to 3).
pub fn nats_url(node: usize) -> String {
    format!(
        "nats://{}:{}",
        node_ip(Broker::Nats, node),
        NATS_PORTS[node - 1]
    )
}

/// The URLs of every NATS node, comma-separated (what `NatsConfig` takes).
pub fn nats_urls() -> String {
    (1..=NODES).map(nats_url).collect::<Vec<_>>().join(",")
}

/// The Erlang node name of RabbitMQ node `node` (a long name: its host is its address).
pub fn rabbit_node(node: usize) -> String {
    format!("outbox-rabbit-{node}@{}", node_ip(Broker::Rabbit, node))
}

/// `rabbitmqctl --longnames -n NODE ARGS` with the cluster's Erlang cookie and
/// environment file; its standard output, or why it failed.
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
    let home = dir().join("rabbitmq");
    // `-t` bounds the wait for an answer, not the command: `stop_app` on a node left
    // stuck by a partition hung for 13 minutes with `-t 60` (seen here). `timeout`
    // (coreutils) ends it 15 s after its own limit (30 s when none is given).
    let limit = args
        .iter()
        .position(|a| *a == "-t")
        .and_then(|i| args.get(i + 1))
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(30)
        + 15;
    let output = Command::new("timeout")
        .args(["--kill-after=5", &format!("{limit}s")])
        .arg(program)
        .env("HOME", &home)
        .env("RABBITMQ_CONF_ENV_FILE", home.join("rabbitmq-env.conf"))
        .args(["--longnames", "-n", &rabbit_node(node)])
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

/// The node (1 to 3) holding the leader of quorum queue `queue`: the node that lists
/// it among its local queues (`list_queues --local`; a listing over the whole cluster
/// can time out for a while after a partition heals).
pub fn quorum_leader(queue: &str) -> Option<usize> {
    (1..=NODES).find(|node| {
        rabbitmqctl(
            *node,
            &[
                "-t",
                "10",
                "-q",
                "list_queues",
                "name",
                "--local",
                "--no-table-headers",
            ],
        )
        .is_ok_and(|text| text.lines().any(|line| line.trim() == queue))
    })
}

/// Whether every RabbitMQ node sees all nodes running and no partition
/// (`cluster_status`).
pub fn rabbit_cluster_whole() -> bool {
    (1..=NODES).all(|node| {
        rabbitmqctl(node, &["-t", "10", "cluster_status", "--formatter", "json"])
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .is_some_and(|status| {
                status["running_nodes"].as_array().map(Vec::len) == Some(NODES)
                    && status["partitions"]
                        .as_object()
                        .is_none_or(serde_json::Map::is_empty)
            })
    })
}

/// The node (1 to 3) holding the leader of JetStream stream `stream`, read from a
/// node's monitoring endpoint (`/jsz?streams=true`).
pub fn stream_leader(stream: &str) -> Option<usize> {
    (1..=NODES).find_map(|asked| {
        let body = http_get(asked, NATS_HTTP_PORTS[asked - 1], "/jsz?streams=true")?;
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

/// Whether every NATS node has routes to the two others and all three name the same
/// JetStream meta leader (`/routez`, `/jsz`).
pub fn nats_cluster_whole() -> bool {
    let mut leaders = Vec::new();
    for node in 1..=NODES {
        let port = NATS_HTTP_PORTS[node - 1];
        let json = |path| {
            http_get(node, port, path)
                .and_then(|body| serde_json::from_str::<serde_json::Value>(&body).ok())
        };
        let routes = json("/routez").and_then(|r| r["num_routes"].as_u64());
        if routes.unwrap_or(0) < 2 {
            return false;
        }
        match json("/jsz").and_then(|j| j["meta_cluster"]["leader"].as_str().map(str::to_owned)) {
            Some(leader) if !leader.is_empty() => leaders.push(leader),
            _ => return false,
        }
    }
    leaders.windows(2).all(|pair| pair[0] == pair[1])
}

/// Whether `broker`'s cluster is whole: every node sees the others, no partition
/// recorded, one meta leader.
pub fn whole(broker: Broker) -> bool {
    match broker {
        Broker::Rabbit => rabbit_cluster_whole(),
        Broker::Nats => nats_cluster_whole(),
    }
}

fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until `broker`'s cluster is whole after a fault on node `node`; where it does
/// not heal by itself within a minute, restores that node as an operator would and
/// waits two minutes more, then, where that did not do, restarts the node's process
/// (RabbitMQ: first `stop_app` and `start_app`, which clears a recorded partition, then
/// the node killed and started again; NATS: the server restarted, after a partition
/// that left two meta leaders). Whether the cluster is whole.
pub fn make_whole(broker: Broker, node: usize) -> bool {
    if wait_for(Duration::from_secs(60), || whole(broker)) {
        return true;
    }
    eprintln!(
        "cluster: {broker:?} is not whole a minute after the fault on node {node}; restoring that node"
    );
    if broker == Broker::Rabbit {
        // A node left stuck by a partition (Mnesia's `inconsistent_database`) does not
        // stop its application in time, or starts it with `noproc` (seen here): then
        // only its process restarted does.
        match rabbitmqctl(node, &["-t", "60", "stop_app"])
            .and_then(|_| rabbitmqctl(node, &["-t", "120", "start_app"]))
        {
            Ok(_) if wait_for(Duration::from_secs(120), || whole(broker)) => return true,
            Ok(_) => {
                eprintln!("cluster: RabbitMQ is still not whole; restarting node {node}'s process")
            }
            Err(e) => eprintln!("cluster: {e}; restarting node {node}'s process"),
        }
    }
    restart_process(broker, node);
    wait_for(Duration::from_secs(120), || whole(broker))
}

/// Stops node `node`'s process (`SIGTERM`, `SIGKILL` after 15 s; a frozen one is
/// continued first), starts it again with its start script and waits until it serves.
fn restart_process(broker: Broker, node: usize) {
    if let Some(pid) = broker.pid(node) {
        signal(pid, "-CONT");
        signal(pid, "-TERM");
        if !wait_for(Duration::from_secs(15), || {
            !Path::new(&format!("/proc/{pid}")).exists()
        }) {
            signal(pid, "-KILL");
            wait_for(Duration::from_secs(10), || {
                !Path::new(&format!("/proc/{pid}")).exists()
            });
        }
    }
    broker.start(node);
    broker.wait_serving(node, Duration::from_secs(120));
}

/// The node (1 to 3) that `leader` names, waiting up to `limit` for one to be known
/// (a leader is elected after a create or a loss).
pub async fn wait_for_leader(limit: Duration, leader: impl Fn() -> Option<usize>) -> Option<usize> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(node) = leader() {
            return Some(node);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn http_get(node: usize, port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let ip = node_ip(Broker::Nats, node);
    let mut stream =
        TcpStream::connect_timeout(&SocketAddr::new(ip, port), Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// The node (1 to 3) of `broker`'s cluster that process `pid` holds an established TCP
/// connection to, if any (the lowest when several): which node a relay or a consumer
/// is connected to. See [`connected_nodes`].
pub fn connected_node(pid: u32, broker: Broker) -> Option<usize> {
    connected_nodes(pid, broker).first().copied()
}

/// The nodes (1 to 3, ascending) of `broker`'s cluster that process `pid` holds an
/// established TCP connection to (from `/proc/PID/net/tcp` and the process's open
/// sockets). A connection to a node cut off by a partition may still count as
/// established until the process gives it up.
pub fn connected_nodes(pid: u32, broker: Broker) -> Vec<usize> {
    let mut nodes = connections(pid, broker).unwrap_or_default();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

fn connections(pid: u32, broker: Broker) -> Option<Vec<usize>> {
    let sockets: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .map(|target| target.to_string_lossy().into_owned())
        .filter(|target| target.starts_with("socket:["))
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
    let nodes = table.lines().skip(1).filter_map(|line| {
        // sl local_address rem_address st ... inode
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (address, port) = fields.get(2)?.split_once(':')?;
        let remote = (
            // /proc/net/tcp writes the IPv4 address as a little-endian hex word.
            IpAddr::V4(Ipv4Addr::from(
                u32::from_str_radix(address, 16).ok()?.swap_bytes(),
            )),
            u16::from_str_radix(port, 16).ok()?,
        );
        let established = fields.get(3)? == &"01";
        let inode = format!("socket:[{}]", fields.get(9)?);
        (established && sockets.contains(&inode))
            .then(|| {
                (1..=NODES).find(|node| (node_ip(broker, *node), broker.port(*node)) == remote)
            })
            .flatten()
    });
    Some(nodes.collect())
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
    /// The client port of node `node` (1 to 3).
    pub fn port(self, node: usize) -> u16 {
        match self {
            Self::Rabbit => RABBIT_PORTS[node - 1],
            Self::Nats => NATS_PORTS[node - 1],
        }
    }

    fn node_dir(self, node: usize) -> PathBuf {
        let sub = match self {
            Self::Rabbit => "rabbitmq",
            Self::Nats => "nats",
        };
        dir().join(sub).join(node.to_string())
    }

    /// The PID of node `node`'s server process, from its PID file.
    pub fn pid(self, node: usize) -> Option<u32> {
        let file = match self {
            Self::Rabbit => "rabbitmq.pid",
            Self::Nats => "nats.pid",
        };
        std::fs::read_to_string(self.node_dir(node).join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
            .filter(|pid| Path::new(&format!("/proc/{pid}")).exists())
    }

    /// Starts node `node` with its start script (in the background, with a clean
    /// environment: the script exports what the node needs); whether the script ran.
    fn start(self, node: usize) -> bool {
        crate::faults::server_command("sh")
            .arg(self.node_dir(node).join("start.sh"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Waits until node `node` serves clients again (RabbitMQ: `rabbitmqctl
    /// await_startup` after its port answers), up to `limit`; whether it does.
    fn wait_serving(self, node: usize, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !answers(self, node) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self != Self::Rabbit
            || rabbitmqctl(node, &["-t", &limit.as_secs().to_string(), "await_startup"]).is_ok()
    }
}

fn signal(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .args([signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
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
    /// When the node has no running process or it survives `SIGKILL`.
    pub fn kill(broker: Broker, node: usize) -> Self {
        let pid = broker
            .pid(node)
            .unwrap_or_else(|| panic!("{broker:?} node {node} does not run"));
        assert!(signal(pid, "-KILL"), "kill -9 {pid}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { broker, node }
    }

    /// Starts the node again now (dropping the guard does it too).
    pub fn restart(self) {}
}

impl Drop for NodeKilled {
    fn drop(&mut self) {
        let started = self.broker.start(self.node);
        assert!(
            started || std::thread::panicking(),
            "failed to start {:?} node {} again",
            self.broker,
            self.node
        );
        let back = self.broker.wait_serving(self.node, Duration::from_secs(90))
            && make_whole(self.broker, self.node);
        assert!(
            back || std::thread::panicking(),
            "{:?} node {} did not come back into a whole cluster",
            self.broker,
            self.node
        );
    }
}

/// A cluster node frozen with `SIGSTOP` (a stalled host: connections stay open, nothing
/// answers); dropping the guard sends `SIGCONT`.
#[derive(Debug)]
pub struct NodeFrozen {
    broker: Broker,
    node: usize,
    pid: u32,
}

impl NodeFrozen {
    /// Freezes node `node` (1 to 3) of `broker`'s cluster.
    ///
    /// # Panics
    /// When the node has no running process or cannot be stopped.
    pub fn freeze(broker: Broker, node: usize) -> Self {
        let pid = broker
            .pid(node)
            .unwrap_or_else(|| panic!("{broker:?} node {node} does not run"));
        assert!(signal(pid, "-STOP"), "kill -STOP {pid}");
        Self { broker, node, pid }
    }

    /// Lets the node run again now (dropping the guard does it too).
    pub fn thaw(self) {}
}

impl Drop for NodeFrozen {
    /// Thaws the node and waits until the cluster is whole ([`make_whole`]).
    fn drop(&mut self) {
        let thawed = signal(self.pid, "-CONT");
        assert!(
            thawed || std::thread::panicking(),
            "kill -CONT {}",
            self.pid
        );
        let whole = make_whole(self.broker, self.node);
        assert!(
            whole || std::thread::panicking(),
            "the {:?} cluster is not whole after node {} was thawed",
            self.broker,
            self.node
        );
    }
}

/// `broker`'s node `node` cut off from the network: the link of its namespace set down
/// (`ip link set eth0 down` inside `outbox-rabbit-N` or `outbox-nats-N`), so that
/// nothing reaches it or leaves it, clients and the other nodes alike, and open
/// connections hang without a reset. Dropping the guard sets the link up again and
/// waits until the cluster is whole ([`make_whole`], which restores a paused RabbitMQ
/// node that does not resume by itself) and the node serves clients.
#[derive(Debug)]
pub struct NodePartitioned {
    broker: Broker,
    node: usize,
}

fn set_link(broker: Broker, node: usize, state: &str) -> Result<(), String> {
    let netns = match broker {
        Broker::Rabbit => format!("outbox-rabbit-{node}"),
        Broker::Nats => format!("outbox-nats-{node}"),
    };
    let output = Command::new("ip")
        .args(["netns", "exec", &netns])
        .args(["ip", "link", "set", "eth0", state])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_owned())
    }
}

impl NodePartitioned {
    /// Cuts `broker`'s node `node` (1 to 3) off.
    ///
    /// # Panics
    /// When the link cannot be set down (no namespace, or no `CAP_NET_ADMIN`).
    pub fn isolate(broker: Broker, node: usize) -> Self {
        set_link(broker, node, "down")
            .unwrap_or_else(|e| panic!("cannot cut {broker:?} node {node} off: {e}"));
        Self { broker, node }
    }

    /// Heals the partition now (dropping the guard does it too).
    pub fn heal(self) {}
}

impl Drop for NodePartitioned {
    fn drop(&mut self) {
        let healed = set_link(self.broker, self.node, "up");
        assert!(
            healed.is_ok() || std::thread::panicking(),
            "cannot join {:?} node {} again: {healed:?}",
            self.broker,
            self.node
        );
        // Whole first: a RabbitMQ node paused by `pause_minority` may never resume by
        // itself (seen here: Mnesia's `inconsistent_database` after a 24 s cut, the
        // application left stopped), and only `make_whole` restores it; waiting for it
        // to serve clients first would wait for nothing.
        let back = make_whole(self.broker, self.node)
            && self
                .broker
                .wait_serving(self.node, Duration::from_secs(120));
        assert!(
            back || std::thread::panicking(),
            "the {:?} cluster is not whole after node {} rejoined",
            self.broker,
            self.node
        );
    }
}
