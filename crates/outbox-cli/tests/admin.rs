//! The admin commands through the library entry point (`outboxkit_cli::run`), against the
//! real PostgreSQL, each test in its own schema.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use clap::Parser as _;
use common::{enqueue, exec, fresh_outbox, message, scalar};
use outboxkit_cli::{Cli, CliError};
use outboxkit_core::consumer::HandlerDecision;
use outboxkit_core::inbox::{ConsumerDeadLetters, DurableInbox};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{NewMessage, OutboxAdmin as _, OutboxStore};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgInbox, PgOutbox};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

/// Runs `outbox --database-url .. --schema .. ARGS` in-process; returns stdout.
async fn outbox(db: &PgOutbox, args: &[&str]) -> Result<String, CliError> {
    let url = common::database_url();
    let mut argv = vec!["outbox", "--database-url", &url, "--schema", db.schema()];
    argv.extend_from_slice(args);
    let mut out = Vec::new();
    outboxkit_cli::run(Cli::parse_from(argv), &mut out).await?;
    Ok(String::from_utf8(out).expect("utf-8"))
}

async fn json(db: &PgOutbox, args: &[&str]) -> serde_json::Value {
    let text = outbox(db, args).await.expect("command");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

async fn ids_with_status(db: &PgOutbox, status: i16) -> BTreeSet<Uuid> {
    sqlx::query_scalar::<_, Uuid>(AssertSqlSafe(format!(
        "SELECT id FROM {}.outbox_messages WHERE status = $1",
        db.schema()
    )))
    .bind(status)
    .fetch_all(db.pool())
    .await
    .expect("ids")
    .into_iter()
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_replay_by_each_filter_with_dry_run() {
    let db = fresh_outbox().await;
    let a = message("OrderPlaced", "acme", "1");
    let b = message("OrderPlaced", "globex", "2");
    let c = message("OrderShipped", "acme", "3");
    let d = NewMessage::builder("invoice", "4", "OrderShipped")
        .tenant_id("acme")
        .payload_json("{}")
        .build()
        .expect("valid");
    let alive = message("OrderPlaced", "acme", "5");
    enqueue(
        &db,
        &[a.clone(), b.clone(), c.clone(), d.clone(), alive.clone()],
    )
    .await;
    let errors = [
        (a.id, "unroutable: NO_ROUTE"),
        (b.id, "payload too large"),
        (c.id, "Unroutable again"),
        (d.id, "no broker confirmation within 30s"),
    ];
    let kill = |db: PgOutbox| async move {
        for (id, error) in errors {
            sqlx::query(AssertSqlSafe(format!(
                "UPDATE {}.outbox_messages SET status = 3, attempts = 8, last_error = $2 WHERE id = $1",
                db.schema()
            )))
            .bind(id)
            .bind(error)
            .execute(db.pool())
            .await
            .expect("kill");
        }
    };
    kill(db.clone()).await;
    exec(
        &db,
        &format!(
            "UPDATE {{s}}.outbox_messages SET created_at = now() - interval '3 days' WHERE id = '{}'",
            a.id
        ),
    )
    .await;
    let all_dead: BTreeSet<Uuid> = [a.id, b.id, c.id, d.id].into();
    let a_id = a.id.to_string();
    let cases: Vec<(Vec<&str>, BTreeSet<Uuid>)> = vec![
        (vec!["--id", &a_id], [a.id].into()),
        (vec!["--since", "1d"], [b.id, c.id, d.id].into()),
        (vec!["--until", "1d"], [a.id].into()),
        (vec!["--tenant", "globex"], [b.id].into()),
        (vec!["--aggregate-type", "invoice"], [d.id].into()),
        (
            vec!["--aggregate-type", "order", "--aggregate-id", "3"],
            [c.id].into(),
        ),
        (vec!["--event-type", "OrderShipped"], [c.id, d.id].into()),
        (vec!["--error-contains", "UNROUTABLE"], [a.id, c.id].into()),
    ];
    for (filter, expected) in cases {
        // list
        let mut args = vec!["dead", "list", "--json"];
        args.extend(&filter);
        let listed: BTreeSet<Uuid> = json(&db, &args)
            .await
            .as_array()
            .expect("array")
            .iter()
            .map(|m| m["id"].as_str().expect("id").parse().expect("uuid"))
            .collect();
        assert_eq!(listed, expected, "list {filter:?}");
        // dry run: counts, changes nothing
        let mut args = vec!["dead", "replay", "--dry-run", "--json"];
        args.extend(&filter);
        let report = json(&db, &args).await;
        assert_eq!(report["matched"], expected.len() as u64, "{filter:?}");
        assert_eq!(report["replayed"], 0);
        assert_eq!(
            ids_with_status(&db, 3).await,
            all_dead,
            "dry run {filter:?}"
        );
        // replay: exactly the matched ones go New with attempts reset
        let mut args = vec!["dead", "replay", "--json"];
        args.extend(&filter);
        let report = json(&db, &args).await;
        assert_eq!(report["matched"], expected.len() as u64);
        assert_eq!(report["replayed"], expected.len() as u64);
        assert_eq!(report["failed"], 0);
        assert!(report["elapsed_secs"].as_f64().is_some());
        let dead_now = ids_with_status(&db, 3).await;
        assert_eq!(
            dead_now,
            all_dead.difference(&expected).copied().collect(),
            "{filter:?}"
        );
        for id in &expected {
            let m = db.get(*id).await.expect("get").expect("row");
            assert_eq!(m.attempts, 0);
            assert!(m.visible_at <= chrono::Utc::now() + chrono::Duration::seconds(1));
        }
        kill(db.clone()).await;
    }
    // The live message was never touched.
    let m = db.get(alive.id).await.expect("get").expect("row");
    assert_eq!(m.status, outboxkit_core::MessageStatus::New);

    // No filter: refused without --all.
    let err = outbox(&db, &["dead", "replay"]).await.expect_err("guarded");
    assert!(
        matches!(
            err,
            CliError::Invalid {
                field: "filter",
                ..
            }
        ),
        "{err}"
    );
    let report = json(&db, &["dead", "replay", "--all", "--json"]).await;
    assert_eq!(report["replayed"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_match_the_table() {
    let db = fresh_outbox().await;
    let msgs: Vec<NewMessage> = vec![
        message("OrderPlaced", "acme", "1"),
        message("OrderPlaced", "acme", "2"),
        message("OrderPlaced", "acme", "3"),
        message("OrderPlaced", "globex", "4"),
        message("OrderPlaced", "globex", "5"),
        NewMessage::builder("order", "6", "OrderShipped")
            .payload_json("{}")
            .build()
            .expect("valid"),
        message("OrderShipped", "acme", "7"),
    ];
    enqueue(&db, &msgs).await;
    let set = |id: Uuid, sql: &str| {
        let db = db.clone();
        let sql = format!(
            "UPDATE {}.outbox_messages SET {sql} WHERE id = '{id}'",
            db.schema()
        );
        async move { exec(&db, &sql).await }
    };
    set(msgs[3].id, "status = 1, sent_at = now()").await;
    set(msgs[4].id, "status = 1, sent_at = now()").await;
    set(msgs[5].id, "status = 3, last_error = 'x'").await;
    set(
        msgs[6].id,
        "status = 9, lease_until = now() + interval '1 minute', claim_token = gen_random_uuid()",
    )
    .await;

    let report = json(&db, &["stats", "--json"]).await;
    let totals = &report["totals"];
    for (key, status) in [("new", 0), ("processing", 9), ("sent", 1), ("dead", 3)] {
        let expected = scalar(
            &db,
            &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE status = {status}"),
        )
        .await;
        assert_eq!(totals[key], expected, "{key}");
    }
    assert_eq!(totals["new"], 3);
    assert!(totals["oldest_pending_age_secs"].as_f64().is_some());
    let groups = report["groups"].as_array().expect("groups");
    let rows: Vec<(String, Option<String>, i64, i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT event_type, tenant_id, count(*) FILTER (WHERE status = 0), count(*) FILTER (WHERE status = 9),
                count(*) FILTER (WHERE status = 1), count(*) FILTER (WHERE status = 3)
           FROM {}.outbox_messages GROUP BY 1, 2 ORDER BY 1, 2 NULLS FIRST",
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .expect("groups");
    assert_eq!(groups.len(), rows.len());
    for (g, (event_type, tenant, new, processing, sent, dead)) in groups.iter().zip(rows) {
        assert_eq!(g["event_type"], event_type.as_str());
        assert_eq!(g["tenant_id"].as_str(), tenant.as_deref());
        assert_eq!(
            [&g["new"], &g["processing"], &g["sent"], &g["dead"]],
            [new, processing, sent, dead]
                .map(serde_json::Value::from)
                .each_ref()
        );
    }
    assert!(report["blocked_keys"].is_array());
    // The relay's cheap variant (health checks, gauges) agrees except for `sent`.
    let pending = db.pending_stats().await.expect("pending stats");
    let full = db.stats().await.expect("stats");
    assert_eq!(
        (pending.new, pending.processing, pending.dead, pending.sent),
        (full.new, full.processing, full.dead, 0)
    );
    assert!(pending.oldest_pending_age.is_some());
    // The table form prints the same numbers.
    let text = outbox(&db, &["stats"]).await.expect("stats");
    assert!(
        text.starts_with("new 3  processing 1  sent 2  dead 1"),
        "{text}"
    );
    assert!(text.contains("OrderShipped"), "{text}");
}

/// The queue lag of the relay's gauges and of `outbox stats` counts a message from
/// when it is due: one delayed 1 hour is pending, not late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_message_is_pending_but_not_late() {
    let db = fresh_outbox().await;
    let later = NewMessage::builder("order", "later", "ReminderDue")
        .payload_json("{}")
        .deliver_after(std::time::Duration::from_secs(3600))
        .build()
        .expect("valid");
    enqueue(&db, &[later]).await;
    let pending = db.pending_stats().await.expect("pending stats");
    assert_eq!((pending.new, pending.oldest_pending_age), (1, None));
    let groups = db.stats_by_group().await.expect("groups");
    assert_eq!(
        (groups[0].new, groups[0].oldest_pending_age_secs),
        (1, None)
    );
    let report: serde_json::Value =
        serde_json::from_str(&outbox(&db, &["stats", "--json"]).await.expect("stats"))
            .expect("json");
    assert!(
        report["totals"]["oldest_pending_age_secs"].is_null(),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_is_zero_after_a_clean_run_and_counts_removed_records() {
    let db = fresh_outbox().await;
    let msgs = vec![
        message("OrderPlaced", "acme", "1"),
        message("OrderPlaced", "acme", "2"),
        message("OrderPlaced", "globex", "3"),
        message("OrderShipped", "acme", "4"),
    ];
    enqueue(&db, &msgs).await;
    exec(
        &db,
        "UPDATE {s}.outbox_messages SET status = 1, sent_at = now()",
    )
    .await;
    // "projector" handles everything, "mailer" only OrderPlaced.
    exec(
        &db,
        "INSERT INTO {s}.inbox_records (message_id, consumer) SELECT id, 'projector' FROM {s}.outbox_messages",
    )
    .await;
    exec(
        &db,
        "INSERT INTO {s}.inbox_records (message_id, consumer)
         SELECT id, 'mailer' FROM {s}.outbox_messages WHERE event_type = 'OrderPlaced'",
    )
    .await;
    let rows = json(&db, &["reconcile", "--since", "1d", "--json"]).await;
    let rows = rows.as_array().expect("rows");
    // acme/OrderPlaced, globex/OrderPlaced x 2 consumers + acme/OrderShipped x projector
    assert_eq!(rows.len(), 5, "{rows:?}");
    assert!(rows.iter().all(|r| r["missing"] == 0), "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r["written"] == r["processed"] && r["day"].is_string())
    );

    // Remove one record of the projector for acme/OrderPlaced.
    exec(
        &db,
        &format!(
            "DELETE FROM {{s}}.inbox_records WHERE consumer = 'projector' AND message_id = '{}'",
            msgs[1].id
        ),
    )
    .await;
    let rows = json(
        &db,
        &["reconcile", "--since", "1d", "--only-differences", "--json"],
    )
    .await;
    let rows = rows.as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert_eq!(r["tenant_id"], "acme");
    assert_eq!(r["event_type"], "OrderPlaced");
    assert_eq!(r["consumer"], "projector");
    assert_eq!(r["written"], 2);
    assert_eq!(r["processed"], 1);
    assert_eq!(r["missing"], 1);
    let text = outbox(&db, &["reconcile", "--since", "1d"])
        .await
        .expect("table");
    assert!(text.contains("total difference: 1"), "{text}");
    // A window in the future is empty.
    let rows = json(
        &db,
        &[
            "reconcile",
            "--since",
            "2099-01-01T00:00:00Z",
            "--until",
            "2099-01-02T00:00:00Z",
            "--json",
        ],
    )
    .await;
    assert_eq!(rows.as_array().map(Vec::len), Some(0));
    // A reversed window is a typed error.
    let err = outbox(&db, &["reconcile", "--since", "1h", "--until", "2h"])
        .await
        .expect_err("bad window");
    assert!(matches!(err, CliError::TimeWindow { .. }), "{err}");
}

async fn seed_for_purge(db: &PgOutbox) -> (Vec<Uuid>, Vec<Uuid>) {
    let msgs: Vec<NewMessage> = (0..6)
        .map(|i| message("OrderPlaced", "acme", &i.to_string()))
        .collect();
    enqueue(db, &msgs).await;
    let ids: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let set = |id: Uuid, sql: &'static str| {
        let db = db.clone();
        let sql = format!("UPDATE {{s}}.outbox_messages SET {sql} WHERE id = '{id}'");
        async move { exec(&db, &sql).await }
    };
    for &id in &ids[0..3] {
        set(id, "status = 1, sent_at = now() - interval '2 days'").await;
    }
    set(ids[3], "status = 1, sent_at = now()").await;
    set(ids[4], "status = 3, created_at = now() - interval '9 days'").await;
    set(ids[5], "created_at = now() - interval '9 days'").await; // New, old
    let records: Vec<Uuid> = (0..3).map(|_| Uuid::now_v7()).collect();
    for (i, id) in records.iter().enumerate() {
        let age = if i < 2 { "2 days" } else { "0 days" };
        exec(
            db,
            &format!(
                "INSERT INTO {{s}}.inbox_records (message_id, consumer, processed_at)
                 VALUES ('{id}', 'projector', now() - interval '{age}')"
            ),
        )
        .await;
    }
    (ids, records)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_removes_only_old_sent_rows_and_old_records() {
    let db = fresh_outbox().await;
    let (ids, records) = seed_for_purge(&db).await;
    let report = json(
        &db,
        &["purge", "--older-than", "1d", "--batch-size", "2", "--json"],
    )
    .await;
    assert_eq!(report["outbox_sent"], 3);
    assert_eq!(report["inbox_records"], 2);
    assert_eq!(report["archived"], false);
    let left: BTreeSet<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM {}.outbox_messages",
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .expect("ids")
    .into_iter()
    .collect();
    assert_eq!(left, ids[3..].iter().copied().collect());
    let left: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_id FROM {}.inbox_records",
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .expect("records");
    assert_eq!(left, [records[2]]);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM {s}.outbox_messages_archive").await,
        0
    );
    // Nothing older is left: a second run removes nothing.
    let report = json(&db, &["purge", "--older-than", "1d", "--json"]).await;
    assert_eq!(report["outbox_sent"], 0);
    assert_eq!(report["inbox_records"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_with_archive_moves_rows() {
    let db = fresh_outbox().await;
    let (ids, records) = seed_for_purge(&db).await;
    let report = json(
        &db,
        &[
            "purge",
            "--older-than",
            "1d",
            "--batch-size",
            "2",
            "--archive",
            "--json",
        ],
    )
    .await;
    assert_eq!(report["archived"], true);
    assert_eq!(report["outbox_sent"], 3);
    assert_eq!(report["inbox_records"], 2);
    let archived: BTreeSet<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM {}.outbox_messages_archive",
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .expect("archive")
    .into_iter()
    .collect();
    assert_eq!(archived, ids[0..3].iter().copied().collect());
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM {s}.outbox_messages").await,
        3
    );
    let archived: BTreeSet<Uuid> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_id FROM {}.inbox_records_archive",
        db.schema()
    )))
    .fetch_all(db.pool())
    .await
    .expect("archive")
    .into_iter()
    .collect();
    assert_eq!(archived, records[0..2].iter().copied().collect());
    // --outbox-only leaves the inbox alone.
    exec(
        &db,
        "UPDATE {s}.inbox_records SET processed_at = now() - interval '5 days'",
    )
    .await;
    let report = json(
        &db,
        &["purge", "--older-than", "1d", "--outbox-only", "--json"],
    )
    .await;
    assert_eq!(report["inbox_records"], 0);
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM {s}.inbox_records").await,
        1
    );
}

/// Inserts into `effects` unless told to fail (permanently).
struct Projector {
    schema: String,
    fail: Arc<AtomicBool>,
}

#[async_trait]
impl Handler<PgInbox> for Projector {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent(std::io::Error::other(
                "projection broken",
            )));
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.schema
        )))
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_dead_letters_list_and_replay() {
    let db = fresh_outbox().await;
    exec(&db, "CREATE TABLE {s}.effects (message_id uuid NOT NULL)").await;
    let store = Arc::new(db.inbox());
    let fail = Arc::new(AtomicBool::new(true));
    let consumer = IdempotentConsumer::new(
        Arc::clone(&store),
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            Projector {
                schema: db.schema().to_owned(),
                fail: Arc::clone(&fail),
            },
        ),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    // A message the relay published (Sent), which the consumer dead-letters.
    let m = message("OrderPlaced", "acme", "1");
    enqueue(&db, std::slice::from_ref(&m)).await;
    exec(
        &db,
        "UPDATE {s}.outbox_messages SET status = 1, sent_at = now(), attempts = 1",
    )
    .await;
    let incoming = IncomingMessage::new(m.id, "OrderPlaced", b"{}".to_vec());
    assert_eq!(consumer.process(&incoming).await, HandlerDecision::Ack);
    // One from another producer database (no outbox row here).
    let foreign = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert_eq!(consumer.process(&foreign).await, HandlerDecision::Ack);
    // A durable-inbox message that went Dead.
    let durable = IncomingMessage::new(Uuid::now_v7(), "OrderShipped", b"{}".to_vec());
    assert!(store.store(&durable).await.expect("store"));
    exec(
        &db,
        &format!(
            "UPDATE {{s}}.inbox_messages SET status = 3, attempts = 8, last_error = 'projector: boom' WHERE id = '{}'",
            durable.id
        ),
    )
    .await;

    let listed = json(&db, &["inbox", "dead", "list", "--json"]).await;
    let kinds: Vec<(String, String)> = listed
        .as_array()
        .expect("array")
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().expect("kind").to_owned(),
                d["message_id"].as_str().expect("id").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("consumer".to_owned(), m.id.to_string()),
            ("consumer".to_owned(), foreign.id.to_string()),
            ("durable".to_owned(), durable.id.to_string()),
        ]
    );
    let only = json(
        &db,
        &[
            "inbox",
            "dead",
            "list",
            "--event-type",
            "OrderShipped",
            "--json",
        ],
    )
    .await;
    assert_eq!(only.as_array().map(Vec::len), Some(1));

    // Dry run: counts, changes nothing.
    let report = json(
        &db,
        &["inbox", "dead", "replay", "--all", "--dry-run", "--json"],
    )
    .await;
    assert_eq!(report["matched"], 3);
    assert_eq!(report["replayed"], 0);
    assert!(store.is_dead(m.id, "projector").await.expect("dead"));
    assert_eq!(
        db.get(m.id).await.expect("get").expect("row").status,
        outboxkit_core::MessageStatus::Sent
    );

    // Replay the idempotent consumer's dead letter of our outbox message.
    let id = m.id.to_string();
    let report = json(&db, &["inbox", "dead", "replay", "--id", &id, "--json"]).await;
    assert_eq!(
        (report["matched"].clone(), report["replayed"].clone()),
        (1.into(), 1.into())
    );
    assert!(!store.is_dead(m.id, "projector").await.expect("dead"));
    let row = db.get(m.id).await.expect("get").expect("row");
    assert_eq!(
        row.status,
        outboxkit_core::MessageStatus::New,
        "requeued for the relay"
    );
    assert_eq!(row.attempts, 0);
    // Redelivered (what the relay will do): processed once, duplicates absorbed.
    fail.store(false, Ordering::SeqCst);
    for _ in 0..3 {
        assert_eq!(consumer.process(&incoming).await, HandlerDecision::Ack);
    }
    assert_eq!(
        scalar(
            &db,
            &format!(
                "SELECT count(*) FROM {{s}}.effects WHERE message_id = '{}'",
                m.id
            )
        )
        .await,
        1
    );

    // The foreign one cannot be requeued here: failed, kept; --clear-only clears it.
    let fid = foreign.id.to_string();
    let report = json(&db, &["inbox", "dead", "replay", "--id", &fid, "--json"]).await;
    assert_eq!(
        (report["replayed"].clone(), report["failed"].clone()),
        (0.into(), 1.into())
    );
    assert!(store.is_dead(foreign.id, "projector").await.expect("dead"));
    let report = json(
        &db,
        &[
            "inbox",
            "dead",
            "replay",
            "--id",
            &fid,
            "--clear-only",
            "--json",
        ],
    )
    .await;
    assert_eq!(report["replayed"], 1);
    assert!(!store.is_dead(foreign.id, "projector").await.expect("dead"));

    // The durable one goes back to New, attempts reset.
    let report = json(
        &db,
        &[
            "inbox",
            "dead",
            "replay",
            "--consumer",
            "projector",
            "--event-type",
            "OrderShipped",
            "--json",
        ],
    )
    .await;
    assert_eq!(report["replayed"], 1);
    let (status, attempts): (i16, i32) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT status, attempts FROM {}.inbox_messages WHERE id = $1",
        db.schema()
    )))
    .bind(durable.id)
    .fetch_one(db.pool())
    .await
    .expect("row");
    assert_eq!((status, attempts), (0, 0));
    assert_eq!(
        json(&db, &["inbox", "dead", "list", "--json"])
            .await
            .as_array()
            .map(Vec::len),
        Some(0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_typed_error_before_anything_connects() {
    // The database URL is never dialled: the input is rejected first.
    let run = |args: Vec<&'static str>| async move {
        let mut out = Vec::new();
        outboxkit_cli::run(Cli::parse_from(args), &mut out).await
    };
    let e = run(vec!["outbox", "--database-url", "oracle://x/y", "stats"]).await;
    assert!(
        matches!(
            e,
            Err(CliError::Invalid {
                field: "database_url",
                ..
            })
        ),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@h/db",
        "--schema",
        "Bad-Name",
        "stats",
    ])
    .await;
    assert!(
        matches!(
            e,
            Err(CliError::Invalid {
                field: "schema",
                ..
            })
        ),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "dead",
        "list",
        "--since",
        "last tuesday",
    ])
    .await;
    assert!(matches!(e, Err(CliError::TimeWindow { .. })), "{e:?}");
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "purge",
        "--older-than",
        "forever",
    ])
    .await;
    assert!(
        matches!(
            e,
            Err(CliError::Invalid {
                field: "older_than",
                ..
            })
        ),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "relay",
        "--event-type",
        "OrderPlaced=3",
    ])
    .await;
    assert!(
        matches!(e, Err(CliError::EventTypeOverride { .. })),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "relay",
        "--broker-url",
        "http://rabbit",
    ])
    .await;
    assert!(
        matches!(&e, Err(err @ CliError::Rabbit(_)) if err.is_bad_input()),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "relay",
        "--transport",
        "nats",
        "--broker-url",
        "amqp://x",
    ])
    .await;
    assert!(
        matches!(&e, Err(err @ CliError::Nats(_)) if err.is_bad_input()),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "relay",
        "--lease",
        "0s",
    ])
    .await;
    assert!(
        matches!(e, Err(CliError::Invalid { field: "lease", .. })),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "relay",
        "--listen",
        "localhost",
    ])
    .await;
    assert!(
        matches!(
            e,
            Err(CliError::Invalid {
                field: "listen",
                ..
            })
        ),
        "{e:?}"
    );
    let e = run(vec![
        "outbox",
        "--config",
        "/nonexistent/outbox.toml",
        "stats",
    ])
    .await;
    assert!(matches!(e, Err(CliError::ConfigRead { .. })), "{e:?}");
    // An unreachable database is a runtime error (exit code 1), not bad input.
    let e = run(vec![
        "outbox",
        "--database-url",
        "postgres://u@127.0.0.1:1/db",
        "stats",
    ])
    .await;
    assert!(
        matches!(&e, Err(err @ CliError::Store(_)) if !err.is_bad_input()),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimable_wait_ignores_keys_blocked_by_design_in_ordered_mode() {
    use outboxkit_core::OnDead;
    let db = fresh_outbox().await;
    let head = message("OrderPlaced", "acme", "1");
    let next = message("OrderShipped", "acme", "1"); // same aggregate: same key
    enqueue(&db, &[head.clone(), next.clone()]).await;
    exec(
        &db,
        "UPDATE {s}.outbox_messages SET visible_at = now() - interval '10 minutes', created_at = now() - interval '10 minutes'",
    )
    .await;
    exec(
        &db,
        &format!(
            "UPDATE {{s}}.outbox_messages SET status = 3 WHERE id = '{}'",
            head.id
        ),
    )
    .await;
    let secs = |d: Option<std::time::Duration>| d.map(|d| d.as_secs());
    let unordered = db.oldest_claimable_wait(None).await.expect("query");
    assert!(secs(unordered).is_some_and(|s| s >= 599), "{unordered:?}");
    assert_eq!(
        db.oldest_claimable_wait(Some(OnDead::Block))
            .await
            .expect("query"),
        None
    );
    let skip = db
        .oldest_claimable_wait(Some(OnDead::Skip))
        .await
        .expect("query");
    assert!(secs(skip).is_some_and(|s| s >= 599), "{skip:?}");
}

/// A broker that is always reachable and never used.
struct Reachable;

#[async_trait]
impl outboxkit_core::EventPublisher for Reachable {
    async fn publish_batch(
        &self,
        messages: &[outboxkit_core::OutboxMessage],
    ) -> Vec<outboxkit_core::PublishOutcome> {
        messages
            .iter()
            .map(|_| outboxkit_core::PublishOutcome::Published)
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_a_stuck_relay_and_queue_lag() {
    use outboxkit_cli::testing::internals::Health;
    use std::time::Duration;
    let db = fresh_outbox().await;
    let health = Health::new(Duration::from_secs(300), Duration::from_secs(60), None);
    assert!(!health.report().is_healthy(), "starting");
    health
        .check(&*db, &Reachable, false, 0, Duration::from_secs(1))
        .await;
    let report = health.report();
    assert!(report.is_healthy(), "{report:?}");
    assert_eq!(report.pending, Some(0));

    // A message claimable for 10 minutes that nobody claimed: stuck, and lagging.
    enqueue(&db, &[message("OrderPlaced", "acme", "1")]).await;
    exec(
        &db,
        "UPDATE {s}.outbox_messages SET visible_at = now() - interval '10 minutes', created_at = now() - interval '10 minutes'",
    )
    .await;
    health
        .check(&*db, &Reachable, false, 0, Duration::from_secs(1))
        .await;
    let report = health.report();
    assert_eq!(report.status, "unhealthy");
    assert!(
        report.reasons.iter().any(|r| r.starts_with("relay stuck")),
        "{report:?}"
    );
    assert!(
        report.reasons.iter().any(|r| r.starts_with("queue lag")),
        "{report:?}"
    );
    // While the circuit is open, waiting is the broker's fault, not a stuck relay.
    health
        .check(&*db, &Reachable, true, 0, Duration::from_secs(1))
        .await;
    let report = health.report();
    assert!(
        report.reasons.iter().all(|r| !r.starts_with("relay stuck")),
        "{report:?}"
    );
    assert!(
        report.reasons.iter().any(|r| r.contains("circuit open")),
        "{report:?}"
    );

    // A message in a retry backoff since its first failure 10 minutes ago is pending
    // (lag, counted from that failure) but not claimable (not stuck).
    exec(
        &db,
        "UPDATE {s}.outbox_messages SET visible_at = now() + interval '1 hour', first_failed_at = now() - interval '10 minutes'",
    )
    .await;
    health
        .check(&*db, &Reachable, false, 0, Duration::from_secs(1))
        .await;
    let report = health.report();
    assert!(
        report.reasons.iter().all(|r| !r.starts_with("relay stuck")),
        "{report:?}"
    );
    assert!(
        report.reasons.iter().any(|r| r.starts_with("queue lag")),
        "{report:?}"
    );
}
