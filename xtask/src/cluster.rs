//! `cargo xtask services --cluster`: a 3-node RabbitMQ cluster and a 3-node NATS
//! JetStream cluster on this machine, from the installed servers, beside the shared
//! single-node services (which are never touched).
//!
//! Every node runs in a network namespace of its own (`outbox-rabbit-N`, `outbox-nats-N`)
//! with an address of its own (RabbitMQ `10.77.0.N`, NATS `10.77.0.1N`); the namespaces
//! are joined by veth pairs to the bridge `obx-br` (`10.77.0.254`, in this machine's own
//! namespace), so that a test can cut one node off (`ip link set eth0 down` inside its
//! namespace, a real network partition) without touching any other node, interface or
//! address. Every node is a process of the project's own, so tests may kill, freeze and
//! restart them freely: they find a node by its PID file, never by the executable's
//! name. Data, logs, configuration and each node's start script live under
//! `target/cluster/`; `--cluster --stop` stops the nodes, removes the namespaces and the
//! bridge, and keeps the data (delete the directory for a fresh cluster).
//!
//! | node | RabbitMQ: address, AMQP / Erlang distribution | NATS: address, client / route / monitoring |
//! |------|-----------------------------------------------|---------------------------------------------|
//! | 1 | 10.77.0.1, 5681 / 25681, `outbox-rabbit-1@10.77.0.1` | 10.77.0.11, 4231 / 6231 / 8231, `outbox-nats-1` |
//! | 2 | 10.77.0.2, 5682 / 25682, `outbox-rabbit-2@10.77.0.2` | 10.77.0.12, 4232 / 6232 / 8232, `outbox-nats-2` |
//! | 3 | 10.77.0.3, 5683 / 25683, `outbox-rabbit-3@10.77.0.3` | 10.77.0.13, 4233 / 6233 / 8233, `outbox-nats-3` |
//!
//! RabbitMQ nodes use long names (their host is their address) and an environment file
//! of their own (Debian's `/etc/rabbitmq/rabbitmq-env.conf` pins epmd and the
//! distribution to 127.0.0.1); nodes 2 and 3 join node 1 with `rabbitmqctl
//! join_cluster`; they share an Erlang cookie kept in `target/cluster/rabbitmq/`
//! (the nodes and `rabbitmqctl` run with `HOME` there). `net_ticktime` is 10 s (60 s by
//! default) so that a partition is noticed within seconds; `pause_minority` pauses the
//! cut-off node. The NATS nodes form one cluster through explicit routes, with
//! JetStream on every node (the meta group needs a leader before streams can be
//! created, which readiness waits for).
//!
//! Namespaces need root (`CAP_NET_ADMIN`); where that is missing the command says so.

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::workspace_root;

/// Nodes per cluster.
pub(crate) const NODES: u16 = 3;

/// The reason the broker clusters' tests are ignored with: `cargo xtask itest` leaves
/// them out (they take minutes and need the clusters), `cargo xtask itest --cluster`
/// runs them in a pass of their own with `--ignored`.
pub(crate) const IGNORE_REASON: &str = "needs the broker clusters";

/// The start of every cluster test's name, so that the SQL Server pass (`--ignored`)
/// can skip them and the cluster pass pick them.
pub(crate) const TEST_PREFIX: &str = "on_cluster_";

/// `cargo test` over the test targets holding the clusters' tests (outboxkit-cli's relay
/// tests, outboxkit-testkit's consumer tests), ignored ones only, with the test harness's
/// arguments of `args` (those after its `--`; cargo's own select the main pass).
pub(crate) fn tests(args: &[std::ffi::OsString]) -> Command {
    let mut cmd = crate::cargo();
    cmd.args([
        "test",
        "-p",
        "outboxkit-cli",
        "-p",
        "outboxkit-testkit",
        "--test",
        "cluster",
        "--",
    ])
    .args(args.iter().skip_while(|a| *a != "--").skip(1))
    .args(["--ignored", TEST_PREFIX]);
    cmd
}

/// The bridge joining the nodes' namespaces, in this machine's own namespace.
const BRIDGE: &str = "obx-br";

/// The bridge's address: where the nodes see this machine's processes come from.
const BRIDGE_ADDRESS: &str = "10.77.0.254/24";

/// The two clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Rabbit,
    Nats,
}

const BROKERS: [Broker; 2] = [Broker::Rabbit, Broker::Nats];

impl Broker {
    /// Node `node`'s address in its namespace: RabbitMQ `10.77.0.N`, NATS `10.77.0.1N`.
    fn ip(self, node: u16) -> String {
        match self {
            Self::Rabbit => format!("10.77.0.{node}"),
            Self::Nats => format!("10.77.0.1{node}"),
        }
    }

    /// Node `node`'s network namespace.
    fn netns(self, node: u16) -> String {
        match self {
            Self::Rabbit => format!("outbox-rabbit-{node}"),
            Self::Nats => format!("outbox-nats-{node}"),
        }
    }

    /// This machine's end of node `node`'s veth pair (the other end is `eth0` inside).
    fn veth(self, node: u16) -> String {
        match self {
            Self::Rabbit => format!("obx-r{node}"),
            Self::Nats => format!("obx-n{node}"),
        }
    }
}

/// AMQP URLs of the RabbitMQ cluster's nodes, comma-separated.
pub(crate) fn amqp_urls() -> String {
    (1..=NODES)
        .map(|i| {
            format!(
                "amqp://guest:guest@{}:{}/%2f",
                Broker::Rabbit.ip(i),
                rabbit_port(i)
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// NATS URLs of the cluster's nodes, comma-separated.
pub(crate) fn nats_urls() -> String {
    (1..=NODES)
        .map(|i| format!("nats://{}:{}", Broker::Nats.ip(i), nats_port(i)))
        .collect::<Vec<_>>()
        .join(",")
}

const fn rabbit_port(node: u16) -> u16 {
    5680 + node
}

const fn rabbit_dist_port(node: u16) -> u16 {
    25680 + node
}

fn rabbit_node(node: u16) -> String {
    format!("outbox-rabbit-{node}@{}", Broker::Rabbit.ip(node))
}

const fn nats_port(node: u16) -> u16 {
    4230 + node
}

const fn nats_route_port(node: u16) -> u16 {
    6230 + node
}

const fn nats_http_port(node: u16) -> u16 {
    8230 + node
}

fn cluster_dir() -> PathBuf {
    workspace_root().join("target").join("cluster")
}

fn rabbit_home() -> PathBuf {
    cluster_dir().join("rabbitmq")
}

/// The environment file every RabbitMQ script of the cluster reads instead of
/// Debian's, which pins epmd and the distribution to 127.0.0.1.
fn rabbit_env_file() -> PathBuf {
    rabbit_home().join("rabbitmq-env.conf")
}

/// The RabbitMQ scripts themselves, not Debian's wrappers in `/usr/sbin` (which switch
/// to the `rabbitmq` user and its cookie).
fn rabbit_script(name: &str) -> PathBuf {
    let direct = Path::new("/usr/lib/rabbitmq/bin").join(name);
    if direct.exists() {
        direct
    } else {
        PathBuf::from(name)
    }
}

/// `rabbitmqctl --longnames -n NODE ARGS` with the cluster's cookie and environment.
fn rabbitmqctl(node: u16, args: &[&str]) -> Command {
    let mut cmd = Command::new(rabbit_script("rabbitmqctl"));
    cmd.env("HOME", rabbit_home())
        .env("RABBITMQ_CONF_ENV_FILE", rabbit_env_file())
        .args(["--longnames", "-n", &rabbit_node(node)])
        .args(args)
        .stdin(Stdio::null());
    cmd
}

fn run_quiet(mut cmd: Command, what: &str) -> Result<String> {
    let output = cmd
        .output()
        .with_context(|| format!("could not run {what}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )
    }
}

/// `ip ARGS`, failing with its standard error.
fn ip(args: &[&str]) -> Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(args).stdin(Stdio::null());
    run_quiet(cmd, &format!("ip {}", args.join(" "))).map(drop)
}

/// `ip netns exec NS ip ARGS` in node `node`'s namespace.
fn ip_in(broker: Broker, node: u16, args: &[&str]) -> Result<()> {
    let ns = broker.netns(node);
    let mut all = vec!["netns", "exec", ns.as_str(), "ip"];
    all.extend_from_slice(args);
    ip(&all)
}

fn netns_exists(broker: Broker, node: u16) -> bool {
    Path::new("/run/netns").join(broker.netns(node)).exists()
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// The bridge and one namespace per node, each joined to the bridge by a veth pair;
/// what exists already is kept, and a node cut off by a test that did not undo it is
/// joined again.
fn network_up() -> Result<()> {
    if !link_exists(BRIDGE) {
        ip(&["link", "add", BRIDGE, "type", "bridge"]).context(
            "could not create the cluster's bridge: network namespaces need root \
             (CAP_NET_ADMIN); run as root, or run the clusters elsewhere with Docker \
             Compose (`docker compose --profile cluster up -d`, see docs/clusters.md)",
        )?;
        ip(&["addr", "add", BRIDGE_ADDRESS, "dev", BRIDGE])?;
    }
    ip(&["link", "set", BRIDGE, "up"])?;
    for broker in BROKERS {
        for node in 1..=NODES {
            if !netns_exists(broker, node) {
                ip(&["netns", "add", &broker.netns(node)])?;
            }
            if !link_exists(&broker.veth(node)) {
                ip(&[
                    "link",
                    "add",
                    &broker.veth(node),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    &broker.netns(node),
                ])?;
                ip_in(
                    broker,
                    node,
                    &[
                        "addr",
                        "add",
                        &format!("{}/24", broker.ip(node)),
                        "dev",
                        "eth0",
                    ],
                )?;
            }
            ip(&["link", "set", &broker.veth(node), "master", BRIDGE, "up"])?;
            ip_in(broker, node, &["link", "set", "eth0", "up"])?;
            ip_in(broker, node, &["link", "set", "lo", "up"])?;
        }
    }
    Ok(())
}

/// Ends whatever still runs in the namespaces (epmd, a node that did not stop), deletes
/// them (their veth pairs go with them) and the bridge.
fn network_down() -> Result<()> {
    for broker in BROKERS {
        for node in 1..=NODES {
            if !netns_exists(broker, node) {
                continue;
            }
            if let Ok(pids) = Command::new("ip")
                .args(["netns", "pids", &broker.netns(node)])
                .output()
            {
                for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-CONT", pid]).status();
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            ip(&["netns", "del", &broker.netns(node)])?;
        }
    }
    if link_exists(BRIDGE) {
        ip(&["link", "del", BRIDGE])?;
    }
    println!("cluster: namespaces and bridge removed");
    Ok(())
}

fn answers(broker: Broker, node: u16, port: u16) -> bool {
    let Ok(address) = broker.ip(node).parse() else {
        return false;
    };
    TcpStream::connect_timeout(&SocketAddr::new(address, port), Duration::from_secs(1)).is_ok()
}

fn wait(what: &str, deadline: Instant, mut done: impl FnMut() -> bool) -> Result<()> {
    while !done() {
        if Instant::now() >= deadline {
            bail!("timed out waiting until {what}");
        }
        thread::sleep(Duration::from_millis(500));
    }
    Ok(())
}

/// Whether every node of both clusters answers on its client port.
pub(crate) fn running() -> bool {
    (1..=NODES).all(|node| {
        answers(Broker::Rabbit, node, rabbit_port(node))
            && answers(Broker::Nats, node, nats_port(node))
    })
}

/// The clusters for a run of `cargo xtask itest`: started when they do not run, and
/// stopped again when the guard is dropped (a failed run included) only if this run
/// started them, so a developer's running clusters stay up.
pub(crate) struct ForRun {
    started: bool,
}

impl ForRun {
    pub(crate) fn up(timeout: Duration) -> Result<Self> {
        let started = !running();
        let guard = Self { started };
        up(timeout)?;
        Ok(guard)
    }
}

impl Drop for ForRun {
    fn drop(&mut self) {
        if self.started
            && let Err(e) = down()
        {
            eprintln!("xtask: could not stop the clusters: {e:#}");
        }
    }
}

/// Builds the network, starts whatever node of the two clusters is not running, joins
/// the RabbitMQ nodes, and waits until both clusters serve clients (RabbitMQ: every
/// node running in one cluster; NATS: every node answering and a JetStream meta leader
/// elected).
pub(crate) fn up(timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    network_up()?;
    nats_up(deadline)?;
    rabbit_up(deadline)?;
    println!("cluster: RabbitMQ {}", amqp_urls());
    println!("cluster: NATS {}", nats_urls());
    Ok(())
}

/// Stops every node of the two clusters (data kept under `target/cluster/`), then
/// removes the namespaces and the bridge.
pub(crate) fn down() -> Result<()> {
    for node in 1..=NODES {
        // A frozen node (a test's SIGSTOP left behind) must run to stop.
        continue_pid_file(&rabbit_dir(node).join("rabbitmq.pid"));
        if netns_exists(Broker::Rabbit, node)
            && answers(Broker::Rabbit, node, rabbit_dist_port(node))
        {
            match run_quiet(
                rabbitmqctl(node, &["-t", "30", "stop"]),
                &format!("stopping {}", rabbit_node(node)),
            ) {
                Ok(_) => println!("cluster: {} stopped", rabbit_node(node)),
                // Cut off or unresponsive: killed with its namespace below.
                Err(e) => eprintln!("cluster: {e:#}; it is killed"),
            }
        }
    }
    for node in 1..=NODES {
        let pid_file = nats_dir(node).join("nats.pid");
        let Ok(pid) = fs::read_to_string(&pid_file) else {
            continue;
        };
        let pid = pid.trim().to_owned();
        if continue_pid_file(&pid_file) {
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            let gone = Instant::now() + Duration::from_secs(15);
            wait(&format!("outbox-nats-{node} stops"), gone, || {
                !Path::new(&format!("/proc/{pid}")).exists()
            })?;
            println!("cluster: outbox-nats-{node} stopped");
        }
        let _ = fs::remove_file(pid_file);
    }
    network_down()
}

/// Sends `SIGCONT` to the process of a PID file; whether it exists.
fn continue_pid_file(pid_file: &Path) -> bool {
    fs::read_to_string(pid_file).is_ok_and(|pid| {
        Command::new("kill")
            .args(["-CONT", pid.trim()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

fn nats_dir(node: u16) -> PathBuf {
    cluster_dir().join("nats").join(node.to_string())
}

fn rabbit_dir(node: u16) -> PathBuf {
    rabbit_home().join(node.to_string())
}

fn nats_up(deadline: Instant) -> Result<()> {
    let routes = (1..=NODES)
        .map(|i| format!("nats-route://{}:{}", Broker::Nats.ip(i), nats_route_port(i)))
        .collect::<Vec<_>>()
        .join(", ");
    for node in 1..=NODES {
        if answers(Broker::Nats, node, nats_port(node)) {
            continue;
        }
        let dir = nats_dir(node);
        fs::create_dir_all(dir.join("jetstream"))
            .with_context(|| format!("could not create {}", dir.display()))?;
        // nats-server 2.9 has no `sync_interval` (2.10+): see docs/clusters.md.
        let config = format!(
            "server_name: outbox-nats-{node}\n\
             listen: {ip}:{port}\n\
             http: {ip}:{http}\n\
             jetstream {{ store_dir: \"{store}\" }}\n\
             cluster {{\n  name: outbox\n  listen: {ip}:{route}\n  routes: [{routes}]\n}}\n",
            ip = Broker::Nats.ip(node),
            port = nats_port(node),
            http = nats_http_port(node),
            route = nats_route_port(node),
            store = dir.join("jetstream").display(),
        );
        let conf = dir.join("nats.conf");
        fs::write(&conf, config).with_context(|| format!("could not write {}", conf.display()))?;
        let log = dir.join("nats.log");
        let script = write_start_script(
            &dir,
            &Broker::Nats.netns(node),
            &[],
            &format!(
                "setsid -f {} -c {} -l {} -P {} </dev/null >/dev/null 2>&1",
                nats_server()?.display(),
                conf.display(),
                log.display(),
                dir.join("nats.pid").display()
            ),
        )?;
        run_quiet(start(&script), &format!("starting outbox-nats-{node}"))?;
        println!(
            "cluster: outbox-nats-{node} started (log {})",
            log.display()
        );
    }
    wait("every NATS node answers", deadline, || {
        (1..=NODES).all(|node| answers(Broker::Nats, node, nats_port(node)))
    })?;
    wait("the JetStream meta group has a leader", deadline, || {
        (1..=NODES).all(|node| meta_leader(node).is_some())
    })?;
    println!(
        "cluster: NATS ready, JetStream meta leader {}",
        meta_leader(1).unwrap_or_default()
    );
    Ok(())
}

fn nats_server() -> Result<PathBuf> {
    [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|path| path.exists())
    .context("no nats-server executable installed")
}

/// The JetStream meta leader node `node` knows of, from its monitoring endpoint
/// (`/jsz`, field `meta_cluster.leader`).
fn meta_leader(node: u16) -> Option<String> {
    let body = http_get(node, nats_http_port(node), "/jsz")?;
    let json: serde_json::Value = serde_json::from_str(&body).ok()?;
    json.pointer("/meta_cluster/leader")
        .and_then(serde_json::Value::as_str)
        .filter(|leader| !leader.is_empty())
        .map(str::to_owned)
}

/// The body of `GET path` on NATS node `node`'s `port` (HTTP/1.0, so the server closes).
fn http_get(node: u16, port: u16, path: &str) -> Option<String> {
    let address = SocketAddr::new(Broker::Nats.ip(node).parse().ok()?, port);
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n",
        Broker::Nats.ip(node)
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.").then(|| body.to_owned())
}

fn rabbit_up(deadline: Instant) -> Result<()> {
    let home = rabbit_home();
    fs::create_dir_all(&home).with_context(|| format!("could not create {}", home.display()))?;
    let cookie = home.join(".erlang.cookie");
    if !cookie.exists() {
        fs::write(&cookie, "OUTBOXRSCLUSTERCOOKIE")
            .with_context(|| format!("could not write {}", cookie.display()))?;
        set_mode(&cookie, 0o400)?;
    }
    fs::write(home.join("enabled_plugins"), "[].\n").context("enabled_plugins")?;
    fs::write(
        rabbit_env_file(),
        "# Written by `cargo xtask services --cluster`: read instead of\n\
         # /etc/rabbitmq/rabbitmq-env.conf, which binds epmd and the distribution to\n\
         # 127.0.0.1. Everything is set in the environment of each node's start.sh.\n",
    )
    .context("rabbitmq-env.conf")?;
    for node in 1..=NODES {
        if answers(Broker::Rabbit, node, rabbit_dist_port(node)) {
            continue;
        }
        let dir = rabbit_dir(node);
        fs::create_dir_all(&dir).with_context(|| format!("could not create {}", dir.display()))?;
        let conf = dir.join("rabbitmq.conf");
        fs::write(
            &conf,
            format!(
                "listeners.tcp.1 = {}:{}\n\
                 # guest may connect from the bridge (the nodes see no loopback client).\n\
                 loopback_users = none\n\
                 # A cut-off node pauses itself (docs/clusters.md).\n\
                 cluster_partition_handling = pause_minority\n",
                Broker::Rabbit.ip(node),
                rabbit_port(node)
            ),
        )
        .with_context(|| format!("could not write {}", conf.display()))?;
        let advanced = dir.join("advanced.config");
        // A lost peer is noticed after 10 s instead of 60 s (net_ticktime). RabbitMQ
        // is not compatible with global's prevent_overlapping_partitions, which OTP 25
        // turns on: a paused node then hangs when the partition heals
        // (rabbitmq/rabbitmq-server#5483).
        fs::write(
            &advanced,
            "[{kernel, [{net_ticktime, 10}, {prevent_overlapping_partitions, false}]}].\n",
        )
        .with_context(|| format!("could not write {}", advanced.display()))?;
        let path = |p: PathBuf| p.display().to_string();
        let script = write_start_script(
            &dir,
            &Broker::Rabbit.netns(node),
            &[
                ("HOME", path(home.clone())),
                ("RABBITMQ_CONF_ENV_FILE", path(rabbit_env_file())),
                ("RABBITMQ_USE_LONGNAME", "true".to_owned()),
                ("RABBITMQ_NODENAME", rabbit_node(node)),
                ("RABBITMQ_NODE_PORT", rabbit_port(node).to_string()),
                ("RABBITMQ_DIST_PORT", rabbit_dist_port(node).to_string()),
                ("RABBITMQ_MNESIA_BASE", path(dir.join("mnesia"))),
                ("RABBITMQ_LOG_BASE", path(dir.join("log"))),
                ("RABBITMQ_CONFIG_FILE", path(conf.clone())),
                ("RABBITMQ_ADVANCED_CONFIG_FILE", path(advanced.clone())),
                (
                    "RABBITMQ_ENABLED_PLUGINS_FILE",
                    path(home.join("enabled_plugins")),
                ),
                ("RABBITMQ_PID_FILE", path(dir.join("rabbitmq.pid"))),
            ],
            &format!(
                "{} -detached </dev/null >/dev/null 2>&1",
                rabbit_script("rabbitmq-server").display()
            ),
        )?;
        run_quiet(start(&script), &format!("starting {}", rabbit_node(node)))?;
        println!(
            "cluster: {} started (log {})",
            rabbit_node(node),
            dir.join("log").display()
        );
    }
    for node in 1..=NODES {
        // `await_startup` fails at once while the node is not yet registered with epmd:
        // its distribution port opens first.
        wait(&format!("{} listens", rabbit_node(node)), deadline, || {
            answers(Broker::Rabbit, node, rabbit_dist_port(node))
        })?;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .as_secs()
            .max(1);
        run_quiet(
            rabbitmqctl(node, &["-t", &left.to_string(), "await_startup"]),
            &format!("waiting for {}", rabbit_node(node)),
        )?;
    }
    for node in 2..=NODES {
        let status = run_quiet(
            rabbitmqctl(node, &["cluster_status", "--formatter", "json"]),
            &format!("cluster_status of {}", rabbit_node(node)),
        )?;
        if status.contains(&rabbit_node(1)) {
            continue;
        }
        for args in [
            vec!["stop_app"],
            vec!["join_cluster", &rabbit_node(1)],
            vec!["start_app"],
        ] {
            run_quiet(
                rabbitmqctl(node, &args),
                &format!("{} {}", rabbit_node(node), args.join(" ")),
            )?;
        }
        println!("cluster: {} joined {}", rabbit_node(node), rabbit_node(1));
    }
    wait("every RabbitMQ node runs in one cluster", deadline, || {
        running_nodes(1).is_some_and(|nodes| nodes == usize::from(NODES))
            && (1..=NODES).all(|node| answers(Broker::Rabbit, node, rabbit_port(node)))
    })?;
    println!("cluster: RabbitMQ ready, {NODES} nodes running");
    Ok(())
}

/// How many nodes `node` sees running in its cluster.
fn running_nodes(node: u16) -> Option<usize> {
    let status = run_quiet(
        rabbitmqctl(node, &["cluster_status", "--formatter", "json"]),
        "cluster_status",
    )
    .ok()?;
    let json: serde_json::Value = serde_json::from_str(&status).ok()?;
    json.get("running_nodes")?.as_array().map(Vec::len)
}

/// Writes `DIR/start.sh`, which starts the node in the background inside its network
/// namespace: the one way a node is started, here and by the tests that kill one and
/// bring it back (`outboxkit_testkit::cluster`).
fn write_start_script(
    dir: &Path,
    netns: &str,
    env: &[(&str, String)],
    command: &str,
) -> Result<PathBuf> {
    let mut script = String::from("#!/bin/sh\n# Written by `cargo xtask services --cluster`.\n");
    for (name, value) in env {
        script.push_str(&format!("export {name}='{value}'\n"));
    }
    script.push_str(&format!("exec ip netns exec {netns} {command}\n"));
    let path = dir.join("start.sh");
    fs::write(&path, script).with_context(|| format!("could not write {}", path.display()))?;
    set_mode(&path, 0o755)?;
    Ok(path)
}

/// `sh SCRIPT` with a clean environment (the script exports what its node needs).
fn start(script: &Path) -> Command {
    let mut cmd = crate::services::server_command("sh");
    cmd.arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd
}

#[cfg(unix)]
fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("could not chmod {}", path.display()))
}

#[cfg(not(unix))]
fn set_mode(_path: &Path, _mode: u32) -> Result<()> {
    Ok(())
}
