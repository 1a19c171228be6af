//! The outbox pages: `GET /messages` (one state, filtered, keyset-paged, with a bounded
//! count), `GET /messages/{id}` (one message: headers, payload, attempts, last error,
//! claim state) and `GET /blocked` (keys whose head is dead or in a retry backoff).

use axum::extract::{Path, Query, State};
use chrono::{DateTime, Utc};
use maud::{Markup, html};
use outboxkit_core::admin::DEFAULT_SCAN_BOUND;
use outboxkit_core::{MessageCursor, MessageState, MessageStatus, MessageSummary};
use uuid::Uuid;

use super::filter::{Fields, Side};
use super::layout::{self, bounded, short, status, thousands, time};
use super::{Dashboard, PageError};

/// Rows per page.
const PAGE: usize = 50;
/// Matching rows counted at most.
const COUNT_BOUND: u64 = 10_000;
/// Blocked keys listed at most.
const BLOCKED_SHOWN: usize = 200;

/// A cursor in a URL: `SECONDS.NANOS_SEQ`.
fn cursor_text(c: MessageCursor) -> String {
    format!(
        "{}.{:09}_{}",
        c.at.timestamp(),
        c.at.timestamp_subsec_nanos(),
        c.seq
    )
}

fn parse_cursor(text: &str) -> Result<MessageCursor, PageError> {
    let bad = || PageError::BadRequest(format!("{text:?} is not a page cursor"));
    let (at, seq) = text.split_once('_').ok_or_else(bad)?;
    let (secs, nanos) = at.split_once('.').ok_or_else(bad)?;
    let at = DateTime::<Utc>::from_timestamp(
        secs.parse().map_err(|_| bad())?,
        nanos.parse().map_err(|_| bad())?,
    )
    .ok_or_else(bad)?;
    Ok(MessageCursor {
        at,
        seq: seq.parse().map_err(|_| bad())?,
    })
}

fn value<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

fn state_label(state: MessageState) -> &'static str {
    match state {
        MessageState::Pending => "Pending messages",
        MessageState::Dead => "Dead letters",
        MessageState::Sent => "Sent messages",
    }
}

/// `GET /messages?state=pending|dead|sent&FILTER&after=CURSOR`
pub(crate) async fn list(
    State(d): State<Dashboard>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Markup, PageError> {
    let state = match value(&pairs, "state") {
        None => MessageState::Pending,
        Some(name) => MessageState::from_name(name)
            .ok_or_else(|| PageError::BadRequest(format!("unknown state {name:?}")))?,
    };
    let fields = Fields::from_pairs(&pairs, Side::Outbox)?;
    let filter = fields.message_filter(Utc::now())?;
    let after = value(&pairs, "after").map(parse_cursor).transpose()?;
    let (page, matching) = tokio::try_join!(
        d.admin
            .list_messages(state, &filter, after, PAGE, DEFAULT_SCAN_BOUND),
        d.admin
            .count_messages(state, &filter, COUNT_BOUND, DEFAULT_SCAN_BOUND),
    )?;
    let rows = page.rows;
    // A short page with more to come: the scan bound stopped it.
    let scan_stopped = rows.len() < PAGE && page.next.is_some();
    let next = page.next.map(|c| {
        fields.link(
            "/messages",
            &[("state", state.as_str()), ("after", &cursor_text(c))],
        )
    });
    let dead = state == MessageState::Dead;
    let body = html! {
        div.tabs {
            @for s in [MessageState::Pending, MessageState::Dead, MessageState::Sent] {
                a href=(fields.link("/messages", &[("state", s.as_str())]))
                    class=[(s == state).then_some("current")] { (s.as_str()) }
            }
        }
        (fields.form("/messages", Side::Outbox, &[("state", state.as_str())]))
        p.muted #count {
            @if matching.exact { (thousands(matching.matching)) " matching" }
            @else if matching.matching >= COUNT_BOUND { (bounded(matching.matching, COUNT_BOUND)) " matching" }
            @else {
                "≥ " (thousands(matching.matching)) " matching (counted among the first "
                (thousands(DEFAULT_SCAN_BOUND)) " rows of this state)"
            }
            @if after.is_some() { " · a later page" }
        }
        @if dead && !rows.is_empty() {
            div.actions {
                a.button.secondary #replay-filter href=(fields.link("/replay", &[])) {
                    "Replay all matching this filter…"
                }
                span.muted { "or tick messages below and replay the selection" }
            }
        }
        form method="get" action="/replay" {
            (table(state, &rows))
            @if dead && !rows.is_empty() {
                div.actions { button #replay-selected type="submit" { "Replay selected…" } }
            }
        }
        div.pager {
            @if after.is_some() {
                a href=(fields.link("/messages", &[("state", state.as_str())])) { "« First page" }
            }
            @if let Some(next) = next {
                @if scan_stopped {
                    span { "No more matches among the next " (thousands(DEFAULT_SCAN_BOUND)) " rows examined." }
                    a #next-page href=(next) { "Search on »" }
                } @else {
                    a #next-page href=(next) { "Next page »" }
                }
            }
        }
    };
    Ok(layout::page(&d, state.as_str(), state_label(state), body))
}

/// Which time of a row a listing shows.
type TimeOf = fn(&MessageSummary) -> Option<DateTime<Utc>>;

fn table(state: MessageState, rows: &[MessageSummary]) -> Markup {
    let dead = state == MessageState::Dead;
    let (time_label, when): (&str, TimeOf) = match state {
        MessageState::Pending => ("Visible at", |m| Some(m.visible_at)),
        MessageState::Dead => ("Created", |m| Some(m.created_at)),
        MessageState::Sent => ("Sent at", |m| m.sent_at),
    };
    html! {
        @if rows.is_empty() {
            p.muted { "No messages." }
        } @else {
            table #messages {
                thead {
                    tr {
                        @if dead { th { input type="checkbox" data-select-all aria-label="select all"; } }
                        th { "Id" } th { "Status" } th { "Event type" } th { "Aggregate" }
                        th { "Tenant" } th { (time_label) } th { "Attempts" } th { "Last error" }
                    }
                }
                tbody {
                    @for m in rows {
                        tr {
                            @if dead {
                                td { input type="checkbox" name="id" value=(m.id) aria-label="select"; }
                            }
                            td.mono { a href=(format!("/messages/{}", m.id)) { (m.id) } }
                            td { (status(m.status)) }
                            td { (m.event_type) }
                            td { (m.aggregate_type) "/" (short(Some(&m.aggregate_id), 40)) }
                            td { (m.tenant_id.as_deref().unwrap_or("-")) }
                            td.mono { (time(when(m))) }
                            td { (m.attempts) }
                            td.error { (short(m.last_error.as_deref(), 120)) }
                        }
                    }
                }
            }
        }
    }
}

/// `GET /messages/{id}`
pub(crate) async fn detail(
    State(d): State<Dashboard>,
    Path(id): Path<String>,
) -> Result<Markup, PageError> {
    let id: Uuid = id
        .parse()
        .map_err(|_| PageError::BadRequest(format!("{id:?} is not a message id")))?;
    let m = d.admin.get(id).await?.ok_or_else(|| {
        PageError::NotFound(format!(
            "no outbox message {id} (never written, purged, or deleted when sent)"
        ))
    })?;
    let body = html! {
        @if m.status == MessageStatus::Dead {
            div.actions {
                a.button #replay-one href=(format!("/replay?id={}", m.id)) { "Replay this message…" }
            }
        }
        div.panel {
            dl.fields #message {
                dt { "Id" } dd.mono { (m.id) }
                dt { "Status" } dd #status { (status(m.status)) }
                dt { "Event type" } dd { (m.event_type) }
                dt { "Aggregate" } dd { (m.aggregate_type) " / " (m.aggregate_id) " (version " (m.aggregate_version) ")" }
                dt { "Tenant" } dd { (m.tenant_id.as_deref().unwrap_or("-")) }
                dt { "Routing key" } dd { (m.routing_key.as_deref().unwrap_or("- (the event type)")) }
                dt { "Partition key" } dd { (m.partition_key.as_deref().unwrap_or("- (the aggregate)")) }
                dt { "Seq" } dd { (m.seq) }
                dt { "Occurred" } dd.mono { (time(Some(m.occurred_at))) }
                dt { "Written" } dd.mono { (time(Some(m.created_at))) }
                dt { "Visible at" } dd.mono { (time(Some(m.visible_at))) }
                dt { "Sent at" } dd.mono { (time(m.sent_at)) }
                dt { "Attempts" } dd { (m.attempts) }
                dt { "Claim" } dd.mono {
                    @match (m.claim_token, m.lease_until) {
                        (Some(token), lease) => { "token " (token) ", lease until " (time(lease)) }
                        (None, _) => "none",
                    }
                }
            }
            p.muted {
                "Claim history: the row keeps its attempts, its current claim and its last error; "
                "earlier claims are not recorded."
            }
        }
        h2 { "Last error" }
        @if let Some(e) = &m.last_error { pre #last-error { (e) } } @else { p.muted { "None." } }
        h2 { "Headers" }
        @if m.headers.is_empty() {
            p.muted { "None." }
        } @else {
            table #headers {
                thead { tr { th { "Name" } th { "Value" } } }
                tbody {
                    @for (name, value) in &m.headers {
                        tr {
                            td.mono { (name) }
                            td.mono {
                                @if layout::is_secret_header(name) { span.muted { "*** (hidden: the name suggests a secret)" } }
                                @else { (value) }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Payload" }
        pre #payload { (layout::pretty_json(m.payload.get())) }
    };
    Ok(layout::page(&d, "", &format!("Message {id}"), body))
}

/// `GET /blocked`
pub(crate) async fn blocked(State(d): State<Dashboard>) -> Result<Markup, PageError> {
    let keys = d.admin.blocked_keys(BLOCKED_SHOWN).await?;
    let body = html! {
        p.muted {
            "Keys whose first unfinished message is dead or waiting out a retry backoff. In per-key "
            "order (" code { "--ordering per-key" } ", OnDead::Block) their later messages wait until the head "
            "is replayed; under per-key-skip a dead head is listed but does not block. Longest blocked first, at most "
            (BLOCKED_SHOWN) "."
        }
        @if keys.is_empty() {
            p.muted { "No blocked keys." }
        } @else {
            table #blocked {
                thead {
                    tr {
                        th { "Key" } th { "Head" } th { "Status" } th { "Attempts" } th { "Blocked since" }
                        th { "Retry at" } th { "Waiting behind" } th { "Last error" }
                    }
                }
                tbody {
                    @for k in &keys {
                        tr {
                            td.mono { (short(Some(&k.key), 60)) }
                            td.mono { a href=(format!("/messages/{}", k.head_id)) { (k.head_id) } }
                            td { (status(k.status)) }
                            td { (k.attempts) }
                            td.mono { (time(k.blocked_since)) }
                            td.mono { (time(k.retry_at)) }
                            td { (k.waiting) }
                            td.error { (short(k.last_error.as_deref(), 120)) }
                        }
                    }
                }
            }
        }
    };
    Ok(layout::page(&d, "blocked", "Blocked keys", body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_through_urls() {
        let c = MessageCursor {
            at: DateTime::from_timestamp(1_700_000_000, 123_456_789).expect("time"),
            seq: 42,
        };
        assert_eq!(parse_cursor(&cursor_text(c)).expect("parses"), c);
        for bad in ["", "1.2", "x.1_2", "1.2_x", "1_2"] {
            assert!(parse_cursor(bad).is_err(), "{bad}");
        }
    }
}
