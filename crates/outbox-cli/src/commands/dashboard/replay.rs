//! Replays: a dry-run preview (`GET`: how many dead letters the selection or filter
//! matches, and a sample), then a confirmation (`POST`, with the CSRF token and the
//! count the operator saw). Refused in read-only mode. Every replay is logged on the
//! `outbox::audit` target with who, from where, what filter and what it did.
//!
//! The preview turns relative times (`2h`) into instants, so the confirmation acts on
//! the window that was previewed; and the confirmation refuses to go on when more rows
//! match than the operator confirmed (they died meanwhile): it asks again.

use axum::Extension;
use axum::extract::{Query, State};
use axum::response::Html;
use chrono::{SecondsFormat, Utc};
use maud::{Markup, html};
use outboxkit_core::{InboxReplayMode, MessageFilter};

use super::filter::{Fields, Side};
use super::layout::{self, short, thousands, time};
use super::security::{Operator, check_csrf};
use super::{Dashboard, PageError};

/// Matching rows shown in a preview.
const SAMPLE: usize = 20;

fn value<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Fixes relative times of `fields` to the instants `filter` resolved them to.
fn pin_window(
    fields: &mut Fields,
    from: Option<chrono::DateTime<Utc>>,
    to: Option<chrono::DateTime<Utc>>,
) {
    if let Some(t) = from {
        fields.since = t.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    }
    if let Some(t) = to {
        fields.until = t.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    }
}

fn read_only_notice() -> Markup {
    html! {
        div.notice #read-only {
            "Replay is disabled: this dashboard is read-only. Start it with "
            code { "--allow-replay" } " to replay from here, or use "
            code { "outbox dead replay" } "."
        }
    }
}

/// The confirmation form: the fields as hidden inputs, the CSRF token, the count seen.
fn confirm_form(
    d: &Dashboard,
    action: &str,
    cancel: &str,
    fields: &Fields,
    matched: u64,
    extra: Markup,
) -> Markup {
    html! {
        form.panel #confirm method="post" action=(action) {
            (fields.hidden_inputs())
            input type="hidden" name="csrf" value=(d.csrf);
            input type="hidden" name="expected" value=(matched);
            (extra)
            @if fields.is_empty() {
                p {
                    label {
                        input type="checkbox" name="all" value="yes";
                        " No filter: yes, replay every dead letter"
                    }
                }
            }
            button.danger #confirm-replay type="submit" { "Replay " (thousands(matched)) " message" @if matched != 1 { "s" } }
            " "
            a href=(cancel) { "Cancel" }
        }
    }
}

fn expected(pairs: &[(String, String)]) -> Result<u64, PageError> {
    value(pairs, "expected")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| PageError::BadRequest("the confirmation carries no expected count".into()))
}

fn check_unfiltered(fields: &Fields, pairs: &[(String, String)]) -> Result<(), PageError> {
    if fields.is_empty() && value(pairs, "all") != Some("yes") {
        return Err(PageError::BadRequest(
            "no filter: tick \"replay every dead letter\" to replay them all".into(),
        ));
    }
    Ok(())
}

/// `GET /replay?FILTER`: the dry run of an outbox replay.
pub(crate) async fn preview(
    State(d): State<Dashboard>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Markup, PageError> {
    let mut fields = Fields::from_pairs(&pairs, Side::Outbox)?;
    let filter = fields.message_filter(Utc::now())?;
    pin_window(&mut fields, filter.from, filter.to);
    let (dry, sample) = tokio::try_join!(
        d.admin.replay(&filter, true),
        d.admin.dead_letters(&filter, SAMPLE)
    )?;
    let body = html! {
        p { "Selection: " span.mono #selection { (fields.describe()) } }
        p #matched { strong { (thousands(dry.matched)) } " dead message" @if dry.matched != 1 { "s" } " match (dry run: nothing changed)." }
        p.muted {
            "A replay moves them back to New, visible now, attempts reset; the relay publishes them again "
            "and consumers' inboxes absorb duplicates."
        }
        @if !sample.is_empty() {
            table #sample {
                thead { tr { th { "Id" } th { "Event type" } th { "Aggregate" } th { "Created" } th { "Last error" } } }
                tbody {
                    @for m in &sample {
                        tr {
                            td.mono { a href=(format!("/messages/{}", m.id)) { (m.id) } }
                            td { (m.event_type) }
                            td { (m.aggregate_type) "/" (short(Some(&m.aggregate_id), 40)) }
                            td.mono { (time(Some(m.created_at))) }
                            td.error { (short(m.last_error.as_deref(), 100)) }
                        }
                    }
                }
            }
            @if dry.matched > sample.len() as u64 { p.muted { "The oldest " (SAMPLE) " are shown." } }
        }
        @if !d.allow_replay {
            (read_only_notice())
        } @else if dry.matched == 0 {
            p.notice { "Nothing to replay." }
        } @else {
            (confirm_form(&d, "/replay", &fields.link("/messages", &[("state", "dead")]), &fields, dry.matched, html! {}))
        }
    };
    Ok(layout::page(&d, "dead", "Replay dead letters", body))
}

/// `POST /replay`: the confirmed outbox replay.
pub(crate) async fn confirm(
    State(d): State<Dashboard>,
    Extension(op): Extension<Operator>,
    axum::Form(pairs): axum::Form<Vec<(String, String)>>,
) -> Result<Html<String>, PageError> {
    if !d.allow_replay {
        return Err(PageError::Forbidden(
            "replay is disabled: the dashboard is read-only (start it with --allow-replay)",
        ));
    }
    check_csrf(&d, value(&pairs, "csrf"))?;
    let fields = Fields::from_pairs(&pairs, Side::Outbox)?;
    check_unfiltered(&fields, &pairs)?;
    let expected = expected(&pairs)?;
    let filter: MessageFilter = fields.message_filter(Utc::now())?;
    let now_matching = d.admin.replay(&filter, true).await?.matched;
    if now_matching > expected {
        return Err(PageError::Conflict(format!(
            "{now_matching} dead messages match now, more than the {expected} you confirmed: review the preview again"
        )));
    }
    let report = d.admin.replay(&filter, false).await?;
    tracing::info!(
        target: "outbox::audit",
        action = "replay",
        side = "outbox",
        who = %op.who,
        peer = ?op.peer,
        filter = %fields.describe(),
        matched = report.matched,
        replayed = report.replayed,
        failed = report.failed,
        "dashboard replay"
    );
    let body = html! {
        div.notice.ok #result {
            "Replayed " strong #replayed { (report.replayed) } " of " (report.matched) " matched"
            @if report.failed > 0 { " (" (report.failed) " had left Dead meanwhile)" }
            ". The relay publishes them again."
        }
        p.muted { "Logged: replay by " (op.who) " of " (fields.describe()) " at " (time(Some(Utc::now()))) "." }
        ul {
            @for id in &fields.ids {
                li { a href=(format!("/messages/{id}")) { "message " (id) } }
            }
            li { a href=(fields.link("/messages", &[("state", "pending")])) { "The replayed messages, pending" } }
            li { a href="/messages?state=dead" { "Dead letters" } }
        }
    };
    Ok(Html(
        layout::page(&d, "dead", "Replay done", body).into_string(),
    ))
}

fn mode_of(pairs: &[(String, String)]) -> Result<InboxReplayMode, PageError> {
    match value(pairs, "mode").unwrap_or("republish") {
        "republish" => Ok(InboxReplayMode::Republish),
        "clear-only" => Ok(InboxReplayMode::ClearOnly),
        other => Err(PageError::BadRequest(format!(
            "unknown replay mode {other:?}"
        ))),
    }
}

/// `GET /inbox/replay?FILTER`: the dry run of a consumer dead-letter replay.
pub(crate) async fn inbox_preview(
    State(d): State<Dashboard>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Markup, PageError> {
    let mut fields = Fields::from_pairs(&pairs, Side::Inbox)?;
    let filter = fields.inbox_filter(Utc::now())?;
    pin_window(&mut fields, filter.from, filter.to);
    let (dry, sample) = tokio::try_join!(
        d.admin
            .replay_inbox_dead_letters(&filter, InboxReplayMode::DryRun),
        d.admin.inbox_dead_letters(&filter, SAMPLE)
    )?;
    let modes = html! {
        p {
            label {
                "Mode "
                select name="mode" {
                    option value="republish" selected { "republish: the outbox row goes back to New and the relay publishes it again" }
                    option value="clear-only" { "clear only: delete the dead letters; you arrange the redelivery" }
                }
            }
        }
    };
    let body = html! {
        p { "Selection: " span.mono #selection { (fields.describe()) } }
        p #matched { strong { (thousands(dry.matched)) } " consumer dead letter" @if dry.matched != 1 { "s" } " match (dry run: nothing changed)." }
        p.muted {
            "Durable-inbox rows go back to New; an idempotent consumer's dead letter is deleted and its message "
            "republished from this outbox (or only deleted, in clear-only mode)."
        }
        @if !sample.is_empty() {
            table #sample {
                thead { tr { th { "Message" } th { "Consumer" } th { "Event type" } th { "Dead at" } th { "Last error" } } }
                tbody {
                    @for r in &sample {
                        tr {
                            td.mono { a href=(format!("/inbox/{}", r.message_id)) { (r.message_id) } }
                            td { (r.consumer.as_deref().unwrap_or("-")) }
                            td { (r.event_type) }
                            td.mono { (time(Some(r.at))) }
                            td.error { (short(r.last_error.as_deref(), 100)) }
                        }
                    }
                }
            }
        }
        @if !d.allow_replay {
            (read_only_notice())
        } @else if dry.matched == 0 {
            p.notice { "Nothing to replay." }
        } @else {
            (confirm_form(&d, "/inbox/replay", &fields.link("/inbox", &[]), &fields, dry.matched, modes))
        }
    };
    Ok(layout::page(
        &d,
        "inbox",
        "Replay consumer dead letters",
        body,
    ))
}

/// `POST /inbox/replay`: the confirmed consumer dead-letter replay.
pub(crate) async fn inbox_confirm(
    State(d): State<Dashboard>,
    Extension(op): Extension<Operator>,
    axum::Form(pairs): axum::Form<Vec<(String, String)>>,
) -> Result<Html<String>, PageError> {
    if !d.allow_replay {
        return Err(PageError::Forbidden(
            "replay is disabled: the dashboard is read-only (start it with --allow-replay)",
        ));
    }
    check_csrf(&d, value(&pairs, "csrf"))?;
    let fields = Fields::from_pairs(&pairs, Side::Inbox)?;
    check_unfiltered(&fields, &pairs)?;
    let expected = expected(&pairs)?;
    let mode = mode_of(&pairs)?;
    let filter = fields.inbox_filter(Utc::now())?;
    let now_matching = d
        .admin
        .replay_inbox_dead_letters(&filter, InboxReplayMode::DryRun)
        .await?
        .matched;
    if now_matching > expected {
        return Err(PageError::Conflict(format!(
            "{now_matching} consumer dead letters match now, more than the {expected} you confirmed: review the preview again"
        )));
    }
    let report = d.admin.replay_inbox_dead_letters(&filter, mode).await?;
    tracing::info!(
        target: "outbox::audit",
        action = "replay",
        side = "inbox",
        mode = ?mode,
        who = %op.who,
        peer = ?op.peer,
        filter = %fields.describe(),
        matched = report.matched,
        replayed = report.replayed,
        failed = report.failed,
        "dashboard replay"
    );
    let body = html! {
        div.notice.ok #result {
            "Replayed " strong #replayed { (report.replayed) } " of " (report.matched) " matched"
            @if report.failed > 0 { " (" (report.failed) " could not be: their message is not in this outbox)" }
            "."
        }
        p.muted { "Logged: replay by " (op.who) " of " (fields.describe()) " at " (time(Some(Utc::now()))) "." }
        p { a href="/inbox" { "Consumer dead letters" } }
    };
    Ok(Html(
        layout::page(&d, "inbox", "Replay done", body).into_string(),
    ))
}
