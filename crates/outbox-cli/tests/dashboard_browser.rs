//! The dashboard in a real browser: Debian's Chromium driven through chromedriver
//! (WebDriver, the `fantoccini` client), against the real PostgreSQL and RabbitMQ.
//!
//! - An operator opens the overview of a relay serving `--dashboard --allow-replay`,
//!   filters the dead letters, opens one, replays it with the confirmation, and sees
//!   it sent by the relay.
//! - A payload, header, error and aggregate id holding `<script>` and an `onerror`
//!   attribute render as text: no script of theirs runs (the global they would set
//!   stays undefined).
//!
//! Screenshots of every page land in `target/dashboard-screenshots/`. The browser and
//! its driver are found at `/usr/bin/chromium` and `/usr/bin/chromedriver` (or
//! `CHROMIUM` and `CHROMEDRIVER`); `cargo xtask itest` installs them when missing.
//! Without them these tests fail, loudly: they are never skipped.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{enqueue, exec, fresh_outbox, scalar};
use fantoccini::{Client, ClientBuilder, Locator};
use outboxkit_cli::testing::internals::{
    DashboardSettings, DbSettings, Relay, RelaySettings, RunningDashboard,
};
use outboxkit_core::{NewMessage, OutboxAdmin, TransportKind};
use outboxkit_postgres::{PgConfig, PgOutbox};
use outboxkit_rabbit::lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long a page may take to show what the test waits for.
const DEADLINE: Duration = Duration::from_secs(30);

fn program(env: &str, default: &str) -> PathBuf {
    let path = std::env::var_os(env).map_or_else(|| PathBuf::from(default), PathBuf::from);
    assert!(
        path.exists(),
        "{} not found: the browser tests need Debian's chromium and chromium-driver \
         (`apt-get install -y chromium chromium-driver`; `cargo xtask itest` installs them), \
         or {env} pointing at it",
        path.display()
    );
    path
}

/// chromedriver on a free loopback port, and the browser session it drives; both
/// end on drop.
struct Browser {
    client: Option<Client>,
    driver: Child,
    profile: PathBuf,
    shots: PathBuf,
}

impl Browser {
    async fn start() -> Self {
        let driver_bin = program("CHROMEDRIVER", "/usr/bin/chromedriver");
        let chromium = program("CHROMIUM", "/usr/bin/chromium");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", driver_bin.display()));
        let profile = std::env::temp_dir().join(format!("outbox-chromium-{}", Uuid::new_v4()));
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": chromium,
                // Headless as root; the background-networking flags keep it off the
                // closed network (it would otherwise flood it).
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--disable-dev-shm-usage", "--window-size=1360,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        let client = loop {
            match ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(client) => break client,
                Err(e) if started.elapsed() < DEADLINE => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("no browser session from chromedriver at {url}: {e}"),
            }
        };
        let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"),
            PathBuf::from,
        );
        let shots = target.join("dashboard-screenshots");
        std::fs::create_dir_all(&shots).expect("screenshot directory");
        Self {
            client: Some(client),
            driver,
            profile,
            shots,
        }
    }

    fn c(&self) -> &Client {
        self.client.as_ref().expect("open")
    }

    async fn goto(&self, url: &str) {
        self.c()
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("goto {url}: {e}"));
    }

    async fn text(&self, css: &str) -> String {
        self.c()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("find {css}: {e}"))
            .text()
            .await
            .expect("text")
    }

    async fn click(&self, css: &str) {
        self.c()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("find {css}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    async fn type_into(&self, css: &str, text: &str) {
        self.c()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("find {css}: {e}"))
            .send_keys(text)
            .await
            .expect("type");
    }

    /// Waits until the element `css` (reloading the page each time) has text
    /// containing `want`.
    async fn wait_for_text(&self, css: &str, want: &str, reload: bool) -> String {
        let started = Instant::now();
        loop {
            if let Ok(el) = self.c().find(Locator::Css(css)).await
                && let Ok(text) = el.text().await
                && text.contains(want)
            {
                return text;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "{css} never showed {want:?} (page: {})",
                self.c()
                    .source()
                    .await
                    .unwrap_or_default()
                    .chars()
                    .take(2000)
                    .collect::<String>()
            );
            if reload {
                self.c().refresh().await.expect("refresh");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn shot(&self, name: &str) {
        let png = self.c().screenshot().await.expect("screenshot");
        std::fs::write(self.shots.join(format!("{name}.png")), png).expect("write screenshot");
    }

    /// No script of a page's content ran: the global it would set is undefined.
    async fn assert_no_script_ran(&self) {
        let pwned = self
            .c()
            .execute("return typeof window.__pwned;", vec![])
            .await
            .expect("execute");
        assert_eq!(
            pwned,
            serde_json::json!("undefined"),
            "a payload's script ran"
        );
    }

    async fn end(mut self) {
        if let Some(client) = self.client.take() {
            let _ = client.close().await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

fn dead(event_type: &str, aggregate: &str) -> NewMessage {
    NewMessage::builder("payment", aggregate, event_type)
        .tenant_id("acme")
        .payload(&serde_json::json!({ "amount": 42, "currency": "EUR", "lines": [1, 2] }))
        .header("x-request-id", "req-7")
        .build()
        .expect("valid")
}

async fn kill(db: &PgOutbox, id: Uuid, error: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox_messages SET status = 3, attempts = 8, last_error = $2, first_failed_at = now() WHERE id = $1",
        db.schema()
    )))
    .bind(id)
    .bind(error)
    .execute(db.pool())
    .await
    .expect("kill");
}

async fn status_of(db: &PgOutbox, id: Uuid) -> i64 {
    scalar(
        db,
        &format!("SELECT status::int8 FROM \"{{s}}\".outbox_messages WHERE id = '{id}'"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_filters_dead_letters_replays_one_and_sees_it_sent() {
    let db = fresh_outbox().await;
    let fixture = outboxkit_testkit::rabbit::relay_fixture(FieldTable::default()).await;
    let traffic: Vec<NewMessage> = (0..40)
        .map(|n| {
            NewMessage::builder("order", n.to_string(), "OrderPlaced")
                .tenant_id(if n % 2 == 0 { "acme" } else { "globex" })
                .payload(&serde_json::json!({ "order": n }))
                .build()
                .expect("valid")
        })
        .collect();
    enqueue(&db, &traffic).await;
    let target = dead("PaymentCaptured", "p-1");
    let other = dead("RefundIssued", "p-2");
    enqueue(&db, &[target.clone(), other.clone()]).await;
    kill(
        &db,
        target.id,
        "unroutable: NO_ROUTE (no queue bound for PaymentCaptured)",
    )
    .await;
    kill(
        &db,
        other.id,
        "payload too large: 9 MB over the broker's limit",
    )
    .await;
    exec(&db, &format!(
        "INSERT INTO \"{{s}}\".inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
         VALUES ('{}', 'billing-projection', 'OrderPlaced', 5, 'handler failed: invoice 17 missing', now())",
        traffic[3].id
    )).await;

    let mut settings = RelaySettings::new(
        DbSettings {
            url: common::database_url(),
            schema: db.schema().to_owned(),
        },
        TransportKind::Rabbit,
        common::amqp_url(),
    );
    settings.exchange = fixture.exchange.clone();
    settings.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    settings.poll_interval = Some(Duration::from_millis(50));
    settings.health_interval = Duration::from_millis(300);
    let mut pages = DashboardSettings::new();
    pages.allow_replay = true;
    settings.dashboard = Some(pages);
    let stop = CancellationToken::new();
    let relay = Relay::start(&settings, stop.clone())
        .await
        .expect("relay starts");
    let base = format!("http://{}", relay.local_addr());
    assert!(
        common::eventually(DEADLINE, || async {
            scalar(
                &db,
                "SELECT count(*) FROM \"{s}\".outbox_messages WHERE status = 1",
            )
            .await
                == 40
        })
        .await,
        "the relay sends the traffic"
    );

    let b = Browser::start().await;
    // The overview: gauges, chart, the relay's own health.
    b.goto(&format!("{base}/")).await;
    let overview = b.text("#overview").await;
    assert!(overview.contains("Sent per minute"), "{overview}");
    b.wait_for_text("#overview", "closed", true).await;
    // The relay's heartbeat: it lists itself, by process id.
    b.wait_for_text("#relays", &std::process::id().to_string(), true)
        .await;
    b.shot("overview").await;

    // Dead letters, filtered by error text.
    b.click("nav a[href='/messages?state=dead']").await;
    b.wait_for_text("#count", "2 matching", false).await;
    b.type_into("form.filters input[name=error]", "no_route")
        .await;
    b.click("form.filters button[type=submit]").await;
    b.wait_for_text("#count", "1 matching", false).await;
    let table = b.text("#messages").await;
    assert!(
        table.contains("PaymentCaptured") && !table.contains("RefundIssued"),
        "{table}"
    );
    b.shot("dead-letters-filtered").await;

    // One dead letter, then its replay: preview (dry run), confirmation.
    b.click(&format!("#messages a[href='/messages/{}']", target.id))
        .await;
    b.wait_for_text("#status", "Dead", false).await;
    assert!(b.text("#payload").await.contains("\"currency\": \"EUR\""));
    b.shot("message-detail").await;
    b.click("#replay-one").await;
    b.wait_for_text("#matched", "1 dead message match", false)
        .await;
    b.shot("replay-preview").await;
    assert_eq!(
        status_of(&db, target.id).await,
        3,
        "the preview is a dry run"
    );
    b.click("#confirm-replay").await;
    b.wait_for_text("#result", "Replayed 1 of 1", false).await;
    b.shot("replay-done").await;

    // The relay publishes it again: the operator sees it sent.
    b.click(&format!("a[href='/messages/{}']", target.id)).await;
    b.wait_for_text("#status", "Sent", true).await;
    b.shot("message-sent").await;
    assert_eq!(status_of(&db, target.id).await, 1);
    assert_eq!(status_of(&db, other.id).await, 3, "only the one replayed");

    // The other pages, for the screenshots (and that they render in a browser).
    for (path, name, css) in [
        ("/messages?state=pending", "pending", "#count"),
        ("/messages?state=sent", "sent", "#messages"),
        ("/blocked", "blocked-keys", "main"),
        ("/inbox", "consumer-dead-letters", "#inbox"),
    ] {
        b.goto(&format!("{base}{path}")).await;
        b.text(css).await;
        b.shot(name).await;
    }
    b.end().await;
    relay.stop();
    relay.wait().await.expect("relay stops");
    fixture.delete_exchange().await;
    exec(&db, "DROP SCHEMA \"{s}\" CASCADE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_payload_renders_as_text_and_never_runs() {
    let db = fresh_outbox().await;
    let hostile = NewMessage::builder("order", "<img src=x onerror=\"window.__pwned=4\">", "OrderPlaced")
        .payload_json(r#"{"note":"</pre><script>window.__pwned=1</script>","html":"<img src=x onerror=window.__pwned=5>"}"#)
        .header("x-note", "<script>window.__pwned=2</script>")
        .build()
        .expect("valid");
    enqueue(&db, std::slice::from_ref(&hostile)).await;
    kill(&db, hostile.id, "<script>window.__pwned=3</script>").await;
    let admin: Arc<dyn OutboxAdmin> = Arc::new(
        PgOutbox::connect(&PgConfig::new(common::database_url()).with_schema(db.schema()))
            .await
            .expect("connect"),
    );
    let mut settings = DashboardSettings::new();
    settings.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    settings.allow_replay = true;
    let dashboard = RunningDashboard::start(admin, &settings, CancellationToken::new())
        .await
        .expect("dashboard starts");
    let base = format!("http://{}", dashboard.local_addr());

    let b = Browser::start().await;
    b.goto(&format!("{base}/messages?state=dead")).await;
    let table = b.text("#messages").await;
    assert!(
        table.contains("<script>window.__pwned=3</script>"),
        "{table}"
    );
    assert!(
        table.contains("<img src=x onerror=\"window.__pwned=4\">"),
        "{table}"
    );
    b.assert_no_script_ran().await;
    b.goto(&format!("{base}/messages/{}", hostile.id)).await;
    let payload = b.text("#payload").await;
    assert!(
        payload.contains("</pre><script>window.__pwned=1</script>"),
        "{payload}"
    );
    assert!(
        b.text("#headers")
            .await
            .contains("<script>window.__pwned=2</script>")
    );
    b.shot("hostile-payload").await;
    b.assert_no_script_ran().await;
    b.goto(&format!("{base}/replay?id={}", hostile.id)).await;
    b.text("#sample").await;
    b.assert_no_script_ran().await;
    b.end().await;
    dashboard.stop().await.expect("stops");
    exec(&db, "DROP SCHEMA \"{s}\" CASCADE").await;
}
