//! The operator queries ([`OutboxAdmin`] for `MssqlOutbox`) against a real SQL Server
//! (ignored unless run with `--ignored` and `MSSQL_URL` set), mirroring the PostgreSQL
//! backend's tests of the same queries.

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
use outboxkit_sqlserver::{LATEST_VERSION, MssqlOutbox};
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

async fn enqueue(outbox: &MssqlOutbox, messages: &[NewMessage]) {
    let mut tx = outbox.begin().await.expect("begin");
    for chunk in messages.chunks(1000) {
        outbox.enqueue_batch(&mut tx, chunk).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
}

async fn count(outbox: &MssqlOutbox, table: &str) -> i64 {
    let mut conn = outbox.pool().get().await.expect("connection");
    conn.simple_query(format!(
        "SELECT COUNT_BIG(*) FROM [{}].{table}",
        outbox.schema()
    ))
    .await
    .expect("count")
    .into_row()
    .await
    .expect("row")
    .and_then(|r| r.get::<i64, _>(0))
    .unwrap_or(-1)
}

async fn exec(outbox: &MssqlOutbox, sql: &str, params: &[&dyn tiberius::ToSql]) {
    let sql = sql.replace("{s}", &format!("[{}]", outbox.schema()));
    let mut conn = outbox.pool().get().await.expect("connection");
    conn.execute(sql, params).await.expect("statement");
}

/// Claims everything and completes `sent` as Sent, the rest as Dead (`error`).
async fn finish(outbox: &MssqlOutbox, sent: &[Uuid], error: &str) {
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
#[ignore = "needs MSSQL_URL"]
async fn every_admin_query_runs_once() {
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let admin: &dyn OutboxAdmin = &outbox;
    assert_eq!(admin.backend(), "sqlserver");
    assert_eq!(admin.schema(), outbox.schema());
    assert!(admin.migrate().await.expect("migrate again").is_empty());
    assert_eq!(LATEST_VERSION, 8);

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

/// A batch over [`MAX_ROWS_PER_STATEMENT`](outboxkit_sqlserver::MAX_ROWS_PER_STATEMENT)
/// moves in several statements of one call, and the caller's "less than the batch means
/// done" loop still holds; rows not yet due stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn archive_batches_above_the_cap_move_in_one_call() {
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
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
#[ignore = "needs MSSQL_URL"]
async fn groups_and_reconciliation_count_per_tenant_and_consumer() {
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
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
/// tables (`[` is a LIKE class in T-SQL and must match itself too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn inbox_error_filters_match_literal_text() {
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let errors = [
        "plain error",
        "rate 100% reached",
        "no_route",
        "C:\\temp",
        "MiXeD",
        "list [a] failed",
    ];
    let mut failures = Vec::new();
    let mut durable = Vec::new();
    for error in errors {
        let (f, d) = (Uuid::now_v7(), Uuid::now_v7());
        let text = format!("projector: {error}");
        exec(
            &outbox,
            "INSERT INTO {s}.inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
             VALUES (@P1, N'projector', N'OrderPlaced', 5, @P2, SYSUTCDATETIME())",
            &[&f, &text.as_str()],
        )
        .await;
        exec(
            &outbox,
            "INSERT INTO {s}.inbox_messages (id, event_type, payload, status, attempts, last_error)
             VALUES (@P1, N'OrderPlaced', 0x7b7d, 3, 5, @P2)",
            &[&d, &text.as_str()],
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
        12
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
#[ignore = "needs MSSQL_URL"]
async fn inbox_replay_without_the_outbox_row_fails_unless_clear_only() {
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let inbox = outbox.inbox();
    let foreign = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    inbox
        .record_failure(&foreign, "c", "boom", 1)
        .await
        .expect("failure");
    let stored = Uuid::now_v7();
    exec(
        &outbox,
        "INSERT INTO {s}.inbox_messages (id, event_type, payload, status, attempts, last_error)
         VALUES (@P1, N'OrderPlaced', 0x7b7d, 3, 5, N'c: boom')",
        &[&stored],
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

/// The dashboard's browsing queries, as `tests/browse.rs` of the PostgreSQL backend:
/// keyset pages of each state, the bounded count, sent per minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn listings_page_by_key_count_with_a_bound_and_bucket_sent_rows() {
    use outboxkit_core::{MessageFilter, MessageState};
    const SCAN: u64 = 100_000;
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let messages: Vec<NewMessage> = (0..25)
        .map(|n| {
            event(
                &n.to_string(),
                if n < 20 {
                    "OrderPlaced"
                } else {
                    "OrderShipped"
                },
                Some(if n % 2 == 0 { "acme" } else { "globex" }),
            )
        })
        .collect();
    enqueue(&outbox, &messages).await;
    exec(
        &outbox,
        "UPDATE {s}.outbox_messages SET status = 3, last_error = N'Unroutable: NO_ROUTE 100%'
          WHERE seq IN (SELECT TOP (5) seq FROM {s}.outbox_messages ORDER BY seq);
         UPDATE {s}.outbox_messages SET status = 1, sent_at = SYSUTCDATETIME()
          WHERE seq IN (SELECT seq FROM {s}.outbox_messages ORDER BY seq OFFSET 5 ROWS FETCH NEXT 2 ROWS ONLY);
         UPDATE {s}.outbox_messages SET status = 1, sent_at = DATEADD(second, -190, SYSUTCDATETIME())
          WHERE seq IN (SELECT seq FROM {s}.outbox_messages ORDER BY seq OFFSET 7 ROWS FETCH NEXT 2 ROWS ONLY);",
        &[],
    )
    .await;
    let all = MessageFilter::new();
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = outbox
            .list_messages(MessageState::Pending, &all, after, 5, SCAN)
            .await
            .expect("page");
        seen.extend(page.rows.iter().map(|m| m.seq));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen.len(), 16);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "claim order: {seen:?}"
    );
    let dead = outbox
        .list_messages(
            MessageState::Dead,
            &MessageFilter::new().with_error_containing("no_route 100%"),
            None,
            10,
            SCAN,
        )
        .await
        .expect("dead")
        .rows;
    assert_eq!(dead.len(), 5);
    assert!(dead.windows(2).all(|w| w[0].seq > w[1].seq), "newest first");
    let second = outbox
        .list_messages(
            MessageState::Dead,
            &all,
            Some(dead[1].cursor(MessageState::Dead)),
            10,
            SCAN,
        )
        .await
        .expect("dead page 2")
        .rows;
    assert_eq!(
        second.iter().map(|m| m.id).collect::<Vec<_>>(),
        dead[2..].iter().map(|m| m.id).collect::<Vec<_>>()
    );
    let shipped = MessageFilter::new()
        .with_event_type("OrderShipped")
        .with_tenant("acme");
    assert_eq!(
        outbox
            .list_messages(MessageState::Pending, &shipped, None, 100, SCAN)
            .await
            .expect("filtered")
            .rows
            .len(),
        3
    );
    let n = |state, filter, bound| {
        let outbox = &outbox;
        async move {
            let c = outbox
                .count_messages(state, filter, bound, SCAN)
                .await
                .expect("count");
            (c.matching, c.exact)
        }
    };
    assert_eq!(n(MessageState::Pending, &all, 1000).await, (16, true));
    assert_eq!(n(MessageState::Pending, &all, 10).await, (10, false));
    assert_eq!(n(MessageState::Sent, &all, 10).await, (4, true));
    assert_eq!(n(MessageState::Pending, &shipped, 10).await, (3, true));
    // The scan bound: 4 rows examined per call, pages continue from the last one.
    let late = MessageFilter::new().with_event_type("OrderShipped");
    let (mut found, mut after, mut calls) = (0, None, 0);
    loop {
        calls += 1;
        let page = outbox
            .list_messages(MessageState::Pending, &late, after, 10, 4)
            .await
            .expect("bounded page");
        found += page.rows.len();
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!((found, calls), (5, 5));
    let c = outbox
        .count_messages(MessageState::Pending, &late, 1000, 4)
        .await
        .expect("count");
    assert_eq!((c.matching, c.exact), (0, false));
    let series = outbox.sent_per_minute(60).await.expect("series");
    assert_eq!(series.counts.len(), 60);
    assert_eq!(series.counts[59], 2, "{:?}", series.counts);
    assert_eq!(series.counts[56], 2, "{:?}", series.counts);
    let sent = outbox
        .list_messages(MessageState::Sent, &all, None, 10, SCAN)
        .await
        .expect("sent")
        .rows;
    assert_eq!(sent.len(), 4);
}

/// Relay heartbeats (migration 7), as `tests/browse.rs` of the PostgreSQL backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs MSSQL_URL"]
async fn heartbeats_keep_one_row_per_relay() {
    use outboxkit_core::RelayHeartbeat;
    let url = common::mssql_url();
    let outbox = common::fresh_outbox(&url).await;
    let mut beat = RelayHeartbeat::new(Uuid::now_v7(), "host-a", 4242, "0.1.0");
    outbox.record_heartbeat(&beat).await.expect("first beat");
    beat.circuit_open = true;
    beat.healthy = false;
    beat.published = 17;
    beat.detail = "broker unreachable: circuit open".into();
    outbox.record_heartbeat(&beat).await.expect("second beat");
    let seen = outbox
        .relays_seen(Duration::from_secs(60), 10)
        .await
        .expect("relays");
    assert_eq!(seen.len(), 1);
    let a = &seen[0];
    assert_eq!((a.host.as_str(), a.pid, a.published), ("host-a", 4242, 17));
    assert!(a.circuit_open && !a.healthy && a.detail.contains("circuit open"));
    assert_eq!(count(&outbox, "outbox_relays").await, 1);
}
