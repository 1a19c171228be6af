//! Every admin command on every database, through the shared `OutboxAdmin` capability:
//! the same scenario runs on PostgreSQL and on MariaDB / MySQL (always: `MYSQL_URL`,
//! default the local MariaDB) and on SQL Server (ignored unless run with `--ignored`
//! and `MSSQL_URL` set). The binary picks the backend from `--database-url` alone.

use std::time::Duration;

use clap::Parser as _;
use outboxkit_cli::{Cli, CliError};
use outboxkit_core::inbox::ConsumerDeadLetters;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{Completion, CompletionOutcome, NewMessage, OutboxAdmin, OutboxProducer};
use uuid::Uuid;

/// Runs `outbox --database-url URL --schema SCHEMA ARGS` in-process; returns stdout.
async fn outbox(url: &str, schema: &str, args: &[&str]) -> Result<String, CliError> {
    let mut argv = vec!["outbox", "--database-url", url, "--schema", schema];
    argv.extend_from_slice(args);
    let mut out = Vec::new();
    outboxkit_cli::run(Cli::parse_from(argv), &mut out).await?;
    Ok(String::from_utf8(out).expect("utf-8"))
}

async fn json(url: &str, schema: &str, args: &[&str]) -> serde_json::Value {
    let text = outbox(url, schema, args)
        .await
        .unwrap_or_else(|e| panic!("outbox {args:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn message(n: usize) -> NewMessage {
    NewMessage::builder("order", format!("o-{n}"), "OrderPlaced")
        .aggregate_version(1)
        .tenant_id("acme")
        .payload_json("{}")
        .build()
        .expect("valid message")
}

/// What differs per backend: writing messages in a transaction and the inbox's
/// consumer dead letters.
#[async_trait::async_trait]
trait Backend {
    async fn enqueue(&self, url: &str, schema: &str, messages: &[NewMessage]);
    async fn consumer_failure(&self, url: &str, schema: &str, id: Uuid);
}

/// The scenario: migrate, write 5 messages, publish 3 and dead-letter 2 through the
/// store trait, then every command, checking what each reports. Returns the schema it
/// used.
async fn scenario(url: &str, backend: &dyn Backend) -> String {
    let schema = format!("t_{}", Uuid::new_v4().simple());
    let applied = outbox(url, &schema, &["migrate"]).await.expect("migrate");
    assert!(applied.contains("applied migrations"), "{applied}");
    let again = outbox(url, &schema, &["migrate"]).await.expect("migrate");
    assert!(again.contains("up to date"), "{again}");

    let messages: Vec<NewMessage> = (0..5).map(message).collect();
    backend.enqueue(url, &schema, &messages).await;
    let db = outboxkit_cli::testing::internals::DbSettings {
        url: url.to_owned(),
        schema: schema.clone(),
    };
    let store: Box<dyn OutboxAdmin> = outboxkit_cli::testing::internals::connect_admin(&db)
        .await
        .expect("connect");
    let claimed = store
        .claim(10, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(claimed.messages.len(), 5);
    let completions: Vec<Completion> = claimed
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| Completion {
            id: m.id,
            claim_token: m.claim_token.expect("claimed rows carry a token"),
            outcome: if i < 3 {
                CompletionOutcome::Sent
            } else {
                CompletionOutcome::Dead {
                    error: "broker said no".into(),
                }
            },
        })
        .collect();
    store.complete(&completions).await.expect("complete");

    let stats = json(url, &schema, &["stats", "--json"]).await;
    assert_eq!(stats["totals"]["sent"], 3, "{stats}");
    assert_eq!(stats["totals"]["dead"], 2, "{stats}");
    assert_eq!(stats["groups"][0]["event_type"], "OrderPlaced", "{stats}");
    assert_eq!(stats["groups"][0]["tenant_id"], "acme", "{stats}");
    let gauges = store.pending_stats().await.expect("pending stats");
    assert_eq!((gauges.new, gauges.dead), (0, 2));

    let dead = json(url, &schema, &["dead", "list", "--json"]).await;
    assert_eq!(dead.as_array().map(Vec::len), Some(2), "{dead}");
    let filtered = json(
        url,
        &schema,
        &["dead", "list", "--json", "--error-contains", "SAID"],
    )
    .await;
    assert_eq!(filtered.as_array().map(Vec::len), Some(2), "{filtered}");
    let replay = json(url, &schema, &["dead", "replay", "--all", "--json"]).await;
    assert_eq!(replay["replayed"], 2, "{replay}");
    let stats = json(url, &schema, &["stats", "--json"]).await;
    assert_eq!(
        (&stats["totals"]["new"], &stats["totals"]["dead"]),
        (&2.into(), &0.into())
    );

    // A consumer dead letter of a sent message, then its replay: the outbox row goes
    // back to New for the relay to publish again.
    let sent = claimed.messages[0].id;
    backend.consumer_failure(url, &schema, sent).await;
    let inbox_dead = json(url, &schema, &["inbox", "dead", "list", "--json"]).await;
    assert_eq!(inbox_dead.as_array().map(Vec::len), Some(1), "{inbox_dead}");
    assert_eq!(
        inbox_dead[0]["message_id"],
        sent.to_string(),
        "{inbox_dead}"
    );
    let replay = json(
        url,
        &schema,
        &["inbox", "dead", "replay", "--all", "--json"],
    )
    .await;
    assert_eq!(
        (&replay["matched"], &replay["replayed"]),
        (&1.into(), &1.into())
    );
    let stats = json(url, &schema, &["stats", "--json"]).await;
    assert_eq!(stats["totals"]["new"], 3, "{stats}");

    let reconcile = json(url, &schema, &["reconcile", "--since", "1h", "--json"]).await;
    assert!(reconcile.is_array(), "{reconcile}");

    // The two sent rows left are older than 0 s: purge deletes them, archive moves none.
    let purge = json(url, &schema, &["purge", "--older-than", "0s", "--json"]).await;
    assert_eq!(purge["outbox_sent"], 2, "{purge}");
    let stats = json(url, &schema, &["stats", "--json"]).await;
    assert_eq!(
        (&stats["totals"]["sent"], &stats["totals"]["new"]),
        (&0.into(), &3.into())
    );
    schema
}

mod postgres {
    use super::*;
    use outboxkit_postgres::{PgConfig, PgOutbox};

    struct Pg;

    #[async_trait::async_trait]
    impl Backend for Pg {
        async fn enqueue(&self, url: &str, schema: &str, messages: &[NewMessage]) {
            let outbox = PgOutbox::connect(&PgConfig::new(url).with_schema(schema))
                .await
                .expect("connect");
            let mut tx = outbox.begin().await.expect("begin");
            outbox
                .enqueue_batch(&mut tx, messages)
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
        }

        async fn consumer_failure(&self, url: &str, schema: &str, id: Uuid) {
            let outbox = PgOutbox::connect(&PgConfig::new(url).with_schema(schema))
                .await
                .expect("connect");
            let inbox = PgOutbox::new(
                outbox.pool().clone(),
                &PgConfig::default().with_schema(schema),
            )
            .expect("outbox")
            .inbox();
            let msg = IncomingMessage::new(id, "OrderPlaced", b"{}".to_vec());
            let count = inbox
                .record_failure(&msg, "projector", "boom", 1)
                .await
                .expect("record failure");
            assert!(count.dead);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_command_on_postgres() {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let schema = scenario(&url, &Pg).await;
        outboxkit_testkit::pg::drop_schema_blocking(&url, &schema);
    }
}

mod sqlserver {
    use super::*;
    use outboxkit_sqlserver::{MssqlConfig, MssqlOutbox};

    struct Mssql;

    async fn connect(url: &str, schema: &str) -> MssqlOutbox {
        let config: MssqlConfig = url.parse().expect("url");
        MssqlOutbox::connect(&config.with_schema(schema))
            .await
            .expect("connect")
    }

    #[async_trait::async_trait]
    impl Backend for Mssql {
        async fn enqueue(&self, url: &str, schema: &str, messages: &[NewMessage]) {
            let outbox = connect(url, schema).await;
            let mut tx = outbox.begin().await.expect("begin");
            outbox
                .enqueue_batch(&mut tx, messages)
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
        }

        async fn consumer_failure(&self, url: &str, schema: &str, id: Uuid) {
            let outbox = connect(url, schema).await;
            let inbox = MssqlOutbox::new(
                outbox.pool().clone(),
                &MssqlConfig::default().with_schema(schema),
            )
            .expect("outbox")
            .inbox();
            let msg = IncomingMessage::new(id, "OrderPlaced", b"{}".to_vec());
            let count = inbox
                .record_failure(&msg, "projector", "boom", 1)
                .await
                .expect("record failure");
            assert!(count.dead);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs MSSQL_URL"]
    async fn every_command_on_sqlserver() {
        let url = std::env::var("MSSQL_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .expect("needs MSSQL_URL (see docs/sqlserver.md)");
        scenario(&url, &Mssql).await;
    }
}

mod mysql {
    use super::*;
    use outboxkit_mysql::{MySqlConfig, MySqlOutbox};

    struct MySql;

    async fn connect(url: &str, schema: &str) -> MySqlOutbox {
        MySqlOutbox::connect(&MySqlConfig::new(url).with_schema(schema))
            .await
            .expect("connect")
    }

    #[async_trait::async_trait]
    impl Backend for MySql {
        async fn enqueue(&self, url: &str, schema: &str, messages: &[NewMessage]) {
            let outbox = connect(url, schema).await;
            let mut tx = outbox.begin().await.expect("begin");
            outbox
                .enqueue_batch(&mut tx, messages)
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
        }

        async fn consumer_failure(&self, url: &str, schema: &str, id: Uuid) {
            let inbox = connect(url, schema).await.inbox();
            let msg = IncomingMessage::new(id, "OrderPlaced", b"{}".to_vec());
            let count = inbox
                .record_failure(&msg, "projector", "boom", 1)
                .await
                .expect("record failure");
            assert!(count.dead);
        }
    }

    /// The scenario on the MariaDB of every machine of the project, through a
    /// `mariadb://` URL (the binary reads it as `mysql://`); the scenario's database is
    /// dropped afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_command_on_mysql() {
        let url = std::env::var("MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
            .replacen("mysql://", "mariadb://", 1);
        let schema = scenario(&url, &MySql).await;
        let pool = MySqlOutbox::connect(&MySqlConfig::new(&url))
            .await
            .expect("connect")
            .pool()
            .clone();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE `{schema}`")))
            .execute(&pool)
            .await
            .expect("drop the scenario's database");
    }
}

/// The URL alone picks the backend: a SQL Server URL is tried on SQL Server (here a
/// closed port, so the error names SQL Server), and an unknown scheme is bad input.
#[tokio::test]
async fn the_url_picks_the_backend() {
    for url in [
        "sqlserver://127.0.0.1:1;user=sa;password=x",
        "mssql://sa:x@127.0.0.1:1/app",
        "server=tcp:127.0.0.1,1;user=sa;password=x",
    ] {
        let e = outbox(url, "outbox", &["stats"])
            .await
            .expect_err("nothing listens on port 1");
        assert!(e.to_string().contains("SQL Server"), "{url}: {e}");
        assert!(!e.to_string().contains("password=x"), "{url}: {e}");
        assert_eq!(e.exit_code(), 1, "{url}: {e}");
    }
    for url in ["mysql://u:x@127.0.0.1:1/db", "mariadb://u:x@127.0.0.1:1/db"] {
        let e = outbox(url, "outbox", &["stats"])
            .await
            .expect_err("nothing listens on port 1");
        assert!(!e.to_string().contains(":x@"), "{url}: {e}");
        assert_eq!(e.exit_code(), 1, "{url}: {e}");
    }
    let e = outbox("oracle://u@127.0.0.1/db", "outbox", &["stats"])
        .await
        .expect_err("no Oracle backend");
    assert_eq!(e.exit_code(), 2, "{e}");
}
