//! The `outbox` binary as a process: exit codes, stdout/stderr, graceful SIGTERM.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{database_url, fresh_outbox, http_get};

fn outbox(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("OUTBOX_CONFIG")
        .env_remove("OUTBOX_SCHEMA")
        .output()
        .expect("run outbox")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_then_stats_as_a_process() {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let url = database_url();
    let _schema = outboxkit_testkit::pg::DropSchema::new(&url, &schema);
    let o = outbox(&["--database-url", &url, "--schema", &schema, "migrate"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("applied migrations [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]"),
        "{text}"
    );
    let o = outbox(&["--database-url", &url, "--schema", &schema, "migrate"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("up to date"));
    let o = outbox(&[
        "--database-url",
        &url,
        "--schema",
        &schema,
        "stats",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["totals"]["new"], 0);
    assert_eq!(v["groups"], serde_json::json!([]));
    let o = outbox(&["--help"]);
    assert!(o.status.success());
    let o = outbox(&["relay", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    for flag in [
        "--transport",
        "--broker-url",
        "--exchange",
        "--subject-prefix",
        "--batch-size",
        "--poll-interval",
        "--lease",
        "--max-attempts",
        "--event-type",
        "--ordering",
        "--listen",
        "--max-lag",
        "[env: OUTBOX_BATCH_SIZE=]",
    ] {
        assert!(
            help.contains(flag),
            "{flag} missing from relay --help:\n{help}"
        );
    }
}

/// Drops a schema when the test ends, even on failure.
struct DropSchema(&'static str);

impl Drop for DropSchema {
    fn drop(&mut self) {
        let schema = self.0;
        // On a runtime of our own: the test's may be shutting down (a failed assertion).
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(pool) = sqlx::PgPool::connect(&database_url()).await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
                    )))
                    .execute(&pool)
                    .await;
                }
            });
        })
        .join();
    }
}

fn stdout_json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// Schema names that are reserved words (`user`, `select`) are valid: the binary
/// migrates them, and the library enqueues, claims and completes in them, and the
/// binary lists them in `stats` and `dead list` (whose `--error-contains` is literal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_word_schemas_work_end_to_end() {
    use outboxkit_core::{Completion, CompletionOutcome, OutboxStore as _};
    let url = database_url();
    for schema in ["user", "select"] {
        let _cleanup = DropSchema(schema);
        // Left behind by an interrupted run.
        drop(DropSchema(schema));
        let run = |args: &[&str]| {
            let mut argv = vec!["--database-url", url.as_str(), "--schema", schema];
            argv.extend_from_slice(args);
            outbox(&argv)
        };
        let o = run(&["migrate"]);
        assert!(o.status.success(), "{schema}: {}", stderr(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout)
                .contains("applied migrations [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]"),
            "{schema}"
        );

        let db = outboxkit_postgres::PgOutbox::connect(
            &outboxkit_postgres::PgConfig::new(&url)
                .with_schema(schema)
                .with_max_connections(2),
        )
        .await
        .expect("connect");
        let sent = common::message("OrderPlaced", "acme", "1");
        let unroutable = common::message("OrderPlaced", "acme", "2");
        let plain = common::message("OrderShipped", "acme", "3");
        common::enqueue(&db, &[sent.clone(), unroutable.clone(), plain.clone()]).await;
        let claimed = db
            .claim(10, Duration::from_secs(30))
            .await
            .expect("claim")
            .messages;
        assert_eq!(claimed.len(), 3, "{schema}");
        let outcome = |id| {
            if id == sent.id {
                CompletionOutcome::Sent
            } else if id == unroutable.id {
                CompletionOutcome::Dead {
                    error: "312 NO_ROUTE: no_route".into(),
                }
            } else {
                CompletionOutcome::Dead {
                    error: "plain error".into(),
                }
            }
        };
        let done: Vec<Completion> = claimed
            .iter()
            .map(|m| Completion {
                id: m.id,
                claim_token: m.claim_token.expect("token"),
                outcome: outcome(m.id),
            })
            .collect();
        assert_eq!(db.complete(&done).await.expect("complete").applied, 3);

        let stats = stdout_json(&run(&["stats", "--json"]));
        assert_eq!(stats["totals"]["sent"], 1, "{schema}: {stats}");
        assert_eq!(stats["totals"]["dead"], 2, "{schema}: {stats}");
        assert_eq!(stats["groups"].as_array().map(Vec::len), Some(2), "{stats}");

        let ids = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .map(|rows| {
                    rows.iter()
                        .map(|r| r["id"].as_str().unwrap_or_default().to_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        let all = stdout_json(&run(&["dead", "list", "--json"]));
        assert_eq!(ids(&all).len(), 2, "{schema}: {all}");
        let underscore = stdout_json(&run(&["dead", "list", "--json", "--error-contains", "_"]));
        assert_eq!(
            ids(&underscore),
            [unroutable.id.to_string()],
            "{underscore}"
        );
        // As a LIKE pattern `e_r` would match the `err` of "plain error".
        let none = stdout_json(&run(&["dead", "list", "--json", "--error-contains", "e_r"]));
        assert_eq!(ids(&none), Vec::<String>::new(), "{none}");
        let dry = stdout_json(&run(&[
            "dead",
            "replay",
            "--error-contains",
            "_",
            "--dry-run",
            "--json",
        ]));
        assert_eq!(dry["matched"], 1, "{dry}");
        for args in [
            &["reconcile", "--json"][..],
            &["inbox", "dead", "list", "--json"],
            &["purge", "--older-than", "0s", "--archive", "--json"],
        ] {
            stdout_json(&run(args));
        }
        db.pool().close().await;
    }
}

#[test]
fn bad_input_exits_with_code_2_and_says_why() {
    let dir = std::env::temp_dir().join(format!("outbox-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let bad_config = dir.join("bad.toml");
    std::fs::write(&bad_config, "[relay]\nbatch_sise = 10\n").expect("write");
    let bad_config = bad_config.to_string_lossy().into_owned();
    let db = "postgres://u@127.0.0.1:1/db";
    for (args, needle) in [
        (
            vec!["--database-url", "oracle://x/y", "stats"],
            "invalid database_url",
        ),
        (
            vec!["--config", bad_config.as_str(), "stats"],
            "unknown field `batch_sise`",
        ),
        (
            vec!["--database-url", db, "relay", "--event-type", "OrderPlaced"],
            "invalid event type override",
        ),
        (
            vec![
                "--database-url",
                db,
                "relay",
                "--broker-url",
                "amqp://guest:s3cret@host:notaport/",
            ],
            "invalid AMQP URL",
        ),
        (
            vec!["--database-url", db, "dead", "list", "--since", "yesterday"],
            "invalid time window",
        ),
        (
            vec![
                "--database-url",
                db,
                "dead",
                "list",
                "--until",
                "3h",
                "--since",
                "1h",
            ],
            "must be before",
        ),
        (vec!["stats"], "missing setting database_url"),
        (
            vec!["--database-url", db, "nonsense"],
            "unrecognized subcommand",
        ),
    ] {
        let o = outbox(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).contains("s3cret"), "passwords are redacted");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_process_serves_health_and_stops_on_sigterm() {
    let db = fresh_outbox().await;
    // Nothing is bound to the relay's exchange: this message is returned (unroutable)
    // and dies; its payload must not reach the logs.
    let secret = outboxkit_core::NewMessage::builder("card", "1", "CardAdded")
        .payload_json(r#"{"pan":"4111111111111111"}"#)
        .build()
        .expect("valid");
    common::enqueue(&db, std::slice::from_ref(&secret)).await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let listen = format!("127.0.0.1:{port}");
    let dir = std::env::temp_dir().join(format!("outbox-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("outbox.toml");
    // The relay declares it; the guard deletes it when the test ends.
    let exchange = format!("t.{}", uuid::Uuid::new_v4().simple());
    let _exchange = outboxkit_testkit::rabbit::DropExchange::new(&common::amqp_url(), &exchange);
    std::fs::write(
        &config,
        format!(
            "database_url = \"{}\"\nschema = \"{}\"\nlog_format = \"json\"\n[relay]\nexchange = \"{exchange}\"\nlisten = \"{listen}\"\npoll_interval = \"100ms\"\nhealth_interval = \"200ms\"\n[relay.event_types.OrderPlaced]\nmax_attempts = 3\n",
            database_url(),
            db.schema(),
        ),
    )
    .expect("write");
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args([
            "--config",
            &config.to_string_lossy(),
            "relay",
            "--ordering",
            "per-key",
        ])
        .env("OUTBOX_BROKER_URL", common::amqp_url())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let addr = listen.parse().expect("addr");
    let healthy = common::eventually(Duration::from_secs(20), || async move {
        tokio::net::TcpStream::connect(addr).await.is_ok()
            && http_get(addr, "/healthz").await.0 == 200
    })
    .await;
    assert!(healthy, "relay did not become healthy");
    let dead = common::eventually(Duration::from_secs(20), || {
        let db = db.clone();
        async move {
            common::scalar(
                &db,
                "SELECT count(*) FROM {s}.outbox_messages WHERE status = 3",
            )
            .await
                == 1
        }
    })
    .await;
    assert!(dead, "the unroutable message went Dead");
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("outbox_pending_messages"), "{body}");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "relay did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read as _;
        let _ = e.read_to_string(&mut err);
    }
    assert!(status.success(), "{status:?}: {err}");
    assert!(err.contains("SIGTERM received"), "{err}");
    assert!(err.contains("permanent publish failure"), "{err}");
    assert!(
        !err.contains("4111111111111111") && !err.contains("BasicReturnMessage"),
        "payloads never reach the logs: {err}"
    );
    assert!(err.lines().any(|l| l.starts_with('{')), "JSON logs: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}
