//! Claims are heap-only-tuple (HOT) updates (migration 5): no index uses a column a claim
//! or a release changes, a whole backlog claimed at once really is updated in place, and
//! a schema upgraded from migration 4 keeps every row where it was.

mod common;

use std::time::{Duration, Instant};

use common::{database_url, enqueue_committed, fresh_outbox};
use outboxkit_core::{
    Completion, CompletionOutcome, MessageFilter, MessageStatus, NewMessage, OutboxAdmin as _,
    OutboxStore,
};
use outboxkit_postgres::{PgConfig, PgOutbox};

/// The columns a claim (New → Processing) or a release (Processing → New, no charge)
/// writes. If an index used one of them, PostgreSQL could not update the row in place.
const CLAIM_COLUMNS: [&str; 4] = ["status", "lease_until", "claim_token", "attempts"];

/// Every column an index of `schema.table` uses as key, in an expression or in its
/// predicate, with the index's name.
async fn indexed_columns(pool: &sqlx::PgPool, schema: &str, table: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        r"SELECT i.relname::text, a.attname::text
            FROM pg_index x
            JOIN pg_class i ON i.oid = x.indexrelid
            JOIN pg_class t ON t.oid = x.indrelid
            JOIN pg_namespace n ON n.oid = t.relnamespace
            JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
           WHERE n.nspname = $1 AND t.relname = $2
             AND (a.attnum = ANY(x.indkey::int2[])
                  OR coalesce(pg_get_expr(x.indexprs, x.indrelid), '') ~ ('\m' || a.attname || '\M')
                  OR coalesce(pg_get_expr(x.indpred, x.indrelid), '') ~ ('\m' || a.attname || '\M'))",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .expect("index columns")
}

#[tokio::test]
async fn no_index_uses_a_column_that_a_claim_or_release_writes() {
    let outbox = fresh_outbox().await;
    for table in ["outbox_messages", "inbox_messages"] {
        let used = indexed_columns(outbox.pool(), outbox.schema(), table).await;
        // The query sees the indexes at all (the claim index filters on `phase`).
        assert!(
            used.iter().any(|(_, c)| c == "phase"),
            "{table}: no index on phase found in {used:?}"
        );
        let blocking: Vec<_> = used
            .iter()
            .filter(|(_, c)| CLAIM_COLUMNS.contains(&c.as_str()))
            .collect();
        assert!(
            blocking.is_empty(),
            "{table}: these indexes make claims non-HOT: {blocking:?}"
        );
    }
}

/// `(updates, HOT updates)` of the outbox table as PostgreSQL's statistics count them.
/// `conn` must be the pool's only connection, the one that ran the updates: it is told
/// to flush its pending counters (PostgreSQL 15+; older servers flush within seconds).
async fn update_counts(pool: &sqlx::PgPool, schema: &str, at_least: i64) -> (i64, i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(pool)
            .await;
        let (upd, hot): (i64, i64) = sqlx::query_as(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
              WHERE schemaname = $1 AND relname = 'outbox_messages'",
        )
        .bind(schema)
        .fetch_one(pool)
        .await
        .expect("table statistics");
        if upd >= at_least || Instant::now() > deadline {
            return (upd, hot);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_whole_backlog_claimed_at_once_is_updated_in_place() {
    let outbox = fresh_outbox().await;
    // One connection, so the statistics flushed are those of the claims.
    let pool = PgOutbox::connect(
        &PgConfig::new(database_url())
            .with_schema(outbox.schema())
            .with_max_connections(1),
    )
    .await
    .expect("connect")
    .pool()
    .clone();
    let outbox = PgOutbox::new(
        pool.clone(),
        &PgConfig::default().with_schema(outbox.schema()),
    )
    .expect("outbox");
    let body = format!(r#"{{"pad":"{}"}}"#, "x".repeat(246));
    let messages: Vec<NewMessage> = (0..500)
        .map(|i| {
            NewMessage::builder("bench", i.to_string(), "BenchEvent")
                .payload_json(body.clone())
                .build()
                .expect("valid")
        })
        .collect();
    enqueue_committed(&outbox, &messages).await;

    // The worst case for page room: every row of every page in one claim.
    let claimed = outbox
        .claim(500, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
    assert_eq!(claimed.len(), 500);
    let (upd, hot) = update_counts(&pool, outbox.schema(), 500).await;
    assert_eq!(upd, 500, "the claim updated each row once");
    // A claimed version is 24 bytes longer than the original (lease and claim token
    // set), so a page that one more short row filled past the usual count can lack
    // room for its last one: about 56 pages here, at most one miss each.
    assert!(hot >= 490, "only {hot} of 500 claims were HOT updates");

    // An outage hands them back without charge. (In place too when the page has room,
    // which needs the original versions pruned: not asserted, as any older transaction
    // in the database, such as a parallel test's, holds that back.)
    let releases: Vec<Completion> = claimed
        .iter()
        .map(|m| Completion {
            id: m.id,
            claim_token: m.claim_token.expect("claimed"),
            outcome: CompletionOutcome::Release,
        })
        .collect();
    let report = outbox.complete(&releases).await.expect("release");
    assert_eq!(report.applied, 500);

    // And they are claimable again at once, uncharged.
    let again = outbox
        .claim(500, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
    assert_eq!(again.len(), 500);
    assert!(
        again.iter().all(|m| m.attempts == 1),
        "releases charge nothing"
    );
}

/// Migrations 1 to 4 as an older build applied them.
async fn schema_at_migration_4(pool: &sqlx::PgPool, schema: &str) {
    let files = [
        include_str!("../migrations/0001_outbox.sql"),
        include_str!("../migrations/0002_inbox.sql"),
        include_str!("../migrations/0003_ordering.sql"),
        include_str!("../migrations/0004_archive.sql"),
    ];
    let mut sql = format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.outbox_schema_migrations (
             version integer PRIMARY KEY, description text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now());
         INSERT INTO {schema}.outbox_schema_migrations (version, description)
             VALUES (1, 'v1'), (2, 'v2'), (3, 'v3'), (4, 'v4');"
    );
    for file in files {
        sql.push_str(&file.replace("{schema}", schema));
        sql.push('\n');
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect("migrations 1-4");
}

#[tokio::test]
async fn upgrade_from_migration_4_keeps_every_row_where_it_was() {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let pool = PgOutbox::connect(
        &PgConfig::new(database_url())
            .with_schema(&schema)
            .with_max_connections(4),
    )
    .await
    .expect("connect")
    .pool()
    .clone();
    schema_at_migration_4(&pool, &schema).await;
    let outbox =
        PgOutbox::new(pool.clone(), &PgConfig::default().with_schema(&schema)).expect("outbox");

    // Rows in every state, written the way the older build left them.
    let messages: Vec<NewMessage> = (0..5)
        .map(|i| {
            NewMessage::builder("order", i.to_string(), "OrderPlaced")
                .payload(&serde_json::json!({ "n": i }))
                .build()
                .expect("valid")
        })
        .collect();
    enqueue_committed(&outbox, &messages).await;
    let [new, expired, held, sent, dead] = [0, 1, 2, 3, 4].map(|i| messages[i].id);
    let set = |id: uuid::Uuid, assignments: &str| {
        let sql = format!("UPDATE {schema}.outbox_messages SET {assignments} WHERE id = $1");
        let pool = pool.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .execute(&pool)
                .await
                .expect("set state");
        }
    };
    let token = "claim_token = gen_random_uuid(), attempts = 1";
    set(
        expired,
        &format!("status = 9, lease_until = now() - interval '1 minute', {token}"),
    )
    .await;
    set(
        held,
        &format!("status = 9, lease_until = now() + interval '1 hour', {token}"),
    )
    .await;
    set(
        sent,
        "status = 1, sent_at = now() - interval '2 days', attempts = 1",
    )
    .await;
    set(
        dead,
        "status = 3, attempts = 8, last_error = 'broker said no'",
    )
    .await;

    assert_eq!(
        outbox.migrate().await.expect("migrate"),
        (5..=outboxkit_postgres::LATEST_VERSION).collect::<Vec<_>>()
    );

    let stats = outbox.stats().await.expect("stats");
    assert_eq!(
        (stats.new, stats.processing, stats.sent, stats.dead),
        (1, 2, 1, 1)
    );
    let pending = outbox.pending_stats().await.expect("pending stats");
    assert_eq!((pending.new, pending.processing, pending.dead), (1, 2, 1));

    // The New row and the expired lease are claimable; the held lease is not. The
    // expired one (its claim ended without an outcome) is claimed alone.
    let mut claimed = Vec::new();
    for _ in 0..2 {
        let batch = outbox
            .claim(10, Duration::from_secs(60))
            .await
            .expect("claim")
            .messages;
        assert_eq!(batch.len(), 1, "one at a time: {batch:?}");
        claimed.extend(batch);
    }
    let mut ids: Vec<_> = claimed.iter().map(|m| m.id).collect();
    ids.sort();
    let mut want = vec![new, expired];
    want.sort();
    assert_eq!(ids, want);
    assert!(
        claimed
            .iter()
            .all(|m| m.status == MessageStatus::Processing)
    );

    let dead_letters = outbox
        .dead_letters(&MessageFilter::new(), 10)
        .await
        .expect("dead letters");
    assert_eq!(
        dead_letters.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![dead]
    );
    assert_eq!(
        outbox
            .purge_sent(Duration::from_secs(86_400), 10)
            .await
            .expect("purge"),
        1,
        "the two-day-old sent row is purged"
    );
    assert!(outbox.get(sent).await.expect("get").is_none());

    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await;
}
