//! The browsing queries of `OutboxAdmin` (the dashboard's): keyset-paged listings of
//! each state, bounded counts, sent per minute.

mod common;

use std::collections::BTreeSet;

use common::{enqueue_committed, fresh_outbox};
use outboxkit_core::{MessageFilter, MessageState, NewMessage, OutboxAdmin as _, RelayHeartbeat};

/// The scan bound of these tests' listings (large: the scan bound has its own test).
const SCAN: u64 = 100_000;
use uuid::Uuid;

fn event(n: i64, event_type: &str) -> NewMessage {
    NewMessage::builder("order", n.to_string(), event_type)
        .tenant_id(if n % 2 == 0 { "acme" } else { "globex" })
        .payload(&serde_json::json!({ "order": n }))
        .build()
        .expect("valid")
}

#[tokio::test]
async fn listings_page_by_key_count_with_a_bound_and_bucket_sent_rows() {
    let db = fresh_outbox().await;
    let messages: Vec<NewMessage> = (0..25)
        .map(|n| {
            event(
                n,
                if n < 20 {
                    "OrderPlaced"
                } else {
                    "OrderShipped"
                },
            )
        })
        .collect();
    enqueue_committed(&db, &messages).await;
    // 5 dead (with an error), 4 sent (two of them 3 minutes ago), the rest pending.
    let s = db.schema().to_owned();
    let run = |sql: String| {
        let pool = db.pool().clone();
        async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .expect("sql");
        }
    };
    run(format!(
        "UPDATE \"{s}\".outbox_messages SET status = 3, last_error = 'Unroutable: NO_ROUTE 100%'
          WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages ORDER BY seq LIMIT 5);
         UPDATE \"{s}\".outbox_messages SET status = 1, sent_at = now()
          WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages ORDER BY seq OFFSET 5 LIMIT 2);
         UPDATE \"{s}\".outbox_messages SET status = 1, sent_at = now() - interval '3 minutes 10 seconds'
          WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages ORDER BY seq OFFSET 7 LIMIT 2);"
    ))
    .await;

    // Pending: 16 rows in claim order, in pages of 5, no row twice or missed.
    let all = MessageFilter::new();
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = db
            .list_messages(MessageState::Pending, &all, after, 5, SCAN)
            .await
            .expect("page");
        assert!(page.rows.len() <= 5);
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

    // Dead: newest first, filtered by error text literally (`%` is no wildcard).
    let dead = db
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
    assert!(dead.windows(2).all(|w| w[0].seq > w[1].seq));
    let second = db
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
        second.iter().map(|m| m.id).collect::<Vec<Uuid>>(),
        dead[2..].iter().map(|m| m.id).collect::<Vec<_>>()
    );
    let none = db
        .list_messages(
            MessageState::Dead,
            &MessageFilter::new().with_error_containing("no_route 1000"),
            None,
            10,
            SCAN,
        )
        .await
        .expect("dead");
    assert!(none.rows.is_empty() && none.next.is_none());

    // Filters by event type and tenant; counts stop at the bound.
    let shipped = MessageFilter::new()
        .with_event_type("OrderShipped")
        .with_tenant("acme");
    let rows = db
        .list_messages(MessageState::Pending, &shipped, None, 100, SCAN)
        .await
        .expect("filtered")
        .rows;
    let want: BTreeSet<i64> = [20, 22, 24].into();
    assert_eq!(
        rows.iter()
            .map(|m| m.aggregate_id.parse::<i64>().expect("number"))
            .collect::<BTreeSet<_>>(),
        want
    );
    let count = |state, filter, bound| {
        let db = &db;
        async move {
            let c = db
                .count_messages(state, filter, bound, SCAN)
                .await
                .expect("count");
            (c.matching, c.exact)
        }
    };
    assert_eq!(count(MessageState::Pending, &all, 1000).await, (16, true));
    assert_eq!(count(MessageState::Pending, &all, 10).await, (10, false));
    assert_eq!(count(MessageState::Sent, &all, 10).await, (4, true));
    assert_eq!(count(MessageState::Pending, &shipped, 10).await, (3, true));

    // The scan bound: a filter only the last rows match, 4 rows examined per call. The
    // pages come back short, each continuing from the last row examined, and together
    // hold every match once.
    let late = MessageFilter::new().with_event_type("OrderShipped");
    let mut found = Vec::new();
    let mut after = None;
    let mut calls = 0;
    loop {
        calls += 1;
        let page = db
            .list_messages(MessageState::Pending, &late, after, 10, 4)
            .await
            .expect("bounded page");
        assert!(page.rows.iter().all(|m| m.event_type == "OrderShipped"));
        found.extend(page.rows.iter().map(|m| m.seq));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(found.len(), 5, "{found:?}");
    // 16 pending rows, 4 examined per call; the fifth call finds the end.
    assert_eq!(calls, 5);
    let counted = db
        .count_messages(MessageState::Pending, &late, 1000, 4)
        .await
        .expect("count");
    assert_eq!(
        (counted.matching, counted.exact),
        (0, false),
        "only the first 4 rows examined"
    );
    let counted = db
        .count_messages(MessageState::Pending, &late, 1000, 100)
        .await
        .expect("count");
    assert_eq!((counted.matching, counted.exact), (5, true));

    // Sent: two in the minute just ended, two three minutes before.
    let series = db.sent_per_minute(60).await.expect("series");
    assert_eq!(series.counts.len(), 60);
    assert_eq!(series.counts[59], 2, "{:?}", series.counts);
    assert_eq!(series.counts[56], 2, "{:?}", series.counts);
    assert_eq!(series.counts.iter().sum::<u64>(), 4);
    let sent = db
        .list_messages(MessageState::Sent, &all, None, 10, SCAN)
        .await
        .expect("sent")
        .rows;
    assert_eq!(sent.len(), 4);
    assert!(sent[0].sent_at >= sent[3].sent_at, "most recent first");

    // Heartbeats: one row per relay, updated in place, listed most recent first.
    let mut beat = RelayHeartbeat::new(Uuid::now_v7(), "host-a", 4242, "0.1.0");
    db.record_heartbeat(&beat).await.expect("first beat");
    beat.circuit_open = true;
    beat.healthy = false;
    beat.published = 17;
    beat.detail = "broker unreachable: circuit open".into();
    db.record_heartbeat(&beat).await.expect("second beat");
    let other = RelayHeartbeat::new(Uuid::now_v7(), "host-b", 7, "0.1.0");
    db.record_heartbeat(&other).await.expect("other beat");
    let seen = db
        .relays_seen(std::time::Duration::from_secs(60), 10)
        .await
        .expect("relays");
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].relay_id, other.relay_id,
        "most recently heard first"
    );
    let a = &seen[1];
    assert_eq!((a.host.as_str(), a.pid, a.published), ("host-a", 4242, 17));
    assert!(a.circuit_open && !a.healthy && a.detail.contains("circuit open"));
    assert!(a.started_at <= a.last_seen_at && a.silent_for.as_secs() < 60);
    // A relay not heard of for a day is deleted by the next heartbeat of another.
    run(format!(
        "UPDATE \"{s}\".outbox_relays SET last_seen_at = now() - interval '25 hours' WHERE host = 'host-a'"
    ))
    .await;
    db.record_heartbeat(&other).await.expect("beat");
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{s}\".outbox_relays"
    )))
    .fetch_one(db.pool())
    .await
    .expect("count");
    assert_eq!(left, 1);

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{s}\" CASCADE")))
        .execute(db.pool())
        .await
        .expect("drop schema");
}
