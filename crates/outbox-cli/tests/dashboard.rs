//! `outbox dashboard` over HTTP against the real PostgreSQL, each test in its own
//! schema: the pages, keyset paging, escaping, and the security model (read-only mode,
//! CSRF, origin, authentication, the Host check, the address check). The same flows in
//! a real browser are in `dashboard_browser.rs`.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use clap::Parser as _;
use common::{Resp, enqueue, exec, fresh_outbox, request, scalar};
use outboxkit_cli::testing::internals::{DashboardSettings, RunningDashboard};
use outboxkit_cli::{Cli, CliError};
use outboxkit_core::{NewMessage, OutboxAdmin};
use outboxkit_postgres::{PgConfig, PgOutbox};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

async fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], None).await
}

/// The admin handle the dashboard serves (its own pool, same schema).
async fn admin_of(db: &PgOutbox) -> Arc<dyn OutboxAdmin> {
    Arc::new(
        PgOutbox::connect(
            &PgConfig::new(common::database_url())
                .with_schema(db.schema())
                .with_max_connections(4),
        )
        .await
        .expect("connect"),
    )
}

async fn serve(db: &PgOutbox, settings: DashboardSettings) -> (RunningDashboard, SocketAddr) {
    let mut settings = settings;
    settings.listen = "127.0.0.1:0".parse().expect("addr");
    let running = RunningDashboard::start(admin_of(db).await, &settings, CancellationToken::new())
        .await
        .expect("dashboard starts");
    let addr = running.local_addr();
    (running, addr)
}

fn replay_enabled() -> DashboardSettings {
    let mut s = DashboardSettings::new();
    s.allow_replay = true;
    s
}

fn msg(event_type: &str, aggregate: &str, payload: &str) -> NewMessage {
    NewMessage::builder("order", aggregate, event_type)
        .tenant_id("acme")
        .payload_json(payload)
        .build()
        .expect("valid message")
}

async fn kill(db: &PgOutbox, ids: &[Uuid], error: &str) {
    for id in ids {
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
}

/// `n` `PaymentFailed` messages, dead (`unroutable`); their ids.
async fn dead_letters(db: &PgOutbox, n: usize) -> Vec<Uuid> {
    let victims: Vec<NewMessage> = (0..n)
        .map(|n| msg("PaymentFailed", &format!("v{n}"), "{}"))
        .collect();
    enqueue(db, &victims).await;
    let ids: Vec<Uuid> = victims.iter().map(|m| m.id).collect();
    kill(db, &ids, "unroutable").await;
    ids
}

/// Marks message `id` Sent, and records a consumer dead letter of it (consumer
/// `projection`).
async fn sent_with_a_consumer_dead_letter(db: &PgOutbox, id: Uuid) {
    exec(
        db,
        &format!(
            "UPDATE \"{{s}}\".outbox_messages SET status = 1, sent_at = now() WHERE id = '{id}'"
        ),
    )
    .await;
    exec(db, &format!(
        "INSERT INTO \"{{s}}\".inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
         VALUES ('{id}', 'projection', 'PaymentFailed', 5, 'boom', now())"
    )).await;
}

async fn status_of(db: &PgOutbox, id: Uuid) -> i64 {
    scalar(
        db,
        &format!("SELECT status::int8 FROM \"{{s}}\".outbox_messages WHERE id = '{id}'"),
    )
    .await
}

async fn drop_schema(db: &PgOutbox) {
    exec(db, "DROP SCHEMA \"{s}\" CASCADE").await;
}

/// The value of the hidden input `name` in a page.
fn hidden(body: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let at = body
        .find(&marker)
        .unwrap_or_else(|| panic!("no {name} in {body}"))
        + marker.len();
    body[at..].split('"').next().expect("value").to_owned()
}

/// Every `/messages/<uuid>` link of a page, in order.
fn message_links(body: &str) -> Vec<Uuid> {
    body.match_indices("href=\"/messages/")
        .filter_map(|(at, m)| body.get(at + m.len()..at + m.len() + 36))
        .filter_map(|id| id.parse().ok())
        .collect()
}

fn next_page(body: &str) -> Option<String> {
    let at = body.find("id=\"next-page\" href=\"")? + "id=\"next-page\" href=\"".len();
    Some(body[at..].split('"').next()?.replace("&amp;", "&"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_render_filter_and_page_by_key() {
    let db = fresh_outbox().await;
    let pending: Vec<NewMessage> = (0..120)
        .map(|n| {
            msg(
                if n % 3 == 0 {
                    "OrderShipped"
                } else {
                    "OrderPlaced"
                },
                &format!("p{n}"),
                "{\"n\":1}",
            )
        })
        .collect();
    enqueue(&db, &pending).await;
    let dead: Vec<NewMessage> = (0..3)
        .map(|n| msg("PaymentFailed", &format!("d{n}"), "{}"))
        .collect();
    // Blocks its key: a later message of the same aggregate waits behind it.
    let behind = msg("PaymentFailed", "d0", "{}");
    enqueue(&db, &dead).await;
    enqueue(&db, &[behind]).await;
    kill(&db, &[dead[0].id, dead[1].id], "unroutable: NO_ROUTE").await;
    kill(&db, &[dead[2].id], "payload too large").await;
    exec(&db, "UPDATE \"{s}\".outbox_messages SET status = 1, sent_at = now() WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages WHERE status = 0 ORDER BY seq LIMIT 2)").await;
    let consumer_dead = Uuid::now_v7();
    exec(&db, &format!(
        "INSERT INTO \"{{s}}\".inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
         VALUES ('{consumer_dead}', 'projection', 'OrderPlaced', 5, 'handler failed: boom', now())"
    )).await;
    let (running, addr) = serve(&db, DashboardSettings::new()).await;

    let overview = get(addr, "/").await;
    assert_eq!(overview.status, 200, "{}", overview.body);
    for text in [
        "Pending",
        "119",
        "Dead",
        "Sent per minute",
        "read-only",
        "No relay has reported a heartbeat",
    ] {
        assert!(overview.body.contains(text), "overview lacks {text:?}");
    }
    let timing = overview.header("server-timing").expect("Server-Timing");
    assert!(timing.starts_with("app;dur="), "{timing}");
    assert!(
        overview
            .header("content-security-policy")
            .is_some_and(|c| c.contains("script-src 'self'"))
    );

    // Pending: 119 rows in pages of 50, by key, every row once.
    let mut seen = Vec::new();
    let mut path = Some("/messages?state=pending".to_owned());
    while let Some(p) = path {
        let page = get(addr, &p).await;
        assert_eq!(page.status, 200, "{p}: {}", page.body);
        let links = message_links(&page.body);
        assert!(links.len() <= 50);
        seen.extend(links);
        path = next_page(&page.body);
    }
    assert_eq!(seen.len(), 119);
    assert_eq!(
        seen.iter().collect::<std::collections::BTreeSet<_>>().len(),
        119
    );

    // Filters: event type and error text, with a bounded count.
    let shipped = get(addr, "/messages?state=pending&event_type=OrderShipped").await;
    // p0 (shipped) is among the two sent rows.
    assert_eq!(message_links(&shipped.body).len(), 39);
    assert!(shipped.body.contains("39 matching"));
    let no_route = get(addr, "/messages?state=dead&error=no_route").await;
    let ids = message_links(&no_route.body);
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&dead[0].id) && ids.contains(&dead[1].id));
    assert!(no_route.body.contains("Replay all matching this filter"));
    let sent = get(addr, "/messages?state=sent").await;
    assert_eq!(message_links(&sent.body).len(), 2);

    // Detail, blocked keys, the consumer side.
    let detail = get(addr, &format!("/messages/{}", dead[2].id)).await;
    assert_eq!(detail.status, 200);
    assert!(
        detail.body.contains("payload too large") && detail.body.contains("Replay this message")
    );
    let blocked = get(addr, "/blocked").await;
    assert!(
        blocked.body.contains(&dead[0].id.to_string()),
        "{}",
        blocked.body
    );
    let inbox = get(addr, "/inbox?consumer=projection").await;
    assert!(
        inbox.body.contains(&consumer_dead.to_string())
            && inbox.body.contains("handler failed: boom")
    );
    assert_eq!(
        get(addr, &format!("/inbox/{consumer_dead}")).await.status,
        200
    );

    // Bad input is a 400, an unknown message a 404, both escaped pages.
    assert_eq!(get(addr, "/messages/not-a-uuid").await.status, 400);
    assert_eq!(
        get(addr, &format!("/messages/{}", Uuid::now_v7()))
            .await
            .status,
        404
    );
    assert_eq!(
        get(addr, "/messages?state=dead&since=yesterday-ish")
            .await
            .status,
        400
    );
    assert_eq!(get(addr, "/messages?state=lost").await.status, 400);
    assert_eq!(get(addr, "/assets/dashboard.js").await.status, 200);

    running.stop().await.expect("stops");
    drop_schema(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_content_is_escaped_and_secret_headers_hidden() {
    let db = fresh_outbox().await;
    let hostile = NewMessage::builder("order<b>", "<img src=x onerror=alert(1)>", "Evil<script>")
        .payload_json(r#"{"note":"</pre><script>window.__pwned=1</script>"}"#)
        .header("x-note", "<script>window.__pwned=2</script>")
        .header("authorization", "Bearer very-secret-value")
        .build()
        .expect("valid");
    enqueue(&db, std::slice::from_ref(&hostile)).await;
    kill(&db, &[hostile.id], "<script>window.__pwned=3</script>").await;
    let (running, addr) = serve(&db, DashboardSettings::new()).await;
    for path in [
        "/".to_owned(),
        "/messages?state=dead".to_owned(),
        format!("/messages/{}", hostile.id),
        format!("/replay?id={}", hostile.id),
        "/blocked".to_owned(),
    ] {
        let page = get(addr, &path).await;
        assert_eq!(page.status, 200, "{path}");
        assert!(
            !page.body.contains("<script>window"),
            "{path}: unescaped script"
        );
        assert!(!page.body.contains("<img src=x"), "{path}: unescaped tag");
        assert!(
            !page.body.contains("very-secret-value"),
            "{path}: secret shown"
        );
    }
    let detail = get(addr, &format!("/messages/{}", hostile.id)).await;
    assert!(
        detail
            .body
            .contains("&lt;/pre&gt;&lt;script&gt;window.__pwned=1&lt;/script&gt;")
    );
    assert!(
        detail
            .body
            .contains("&lt;script&gt;window.__pwned=2&lt;/script&gt;")
    );
    assert!(detail.body.contains("hidden: the name suggests a secret"));
    running.stop().await.expect("stops");
    drop_schema(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_needs_replay_mode_csrf_and_the_same_origin_and_is_confirmed() {
    let db = fresh_outbox().await;
    let ids = dead_letters(&db, 3).await;
    let one = format!("id={}", ids[0]);

    // Read-only: the preview counts, offers no form, and a POST is refused.
    let (ro, addr) = serve(&db, DashboardSettings::new()).await;
    let preview = get(addr, &format!("/replay?{one}")).await;
    assert_eq!(preview.status, 200);
    assert!(preview.body.contains("id=\"read-only\"") && !preview.body.contains("name=\"csrf\""));
    let refused = request(
        addr,
        "POST",
        "/replay",
        &[],
        Some(&format!("{one}&expected=1&csrf=x")),
    )
    .await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(status_of(&db, ids[0]).await, 3, "read-only changed nothing");
    ro.stop().await.expect("stops");

    let (rw, addr) = serve(&db, replay_enabled()).await;
    let preview = get(addr, &format!("/replay?{one}")).await;
    assert!(
        preview.body.contains("1</strong> dead message match"),
        "{}",
        preview.body
    );
    let csrf = hidden(&preview.body, "csrf");
    // Missing and wrong CSRF tokens, and a cross-site origin with the right one.
    for (form, headers) in [
        (format!("{one}&expected=1"), vec![]),
        (format!("{one}&expected=1&csrf=0000"), vec![]),
        (
            format!("{one}&expected=1&csrf={csrf}"),
            vec![("Origin", "http://evil.example")],
        ),
        (
            format!("{one}&expected=1&csrf={csrf}"),
            vec![("Sec-Fetch-Site", "cross-site")],
        ),
    ] {
        let r = request(addr, "POST", "/replay", &headers, Some(&form)).await;
        assert_eq!(r.status, 403, "{form} {headers:?}: {}", r.body);
    }
    assert_eq!(
        status_of(&db, ids[0]).await,
        3,
        "refused posts changed nothing"
    );
    // No filter at all needs the explicit "all".
    let unfiltered = request(
        addr,
        "POST",
        "/replay",
        &[],
        Some(&format!("expected=3&csrf={csrf}")),
    )
    .await;
    assert_eq!(unfiltered.status, 400);
    // More rows match than were confirmed: asked again.
    let stale = request(
        addr,
        "POST",
        "/replay",
        &[],
        Some(&format!("event_type=PaymentFailed&expected=2&csrf={csrf}")),
    )
    .await;
    assert_eq!(stale.status, 409, "{}", stale.body);
    assert_eq!(status_of(&db, ids[1]).await, 3);
    // Confirmed, from the page's own origin.
    let origin = format!("http://{addr}");
    let done = request(
        addr,
        "POST",
        "/replay",
        &[("Origin", &origin), ("Sec-Fetch-Site", "same-origin")],
        Some(&format!("{one}&expected=1&csrf={csrf}")),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert!(
        done.body.contains("id=\"replayed\">1</strong> of 1"),
        "{}",
        done.body
    );
    assert_eq!(status_of(&db, ids[0]).await, 0, "replayed to New");
    assert_eq!(status_of(&db, ids[1]).await, 3, "only the selection");

    // A consumer dead letter of a sent message: republished.
    sent_with_a_consumer_dead_letter(&db, ids[2]).await;
    let inbox_preview = get(addr, &format!("/inbox/replay?id={}", ids[2])).await;
    assert!(
        inbox_preview
            .body
            .contains("1</strong> consumer dead letter match"),
        "{}",
        inbox_preview.body
    );
    let refused = request(
        addr,
        "POST",
        "/inbox/replay",
        &[],
        Some(&format!("id={}&expected=1&mode=republish", ids[2])),
    )
    .await;
    assert_eq!(refused.status, 403);
    let done = request(
        addr,
        "POST",
        "/inbox/replay",
        &[],
        Some(&format!(
            "id={}&expected=1&mode=republish&csrf={csrf}",
            ids[2]
        )),
    )
    .await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert_eq!(status_of(&db, ids[2]).await, 0, "republished");
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM \"{s}\".inbox_failures").await,
        0
    );
    rw.stop().await.expect("stops");
    drop_schema(&db).await;
}

/// A field the other side has no column for (`consumer` on the outbox, `tenant` and
/// `aggregate_*` on the inbox) filters nothing: it is refused, so that it can neither
/// stand in for the "replay every dead letter" confirmation nor be logged as a filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_the_other_side_ignores_is_refused_not_counted_as_a_filter() {
    let db = fresh_outbox().await;
    let ids = dead_letters(&db, 3).await;
    sent_with_a_consumer_dead_letter(&db, ids[2]).await;
    let (rw, addr) = serve(&db, replay_enabled()).await;
    let csrf = hidden(
        &get(addr, "/replay?event_type=PaymentFailed").await.body,
        "csrf",
    );

    for (path, field) in [
        ("/replay", "consumer=billing"),
        ("/inbox/replay", "tenant=acme"),
        ("/inbox/replay", "aggregate_type=order"),
        ("/inbox/replay", "aggregate_id=v2"),
    ] {
        let preview = get(addr, &format!("{path}?{field}")).await;
        assert_eq!(preview.status, 400, "{path}?{field}: {}", preview.body);
        let name = field.split('=').next().expect("name");
        assert!(preview.body.contains(name), "{}", preview.body);
        let post = request(
            addr,
            "POST",
            path,
            &[],
            Some(&format!("{field}&expected=3&mode=republish&csrf={csrf}")),
        )
        .await;
        assert_eq!(post.status, 400, "POST {path} {field}: {}", post.body);
    }
    for id in &ids[..2] {
        assert_eq!(status_of(&db, *id).await, 3, "no dead letter replayed");
    }
    assert_eq!(
        scalar(&db, "SELECT count(*) FROM \"{s}\".inbox_failures").await,
        1,
        "no consumer dead letter replayed"
    );
    // The listings refuse it too, and the side's own fields still filter.
    assert_eq!(
        get(addr, "/messages?state=dead&consumer=billing")
            .await
            .status,
        400
    );
    assert_eq!(get(addr, "/inbox?tenant=acme").await.status, 400);
    let own = get(addr, "/inbox/replay?consumer=projection").await;
    assert!(
        own.body.contains("1</strong> consumer dead letter match"),
        "{}",
        own.body
    );
    rw.stop().await.expect("stops");
    drop_schema(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_host_check_and_address_check() {
    let db = fresh_outbox().await;
    let mut with_token = DashboardSettings::new();
    with_token.token = Some("correct-horse-battery".into());
    let (secured, addr) = serve(&db, with_token.clone()).await;
    let anonymous = get(addr, "/").await;
    assert_eq!(anonymous.status, 401);
    assert!(
        anonymous
            .header("www-authenticate")
            .is_some_and(|v| v.starts_with("Basic"))
    );
    assert_eq!(
        request(addr, "GET", "/", &[("Authorization", "Bearer wrong")], None)
            .await
            .status,
        401
    );
    assert_eq!(
        request(
            addr,
            "GET",
            "/",
            &[("Authorization", "Bearer correct-horse-battery")],
            None
        )
        .await
        .status,
        200
    );
    // Basic: any user name, the token as password (alice:correct-horse-battery).
    let basic = "Basic YWxpY2U6Y29ycmVjdC1ob3JzZS1iYXR0ZXJ5";
    assert_eq!(
        request(
            addr,
            "GET",
            "/messages?state=dead",
            &[("Authorization", basic)],
            None
        )
        .await
        .status,
        200
    );
    secured.stop().await.expect("stops");

    // Without a token: only loopback names (no DNS rebinding).
    let (open, addr) = serve(&db, DashboardSettings::new()).await;
    assert_eq!(
        request(addr, "GET", "/", &[("Host", "evil.example:9465")], None)
            .await
            .status,
        421
    );
    assert_eq!(
        request(addr, "GET", "/", &[("Host", "localhost:9465")], None)
            .await
            .status,
        200
    );
    open.stop().await.expect("stops");

    // A non-loopback address without a token refuses to start, before anything connects.
    let mut exposed = DashboardSettings::new();
    exposed.listen = "0.0.0.0:0".parse().expect("addr");
    let err = RunningDashboard::start(admin_of(&db).await, &exposed, CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(
        matches!(
            err,
            CliError::Invalid {
                field: "listen",
                ..
            }
        ),
        "{err}"
    );
    let cli = Cli::parse_from([
        "outbox",
        "--database-url",
        "postgres://nobody@127.0.0.1:1/none",
        "dashboard",
        "--listen",
        "0.0.0.0:0",
    ]);
    if std::env::var_os(outboxkit_cli::testing::internals::TOKEN_ENV).is_none() {
        let err = outboxkit_cli::run(cli, &mut Vec::new())
            .await
            .expect_err("refused");
        assert!(err.to_string().contains("OUTBOX_DASHBOARD_TOKEN"), "{err}");
        assert_eq!(err.exit_code(), 2);
    }
    drop_schema(&db).await;
}
