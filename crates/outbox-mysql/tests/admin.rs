//! The operator queries ([`OutboxAdmin`] for `MySqlOutbox`) against the real MariaDB /
//! MySQL, mirroring the SQL Server and PostgreSQL backends' tests of the same queries
//! (the dashboard's browsing queries are in `browse.rs`).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use outboxkit_core::inbox::{ConsumerDeadLetters, DurableInbox};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{
    Completion, CompletionOutcome, InboxStore, NewMessage, OnDead, OutboxAdmin, OutboxProducer,
    OutboxStore,
};
use outboxkit_core::{InboxDeadFilter, InboxReplayMode};
use outboxkit_mysql::{LATEST_VERSION, MySqlOutbox};
use uuid::Uuid;

fn event(aggregate: &str, event_type: &str, tenant: Option<&str>) -> NewMessage {
    let mut b = NewMessage::builder("order", aggregate, event_type)
        .aggregate_version(1)
        .payload_json("{}");
    if let Some(t) = tenant {
        b = b.tenant_id(t);
    }
    b.build().expect("valid")
}

async fn enqueue(outbox: &MySqlOutbox, messages: &[NewMessage]) {
    let mut tx = outbox.begin().await.expect("begin");
    for chunk in messages.chunks(1000) {
        outbox.enqueue_batch(&mut tx, chunk).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
}

async fn count(outbox: &MySqlOutbox, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{}`.{table}",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("count")
}

/// Runs `sql` (`{s}` the database) with `id` and an optional text bound in that order.
async fn exec(outbox: &MySqlOutbox, sql: &str, (id, text): (Uuid, Option<&str>)) {
    let sql = sql.replace("{s}", &format!("`{}`", outbox.schema()));
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id);
    if let Some(text) = text {
        query = query.bind(text);
    }
    query.execute(outbox.pool()).await.expect("statement");
}

/// Claims everything and completes `sent` as Sent, the rest as Dead (`error`).
async fn finish(outbox: &MySqlOutbox, sent: &[Uuid], error: &str) {
    let claimed = outbox
        .claim(10_000, Duration::from_secs(30))
        .await
        .expect("claim")
        .messages;
    let done: Vec<Completion> = claimed
        .iter()
        .map(|m| Completion {
            id: m.id,
            claim_token: m.claim_token.expect("token"),
            outcome: if sent.contains(&m.id) {
                CompletionOutcome::Sent
            } else {
                CompletionOutcome::Dead {
                    error: error.into(),
                }
            },
        })
        .collect();
    outbox.complete(&done).await.expect("complete");
}

/// Every method once on a fresh schema, through `dyn OutboxAdmin` as the binary calls
/// them (the flow of the PostgreSQL backend's reserved-word test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_query_runs_once() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let admin: &dyn OutboxAdmin = &outbox;
    assert_eq!(admin.backend(), "mysql");
    assert_eq!(admin.schema(), outbox.schema());
    assert!(admin.migrate().await.expect("migrate again").is_empty());
    assert_eq!(LATEST_VERSION, 4);

    let (a, b) = (
        event("1", "OrderPlaced", None),
        event("2", "OrderPlaced", None),
    );
    enqueue(&outbox, &[a.clone(), b.clone()]).await;
    let pending = admin.pending_stats().await.expect("pending");
    assert_eq!((pending.new, pending.processing, pending.sent), (2, 0, 0));
    assert!(pending.oldest_pending_age.is_some());
    for ordered in [None, Some(OnDead::Block), Some(OnDead::Skip)] {
        assert!(
            admin
                .oldest_claimable_wait(ordered)
                .await
                .expect("oldest claimable")
                .is_some(),
            "{ordered:?}"
        );
    }
    finish(&outbox, &[a.id], "no_route").await;
    assert_eq!(admin.pending_stats().await.expect("pending").dead, 1);
    assert_eq!(admin.oldest_claimable_wait(None).await.expect("wait"), None);
    let groups = admin.stats_by_group().await.expect("groups");
    assert_eq!(groups.len(), 1);
    assert_eq!((groups[0].sent, groups[0].dead, groups[0].new), (1, 1, 0));
    assert_eq!(groups[0].oldest_pending_age_secs, None);

    let now = chrono::Utc::now();
    let (from, to) = (
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
    );
    assert!(
        admin
            .reconcile(from, to, &[])
            .await
            .expect("reconcile")
            .is_empty(),
        "no consumer known yet"
    );
    assert!(
        admin.reconcile(to, from, &[]).await.is_err(),
        "empty window"
    );
    assert_eq!(
        admin
            .archive_sent(Duration::ZERO, 10)
            .await
            .expect("archive"),
        1
    );
    assert_eq!(count(&outbox, "outbox_messages_archive").await, 1);
    assert_eq!(
        outbox.purge_sent(Duration::ZERO, 10).await.expect("purge"),
        0
    );

    let inbox = outbox.inbox();
    let mut tx = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut tx, a.id, "c").await.expect("claim"));
    inbox.commit(tx).await.expect("commit");
    let msg = IncomingMessage::new(b.id, "OrderPlaced", b"{}".to_vec());
    assert!(
        inbox
            .record_failure(&msg, "c", "boom_1", 1)
            .await
            .expect("failure")
            .dead
    );
    let stored = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    assert!(DurableInbox::store(&inbox, &stored).await.expect("store"));
    assert_eq!(
        admin
            .purge_inbox_processed(Duration::ZERO, 10)
            .await
            .expect("purge processed"),
        0
    );
    let mut filter = InboxDeadFilter::new();
    filter.error_contains = Some("_".into());
    let dead = admin
        .inbox_dead_letters(&filter, 10)
        .await
        .expect("inbox dead");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, b.id);
    assert_eq!(dead[0].consumer.as_deref(), Some("c"));
    // `a` is archived, so only `b` is written in the window; `c` is expected for its
    // event type through its dead letter.
    let lines = admin.reconcile(from, to, &[]).await.expect("reconcile");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0].consumer, "c");
    assert_eq!(
        (
            lines[0].written,
            lines[0].processed,
            lines[0].dead,
            lines[0].missing
        ),
        (1, 0, 1, 1),
        "{lines:?}"
    );
    let dry = admin
        .replay_inbox_dead_letters(&filter, InboxReplayMode::DryRun)
        .await
        .expect("dry run");
    assert_eq!((dry.matched, dry.replayed, dry.failed), (1, 0, 0));
    let report = admin
        .replay_inbox_dead_letters(&filter, InboxReplayMode::Republish)
        .await
        .expect("inbox replay");
    assert_eq!((report.matched, report.replayed, report.failed), (1, 1, 0));
    let requeued = outbox.get(b.id).await.expect("get").expect("row");
    assert_eq!(requeued.status, outboxkit_core::MessageStatus::New);
    assert_eq!(requeued.attempts, 0);
    assert!(!inbox.is_dead(b.id, "c").await.expect("is dead"));

    assert_eq!(
        admin
            .archive_inbox_records(Duration::ZERO, 10)
            .await
            .expect("archive inbox"),
        1
    );
    assert_eq!(count(&outbox, "inbox_records_archive").await, 1);
    assert_eq!(
        admin
            .purge_inbox_records(Duration::ZERO, 10)
            .await
            .expect("purge records"),
        0
    );
}

/// Large archive batches move in one call, and the caller's "less than the batch means
/// done" loop holds; rows not yet due stay.
/// The queue lag of the relay's gauges and of `outbox stats` by group counts a message
/// from when it is due: one delayed 1 hour is pending, not late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_message_is_pending_but_not_late() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let admin: &dyn OutboxAdmin = &outbox;
    let later = NewMessage::builder("order", "later", "ReminderDue")
        .payload_json("{}")
        .deliver_after(Duration::from_secs(3600))
        .build()
        .expect("valid");
    enqueue(&outbox, &[later]).await;
    let pending = admin.pending_stats().await.expect("pending");
    assert_eq!((pending.new, pending.oldest_pending_age), (1, None));
    let groups = admin.stats_by_group().await.expect("groups");
    assert_eq!(
        (groups[0].new, groups[0].oldest_pending_age_secs),
        (1, None)
    );
    enqueue(&outbox, &[event("due", "ReminderDue", None)]).await;
    assert!(
        admin
            .pending_stats()
            .await
            .expect("pending")
            .oldest_pending_age
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_batches_above_the_cap_move_in_one_call() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let messages: Vec<NewMessage> = (0..2_500)
        .map(|i| event(&i.to_string(), "OrderPlaced", None))
        .collect();
    enqueue(&outbox, &messages).await;
    let ids: Vec<Uuid> = messages.iter().map(|m| m.id).collect();
    finish(&outbox, &ids, "unused").await;
    assert_eq!(
        outbox
            .archive_sent(Duration::from_secs(3600), 5_000)
            .await
            .expect("not due"),
        0
    );
    assert_eq!(
        outbox
            .archive_sent(Duration::ZERO, 2_000)
            .await
            .expect("first"),
        2_000
    );
    assert_eq!(
        outbox
            .archive_sent(Duration::ZERO, 2_000)
            .await
            .expect("second"),
        500
    );
    assert_eq!(count(&outbox, "outbox_messages").await, 0);
    assert_eq!(count(&outbox, "outbox_messages_archive").await, 2_500);
}

/// Grouped stats per event type and tenant, no tenant first; reconcile per consumer
/// with named consumers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_and_reconciliation_count_per_tenant_and_consumer() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let placed_none = event("1", "OrderPlaced", None);
    let placed_t1 = event("2", "OrderPlaced", Some("t1"));
    let shipped_t1 = event("3", "OrderShipped", Some("t1"));
    enqueue(
        &outbox,
        &[placed_none.clone(), placed_t1.clone(), shipped_t1.clone()],
    )
    .await;
    let groups = outbox.stats_by_group().await.expect("groups");
    let keys: Vec<(String, Option<String>)> = groups
        .iter()
        .map(|g| (g.event_type.clone(), g.tenant_id.clone()))
        .collect();
    assert_eq!(
        keys,
        [
            ("OrderPlaced".to_owned(), None),
            ("OrderPlaced".to_owned(), Some("t1".to_owned())),
            ("OrderShipped".to_owned(), Some("t1".to_owned())),
        ]
    );
    assert!(
        groups
            .iter()
            .all(|g| g.new == 1 && g.oldest_pending_age_secs.is_some())
    );

    let inbox = outbox.inbox();
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut tx, placed_t1.id, "projector")
            .await
            .expect("claim")
    );
    inbox.commit(tx).await.expect("commit");
    let now = chrono::Utc::now();
    let (from, to) = (
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
    );
    let lines = outbox.reconcile(from, to, &[]).await.expect("reconcile");
    // `projector` is expected for OrderPlaced only: once per tenant.
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0].tenant_id, None);
    assert_eq!(
        (lines[0].written, lines[0].processed, lines[0].missing),
        (1, 0, 1)
    );
    assert_eq!(lines[1].tenant_id.as_deref(), Some("t1"));
    assert_eq!(
        (lines[1].written, lines[1].processed, lines[1].missing),
        (1, 1, 0)
    );
    // A named consumer is expected for every event type, and restricts the output.
    let named = outbox
        .reconcile(from, to, &["auditor".to_owned()])
        .await
        .expect("reconcile named");
    assert_eq!(named.len(), 3, "{named:?}");
    assert!(
        named
            .iter()
            .all(|l| l.consumer == "auditor" && l.processed == 0)
    );
}

/// The consumer-side error filters match literal text, case-insensitively, in both
/// tables (`%`, `_`, `\\` and `!`, the escape character of our LIKE, match themselves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_error_filters_match_literal_text() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let errors = [
        "plain error",
        "rate 100% reached",
        "no_route",
        "C:\\temp",
        "MiXeD",
        "list [a] failed",
        "wow! done",
    ];
    let mut failures = Vec::new();
    let mut durable = Vec::new();
    for error in errors {
        let (f, d) = (Uuid::now_v7(), Uuid::now_v7());
        let text = format!("projector: {error}");
        exec(
            &outbox,
            "INSERT INTO {s}.inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
             VALUES (?, 'projector', 'OrderPlaced', 5, ?, NOW(6))",
            (f, Some(text.as_str())),
        )
        .await;
        exec(
            &outbox,
            "INSERT INTO {s}.inbox_messages (id, event_type, headers, payload, status, attempts, last_error)
             VALUES (?, 'OrderPlaced', '{}', 0x7b7d, 3, 5, ?)",
            (d, Some(text.as_str())),
        )
        .await;
        failures.push(f);
        durable.push(d);
    }
    let ids = |i: usize| BTreeSet::from([failures[i], durable[i]]);
    for (text, want) in [
        ("%", ids(1)),
        ("_", ids(2)),
        ("o_r", ids(2)),
        ("e_r", BTreeSet::new()),
        ("\\", ids(3)),
        ("mixed", ids(4)),
        ("[a]", ids(5)),
        ("[", ids(5)),
        ("PROJECTOR: plain", ids(0)),
        ("!", ids(6)),
        ("w! d", ids(6)),
    ] {
        let mut filter = InboxDeadFilter::new();
        filter.error_contains = Some(text.to_owned());
        let got: BTreeSet<Uuid> = outbox
            .inbox_dead_letters(&filter, 100)
            .await
            .expect("list")
            .iter()
            .map(|d| d.message_id)
            .collect();
        assert_eq!(got, want, "dead letters whose error contains {text:?}");
        let dry = outbox
            .replay_inbox_dead_letters(&filter, InboxReplayMode::DryRun)
            .await
            .expect("dry run");
        assert_eq!(dry.matched, want.len() as u64, "replay matching {text:?}");
    }
    // The consumer filter: equality on consumer dead letters, the `"<consumer>: "`
    // prefix of durable rows.
    let mut filter = InboxDeadFilter::new();
    filter.consumer = Some("projector".into());
    assert_eq!(
        outbox
            .inbox_dead_letters(&filter, 100)
            .await
            .expect("list")
            .len(),
        14
    );
    filter.consumer = Some("proj".into());
    assert!(
        outbox
            .inbox_dead_letters(&filter, 100)
            .await
            .expect("list")
            .is_empty()
    );
    // Ids and the limit; consumer dead letters come first.
    let mut filter = InboxDeadFilter::new();
    filter.ids = vec![failures[0], durable[0]];
    let listed = outbox.inbox_dead_letters(&filter, 100).await.expect("ids");
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0].message_id, failures[0]);
    assert_eq!(
        outbox
            .inbox_dead_letters(&InboxDeadFilter::new(), 3)
            .await
            .expect("limit")
            .len(),
        3
    );
}

/// Replay of consumer dead letters whose outbox row is gone: kept and counted failed,
/// unless clear-only deletes them; durable Dead rows go back to New.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_replay_without_the_outbox_row_fails_unless_clear_only() {
    let (outbox, _drop) = common::fresh_outbox().await;
    let inbox = outbox.inbox();
    let foreign = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    inbox
        .record_failure(&foreign, "c", "boom", 1)
        .await
        .expect("failure");
    let stored = Uuid::now_v7();
    exec(
        &outbox,
        "INSERT INTO {s}.inbox_messages (id, event_type, headers, payload, status, attempts, last_error)
         VALUES (?, 'OrderPlaced', '{}', 0x7b7d, 3, 5, 'c: boom')",
        (stored, None),
    )
    .await;
    let all = InboxDeadFilter::new();
    let report = outbox
        .replay_inbox_dead_letters(&all, InboxReplayMode::Republish)
        .await
        .expect("replay");
    assert_eq!((report.matched, report.replayed, report.failed), (2, 1, 1));
    assert!(inbox.is_dead(foreign.id, "c").await.expect("kept"));
    let claimed = DurableInbox::claim(&inbox, 10, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1, "the durable row is New again");
    assert_eq!(claimed[0].message.id, stored);

    let report = outbox
        .replay_inbox_dead_letters(&all, InboxReplayMode::ClearOnly)
        .await
        .expect("clear only");
    assert_eq!((report.matched, report.replayed, report.failed), (1, 1, 0));
    assert!(!inbox.is_dead(foreign.id, "c").await.expect("cleared"));
    assert_eq!(count(&outbox, "inbox_failures").await, 0);
}
